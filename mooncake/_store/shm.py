"""Same-host segments: memfd-backed memory that store clients on one host map into each other.

A store client's segment is one :class:`SharedSegment` (``memfd_create`` + ``mmap``, pre-faulted,
registered with the engine so remote peers reach it over the network as usual). Each client also
runs a :class:`ShmServer` on an abstract Unix socket whose name is derived from its transfer-engine
segment name (``\\0mooncake-store/<host:port>``). A client that must read or write a replica on
segment ``S`` first tries that socket: if it answers, ``S`` is on this host (and in this network
namespace), the server hands over its memfd with ``SCM_RIGHTS`` together with the segment's base
address and size, and from then on replicas on ``S`` move by ``memcpy`` -- no socket, no copy
through the kernel. If the socket does not exist the peer is remote and the engine's transport
is used (the negative answer is remembered for ``NEGATIVE_TTL_S``).

Trust: both ends check the other's credentials (``SO_PEERCRED``). The owner hands its memfd
only to a connecting process whose uid is its own or listed in ``MOONCAKE_SHM_ALLOW_UIDS``
(comma-separated uids); anyone else is disconnected without it. The connecting side accepts a
listener only under the same rule, and only if the hello's ``pid`` is the listener's pid, so a
process of another user that bound the name first (abstract names carry no permissions) is
detected and refused: the segment is then reached over the network, as a remote one. With
``MOONCAKE_CLUSTER_SECRET`` set the name is ``\\0mooncake-store/h/<HMAC(secret, segment)>``,
which a user without the secret cannot compute ahead of the owner, so it cannot squat it either.

Liveness is the connection itself: the owner never writes to it after the hello, so the socket
becomes readable only when the owner's process is gone (the kernel closes its end) or it closed
the segment. Every copy checks that with a non-blocking ``MSG_PEEK`` *before and after* the
``memcpy``; a copy during which the owner died fails with :class:`PeerDiedError` even though the
pages, being shared, are still mapped here. That is the same outcome a network read would have
had, and it keeps "the owner is dead" from ever reading as "the bytes are fine".

Lifetime: a mapping stays until no copy uses it (``users``), so dropping a dead peer never unmaps
memory under a running ``memcpy``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import mmap
import os
import socket
import threading
import time
from typing import Any

import anyio
import anyio.abc
import numpy as np

from mooncake import _fast
from mooncake._core.auth import load_secret
from mooncake._core.hostmem import check_backable
from mooncake._engine import _unix
from mooncake.errors import InvalidArgumentError, PeerDiedError

log = logging.getLogger("mooncake.store.shm")

NEGATIVE_TTL_S = 5.0
MAX_PEERS = 1024
HELLO_MAX = 4096
_PREFIX = "mooncake-store/"
ALLOWED_UIDS_ENV = _unix.ALLOW_UIDS_ENV
# Guards MappedPeer.users/closing: the sync facade's fast path copies from its caller's thread
# while the loop thread may drop a dead peer.
_MAP_LOCK = threading.Lock()


def socket_name(segment_name: str) -> str:
    """The abstract Unix socket name a segment's owner listens on (leading NUL included).

    Derived from the segment name, keyed by ``MOONCAKE_CLUSTER_SECRET`` when that is set.
    """
    secret = load_secret()
    if secret:
        tag = hmac.new(secret, b"store-shm:" + segment_name.encode(), hashlib.sha256)
        return "\0" + _PREFIX + "h/" + tag.hexdigest()[:40]
    return "\0" + _PREFIX + segment_name


class SharedSegment:
    """``size`` bytes of memfd-backed, page-aligned memory (pre-fault with :meth:`prefault`);
    :class:`InvalidArgumentError` if the machine cannot back that much now
    (:func:`~mooncake._core.hostmem.check_backable`)."""

    def __init__(self, size: int, name: str = "mooncake-segment") -> None:
        if size <= 0:
            raise InvalidArgumentError(f"segment size must be positive, got {size}")
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        check_backable(size, "a segment")  # pre-faulted: too large would end in the OOM killer
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.addr = int(np.frombuffer(self.mmap, dtype=np.uint8).ctypes.data)

    def prefault(self) -> None:
        _fast.prefault(self.addr, self.size)

    def close(self) -> None:
        """Unmap and close; peers that mapped it keep their own mapping until they drop it."""
        if self.fd >= 0:
            try:
                self.mmap.close()
            except BufferError:  # someone still exports it; the mapping dies with the process
                log.warning("segment %#x still exported at close; leaving it mapped", self.addr)
            os.close(self.fd)
            self.fd = -1


class ShmServer:
    """Hands this segment's memfd to same-host clients and holds one connection per client."""

    def __init__(self, segment: SharedSegment, segment_name: str) -> None:
        self.segment = segment
        self.segment_name = segment_name
        self._sock: socket.socket | None = None
        self._limit = anyio.CapacityLimiter(MAX_PEERS)
        self._uids = _unix.allowed_uids()
        self.served = 0
        self.refused = 0
        """Connections turned away because their uid is not allowed."""

    async def serve(self, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(socket_name(self.segment_name))
        except OSError as e:
            sock.close()
            # someone on this host already serves that name: stay network-only
            log.warning(
                "shm: cannot listen as %r (%s); same-host peers use the network",
                self.segment_name,
                e,
            )
            task_status.started("")
            return
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        hello = json.dumps(
            {
                "segment": self.segment_name,
                "base": self.segment.addr,
                "size": self.segment.size,
                "pid": os.getpid(),
            }
        ).encode()
        task_status.started(self.segment_name)
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    await anyio.wait_readable(sock)
                    try:
                        conn, _ = sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            await anyio.sleep(0.05)
                            continue
                        raise
                    conn.setblocking(False)
                    tg.start_soon(self._hold, conn, hello)
        finally:
            _close(sock)
            self._sock = None

    async def _hold(self, conn: socket.socket, hello: bytes) -> None:
        try:
            if self._limit.available_tokens == 0:
                return
            try:
                pid, uid, _ = _unix.peer_credentials(conn)
            except OSError as e:
                log.debug("shm: no credentials for a connection: %s", e)
                return
            if uid not in self._uids:
                self.refused += 1
                log.warning(
                    "shm: refusing segment %s to pid %d of uid %d (allowed uids: %s)",
                    self.segment_name,
                    pid,
                    uid,
                    sorted(self._uids),
                )
                return
            async with self._limit:
                try:
                    socket.send_fds(conn, [hello], [self.segment.fd])
                except OSError as e:
                    log.debug("shm: hello failed: %s", e)
                    return
                self.served += 1
                # Nothing more is ever sent: the peer reads EOF exactly when we are gone.
                while True:
                    await anyio.wait_readable(conn)
                    try:
                        if not conn.recv(64):
                            return
                    except BlockingIOError:
                        continue
                    except OSError:
                        return
        finally:
            _close(conn)


class MappedPeer:
    """A same-host peer's segment mapped here."""

    __slots__ = ("base", "closed", "dead", "delta", "mm", "segment", "size", "sock", "users")

    def __init__(
        self, segment: str, sock: socket.socket, mm: mmap.mmap, base: int, size: int
    ) -> None:
        self.segment = segment
        self.sock = sock
        self.mm = mm
        self.base = base
        self.size = size
        local = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
        self.delta = local - base  # local address = remote address + delta
        self.users = 0
        self.dead = False
        self.closed = False

    def alive(self) -> bool:
        """Whether the owner still holds its end (a non-blocking peek; no loop involved)."""
        if self.dead:
            return False
        if not _unix.peer_alive(self.sock):  # EOF: the owner exited or closed its segment
            self.dead = True
        return not self.dead

    def local(self, remote_addr: int, length: int) -> int:
        if length < 0 or remote_addr < self.base or remote_addr + length > self.base + self.size:
            raise PeerDiedError(
                f"{self.segment}: [{remote_addr:#x}, +{length}) is outside its segment"
            )
        return remote_addr + self.delta

    def acquire(self) -> bool:
        """Pin the mapping for a copy (False if the peer is already known dead)."""
        with _MAP_LOCK:
            if self.dead or self.closed:
                return False
            self.users += 1
            return True

    def unpin(self) -> None:
        """End a copy started with :meth:`acquire`."""
        with _MAP_LOCK:
            self.users -= 1
        self.release()

    def release(self) -> None:
        """Unmap once the peer is dead and no copy uses the mapping."""
        with _MAP_LOCK:
            if self.users or not self.dead or self.closed:
                return
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.mm.close()
        except BufferError:
            pass


class ShmPeers:
    """The same-host peers this client has mapped (and the segments known not to be local)."""

    def __init__(self, own_segment: str) -> None:
        self.own = own_segment
        self._peers: dict[str, MappedPeer] = {}
        self._remote: dict[str, float] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self.enabled = os.environ.get("MC_STORE_MEMCPY", "1") not in ("0", "false", "False")
        self._uids = _unix.allowed_uids()
        self.refused = 0
        """Listeners refused: the name was served by an untrusted uid or a lying hello."""

    def cached(self, segment: str) -> MappedPeer | None:
        """The live mapping of ``segment`` if there is one (no I/O)."""
        p = self._peers.get(segment)
        if p is not None and not p.alive():
            self._drop(segment, p)
            return None
        return p

    async def lookup(self, segment: str) -> MappedPeer | None:
        """Map ``segment`` if its owner is on this host; None when it is not (or is gone)."""
        if not self.enabled or segment == self.own:
            return None
        p = self.cached(segment)
        if p is not None:
            return p
        t = self._remote.get(segment)
        if t is not None and time.monotonic() - t < NEGATIVE_TTL_S:
            return None
        lock = self._locks.setdefault(segment, anyio.Lock())
        async with lock:
            p = self._peers.get(segment)
            if p is not None:
                return p if p.alive() else None
            p = await self._connect(segment)
            if p is None:
                self._remote[segment] = time.monotonic()
                if len(self._remote) > 4 * MAX_PEERS:
                    self._remote.clear()
            else:
                self._remote.pop(segment, None)
                self._peers[segment] = p
            return p

    async def _connect(self, segment: str) -> MappedPeer | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(socket_name(segment))
        except OSError:
            sock.close()
            return None
        try:
            with anyio.fail_after(2.0):
                while True:
                    try:
                        msg, fds, _flags, _addr = socket.recv_fds(sock, HELLO_MAX, 1)
                        break
                    except BlockingIOError:
                        await anyio.wait_readable(sock)
        except (OSError, TimeoutError) as e:
            log.debug("shm: no hello from %s: %s", segment, e)
            _close(sock)
            return None
        try:
            pid, uid, _ = _unix.peer_credentials(sock)
            if uid not in self._uids:
                raise PermissionError(
                    f"its listener is pid {pid} of uid {uid}, not one of uids {sorted(self._uids)}"
                )
            info = json.loads(msg)
            base, size = _check_hello(info, segment, pid, fds)
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (ValueError, KeyError, TypeError, OSError) as e:
            self.refused += 1
            log.warning("shm: not mapping segment %s (%s); using the network", segment, e)
            _close(sock)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        return MappedPeer(segment, sock, mm, base, size)

    def forget(self, segment: str) -> None:
        p = self._peers.get(segment)
        if p is not None:
            p.dead = True
            self._drop(segment, p)

    def _drop(self, segment: str, p: MappedPeer) -> None:
        if self._peers.get(segment) is p:
            del self._peers[segment]
        p.release()

    def close(self) -> None:
        for seg, p in list(self._peers.items()):
            p.dead = True
            self._drop(seg, p)


def _check_hello(info: Any, segment: str, pid: int, fds: list[int]) -> tuple[int, int]:
    """``(base, size)`` of a well-formed hello from listener ``pid`` for ``segment``; else
    ``ValueError`` saying what is wrong (a memfd shorter than ``size`` would fault on access)."""
    if not isinstance(info, dict):
        raise ValueError(f"hello is not an object: {info!r}")
    if info.get("segment") != segment:
        raise ValueError(f"hello names segment {info.get('segment')!r}")
    if info.get("pid") != pid:
        raise ValueError(f"hello claims pid {info.get('pid')!r} but the listener is pid {pid}")
    if len(fds) != 1:
        raise ValueError(f"hello came with {len(fds)} fds, expected 1")
    base, size = info.get("base"), info.get("size")
    if not isinstance(base, int) or not isinstance(size, int) or base < 0 or size <= 0:
        raise ValueError(f"hello has base={base!r} size={size!r}")
    if os.fstat(fds[0]).st_size < size:
        raise ValueError(f"its memfd holds {os.fstat(fds[0]).st_size} bytes, not {size}")
    return base, size


def _close(sock: socket.socket) -> None:
    if sock.fileno() >= 0:
        try:
            anyio.notify_closing(sock)
        except Exception:
            pass
        sock.close()
