"""The wire of the ``shm`` transport and its client end (:mod:`mooncake._engine.transports.shm`
has the protocol, the trust rules and the lifetimes).

* messages: one JSON object per ``SOCK_SEQPACKET`` message (at most :data:`MAX_MSG` bytes and
  :data:`FDS_PER_MSG` passed fds), every field validated (:func:`_int`);
* the cluster-secret exchange of both ends (:func:`_client_auth`, :func:`_server_auth`);
* the client's view of one peer: :class:`_Session` (the connection, the listing it applies,
  revokes acknowledged once no copy of ours uses the range) and its :class:`_Entry` buffers,
  memfd mappings (only sealed ones are mapped, :func:`_mappable`) or process_vm targets.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import itertools
import json
import logging
import mmap
import os
import socket
from collections.abc import Sequence
from typing import Any

import anyio

from mooncake._core import auth
from mooncake._engine import _sockio, _unix
from mooncake.errors import AuthError, MooncakeError, PeerDiedError, ProtocolError

log = logging.getLogger("mooncake.shm")

MAX_MSG = 256 << 10
FDS_PER_MSG = 64
MAX_BUFFERS = 1 << 16  # entries one listing may announce (each mapping costs a VMA)
_U64 = 1 << 64
AUTH_S = 5.0  # the whole challenge-response of one connection


async def _client_auth(sock: socket.socket, secret: bytes, peer: str) -> None:
    """The connecting side of the cluster-secret exchange (channel ``shm``); AuthError when
    the server does not prove the secret or refuses our proof."""
    cn = auth.new_nonce()
    try:
        with anyio.fail_after(AUTH_S):
            await _send(sock, {"op": "auth_hello", "nonce": cn.hex()})
            msg, fds = await _recv(sock)
            for fd in fds:
                os.close(fd)
            if msg.get("op") != "auth_challenge":
                raise AuthError(f"shm: {peer} answered {msg.get('op')!r:.40} to our auth hello")
            sn = auth.check_hex(msg.get("nonce"), auth.NONCE_BYTES, "server nonce")
            sp = auth.check_hex(msg.get("proof"), auth.PROOF_BYTES, "server proof")
            if not auth.verify(auth.server_proof(secret, "shm", cn, sn), sp):
                raise AuthError(f"shm: {peer} does not know the cluster secret")
            proof = auth.client_proof(secret, "shm", cn, sn)
            await _send(sock, {"op": "auth_prove", "proof": proof.hex()})
            msg, fds = await _recv(sock)
            for fd in fds:
                os.close(fd)
            if msg.get("op") != "auth_ok":
                raise AuthError(f"shm: {peer} refused our cluster-secret proof")
    except TimeoutError:
        raise AuthError(f"shm: {peer} did not complete the cluster-secret exchange") from None
    except (ValueError, PeerDiedError, ProtocolError) as e:
        raise AuthError(f"shm: cluster-secret exchange with {peer} failed: {e}") from None


async def _server_auth(sock: socket.socket, secret: bytes) -> bool:
    """The serving side of the exchange: whether the client proved the secret."""
    try:
        with anyio.fail_after(AUTH_S):
            msg, fds = await _recv(sock)
            for fd in fds:
                os.close(fd)
            if msg.get("op") != "auth_hello":
                return False
            cn = auth.check_hex(msg.get("nonce"), auth.NONCE_BYTES, "client nonce")
            sn = auth.new_nonce()
            sp = auth.server_proof(secret, "shm", cn, sn)
            await _send(sock, {"op": "auth_challenge", "nonce": sn.hex(), "proof": sp.hex()})
            msg, fds = await _recv(sock)
            for fd in fds:
                os.close(fd)
            got = auth.check_hex(msg.get("proof"), auth.PROOF_BYTES, "client proof")
            if msg.get("op") != "auth_prove" or not auth.verify(
                auth.client_proof(secret, "shm", cn, sn), got
            ):
                return False
            await _send(sock, {"op": "auth_ok"})
            return True
    except (TimeoutError, ValueError, MooncakeError):
        return False


def _int(v: Any, what: str, lo: int = 0, hi: int = _U64) -> int:
    """``v`` if it is an int in ``[lo, hi)``, else :class:`ProtocolError` naming ``what``."""
    if type(v) is not int or not lo <= v < hi:
        raise ProtocolError(f"shm: {what} must be an int in [{lo}, {hi}), got {v!r:.60}")
    return v


# -- messages ------------------------------------------------------------------------------


async def _send(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_MSG:
        raise ProtocolError(f"shm message of {len(data)} bytes exceeds {MAX_MSG}")
    while True:
        try:
            if fds:
                socket.send_fds(sock, [data], list(fds))
            else:
                sock.send(data)
            return
        except (BlockingIOError, InterruptedError):
            await anyio.wait_writable(sock)
        except OSError as e:
            raise PeerDiedError(f"shm: send failed ({e})") from None


async def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MSG, FDS_PER_MSG)
            break
        except (BlockingIOError, InterruptedError):
            await anyio.wait_readable(sock)
        except OSError as e:
            raise PeerDiedError(f"shm: receive failed ({e})") from None
    if not data:
        for fd in fds:
            os.close(fd)
        raise PeerDiedError("shm: peer closed the connection")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ProtocolError("shm: truncated message")
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as e:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"shm: bad message: {e}") from None
    return obj, fds


def _seqpacket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    return sock


def _mappable(fd: int, length: int) -> bool:
    """Whether ``fd`` can be mapped for ``length`` bytes with no risk of SIGBUS: a memfd sealed
    against shrinking, at least that long."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError:
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK) and size >= length


