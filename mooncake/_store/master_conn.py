"""The client end of the master RPC: one pipelined TCP connection, responses matched by id.

:class:`MasterConnection` sends framed requests (:mod:`mooncake._core.rpc`) and waits for the
response with the same id. There is no reader task: the first waiter whose answer has not
arrived reads the socket for everyone ("leader/follower"), hands each decoded response to its
waiter, and when its own has come, passes the reading role to another waiter. One request in
flight therefore costs one ``send`` and one ``recv`` on the caller's own task, with no task
switch -- the master RPC sits on the latency path of every put and get.

Failure: if the connection breaks (reset, EOF, a frame that does not parse) every outstanding
and later call raises :class:`~mooncake.errors.RpcError` until :meth:`reconnect` succeeds. The
master's error answers raise the matching :mod:`mooncake.errors` class
(:func:`~mooncake._core.rpc.decode_result`). A silent master is bounded by TCP keepalive and
``TCP_USER_TIMEOUT`` (see :mod:`mooncake._engine._sockio`); callers add their own deadlines
with ``anyio.fail_after``.

Cluster secret: with ``secret`` (or ``MOONCAKE_CLUSTER_SECRET``) every (re)connection first runs
``AuthHello``/``AuthProve`` (:mod:`mooncake._core.auth`); a master that does not know the secret
(or takes none) raises :class:`~mooncake.errors.AuthError`.

Cancellation: a cancelled call forgets its request id; its answer, when it comes, is dropped.
The connection stays usable unless the cancellation interrupted a send mid-frame (then it is
closed and the next call reconnects).
"""

from __future__ import annotations

import errno
import itertools
import socket
from typing import Any

import anyio
import msgspec

from mooncake._core import auth, rpc
from mooncake._engine import _sockio
from mooncake.errors import AuthError, MooncakeError, NotSupportedError, RpcError

_RECV = 256 << 10


class _Waiter:
    __slots__ = ("event", "method", "response", "take_over")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = anyio.Event()
        self.response: rpc.Response | None = None
        self.take_over = False


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); raises InvalidArgumentError."""
    from mooncake.errors import InvalidArgumentError

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgumentError(f"master address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class MasterConnection:
    """A pipelined RPC connection to the master (open with :meth:`connect`)."""

    def __init__(self, address: str, *, secret: str | bytes | None = None) -> None:
        self.address = address
        self.secret = auth.load_secret(secret)
        self.host, self.port = parse_address(address)
        self._sock: socket.socket | None = None
        self._decoder = rpc.MessageDecoder()
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._reading = False
        self._send_lock = anyio.Lock()
        self._broken: MooncakeError | None = None
        self._scratch = _sockio.Scratch(_RECV)
        self.calls = 0

    @property
    def connected(self) -> bool:
        return self._sock is not None and self._broken is None

    async def connect(self) -> None:
        """(Re)connect; outstanding calls of a previous connection have already failed."""
        try:
            sock = await _sockio.connect(self.host, self.port)
        except MooncakeError as e:
            raise RpcError(f"cannot reach the master at {self.address}: {e}") from None
        self.close()
        self._sock = sock
        self._decoder = rpc.MessageDecoder()
        self._broken = None
        if self.secret is not None:
            try:
                await self._authenticate(self.secret)
            except BaseException:
                self.close()
                raise

    async def _authenticate(self, key: bytes) -> None:
        cn = auth.new_nonce()
        try:
            ch: rpc.AuthChallenge = await self.call("AuthHello", rpc.AuthHelloParams(nonce=cn))
        except NotSupportedError:
            raise AuthError(f"the master at {self.address} takes no cluster secret") from None
        if not auth.verify(auth.server_proof(key, "rpc", cn, ch.nonce), ch.proof):
            raise AuthError(f"the master at {self.address} does not know the cluster secret")
        try:
            await self.call(
                "AuthProve", rpc.AuthProveParams(proof=auth.client_proof(key, "rpc", cn, ch.nonce))
            )
        except RpcError as e:
            raise AuthError(f"the master at {self.address} refused us: {e}") from None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            _sockio.close(sock)
        self._fail(RpcError(f"connection to the master at {self.address} closed"))

    def _fail(self, err: MooncakeError) -> None:
        if self._broken is None:
            self._broken = err
        for w in self._waiters.values():
            w.event.set()

    async def call(self, method: str, params: msgspec.Struct) -> Any:
        """Send one request and return its decoded result (or raise the master's error)."""
        if self._sock is None or self._broken is not None:
            await self.connect()
        sock = self._sock
        assert sock is not None
        req_id = next(self._ids)
        frame = rpc.encode_request(req_id, method, params)
        w = _Waiter(method)
        self._waiters[req_id] = w
        self.calls += 1
        try:
            await self._send(sock, frame)
            while w.response is None:
                if self._broken is not None:
                    raise RpcError(f"master RPC {method} failed: {self._broken}")
                if self._reading:
                    await w.event.wait()
                    w.event = anyio.Event()
                    continue
                self._reading = True
                try:
                    await self._read_until(sock, w)
                finally:
                    self._reading = False
                    self._hand_over()
        finally:
            self._waiters.pop(req_id, None)
        return rpc.decode_result(method, w.response)

    def _hand_over(self) -> None:
        """Wake one waiter still without an answer so that it becomes the reader."""
        for other in self._waiters.values():
            if other.response is None:
                other.take_over = True
                other.event.set()
                return

    async def _send(self, sock: socket.socket, frame: bytes) -> None:
        # Fast path: small frames almost always go out in one non-blocking send, and taking the
        # uncontended lock without a checkpoint saves a trip through the event loop per call.
        try:
            self._send_lock.acquire_nowait()
        except anyio.WouldBlock:
            await self._send_lock.acquire()
        try:
            try:
                n = sock.send(frame)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._fail(
                    RpcError(f"master connection lost ({errno.errorcode.get(e.errno or 0, e)})")
                )
                raise RpcError(f"cannot send to the master at {self.address}: {e}") from None
            if n == len(frame):
                return
            view = memoryview(frame)[n:]
            try:
                while view:
                    await anyio.wait_writable(sock)
                    try:
                        n = sock.send(view)
                    except BlockingIOError:
                        continue
                    view = view[n:]
            except BaseException as e:
                # a partial frame on the wire poisons the stream
                self._fail(RpcError(f"send to the master interrupted: {e!r}"))
                raise
        finally:
            self._send_lock.release()

    async def _read_until(self, sock: socket.socket, w: _Waiter) -> None:
        scratch = self._scratch
        fd = sock.fileno()
        from mooncake import _fast

        while w.response is None and self._broken is None:
            r = _fast.recv_at(fd, scratch.addr, scratch.size)
            if r > 0:
                self._decoder.feed(scratch.bytes(0, r))
                try:
                    for msg in self._decoder:
                        if isinstance(msg, rpc.Response):
                            other = self._waiters.get(msg.id)
                            if other is not None:
                                other.response = msg
                                if other is not w:
                                    other.event.set()
                except MooncakeError as e:
                    self._fail(RpcError(f"bad frame from the master: {e}"))
            elif r == 0:
                self._fail(RpcError(f"the master at {self.address} closed the connection"))
            elif -r in (errno.EAGAIN, errno.EWOULDBLOCK):
                await anyio.wait_readable(sock)
            elif -r != errno.EINTR:
                self._fail(
                    RpcError(f"master connection failed ({errno.errorcode.get(-r, str(-r))})")
                )
