"""The P2P handshake port: Mooncake's one-request-per-connection control channel.

Server side (:class:`HandshakeServer`): every connection gets its own task, so a peer that sends
garbage, a frame it never finishes, deeply nested JSON or nothing at all costs only its own
connection (the published engine dies on one malformed frame and serves connections one at a
time). Each connection is bounded: one frame of at most ``max_length`` bytes, ``IDLE_S`` seconds
to send it, ``MAX_CONNECTIONS`` served at once (more wait in the kernel backlog).

Client side (:func:`request`): connect, send one frame, read the reply frame, close.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from mooncake import _fast
from mooncake._core.handshake import (
    DEFAULT_MAX_LENGTH,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
)
from mooncake._engine import _sockio
from mooncake.errors import MooncakeError, PeerDiedError, ProtocolError

log = logging.getLogger("mooncake.handshake")

IDLE_S = 10.0
LINGER_S = 2.0
MAX_CONNECTIONS = 256
_CHUNK = 64 << 10

Handler = Callable[[Frame], Awaitable[Any]]


async def read_frame(sock: socket.socket, decoder: FrameDecoder, scratch: _sockio.Scratch) -> Frame:
    """Read one whole frame (raises :class:`ProtocolError` / :class:`PeerDiedError`)."""
    fd = sock.fileno()
    while True:
        frame = decoder.next_frame()
        if frame is not None:
            return frame
        want = min(max(decoder.needed(), 1), _CHUNK)
        r = _fast.recv_at(fd, scratch.addr, want)
        if r > 0:
            decoder.feed(scratch.bytes(0, r))
        elif r == 0:
            raise PeerDiedError(f"peer closed the handshake with {decoder.pending} bytes pending")
        elif -r in (errno.EAGAIN, errno.EWOULDBLOCK):
            await anyio.wait_readable(sock)
        elif -r != errno.EINTR:
            raise PeerDiedError(f"handshake read failed ({errno.errorcode.get(-r, -r)})")


async def send_bytes(sock: socket.socket, data: bytes) -> None:
    scratch = _sockio.Scratch(len(data))
    scratch.put(0, data)
    await _sockio.send_addrs(sock, [scratch.addr], [len(data)], "handshake")


async def request(
    host: str,
    port: int,
    ftype: FrameType,
    payload: Any,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> Frame:
    """Send one handshake frame to ``host:port`` and return the reply frame."""
    sock = await _sockio.connect(host, port)
    try:
        await send_bytes(sock, encode_frame(ftype, payload))
        with anyio.move_on_after(IDLE_S) as scope:
            reply = await read_frame(sock, FrameDecoder(max_length), _sockio.Scratch(_CHUNK))
        if scope.cancelled_caught:
            raise PeerDiedError(f"{host}:{port} did not answer the handshake within {IDLE_S} s")
        if reply.type != ftype:
            raise ProtocolError(f"handshake reply has type {reply.type}, expected {ftype}")
        return reply
    finally:
        _sockio.close(sock)


class HandshakeServer:
    """Serves handshake frames with one handler per frame type."""

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self.handlers: dict[FrameType, Handler] = {}
        self.max_length = max_length
        self._limiter = anyio.CapacityLimiter(MAX_CONNECTIONS)
        self._sock: socket.socket | None = None
        self.served = 0
        self.rejected = 0

    @property
    def port(self) -> int:
        assert self._sock is not None
        return int(self._sock.getsockname()[1])

    async def serve(
        self,
        host: str,
        port: int = 0,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        lsock = socket.socket(family, stype, proto)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(addr)
            lsock.listen(128)  # MC_HANDSHAKE_LISTEN_BACKLOG
            lsock.setblocking(False)
            self._sock = lsock
            task_status.started(self.port)
            async with anyio.create_task_group() as tg:
                while True:
                    await anyio.wait_readable(lsock)
                    try:
                        conn, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            await anyio.sleep(0.05)
                            continue
                        raise
                    conn.setblocking(False)
                    tg.start_soon(self._serve_one, conn)
        finally:
            _sockio.close(lsock)
            self._sock = None

    async def _serve_one(self, sock: socket.socket) -> None:
        try:
            async with self._limiter:
                with anyio.move_on_after(IDLE_S):
                    frame = await read_frame(
                        sock, FrameDecoder(self.max_length), _sockio.Scratch(_CHUNK)
                    )
                    handler = self.handlers.get(frame.type)
                    if handler is None:
                        reply: Any = {"reply_msg": f"frame type {int(frame.type)} not supported"}
                    else:
                        reply = await handler(frame)
                    await send_bytes(sock, encode_frame(frame.type, reply))
                    self.served += 1
                    try:
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        return
                # The protocol has the client close first; wait a little for that, bounded.
                with anyio.move_on_after(LINGER_S):
                    scratch = _sockio.Scratch(4096)
                    while True:
                        r = _fast_recv(sock, scratch)
                        if r == 0 or (r < 0 and r != -errno.EAGAIN):
                            break
                        if r < 0:
                            await anyio.wait_readable(sock)
        except (MooncakeError, OSError, UnicodeError) as e:
            self.rejected += 1
            log.debug("handshake connection dropped: %s", e)
        finally:
            _sockio.close(sock)


def _fast_recv(sock: socket.socket, scratch: _sockio.Scratch) -> int:
    return int(_fast.recv_at(sock.fileno(), scratch.addr, scratch.size))
