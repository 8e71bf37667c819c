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
from mooncake.errors import InvalidArgumentError, PeerDiedError

log = logging.getLogger("mooncake.store.shm")

NEGATIVE_TTL_S = 5.0
MAX_PEERS = 1024
HELLO_MAX = 4096
_PREFIX = "mooncake-store/"
# Guards MappedPeer.users/closing: the sync facade's fast path copies from its caller's thread
# while the loop thread may drop a dead peer.
_MAP_LOCK = threading.Lock()


def socket_name(segment_name: str) -> str:
    """The abstract Unix socket name a segment's owner listens on (leading NUL included)."""
    return "\0" + _PREFIX + segment_name


class SharedSegment:
    """``size`` bytes of memfd-backed, page-aligned memory (pre-fault with :meth:`prefault`)."""

    def __init__(self, size: int, name: str = "mooncake-segment") -> None:
        if size <= 0:
            raise InvalidArgumentError(f"segment size must be positive, got {size}")
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
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
        self.served = 0

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
            {"segment": self.segment_name, "base": self.segment.addr, "size": self.segment.size}
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
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:  # EOF: the owner exited or closed its segment
            self.dead = True
        return not self.dead

    def local(self, remote_addr: int, length: int) -> int:
        if remote_addr < self.base or remote_addr + length > self.base + self.size:
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
            info: dict[str, Any] = json.loads(msg)
            if info.get("segment") != segment or len(fds) != 1:
                raise ValueError(f"unexpected hello {info!r} with {len(fds)} fds")
            size = int(info["size"])
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (ValueError, KeyError, OSError) as e:
            log.warning("shm: bad hello from %s: %s", segment, e)
            _close(sock)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        return MappedPeer(segment, sock, mm, int(info["base"]), size)

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


def _close(sock: socket.socket) -> None:
    if sock.fileno() >= 0:
        try:
            anyio.notify_closing(sock)
        except Exception:
            pass
        sock.close()
