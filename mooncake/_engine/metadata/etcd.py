"""``etcd://host:port[;host:port...]``: etcd v3 through its HTTP/JSON gateway (httpx).

No gRPC stack: etcd serves every v3 RPC as ``POST /v3/<service>/<method>`` with JSON bodies
(bytes base64-encoded, int64 as strings), which httpx speaks natively under trio and asyncio.

* **Failover**: requests go to the current member; a connection failure, a timeout or an
  "unavailable" answer (no leader, member stopping) moves to the next listed member and retries,
  up to twice around the list. Only then does the call fail (:class:`MetadataError` listing what
  each member said).
* **Lease**: ``open`` grants one lease (TTL ``MC_METADATA_LEASE_TTL``, default 10 s) and renews
  it every TTL/3 in the background; keys written with ``leased=True`` are attached to it, so
  they vanish when the process dies. ``aclose`` revokes it (the keys go at once). A lease that
  expired anyway (partition longer than the TTL) is replaced by a new one and
  ``on_lease_lost`` re-writes the keys.
* **Watch**: one streaming ``/v3/watch`` on a prefix, resumed on another member from the last
  seen revision when the stream breaks. A member that is partitioned away (not dead) keeps the
  stream silent until TCP notices; lookups still refetch on a miss, so this only delays
  invalidation.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.streams.memory import MemoryObjectSendStream

from mooncake._engine.metadata.kv import KVStore, WatchCallback, lease_ttl_from_env
from mooncake.errors import InvalidArgumentError, MetadataError

log = logging.getLogger("mooncake.metadata.etcd")

CONNECT_S = 1.5
REQUEST_S = 3.0
#: gRPC status codes that mean "try another member"
_RETRYABLE_GRPC = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
_LEASE_NOT_FOUND = "requested lease not found"


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def parse_endpoints(rest: str) -> list[str]:
    """``"h1:p1;h2:p2"`` (``,`` also accepted, ``http://`` optional) -> base URLs.

    Each endpoint is ``[http[s]://]host:port`` with a port in 1..65535 and no path, query or
    fragment; anything else raises :class:`InvalidArgumentError` naming that endpoint.
    """
    out = []
    for raw in rest.replace(",", ";").split(";"):
        part = raw.strip()
        if not part:
            continue
        try:
            u = httpx.URL(part if "://" in part else "http://" + part)
            port = u.port
        except (httpx.InvalidURL, ValueError):
            u, port = None, None
        if (
            u is None
            or u.scheme not in ("http", "https")
            or not u.host
            or port is None
            or not 0 < port < 65536
            or u.path not in ("", "/")
            or u.query
            or u.fragment
        ):
            raise InvalidArgumentError(f"etcd endpoint {part!r} is not host:port")
        out.append(f"{u.scheme}://{u.host if ':' not in u.host else '[' + u.host + ']'}:{port}")
    if not out:
        raise InvalidArgumentError(f"etcd connection string {rest!r} names no endpoint")
    return out


class _Body(httpx.AsyncByteStream):
    """A request body of one chunk whose iterator is a plain object, not an async generator.

    httpx's own body stream is an async generator. A cancellation between its one chunk and the
    end of the send (trio checkpoints inside every send) leaves that generator suspended; the GC
    finalizes it later and trio reports it as a ``ResourceWarning``. This iterator holds
    nothing that needs finalizing, and each ``__aiter__`` starts over (a resend sends it again).
    """

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _OneChunk(self._data)


class _OneChunk:
    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data


@dataclass
class _WatchState:
    """What one :meth:`EtcdKV.watch` keeps across the streams it opens."""

    task_status: anyio.abc.TaskStatus[None]
    next_rev: int | None = None
    started: bool = False


async def _pump_lines(
    resp: httpx.Response, send: MemoryObjectSendStream[str], errors: list[Exception]
) -> None:
    """Put every line of ``resp`` into ``send`` until the stream ends or fails (the error is
    appended to ``errors``); closes ``send``.

    The loop body neither awaits nor leaves the loop, so the chain of async generators behind
    ``aiter_lines`` ends only with the stream or with an exception raised at its innermost read
    (a cancellation of this task included): none is left suspended for the GC to finalize.
    Lines that arrive after the reader has gone are dropped until the cancellation comes.
    """
    with send:
        try:
            async for line in resp.aiter_lines():
                with contextlib.suppress(anyio.BrokenResourceError):
                    send.send_nowait(line)
        except Exception as e:  # handed to the reader, which raises it
            errors.append(e)


class EtcdKV(KVStore):
    leases = True
    watches = True

    def __init__(self, endpoints: list[str], *, lease_ttl: int | None = None) -> None:
        self.endpoints = endpoints
        self.lease_ttl = lease_ttl if lease_ttl is not None else lease_ttl_from_env()
        self._cur = 0
        self._client: httpx.AsyncClient | None = None
        self.lease_id: str | None = None
        self._lease_lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self.failovers = 0
        self.leases_granted = 0

    def describe(self) -> str:
        return "etcd " + ";".join(e.split("://", 1)[1] for e in self.endpoints)

    @property
    def current_endpoint(self) -> str:
        return self.endpoints[self._cur]

    def _c(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(REQUEST_S, connect=CONNECT_S), trust_env=False
            )
        return self._client

    def _request(
        self, url: str, body: dict[str, Any], timeout: httpx.Timeout | None = None
    ) -> httpx.Request:
        """A JSON POST whose body is a :class:`_Body` (see there why not httpx's own)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        client = self._c()
        req = client.build_request(
            "POST",
            url,
            content=data,
            headers={"Content-Type": "application/json"},
            timeout=client.timeout if timeout is None else timeout,
        )
        req.stream = _Body(data)
        return req

    def _rotate(self, failed: int) -> None:
        if self._cur == failed and len(self.endpoints) > 1:
            self._cur = (failed + 1) % len(self.endpoints)
            self.failovers += 1
            log.warning(
                "etcd %s failed; switching to %s", self.endpoints[failed], self.current_endpoint
            )

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one v3 RPC, failing over across members. Non-retryable errors raise at once."""
        errors: list[str] = []
        for _ in range(2 * len(self.endpoints)):
            idx = self._cur
            ep = self.endpoints[idx]
            try:
                resp = await self._c().send(self._request(ep + path, body))
            except httpx.HTTPError as e:
                errors.append(f"{ep}: {type(e).__name__}: {e}")
                self._rotate(idx)
                continue
            try:
                obj = resp.json()
            except ValueError:
                obj = None
            if resp.status_code == 200 and isinstance(obj, dict):
                return obj
            msg = (obj or {}).get("error") or (obj or {}).get("message") or resp.text[:200]
            code = (obj or {}).get("code")
            if resp.status_code >= 500 and (code in _RETRYABLE_GRPC or code is None):
                errors.append(f"{ep}: HTTP {resp.status_code}: {msg}")
                self._rotate(idx)
                continue
            raise MetadataError(
                f"{self.describe()}: {path} failed: {msg} (HTTP {resp.status_code})"
            )
        raise MetadataError(f"{self.describe()}: no member answered {path}: " + "; ".join(errors))

    # -- lease ------------------------------------------------------------------------------

    async def open(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg
        await self._grant()
        await tg.start(self._keepalive_loop)

    async def _grant(self) -> None:
        obj = await self.call("/v3/lease/grant", {"TTL": self.lease_ttl})
        if obj.get("error") or "ID" not in obj:
            raise MetadataError(f"{self.describe()}: lease grant refused: {obj}")
        self.lease_id = str(obj["ID"])
        self.leases_granted += 1

    async def _lease_lost(self, seen: str | None) -> None:
        async with self._lease_lock:
            if self.lease_id != seen:
                return  # someone replaced it already
            log.warning("etcd lease %s expired; granting a new one", seen)
            await self._grant()
        if self.on_lease_lost is not None and self._tg is not None:
            self._tg.start_soon(self.on_lease_lost)

    async def _keepalive_loop(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await anyio.sleep(max(self.lease_ttl / 3, 0.2))
            lid = self.lease_id
            if lid is None:
                return
            try:
                obj = await self.call("/v3/lease/keepalive", {"ID": lid})
                result = obj.get("result", obj)
                if int(result.get("TTL", 0) or 0) <= 0:
                    await self._lease_lost(lid)
            except MetadataError as e:
                log.warning("etcd lease keep-alive failed: %s", e)

    # -- kv ---------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        obj = await self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = obj.get("kvs") or []
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", ""))

    async def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        for _ in range(2):
            lid = self.lease_id if leased else None
            body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lid is not None:
                body["lease"] = lid
            try:
                await self.call("/v3/kv/put", body)
                return
            except MetadataError as e:
                if lid is None or _LEASE_NOT_FOUND not in str(e):
                    raise
                await self._lease_lost(lid)
        raise MetadataError(f"{self.describe()}: put {key}: lease keeps vanishing")

    async def delete(self, key: str) -> bool:
        obj = await self.call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(obj.get("deleted", 0) or 0) > 0

    async def list(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` with its value."""
        p = prefix.encode()
        obj = await self.call("/v3/kv/range", {"key": _b64(p), "range_end": _b64(prefix_end(p))})
        return {
            _unb64(kv["key"]).decode(): _unb64(kv.get("value", "")) for kv in obj.get("kvs") or []
        }

    # -- watch ------------------------------------------------------------------------------

    async def watch(
        self,
        prefix: str,
        callback: WatchCallback,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        p = prefix.encode()
        state = _WatchState(task_status)
        failures = 0
        while True:
            idx = self._cur
            ep = self.endpoints[idx]
            create: dict[str, Any] = {"key": _b64(p), "range_end": _b64(prefix_end(p))}
            if state.next_rev is not None:
                create["start_revision"] = state.next_rev
            try:
                req = self._request(
                    ep + "/v3/watch",
                    {"create_request": create},
                    timeout=httpx.Timeout(None, connect=CONNECT_S),
                )
                resp = await self._c().send(req, stream=True)
                try:
                    if resp.status_code != 200:
                        raise MetadataError(f"watch on {ep}: HTTP {resp.status_code}")
                    await self._follow_stream(ep, resp, callback, state)
                finally:
                    await resp.aclose()
            except (httpx.HTTPError, MetadataError, ValueError) as e:
                failures += 1
                if not state.started and failures >= 2 * len(self.endpoints):
                    raise MetadataError(f"{self.describe()}: cannot start a watch: {e}") from None
                log.warning("etcd watch on %s broke: %s", ep, e)
                self._rotate(idx)
                await anyio.sleep(0.2)

    async def _follow_stream(
        self, ep: str, resp: httpx.Response, callback: WatchCallback, state: _WatchState
    ) -> None:
        """Apply the events of one watch stream until it ends, is canceled by etcd (compaction:
        ``state.next_rev`` is reset) or fails (the error is raised here).

        The stream's lines are read by a task of their own (:func:`_pump_lines`), so that
        leaving early (a cancellation inside ``callback``, an error line) never abandons the
        response's async generators half-way: they end at a read, where the pump is cancelled.
        """
        send, recv = anyio.create_memory_object_stream[str](math.inf)
        read_errors: list[Exception] = []
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pump_lines, resp, send, read_errors)
            with recv:
                try:
                    async for line in recv:
                        if not line.strip():
                            continue
                        if not await self._apply_watch_line(ep, line, callback, state):
                            break
                except Exception as e:  # raised below, outside the task group (unwrapped)
                    failure = e
                finally:
                    tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if read_errors:
            raise read_errors[0]

    @staticmethod
    async def _apply_watch_line(
        ep: str, line: str, callback: WatchCallback, state: _WatchState
    ) -> bool:
        """One message of the watch stream; False when etcd canceled the watch."""
        msg = json.loads(line)
        result = msg.get("result") or {}
        if msg.get("error"):
            raise MetadataError(f"watch on {ep}: {msg['error']}")
        rev = int((result.get("header") or {}).get("revision", 0) or 0)
        if result.get("created") and not state.started:
            state.started = True
            state.task_status.started()
        if result.get("canceled"):
            compact = int(result.get("compact_revision", 0) or 0)
            log.warning("etcd watch canceled (compacted at %s); restarting", compact)
            state.next_rev = None
            return False
        for ev in result.get("events") or []:
            kv = ev.get("kv") or {}
            key = _unb64(kv.get("key", "")).decode("utf-8", "replace")
            mod = int(kv.get("mod_revision", 0) or 0)
            value = None if ev.get("type") == "DELETE" else _unb64(kv.get("value", ""))
            state.next_rev = max(state.next_rev or 0, mod + 1)
            await callback(key, value)
        if rev and state.next_rev is None:
            state.next_rev = rev + 1
        return True

    async def aclose(self) -> None:
        lid, self.lease_id = self.lease_id, None
        with anyio.CancelScope(shield=True):
            if lid is not None:
                with anyio.move_on_after(REQUEST_S):
                    try:
                        await self.call("/v3/lease/revoke", {"ID": lid})
                    except MetadataError as e:
                        log.warning("revoking etcd lease %s failed: %s", lid, e)
            if self._client is not None:
                c, self._client = self._client, None
                await c.aclose()
