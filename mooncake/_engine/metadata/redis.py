"""``redis://host:port``: the same keys in Redis, through a minimal RESP2 client.

Credentials and database as in Mooncake: ``MC_REDIS_USERNAME``, ``MC_REDIS_PASSWORD``,
``MC_REDIS_DB_INDEX`` (0..255); ``redis://[user:password@]host:port[/db]`` also works.

Leases: a key written with ``leased=True`` gets a TTL (``MC_METADATA_LEASE_TTL``) that a
background task renews every TTL/3 (``PEXPIRE``); a key found gone at renewal (expired during a
partition) triggers ``on_lease_lost`` so the owner writes it again. ``aclose`` deletes nothing by
itself; the owner unpublishes, and a dead owner's keys expire. No watch (keyspace notifications
need server configuration): cached descriptors are refreshed on a miss.

One connection, one command at a time (a lock); a broken connection is reopened on the next
command. Replies are bounded (``MAX_REPLY``).
"""

from __future__ import annotations

import logging
import os
from urllib.parse import unquote, urlsplit

import anyio
import anyio.abc

from mooncake._engine.metadata.kv import KVStore, lease_ttl_from_env
from mooncake.errors import InvalidArgumentError, MetadataError

log = logging.getLogger("mooncake.metadata.redis")

CONNECT_S = 1.5
REQUEST_S = 3.0
MAX_REPLY = 64 << 20

Reply = bytes | int | str | list["Reply"] | None


class RespError(Exception):
    pass


class _Reader:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive(65536)
        self.buf += data
        if len(self.buf) > MAX_REPLY + 1024:
            raise MetadataError(f"redis reply exceeds {MAX_REPLY} bytes")

    async def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            if len(self.buf) > 65536:
                raise MetadataError("redis reply line too long")
            await self._fill()

    async def exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[: n + 2]
        return out

    async def reply(self, depth: int = 0) -> Reply:
        line = await self.line()
        if not line:
            raise MetadataError("empty redis reply")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if n > MAX_REPLY:
                raise MetadataError(f"redis bulk reply of {n} bytes exceeds {MAX_REPLY}")
            return await self.exact(n)
        if kind == b"*":
            n = int(rest)
            if n < 0:
                return None
            if depth > 4 or n > 1 << 20:
                raise MetadataError("redis array reply too deep or too long")
            return [await self.reply(depth + 1) for _ in range(n)]
        raise MetadataError(f"bad redis reply type {kind!r}")


def encode_command(*args: bytes | str | int) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class RedisKV(KVStore):
    leases = True

    def __init__(self, rest: str, *, lease_ttl: int | None = None) -> None:
        u = urlsplit("redis://" + rest)
        if not u.hostname:
            raise InvalidArgumentError(f"redis connection string {rest!r} names no host")
        try:
            self.port = u.port or 6379
        except ValueError:
            raise InvalidArgumentError(f"redis connection string {rest!r}: bad port") from None
        self.host = u.hostname
        self.username = (
            unquote(u.username) if u.username else os.environ.get("MC_REDIS_USERNAME", "")
        )
        self.password = (
            unquote(u.password) if u.password else os.environ.get("MC_REDIS_PASSWORD", "")
        )
        db = u.path.strip("/") or os.environ.get("MC_REDIS_DB_INDEX", "0") or "0"
        if not db.isdigit() or not 0 <= int(db) <= 255:
            raise InvalidArgumentError(f"redis database index {db!r} outside 0..255")
        self.db = int(db)
        self.lease_ttl = lease_ttl if lease_ttl is not None else lease_ttl_from_env()
        self._stream: anyio.abc.SocketStream | None = None
        self._reader: _Reader | None = None
        self._lock = anyio.Lock()
        self._leased: dict[str, bytes] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    def describe(self) -> str:
        return f"redis {self.host}:{self.port}/{self.db}"

    async def _connect(self) -> None:
        try:
            with anyio.fail_after(CONNECT_S):
                stream = await anyio.connect_tcp(self.host, self.port)
        except (OSError, TimeoutError) as e:
            raise MetadataError(f"{self.describe()} unreachable: {e}") from None
        self._stream, self._reader = stream, _Reader(stream)
        if self.password:
            auth = (self.username, self.password) if self.username else (self.password,)
            await self._roundtrip(("AUTH", *auth))
        if self.db:
            await self._roundtrip(("SELECT", self.db))

    async def _roundtrip(self, args: tuple[bytes | str | int, ...]) -> Reply:
        assert self._stream is not None and self._reader is not None
        await self._stream.send(encode_command(*args))
        return await self._reader.reply()

    async def command(self, *args: bytes | str | int) -> Reply:
        async with self._lock:
            try:
                with anyio.fail_after(REQUEST_S):
                    if self._stream is None:
                        await self._connect()
                    return await self._roundtrip(args)
            except RespError as e:
                raise MetadataError(f"{self.describe()}: {args[0]!s} failed: {e}") from None
            except (OSError, TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream) as e:
                await self._drop()
                raise MetadataError(
                    f"{self.describe()}: {args[0]!s} failed: {type(e).__name__}: {e}"
                ) from None
            except BaseException:
                await self._drop()  # cancelled mid-reply: the stream is out of sync
                raise

    async def _drop(self) -> None:
        s, self._stream, self._reader = self._stream, None, None
        if s is not None:
            with anyio.CancelScope(shield=True):
                await s.aclose()

    async def open(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg
        await self.command("PING")
        tg.start_soon(self._renew_loop)

    async def _renew_loop(self) -> None:
        while True:
            await anyio.sleep(max(self.lease_ttl / 3, 0.2))
            ms = self.lease_ttl * 1000
            lost = False
            for key in list(self._leased):
                try:
                    if await self.command("PEXPIRE", key, ms) == 0:
                        lost = True
                except MetadataError as e:
                    log.warning("renewing %s failed: %s", key, e)
            if lost and self.on_lease_lost is not None:
                log.warning("%s: leased keys expired; writing them again", self.describe())
                await self.on_lease_lost()

    async def get(self, key: str) -> bytes | None:
        r = await self.command("GET", key)
        if r is not None and not isinstance(r, bytes):
            raise MetadataError(f"{self.describe()}: GET {key} returned {type(r).__name__}")
        return r

    async def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        if leased:
            await self.command("SET", key, value, "PX", self.lease_ttl * 1000)
            self._leased[key] = value
        else:
            await self.command("SET", key, value)

    async def delete(self, key: str) -> bool:
        self._leased.pop(key, None)
        r = await self.command("DEL", key)
        return isinstance(r, int) and r > 0

    async def aclose(self) -> None:
        self._leased.clear()
        await self._drop()