def _map(fd: int, length: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    probe = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(probe)
    del probe  # drop the export so the mapping can be closed later
    return mm, addr


# -- client side ---------------------------------------------------------------------------


class _Entry:
    """One buffer of the peer: mapped (``mm``/``base``) or reached by process_vm (``base`` 0)."""

    __slots__ = ("addr", "base", "dead", "idle", "length", "mm", "users")

    def __init__(self, addr: int, length: int, mm: mmap.mmap | None, base: int) -> None:
        self.addr = addr
        self.length = length
        self.mm = mm
        self.base = base
        self.users = 0
        self.dead = False
        self.idle: anyio.Event | None = None  # set when users drops to 0 (revoke waits on it)

    def pin(self) -> None:
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self.idle is not None:
                self.idle.set()
            if self.dead:
                self.unmap_when_idle()

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    def unmap_when_idle(self) -> None:
        self.dead = True
        if self.users == 0 and self.mm is not None:
            self.mm.close()
            self.mm = None


class _Session:
    """The client end of one peer's shm connection and the buffers it granted.

    ``pid`` is the listener's, from ``SO_PEERCRED`` (process_vm copies go to it); the server's
    ``buffers`` messages must name the same pid.
    """

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.entries: list[_Entry] = []
        self.starts: list[int] = []
        self.listed = anyio.Event()
        self.list_lock = anyio.Lock()
        self.send_lock = anyio.Lock()
        self.closed = False
        self.vm_denied = False
        self._page: list[_Entry] = []
        #: batches copying through this session right now: while any runs, ``close`` keeps the
        #: socket open, so the server (waiting for our revoke acknowledgements, or for the
        #: connection to end) cannot conclude we stopped while a worker thread still copies
        self.busy = 0

    def find(self, addr: int, length: int) -> _Entry | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and self.entries[i].covers(addr, length) and not self.entries[i].dead:
            return self.entries[i]
        return None

    def _set(self, entries: list[_Entry]) -> None:
        keep = {e.addr: e for e in self.entries}
        merged: dict[int, _Entry] = {}
        for e in entries:
            old = keep.pop(e.addr, None)
            # keep what we have unless the new offer is a mapping where we had process_vm (a
            # buffer listed in the moment between its registration and its memfd being noted)
            if (
                old is not None
                and old.length == e.length
                and not old.dead
                and (old.mm is not None or e.mm is None)
            ):
                merged[e.addr] = old
                e.unmap_when_idle()
            else:
                if old is not None:
                    old.unmap_when_idle()
                merged[e.addr] = e
        for old in keep.values():  # no longer offered
            old.unmap_when_idle()
        self.entries = sorted(merged.values(), key=lambda x: x.addr)
        self.starts = [x.addr for x in self.entries]

    async def refresh(self) -> None:
        async with self.list_lock:
            if self.closed:
                raise PeerDiedError("shm: connection to the peer is closed")
            self.listed = anyio.Event()
            async with self.send_lock:
                await _send(self.sock, {"op": "list"})
            await self.listed.wait()
            if self.closed:
                raise PeerDiedError("shm: connection to the peer closed while listing")

    async def reader(self) -> None:
        """Apply the server's messages until the connection ends; then unmap everything.

        Whatever the server sends ends, at worst, this session: never the engine.
        """
        try:
            while True:
                msg, fds = await _recv(self.sock)
                try:
                    await self._handle(msg, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (MooncakeError, OSError, anyio.ClosedResourceError) as e:
            log.debug("shm session ended: %s", e)
        except Exception as e:  # a message we failed to foresee: drop the peer, keep the engine
            log.warning("shm session dropped on an unexpected message: %r", e)
        finally:
            for ent in self._page:
                ent.unmap_when_idle()
            self._page = []
            self.close()

    def _parse_buffers(self, msg: dict[str, Any], fds: list[int]) -> list[_Entry]:
        """Validate one ``buffers`` page and map its memfds (ProtocolError if malformed)."""
        if _int(msg.get("pid"), "pid", 1, 1 << 31) != self.pid:
            raise ProtocolError(f"shm: listing names pid {msg.get('pid')}, listener is {self.pid}")
        bufs = msg.get("buffers")
        if not isinstance(bufs, list) or len(self._page) + len(bufs) > MAX_BUFFERS:
            raise ProtocolError(f"shm: buffers must be a list of at most {MAX_BUFFERS} entries")
        if not isinstance(msg.get("more", False), bool):
            raise ProtocolError("shm: more must be a boolean")
        checked = []
        for b in bufs:
            if not isinstance(b, dict):
                raise ProtocolError("shm: a buffer entry must be an object")
            addr = _int(b.get("addr"), "buffer addr")
            length = _int(b.get("length"), "buffer length", 1)
            if addr + length > _U64:
                raise ProtocolError(f"shm: buffer [{addr:#x}, +{length}) runs past 2**64")
            fi = _int(b.get("fd"), "buffer fd index", -1, len(fds))
            checked.append((addr, length, fi))
        out: list[_Entry] = []
        try:
            for addr, length, fi in checked:
                if fi >= 0 and _mappable(fds[fi], length):
                    try:
                        mm, base = _map(fds[fi], length)
                    except (OSError, ValueError, OverflowError) as e:
                        raise ProtocolError(f"shm: cannot map a granted buffer ({e})") from None
                    out.append(_Entry(addr, length, mm, base))
                else:  # no fd, or one that could shrink under us: process_vm instead
                    out.append(_Entry(addr, length, None, 0))
        except BaseException:
            for ent in out:
                ent.unmap_when_idle()
            raise
        return out

    async def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "buffers":
            self._page.extend(self._parse_buffers(msg, fds))
            if not msg.get("more", False):
                page, self._page = self._page, []
                page.sort(key=lambda x: x.addr)
                for a, b in itertools.pairwise(page):
                    if a.addr + a.length > b.addr:
                        for e in page:
                            e.unmap_when_idle()
                        raise ProtocolError("shm: the listing has overlapping buffers")
                self._set(page)
                self.listed.set()
        elif op == "revoke":
            addr = _int(msg.get("addr"), "revoke addr")
            seq = _int(msg.get("seq"), "revoke seq")
            i = bisect.bisect_left(self.starts, addr)
            if i < len(self.entries) and self.entries[i].addr == addr:
                e = self.entries.pop(i)
                self.starts.pop(i)
                e.dead = True
                if e.users:  # a worker-thread copy still runs into it
                    e.idle = anyio.Event()
                    await e.idle.wait()
                e.unmap_when_idle()
            async with self.send_lock:
                await _send(self.sock, {"op": "ack", "seq": seq})
        else:
            raise ProtocolError(f"shm: unknown message {op!r:.60}")

    def check_alive(self) -> None:
        """Fail fast (one non-blocking peek) when the peer has closed or died.

        Without it a copy into a dead peer's memfd mapping would "succeed": the pages live on
        in our mapping until the reader task notices the end of the connection.
        """
        if not _unix.peer_alive(self.sock):
            self.close()
        if self.closed:
            raise PeerDiedError("shm: the peer closed its connection (exited or died)")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.listed.set()
        for e in self.entries:
            e.unmap_when_idle()
        self.entries, self.starts = [], []
        if not self.busy:
            _sockio.close(self.sock)

    def enter(self) -> None:
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if self.busy == 0 and self.closed:
            _sockio.close(self.sock)  # the close deferred while copies ran
