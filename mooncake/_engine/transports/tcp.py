"""The ``tcp`` transport: Mooncake's TCP data protocol v2, both ends.

Server: one listening socket on the engine's host; one task per connection, each serving
pipelined requests in order, straight from/into registered memory. The protocol runs in
``_fast.ServeConn`` without the GIL; with the compiled hot path each connection gets a thread
that blocks in ``poll`` (no event-loop round trip per request: ``MOONCAKE_TCP_SERVE=loop``
keeps it on the loop instead). Device (CUDA) regions are in the same table, marked: on a request
for one the state machine stops (``_fast.STAGE``) and this task moves its bytes through the
engine's pinned staging chunks (:class:`mooncake._engine.cudaio.Stager`), then resumes it. A
request outside one registered buffer is refused with status 1; unlike the published server we
keep the connection (a refused WRITE's payload, up to ``DRAIN_LIMIT``, is read and dropped), so
one bad request costs its sender nothing else. v1 requests (no status frame) get the connection
closed on a refusal, since v1 has no way to say no.

Client: up to ``lanes`` connections per peer. A batch is split by opcode into groups of at most
``PIPELINE_DEPTH`` requests spread over the lanes by bytes; each lane sends a group's headers (and
WRITE payloads) in one ``writev`` stream, then reads the replies in order. Because a group holds
one opcode and at most ``PIPELINE_DEPTH`` replies, neither side can block the other on a full
socket buffer. A published server closes after a refusal, so requests behind a refused one on the
same lane are re-sent on a fresh connection.

Bounds (server): at most ``MC_TCP_MAX_CONNECTIONS`` live connections (the longest-idle gives
way to a new one at the cap), ``MC_TCP_IDLE_TIMEOUT`` idle between requests, and
``MC_TCP_PROGRESS_TIMEOUT`` without a byte moved inside a request; ``unregister()`` drops the
connections inside a request on the region at once (:meth:`TcpTransport.abort_users`).

Cluster secret: with ``MOONCAKE_CLUSTER_SECRET`` set, the descriptor says ``tcp_auth: 1`` and every
connection starts with the challenge-response of :mod:`mooncake._core.auth` (channel ``tcp``;
``docs/protocol.md``) before its first request; a peer on the other side of the setting is
refused with :class:`AuthError`.

Cancellation: a lane that is cancelled mid-group is closed, never reused; the peer may have
written part of a WRITE's bytes, and no bytes arrive into local memory after the call returns.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from mooncake import _fast
from mooncake._core import auth, tcpwire
from mooncake._core.gpu import device_of
from mooncake._core.memory import Region
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, completed, failed
from mooncake._engine import _accept, _sockio, _unix
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake.errors import (
    AuthError,
    InvalidArgumentError,
    MooncakeError,
    PeerDiedError,
    ProtocolError,
    RemoteAccessError,
    TransferError,
)

log = logging.getLogger("mooncake.tcp")

PIPELINE_DEPTH = 256
DEFAULT_LANES = 4  # MC_TCP_LANES_PER_PEER
DRAIN_LIMIT = 64 << 20
MAX_CONNECTIONS = 1024  # MC_TCP_MAX_CONNECTIONS
MIN_RATE = float(64 << 10)  # MC_TCP_MIN_RATE, bytes per second
PROGRESS_TIMEOUT_S = 20.0  # MC_TCP_PROGRESS_TIMEOUT
IDLE_TIMEOUT_S = 300.0  # MC_TCP_IDLE_TIMEOUT

AUTH_HELLO = b"MCTAUTH1"  # + client nonce
AUTH_OK = b"MCTAUTHK"

# the v2 OK status frame at a stable address (sent from, never written after import)
_STATUS_OK = _sockio.Scratch(tcpwire.STATUS_SIZE)
ctypes.memmove(_STATUS_OK.addr, tcpwire.encode_status(tcpwire.Status.OK), tcpwire.STATUS_SIZE)


def _busy_clock(conn: Any) -> Callable[[], float]:
    """How long ``conn`` has been inside one request, for the accept loop at the cap: the
    state machine runs on its own thread, so this samples what it publishes (idle, the
    requests served and refused); the clock restarts whenever one of those moved."""
    last = [0, 0]  # served, refused when the clock last restarted
    since = [time.monotonic()]  # from accept until a request is done or it is seen idle

    def busy_for() -> float:
        now = time.monotonic()
        done = [int(conn.served), int(conn.refused)]
        if conn.idle or done != last:
            last[:] = done
            since[0] = now
            return 0.0
        return now - since[0]

    return busy_for


class _Lane:
    """One client connection to a peer's data port, with its reply staging buffer.

    The staging buffer lives as long as the lane and is pre-faulted once: replies to small
    requests are received into it many at a time (see ``_fast.ClientPipe``).
    """

    __slots__ = ("sock", "stage", "stage_addr")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stage = _sockio.Scratch(_fast.STAGE_SIZE)
        self.stage_addr = self.stage.addr
        _fast.prefault(self.stage_addr, _fast.STAGE_SIZE)

    def close(self) -> None:
        _sockio.close(self.sock)


class _PeerLanes:
    """Idle lanes of one peer plus a limiter on how many exist."""

    def __init__(self, lanes: int) -> None:
        self.idle: list[_Lane] = []
        self.limiter = anyio.CapacityLimiter(lanes)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for lane in self.idle:
            lane.close()
        self.idle.clear()


class TcpTransport(Transport):
    name = "tcp"
    priority = 10
    wire_protocol = "tcp"

    def __init__(
        self,
        engine: Any,
        *,
        lanes: int = DEFAULT_LANES,
        port: int = 0,
        max_connections: int | None = None,
        progress_timeout: float | None = None,
        idle_timeout: float | None = None,
        min_rate: float | None = None,
    ) -> None:
        super().__init__(engine)
        self.lanes = max(1, lanes)
        self._port = port
        self._listener: socket.socket | None = None
        #: live server connections at most; more wait in the listen backlog (idle ones go first)
        self.max_connections = max_connections or _env_int(
            "MC_TCP_MAX_CONNECTIONS", MAX_CONNECTIONS
        )
        #: seconds a request may make no progress before its connection is dropped
        self.progress_timeout = progress_timeout or _env_float(
            "MC_TCP_PROGRESS_TIMEOUT", PROGRESS_TIMEOUT_S
        )
        #: seconds a connection may sit idle between requests (from accept) before it is closed
        self.idle_timeout = idle_timeout or _env_float("MC_TCP_IDLE_TIMEOUT", IDLE_TIMEOUT_S)
        #: bytes per second a request must move on average: one must be done within
        #: ``progress_timeout`` + its size / ``min_rate`` of its start (0: no such bound)
        self.min_rate = (
            min_rate if min_rate is not None else _env_float("MC_TCP_MIN_RATE", MIN_RATE)
        )
        self._slots = _accept.Slots(self.max_connections, "tcp")
        self._threads = anyio.CapacityLimiter(self.max_connections)
        mode = os.environ.get("MOONCAKE_TCP_SERVE", "")
        #: serve each connection on its own thread (compiled hot path) or on the event loop
        self.serve_threads = mode == "thread" or (mode != "loop" and bool(_fast.TCP_COMPILED))
        self._table = _fast.RegionTable()
        self._live: dict[Any, _accept.Slot] = {}
        # connections moving a device request's bytes through staging right now
        self._staging: dict[Any, anyio.CancelScope] = {}
        self._refused = 0
        self.served_connections = 0
        self.aborted_connections = 0
        #: the cluster secret peers must prove on the data port (None: the published protocol)
        self.secret = auth.load_secret()
        self.auth_failures = 0

    # -- server ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._listener is not None, "transport not started"
        return int(self._listener.getsockname()[1])

    @property
    def live_connections(self) -> int:
        """Server connections open right now."""
        return len(self._slots)

    async def start(self) -> None:
        host = self.engine.bind_host
        infos = await anyio.getaddrinfo(host, self._port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        sock = socket.socket(family, stype, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.engine.task_group.start_soon(self._accept_loop, sock, name="tcp-accept")

    def descriptor_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "tcp_data_host": self.engine.hostname,
            "tcp_data_port": self.port,
            "tcp_proto_version": tcpwire.PROTO_VERSION,
        }
        if self.secret is not None:
            fields["tcp_auth"] = 1
        return fields

    async def _accept_loop(self, lsock: socket.socket) -> None:
        try:
            await _accept.accept_loop(lsock, self._slots, self._serve_conn, prepare=_sockio.tune)
        finally:
            _sockio.close(lsock)
            self._listener = None

    async def on_register(self, region: Region) -> None:
        if not region.remote_accessible:
            return
        # device memory is marked: the state machine hands its requests to ``_stage``
        device = device_of(region.location)
        self._table.add(region.addr, region.length, -1 if device is None else device)

    def abort_users(self, region: Region) -> None:
        """Refuse ``region`` from now on and drop every server connection inside a request on
        it: a peer that went quiet mid-request cannot hold memory that is being unregistered.
        """
        if not region.remote_accessible or not self._table.close(region.addr):
            return
        for conn, slot in list(self._live.items()):
            staging = self._staging.get(conn)
            if staging is not None:
                if conn.holds_closing():
                    self.aborted_connections += 1
                    staging.cancel()
            elif self.serve_threads:
                conn.wake()  # the thread drops its connection if it holds a closing range
            elif conn.holds_closing() and slot.scope is not None:
                self.aborted_connections += 1
                slot.scope.cancel()

    def reopen_users(self, region: Region) -> None:
        if region.remote_accessible:
            self._table.reopen(region.addr)

    async def on_unregister(self, region: Region) -> None:
        if not region.remote_accessible:
            return
        # refuses new requests at once, drops connections stuck inside a request on it, then
        # waits (in a worker thread) for the running ones
        self.abort_users(region)
        if not await anyio.to_thread.run_sync(self._table.remove, region.addr):
            log.debug("tcp: region %#x was not in the serving table", region.addr)

    @property
    def refused_requests(self) -> int:
        """Requests refused so far (outside every registered buffer), live connections too."""
        return self._refused + sum(int(c.refused) for c in self._live)

    async def _serve_conn(self, sock: socket.socket, slot: _accept.Slot) -> None:
        """Serve one connection: the protocol runs in ``_fast.ServeConn`` (no Python per
        request), on a thread of its own blocking in ``poll`` (``serve_threads``) or stepped
        by this task between readiness waits."""
        self.served_connections += 1
        if self.secret is not None and not await self._server_auth(sock):
            self.auth_failures += 1
            return
        conn = _fast.ServeConn(sock.fileno(), self._table, DRAIN_LIMIT)
        self._live[conn] = slot
        slot.idle_cb = lambda: bool(conn.idle)
        slot.busy_for_cb = _busy_clock(conn)
        try:
            if self.serve_threads:
                slot.evict_cb = conn.evict
            while True:
                if self.serve_threads:
                    r = await self._serve_thread(conn)
                else:
                    r = await self._serve_loop(conn, sock)
                if r != _fast.STAGE:
                    break
                r = await self._stage(conn, sock)
                if r < 0:
                    break
            if r == -errno.ECONNABORTED:
                self.aborted_connections += 1
            if r < 0:
                log.debug("tcp connection dropped: %s", _step_error(r))
        except (MooncakeError, OSError) as e:
            log.debug("tcp connection dropped: %s", e)
        finally:
            del self._live[conn]
            self._refused += conn.refused
            conn.close()
            _sockio.close(sock)

    async def _serve_loop(self, conn: Any, sock: socket.socket) -> int:
        progress_ms = int(self.progress_timeout * 1000)
        idle_ms = int(self.idle_timeout * 1000)
        while True:
            r = int(conn.step())
            if r in (_fast.WANT_READ, _fast.WANT_WRITE):
                busy = not conn.idle
                wait = int(conn.frame_wait(progress_ms, idle_ms, self.min_rate))
                if busy and wait == 0:
                    return -errno.ETIMEDOUT  # the request is not done within its bound
                with anyio.move_on_after(wait / 1000 if wait >= 0 else math.inf) as scope:
                    if r == _fast.WANT_READ:
                        await anyio.wait_readable(sock)
                    else:
                        await anyio.wait_writable(sock)
                if scope.cancelled_caught:
                    return -errno.ETIMEDOUT if busy else int(_fast.CLOSE)
            elif r == _fast.YIELD:
                await anyio.lowlevel.checkpoint()
            else:
                return r  # PEER_CLOSED, CLOSE (refusal we cannot answer), error

    async def _serve_thread(self, conn: Any) -> int:
        # The thread cannot be cancelled from here: on cancellation the watcher's ``finally``
        # signals the connection's stop eventfd, and the thread returns promptly.
        conn.prepare_blocking()
        progress_ms = int(self.progress_timeout * 1000)
        idle_ms = int(self.idle_timeout * 1000)

        async def watcher() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                conn.stop()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher)
            r = int(
                await anyio.to_thread.run_sync(
                    conn.serve_blocking, progress_ms, idle_ms, self.min_rate, limiter=self._threads
                )
            )
            tg.cancel_scope.cancel()
        return r

    async def _server_auth(self, sock: socket.socket) -> bool:
        """The server side of the challenge-response, before the first request."""
        assert self.secret is not None
        scratch = _sockio.Scratch(64)
        p = self.progress_timeout
        try:
            with anyio.fail_after(p):  # the whole exchange, from accept
                magic = await _sockio.recv_exact(sock, 8, scratch, "auth")
                if magic != AUTH_HELLO:
                    log.info("tcp: refused a connection without the cluster secret")
                    return False
                cn = await _sockio.recv_exact(sock, auth.NONCE_BYTES, scratch, "auth")
                sn = auth.new_nonce()
                await self._send(sock, sn + auth.server_proof(self.secret, "tcp", cn, sn))
                got = await _sockio.recv_exact(sock, auth.PROOF_BYTES, scratch, "auth")
                if not auth.verify(auth.client_proof(self.secret, "tcp", cn, sn), got):
                    log.warning("tcp: a peer failed the cluster-secret proof")
                    return False
                await self._send(sock, AUTH_OK)
            return True
        except (MooncakeError, OSError, TimeoutError) as e:
            log.debug("tcp auth: connection dropped: %s", e)
            return False

    async def _stage(self, conn: Any, sock: socket.socket) -> int:
        """Move the bytes of the device request ``conn`` stopped at (``_fast.STAGE``) through
        the engine's pinned staging chunks, then let ``conn`` go on; 0, or ``-ECONNABORTED``
        when ``unregister`` cut it short (:meth:`abort_users`).

        A CUDA failure after the reply has started cannot be reported in-band (v2 sends its
        status before READ data), so it drops the connection: the client sees the peer die.
        """
        op, addr, size, v2, device = conn.staged()
        if conn.holds_closing():  # unregister began while the machine was stopping here
            return -errno.ECONNABORTED
        stager = self.engine.staging
        progress = self.progress_timeout
        # the whole request within progress_timeout + size / min_rate, not just each byte
        bound = progress + (size / self.min_rate if self.min_rate > 0 else math.inf)
        scope = anyio.CancelScope(deadline=anyio.current_time() + bound)
        self._staging[conn] = scope
        try:
            with scope:
                if op == Opcode.WRITE:

                    async def recv_into(buf: int, n: int) -> None:
                        k = int(conn.take_input(buf, n))
                        if k < n:
                            await _sockio.recv_into_addr(
                                sock, buf + k, n - k, "write payload", progress=progress
                            )

                    await stager.serve_write(recv_into, addr, size, device)
                    if v2:
                        await self._send(sock, tcpwire.encode_status(tcpwire.Status.OK))
                else:

                    async def send_from(buf: int, n: int, first: bool) -> None:
                        if first and v2:
                            addrs, lens = [_STATUS_OK.addr, buf], [tcpwire.STATUS_SIZE, n]
                        else:
                            addrs, lens = [buf], [n]
                        await _sockio.send_addrs(
                            sock, addrs, lens, "read payload", progress=progress
                        )

                    await stager.serve_read(send_from, addr, size, device)
        finally:
            del self._staging[conn]
        if scope.cancelled_caught:
            if anyio.current_time() >= scope.deadline:
                return -errno.ETIMEDOUT  # not done within its bound
            return -errno.ECONNABORTED
        conn.staged_done()
        return 0

    async def _send(self, sock: socket.socket, data: bytes) -> None:
        scratch = _sockio.Scratch(len(data))
        scratch.put(0, data)
        await _sockio.send_addrs(
            sock, [scratch.addr], [len(data)], "status", progress=self.progress_timeout
        )

    # -- client ---------------------------------------------------------------------------

    def can_reach(self, peer: PeerInfo) -> bool:
        return peer.descriptor.tcp_data_port > 0

    def _lanes_of(self, peer: PeerInfo) -> _PeerLanes:
        pl = peer.state.get(self.name)
        if pl is None or pl.closed:
            pl = peer.state[self.name] = _PeerLanes(self.lanes)
        assert isinstance(pl, _PeerLanes)
        return pl

    def forget_peer(self, peer: PeerInfo) -> None:
        pl = peer.state.pop(self.name, None)
        if isinstance(pl, _PeerLanes):
            pl.close()

    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        results: list[TransferResult | None] = [None] * len(requests)
        groups = _plan(requests, self.lanes)
        pl = self._lanes_of(peer)
        v2 = peer.descriptor.tcp_proto_version >= 2
        if len(groups) == 1:
            await self._run_group(peer, pl, requests, groups[0], results, v2)
        else:
            async with anyio.create_task_group() as tg:
                for g in groups:
                    tg.start_soon(self._run_group, peer, pl, requests, g, results, v2)
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    async def _run_group(
        self,
        peer: PeerInfo,
        pl: _PeerLanes,
        requests: Sequence[TransferRequest],
        group: list[int],
        results: list[TransferResult | None],
        v2: bool,
    ) -> None:
        pending = group
        attempts = 0
        while pending:
            attempts += 1
            async with pl.limiter:
                lane = None
                while pl.idle and lane is None:
                    lane = pl.idle.pop()
                    if not _unix.peer_alive(lane.sock):  # closed by the server while idle
                        lane.close()
                        lane = None
                reused = lane is not None
                try:
                    if lane is None:
                        sock = await _sockio.connect(peer.data_host, peer.descriptor.tcp_data_port)
                        lane = _Lane(sock)
                        await self._client_auth(lane.sock, peer)
                    done, reusable = await self._pipeline(lane, requests, pending, results, v2)
                except PeerDiedError as e:
                    if lane is not None:
                        lane.close()
                    if reused and all(results[i] is None for i in pending):
                        # An idle lane the server closed just as we took it (idle deadline,
                        # evicted at its connection cap): no reply came, so all of it goes
                        # again on a fresh connection (re-sending a READ or WRITE is idempotent).
                        log.debug("tcp: idle lane to %s was closed (%s); retrying", peer.segment, e)
                        attempts -= 1
                        continue
                    for i in pending:
                        if results[i] is None:
                            results[i] = failed(e)
                    return
                except MooncakeError as e:
                    if lane is not None:
                        lane.close()
                    for i in pending:
                        if results[i] is None:
                            results[i] = failed(e)
                    return
                except BaseException:
                    if lane is not None:
                        lane.close()
                    raise
                if reusable and not pl.closed:
                    pl.idle.append(lane)
                else:
                    lane.close()
            # A published server closes after a refusal: the rest go again on a new lane, as
            # long as each attempt makes progress.
            rest = pending[done:]
            if rest and done == 0 and attempts > 1:
                for i in rest:
                    results[i] = failed(PeerDiedError(f"{peer.segment}: connection lost"))
                return
            pending = rest

    async def _client_auth(self, sock: socket.socket, peer: PeerInfo) -> None:
        wants = bool(peer.descriptor.extra.get("tcp_auth"))
        if self.secret is None:
            if wants:
                raise AuthError(f"{peer.segment} requires the cluster secret ({auth.SECRET_ENV})")
            return
        if not wants:
            raise AuthError(f"{peer.segment} does not take the cluster secret on its data port")
        scratch = _sockio.Scratch(64)
        p = self.progress_timeout
        cn = auth.new_nonce()
        await self._send(sock, AUTH_HELLO + cn)
        try:
            reply = await _sockio.recv_exact(sock, 64, scratch, "auth", progress=p)
        except PeerDiedError:
            raise AuthError(f"{peer.segment} closed the data connection during auth") from None
        sn, sp = reply[:32], reply[32:]
        if not auth.verify(auth.server_proof(self.secret, "tcp", cn, sn), sp):
            raise AuthError(f"{peer.segment} does not know the cluster secret")
        await self._send(sock, auth.client_proof(self.secret, "tcp", cn, sn))
        try:
            ok = await _sockio.recv_exact(sock, 8, scratch, "auth", progress=p)
        except PeerDiedError:
            ok = b""
        if ok != AUTH_OK:
            raise AuthError(f"{peer.segment} refused our cluster-secret proof")

    async def _pipeline(
        self,
        lane: _Lane,
        requests: Sequence[TransferRequest],
        idx: list[int],
        results: list[TransferResult | None],
        v2: bool,
    ) -> tuple[int, bool]:
        """Send ``idx``'s requests on ``lane`` and collect replies.

        Returns (how many of ``idx`` got a definite result, whether the lane can be reused).
        """
        sock = lane.sock
        op = requests[idx[0]].opcode
        reqs = [requests[i] for i in idx]
        pipe = _fast.ClientPipe(
            sock.fileno(),
            op is Opcode.WRITE,
            v2,
            [r.local_addr for r in reqs],
            [r.remote_addr for r in reqs],
            [r.length for r in reqs],
            lane.stage_addr,
            _fast.STAGE_SIZE,
            lane.stage,
        )
        try:
            while True:
                rc = pipe.step()
                if rc == _fast.DONE:
                    break
                if rc == _fast.WANT_READ:
                    await anyio.wait_readable(sock)
                elif rc == _fast.WANT_WRITE:
                    await anyio.wait_writable(sock)
                elif rc == _fast.PEER_CLOSED or (
                    rc != -_fast.E_PROTO and pipe.done > 0 and pipe.statuses[pipe.done - 1] == 1
                ):
                    # a published server closes after a refusal (a reset when our next headers
                    # were already in its buffer): what is left goes again on a new lane
                    return pipe.done, False
                else:
                    raise _step_error(rc)
        finally:
            # every reply that arrived is a result, also when the rest failed or was cancelled
            st = pipe.statuses
            for k in range(pipe.done):
                results[idx[k]] = _status_result(st[k], reqs[k])
        return len(idx), True

    async def aclose(self) -> None:
        if self._listener is not None:  # never started serving
            _sockio.close(self._listener)
            self._listener = None


def client_auth_blocking(sock: socket.socket, secret: bytes) -> None:
    """The client side of the data port's challenge-response on a blocking socket (its timeout
    bounds each step); :class:`AuthError` when the server does not prove the secret or refuses
    ours, ``OSError`` when the connection fails."""

    def recv_exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise AuthError("the peer closed the data connection during auth")
            out += chunk
        return out

    cn = auth.new_nonce()
    sock.sendall(AUTH_HELLO + cn)
    reply = recv_exact(64)
    sn, sp = reply[:32], reply[32:]
    if not auth.verify(auth.server_proof(secret, "tcp", cn, sn), sp):
        raise AuthError("the peer does not know the cluster secret")
    sock.sendall(auth.client_proof(secret, "tcp", cn, sn))
    if recv_exact(8) != AUTH_OK:
        raise AuthError("the peer refused our cluster-secret proof")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        v = int(raw) if raw.strip() else default
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not an integer") from None
    if v < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {v}")
    return v


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        v = float(raw) if raw.strip() else default
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not a number of seconds") from None
    if not v > 0:
        raise InvalidArgumentError(f"{name} must be > 0 seconds, got {v}")
    return v


def _step_error(rc: int) -> MooncakeError:
    if rc == -_fast.E_PROTO:
        return ProtocolError("malformed TCP header or status frame")
    return _sockio._died("tcp", -rc)


def _status_result(code: int, r: TransferRequest) -> TransferResult:
    if code == tcpwire.Status.OK:
        return completed(r.length)
    if code == tcpwire.Status.REJECTED:
        return failed(
            RemoteAccessError(
                f"peer refused {r.opcode.name} of [{r.remote_addr:#x}, +{r.length}): "
                "not inside one of its registered buffers"
            )
        )
    raise ProtocolError(f"unknown TCP status code {code}")


def _plan(requests: Sequence[TransferRequest], lanes: int) -> list[list[int]]:
    """Split request indices into single-opcode groups of <= PIPELINE_DEPTH, balanced by bytes."""
    by_op: dict[Opcode, list[int]] = {}
    for i, r in enumerate(requests):
        by_op.setdefault(r.opcode, []).append(i)
    groups: list[list[int]] = []
    for idx in by_op.values():
        total = sum(requests[i].length for i in idx)
        n = max(1, min(lanes, len(idx)))
        # small batches are latency-bound: one lane, one round trip
        if total < (256 << 10):
            n = 1
        target = total / n
        cur: list[int] = []
        acc = 0
        made = 0
        for i in idx:
            cur.append(i)
            acc += requests[i].length
            if len(cur) >= PIPELINE_DEPTH or (acc >= target and made < n - 1):
                groups.append(cur)
                made += 1
                cur = []
                acc = 0
        if cur:
            groups.append(cur)
    return groups
