"""The P2P handshake port: Mooncake's one-request-per-connection control channel.

Server side (:class:`HandshakeServer`): every connection gets its own task, so a peer that sends
garbage, a frame it never finishes, deeply nested JSON or nothing at all costs only its own
connection (the published engine dies on one malformed frame and serves connections one at a
time). Each connection is bounded: one frame of at most ``max_length`` bytes, ``IDLE_S`` seconds
from accept to send it, ``MAX_CONNECTIONS`` live at once. At the cap the server stops accepting
(the rest wait in the kernel backlog) and evicts the oldest connection that has not yet
delivered its request: a legitimate client sends its frame at once, so one still silent is the
likeliest to be a squatter. A handler that fails costs its connection only.

With a cluster secret (``MOONCAKE_CLUSTER_SECRET`` or ``secret=``) a connection must first
complete the challenge-response of :mod:`mooncake._core.auth` in ``AUTH`` frames
(``docs/protocol.md``); without one, the protocol is the published one, byte for byte.

Client side (:func:`request`): connect, (authenticate,) send one frame, read the reply, close.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from mooncake import _fast
from mooncake._core import auth
from mooncake._core.handshake import (
    DEFAULT_MAX_LENGTH,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
)
from mooncake._engine import _accept, _sockio
from mooncake.errors import AuthError, MooncakeError, PeerDiedError, ProtocolError

log = logging.getLogger("mooncake.handshake")

IDLE_S = 10.0
LINGER_S = 2.0
MAX_CONNECTIONS = 256
_CHUNK = 64 << 10
#: the ``reply_msg`` of a refusal for want of the cluster secret (also read by our client)
AUTH_REQUIRED = (
    "authentication required: this engine needs the cluster secret (MOONCAKE_CLUSTER_SECRET)"
)

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
    secret: str | bytes | None = None,
) -> Frame:
    """Send one handshake frame to ``host:port`` and return the reply frame.

    ``secret`` (``None``: ``$MOONCAKE_CLUSTER_SECRET``; ``""``: none) makes the exchange authenticated; a peer
    that refuses or fails it raises :class:`AuthError`.
    """
    key = auth.load_secret(secret)
    sock = await _sockio.connect(host, port)
    try:
        with anyio.move_on_after(IDLE_S) as scope:
            decoder = FrameDecoder(max_length)
            scratch = _sockio.Scratch(_CHUNK)
            body = encode_frame(ftype, payload)
            if key is not None:
                body = await _client_auth(sock, decoder, scratch, key, body, f"{host}:{port}")
            await send_bytes(sock, body)
            reply = await read_frame(sock, decoder, scratch)
        if scope.cancelled_caught:
            raise PeerDiedError(f"{host}:{port} did not answer the handshake within {IDLE_S} s")
        if reply.type != ftype:
            raise ProtocolError(f"handshake reply has type {reply.type}, expected {ftype}")
        if key is None and _is_auth_refusal(reply):
            raise AuthError(f"{host}:{port} requires the cluster secret (set {auth.SECRET_ENV})")
        return reply
    finally:
        _sockio.close(sock)


def _is_auth_refusal(reply: Frame) -> bool:
    try:
        obj = reply.json()
    except ProtocolError:
        return False
    return isinstance(obj, dict) and obj.get("reply_msg") == AUTH_REQUIRED


async def _client_auth(
    sock: socket.socket,
    decoder: FrameDecoder,
    scratch: _sockio.Scratch,
    key: bytes,
    body: bytes,
    peer: str,
) -> bytes:
    """Run the client side of the challenge-response; returns the bytes to send next."""
    cn = auth.new_nonce()
    await send_bytes(sock, encode_frame(FrameType.AUTH, {"nonce": cn.hex()}))
    frame = await read_frame(sock, decoder, scratch)
    obj = frame.json() if frame.type == FrameType.AUTH else None
    if not isinstance(obj, dict) or "proof" not in obj:
        raise AuthError(f"{peer} does not take the cluster secret (not our engine, or no secret)")
    try:
        sn = auth.check_hex(obj.get("nonce"), auth.NONCE_BYTES, "server nonce")
        sp = auth.check_hex(obj.get("proof"), auth.PROOF_BYTES, "server proof")
    except ValueError as e:
        raise AuthError(f"{peer}: bad authentication reply: {e}") from None
    if not auth.verify(auth.server_proof(key, "handshake", cn, sn), sp):
        raise AuthError(f"{peer} does not know the cluster secret")
    cp = auth.client_proof(key, "handshake", cn, sn, body)
    return encode_frame(FrameType.AUTH, {"proof": cp.hex()}) + body


class HandshakeServer:
    """Serves handshake frames with one handler per frame type."""

    def __init__(
        self,
        max_length: int = DEFAULT_MAX_LENGTH,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = IDLE_S,
        secret: str | bytes | None = None,
    ) -> None:
        self.handlers: dict[FrameType, Handler] = {}
        #: seconds from accept to the reply being sent (whole request, auth included)
        self.request_timeout = request_timeout
        self.max_length = max_length
        self.slots = _accept.Slots(max_connections, "handshake")
        key = auth.load_secret(secret)
        #: the cluster secret peers must prove (None: the published protocol, unauthenticated)
        self.secret: bytes | None = key
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
            await _accept.accept_loop(lsock, self.slots, self._serve_one)
        finally:
            _sockio.close(lsock)
            self._sock = None

    async def _serve_one(self, sock: socket.socket, slot: _accept.Slot) -> None:
        try:
            # the deadline starts at accept and covers the whole request (and its auth)
            with anyio.move_on_after(self.request_timeout) as deadline:
                decoder = FrameDecoder(self.max_length)
                scratch = _sockio.Scratch(_CHUNK)
                frame = await read_frame(sock, decoder, scratch)
                if self.secret is not None:
                    authed = await self._server_auth(sock, decoder, scratch, frame)
                    if authed is None:
                        self.rejected += 1
                        return
                    frame = authed
                slot.busy()
                handler = self.handlers.get(frame.type)
                if frame.type == FrameType.AUTH:
                    reply: Any = {"reply_msg": "no cluster secret is configured on this engine"}
                elif handler is None:
                    reply = {"reply_msg": f"frame type {int(frame.type)} not supported"}
                else:
                    reply = await handler(frame)
                await send_bytes(sock, encode_frame(frame.type, reply))
                self.served += 1
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    return
            if deadline.cancelled_caught:
                self.rejected += 1
                log.debug("handshake connection dropped: no request within %g s", IDLE_S)
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
        except Exception:
            # a handler choking on a peer's payload costs that connection only
            self.rejected += 1
            log.exception("handshake handler failed; connection dropped")

    async def _server_auth(
        self, sock: socket.socket, decoder: FrameDecoder, scratch: _sockio.Scratch, first: Frame
    ) -> Frame | None:
        """The server side of the challenge-response; the authenticated request, or None."""
        assert self.secret is not None
        if first.type != FrameType.AUTH:
            await send_bytes(sock, encode_frame(first.type, {"reply_msg": AUTH_REQUIRED}))
            log.info("handshake: refused a peer without the cluster secret")
            return None
        obj = first.json()
        try:
            if not isinstance(obj, dict):
                raise ValueError("auth frame must be a JSON object")
            cn = auth.check_hex(obj.get("nonce"), auth.NONCE_BYTES, "client nonce")
        except ValueError as e:
            raise ProtocolError(f"handshake auth: {e}") from None
        sn = auth.new_nonce()
        sp = auth.server_proof(self.secret, "handshake", cn, sn)
        await send_bytes(sock, encode_frame(FrameType.AUTH, {"nonce": sn.hex(), "proof": sp.hex()}))
        proof_frame = await read_frame(sock, decoder, scratch)
        request = await read_frame(sock, decoder, scratch)
        pobj = proof_frame.json() if proof_frame.type == FrameType.AUTH else None
        try:
            if not isinstance(pobj, dict):
                raise ValueError("expected the client's proof")
            cp = auth.check_hex(pobj.get("proof"), auth.PROOF_BYTES, "client proof")
        except ValueError as e:
            raise ProtocolError(f"handshake auth: {e}") from None
        bound = encode_frame(request.type, request.payload)
        if not auth.verify(auth.client_proof(self.secret, "handshake", cn, sn, bound), cp):
            await send_bytes(
                sock, encode_frame(request.type, {"reply_msg": "authentication failed"})
            )
            log.warning("handshake: a peer failed the cluster-secret proof")
            return None
        return request


def _fast_recv(sock: socket.socket, scratch: _sockio.Scratch) -> int:
    return int(_fast.recv_at(sock.fileno(), scratch.addr, scratch.size))
