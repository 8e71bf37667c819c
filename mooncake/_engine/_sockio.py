"""Async byte movement on non-blocking sockets, straight from/into raw addresses.

These helpers own no loop: they try the non-blocking primitive from :mod:`mooncake._fast` and,
on EAGAIN, await readiness with ``anyio.wait_readable``/``wait_writable`` (epoll under trio,
``add_reader`` under asyncio). Raw sockets are used instead of anyio streams because the bytes
must land in registered memory, not in a fresh ``bytes`` object.

Cancellation: a cancelled call may have moved part of its bytes; the caller must treat the socket
as unusable (close it). Nothing here touches memory after it returns or raises.

Progress deadlines: ``progress`` (seconds, ``None`` = none) bounds every wait for the socket to
become ready; a peer that moves no byte for that long fails the call with
:class:`~mooncake.errors.PeerDiedError` (a peer that keeps the connection alive at the TCP level
but sends nothing is not caught by keepalive or ``TCP_USER_TIMEOUT``).
"""

from __future__ import annotations

import ctypes
import errno
import socket
from collections.abc import Sequence

import anyio

from mooncake import _fast
from mooncake.errors import PeerDiedError, PeerUnreachableError

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)
_DIED = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTUNREACH)

# TCP keepalive + user timeout bound how long a silent peer (cut link, frozen host) can stall a
# transfer without any timeout argument in the API: the kernel fails the socket.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTVL_S = 2
KEEPALIVE_CNT = 3
USER_TIMEOUT_MS = 15_000
CONNECT_TIMEOUT_S = 5.0  # MC_HANDSHAKE_CONNECT_TIMEOUT


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle, keepalive and user timeout as above."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (
        (getattr(socket, "TCP_KEEPIDLE", None), KEEPALIVE_IDLE_S),
        (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTVL_S),
        (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_CNT),
        (getattr(socket, "TCP_USER_TIMEOUT", None), USER_TIMEOUT_MS),
    ):
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, val)


async def connect(host: str, port: int) -> socket.socket:
    """Open a tuned TCP connection (:class:`PeerUnreachableError` on failure)."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise PeerUnreachableError(f"cannot resolve {host}:{port}: {e}") from None
    last: Exception | None = None
    for family, stype, proto, _, sockaddr in infos:
        sock = socket.socket(family, stype, proto)
        try:
            tune(sock)
            with anyio.move_on_after(CONNECT_TIMEOUT_S) as scope:
                rc = sock.connect_ex(sockaddr)
                if rc == errno.EINPROGRESS:
                    await anyio.wait_writable(sock)
                    rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if rc == 0:
                    return sock
                last = OSError(rc, errno.errorcode.get(rc, str(rc)))
            if scope.cancelled_caught:
                last = TimeoutError(f"no answer within {CONNECT_TIMEOUT_S} s")
        except BaseException:
            sock.close()
            raise
        sock.close()
    raise PeerUnreachableError(f"cannot connect to {host}:{port}: {last}")


async def wait_readable(sock: socket.socket, progress: float | None, what: str) -> None:
    """``anyio.wait_readable`` bounded by ``progress`` seconds (PeerDiedError past it)."""
    if progress is None:
        await anyio.wait_readable(sock)
        return
    with anyio.move_on_after(progress) as scope:
        await anyio.wait_readable(sock)
    if scope.cancelled_caught:
        raise PeerDiedError(f"{what}: no progress from the peer for {progress:g} s")


async def wait_writable(sock: socket.socket, progress: float | None, what: str) -> None:
    """``anyio.wait_writable`` bounded by ``progress`` seconds (PeerDiedError past it)."""
    if progress is None:
        await anyio.wait_writable(sock)
        return
    with anyio.move_on_after(progress) as scope:
        await anyio.wait_writable(sock)
    if scope.cancelled_caught:
        raise PeerDiedError(f"{what}: peer took no data for {progress:g} s")


def _died(what: str, code: int) -> PeerDiedError:
    name = errno.errorcode.get(code, str(code))
    return PeerDiedError(f"{what}: connection failed ({name})")


async def send_addrs(
    sock: socket.socket,
    addrs: Sequence[int],
    lens: Sequence[int],
    what: str = "send",
    *,
    progress: float | None = None,
) -> None:
    """Send every ``(addrs[i], lens[i])`` range, in order, with as few syscalls as possible."""
    fd = sock.fileno()
    i = 0
    skip = 0
    n = len(addrs)
    while i < n:
        r = _fast.writev_at(fd, addrs, lens, i, skip)
        if r < 0:
            if -r in _AGAIN:
                await wait_writable(sock, progress, what)
                continue
            if -r == errno.EINTR:
                continue
            raise _died(what, -r)
        # advance the cursor by r bytes
        while r > 0 and i < n:
            left = lens[i] - skip
            if r >= left:
                r -= left
                i += 1
                skip = 0
            else:
                skip += r
                r = 0
        while i < n and lens[i] == 0:
            i += 1
    await anyio.lowlevel.checkpoint_if_cancelled()


async def recv_into_addr(
    sock: socket.socket,
    addr: int,
    length: int,
    what: str = "recv",
    *,
    progress: float | None = None,
) -> None:
    """Receive exactly ``length`` bytes into ``[addr, addr+length)``."""
    fd = sock.fileno()
    got = 0
    while got < length:
        r = _fast.recv_at(fd, addr + got, length - got)
        if r > 0:
            got += r
        elif r == 0:
            raise PeerDiedError(f"{what}: peer closed the connection after {got}/{length} bytes")
        elif -r in _AGAIN:
            await wait_readable(sock, progress, what)
        elif -r != errno.EINTR:
            raise _died(what, -r)


class Scratch:
    """A small C buffer with a stable address, for headers and status frames."""

    __slots__ = ("addr", "buf", "size")

    def __init__(self, size: int) -> None:
        self.buf = ctypes.create_string_buffer(size)
        self.addr = ctypes.addressof(self.buf)
        self.size = size

    def grow(self, size: int) -> None:
        if size > self.size:
            self.buf = ctypes.create_string_buffer(size)
            self.addr = ctypes.addressof(self.buf)
            self.size = size

    def put(self, off: int, data: bytes) -> None:
        """Copy ``data`` to offset ``off`` (which must fit)."""
        assert off + len(data) <= self.size
        ctypes.memmove(self.addr + off, data, len(data))

    def bytes(self, off: int, n: int) -> bytes:
        return ctypes.string_at(self.addr + off, n)


async def recv_exact(
    sock: socket.socket,
    n: int,
    scratch: Scratch,
    what: str = "recv",
    *,
    progress: float | None = None,
) -> bytes:
    """Receive exactly ``n`` bytes (small control data) and return them."""
    scratch.grow(n)
    await recv_into_addr(sock, scratch.addr, n, what, progress=progress)
    return scratch.bytes(0, n)


def close(sock: socket.socket | None) -> None:
    """Close a socket that no task is waiting on any more."""
    if sock is not None and sock.fileno() >= 0:
        try:
            anyio.notify_closing(sock)
        except Exception:
            pass
        sock.close()
