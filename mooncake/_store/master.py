"""The store master server: the RPC port, the sweeper, ``/metrics``, ``/status``, ``/health``.

::

    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, MasterServerConfig(rpc_port=0))
        server.rpc_port, server.metrics_port, server.state   # a MasterServer

:func:`serve_master` drives a :class:`~mooncake._core.master.MasterState` (all rules live there)
with the framing of :mod:`mooncake._core.rpc`. Everything binds the host it is given (loopback by
default). The RPC listener is bound last, so once it accepts connections the metrics and
(optional) HTTP metadata servers are up too: "the RPC port is open" means ready.

Connections: one task each, at most ``max_connections`` live. On trio with its real clock and
without replication, the requests themselves are read, answered and written by serving threads
beside the loop (:mod:`mooncake._store.rpc_thread`: no scheduler trip per request; the loop
holds the state's lock whenever it runs, so the state is never seen by both at once), each
connection's task waiting for it; ``rpc_threads=0`` keeps everything on the loop. At the cap the master stops
accepting (the rest wait in the listen backlog) and closes the longest-idle connection (no
partial frame, nothing being answered) in favour of the new one: a store client reconnects on
its next call. Deadlines: the first byte must arrive within ``request_timeout`` of accept;
a frame that has begun must keep arriving (no ``progress_timeout`` without a byte); a connection
idle between frames for ``idle_timeout`` is closed (store clients heartbeat far more often);
each of these fires at most 5 % (and 0.5 s) late, never early (one cancel scope per connection
whose deadline moves only when it drifts that far). A connection is served request by request in arrival order (answers in the same order; each
call is a short synchronous state change, so no request waits on another's I/O). Frames are
bounded by ``max_frame``; a frame that does not parse drops that connection only. An unknown
method or malformed params is answered with an error and the connection kept; nothing a client
sends raises out of the connection's task.

Cluster secret: with ``cluster_secret`` (or ``MOONCAKE_CLUSTER_SECRET``) a connection must pass
``AuthHello``/``AuthProve`` (:mod:`mooncake._core.auth`, channel ``rpc``) before any other
call; anything else gets ``RPC_FAIL`` "authentication required" and the connection is closed.

Regex requests (``GetReplicaListByRegex``, ``RemoveByRegex``) match in a worker thread within
``regex_budget`` seconds (:mod:`mooncake._store.keyscan`): a pathological pattern fails that
request with ``-600`` and never stalls the loop.

Liveness: the sweeper measures how late it wakes; time the loop could not run (beyond one
``sweep_interval``) is credited to every client (:meth:`MasterState.credit_stall`) before any
is expired, so a stall of the master never expires a client that kept pinging.

Time: every ``now`` comes from ``anyio.current_time()``, the event loop's clock, so trio's
``MockClock`` drives leases, client TTLs and zombie timeouts in tests. A background task calls
:meth:`MasterState.sweep` every ``sweep_interval`` seconds (client expiry, zombie release,
deferred frees, soft-pin expiry, watermark eviction).

Cancellation: cancelling the task running :func:`serve_master` closes all listeners and
connections; the state object stays usable (tests inspect it afterwards).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
from prometheus_client import CollectorRegistry

from mooncake._core import auth, commands, rpc, tenantscope
from mooncake._core.master import MasterState
from mooncake._engine import _accept
from mooncake._store import master_auth, master_http
from mooncake._store.drain_jobs import DrainJobs
from mooncake._store.ha_base import Replication
from mooncake._store.heldwait import PUT_STARTS, answer_put_start, held_refusal
from mooncake._store.keyscan import SCAN_METHODS, KeyScanner
from mooncake._store.master_config import (
    MasterServerConfig,
)
from mooncake._store.master_metrics import MasterCollector
from mooncake._store.rpc_thread import Handoff, RpcThread, usable
from mooncake._store.serving import ReplyBudget, frame_deadline
from mooncake._store.tenancy import TenantBindings
from mooncake.errors import (
    ErrorCode,
    InvalidArgumentError,
    MooncakeError,
    ProtocolError,
)

if TYPE_CHECKING:
    from mooncake._store.ha import HaNode
    from mooncake._store.kv_events import KvEventPublisher

log = logging.getLogger("mooncake.master")

__all__ = ["MasterServer", "MasterServerConfig", "Replication", "serve_master"]

_RECV = 256 << 10
_FAIR_ROUNDS = 16
#: the calls whose client id marks their connection as that client's heartbeat connection
_HEARTBEATS = frozenset({"Ping", "MountSegment", "ReMountSegment"})
#: heartbeat calls that make a connection its client's heartbeat connection
HEARTBEAT_CONNECTION_CALLS = 2
_DEADLINE_SLACK = 0.5  # seconds a connection's wait deadline may fire late (5 % at most)
AUTH_REQUIRED = master_auth.AUTH_REQUIRED


#: seconds between sweeps of a replicated master (at least)
HA_SWEEP_INTERVAL = 0.2
#: params of one logged call are at most this large (an etcd value holds ~1.5 MiB)
MAX_LOGGED_PARAMS = 1 << 20


class MasterServer:
    """A running master: its state, bound ports and per-method counters."""

    def __init__(self, config: MasterServerConfig, state: MasterState | None = None) -> None:
        self.config = config
        self.state = state if state is not None else MasterState(config.state)
        self.requests: dict[str, int] = dict.fromkeys(rpc.METHODS, 0)
        self.failures: dict[str, int] = dict.fromkeys(rpc.METHODS, 0)
        self.connections = 0
        self.connections_dropped = 0
        self.deduplicated = 0
        """Retried mutating calls answered from the dedup ledger instead of applied again."""
        self.rpc_port = 0
        self.metrics_port: int | None = None
        self.http_metadata_port: int | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MasterCollector(self))
        self.slots = _accept.Slots(config.max_connections, "master")
        self.replies = ReplyBudget(config.reply_budget)
        self.secret = auth.load_secret(config.cluster_secret)
        self.auth_failures = 0
        self.http_slots = _accept.Slots(master_http.HTTP_MAX_CONNECTIONS, "master-http")
        self.scanner = KeyScanner(config.regex_budget)
        # One receive buffer for every connection (each copies what it got into its decoder
        # before it awaits): a fresh recv(256 KiB) allocation per request was an mmap, mremap
        # and munmap each (~0.1 ms a request on the development VM).
        self._scratch = memoryview(bytearray(_RECV))
        self._ha: Replication | None = None
        self.state.held_waits = True  # see heldwait; off once replication is on
        self.ha_node: HaNode | None = None
        self.last_snapshot_seq = 0
        self.clock_offset = 0.0
        self._socks: set[socket.socket] = set()
        self._heartbeats: dict[socket.socket, tuple[str, int]] = {}
        self.tenant_bindings = TenantBindings()
        """Connections bound to a tenant by its key (:mod:`mooncake._store.tenancy`)."""
        """Connection -> (the client id its last ``Ping``/mount carried, how many it carried).
        One that carried two or more is that client's *heartbeat connection* (a tool's
        one-call connection is not): the last of those closing is the sign the client is
        gone."""
        self.rpc_thread: RpcThread | None = None
        self.kv_publisher: KvEventPublisher | None = None
        self.drain_jobs = DrainJobs()
        """The drain jobs of the admin HTTP port (:mod:`mooncake._store.drain_jobs`)."""

    # -- RPC -------------------------------------------------------------------------------

    def now(self) -> float:
        """The state's clock: the loop's clock plus the offset a promotion chose (0 without HA)."""
        return anyio.current_time() + self.clock_offset

    def handle_request(
        self, req: rpc.Request, now: float, matched: list[str] | None = None
    ) -> bytes:
        """Answer one decoded request (a framed response; never raises for request errors).

        ``matched``: for a regex method, the keys its pattern matched (:meth:`handle_scan`).
        A mutating request with a ``rid`` already in the state's dedup ledger is answered with
        the recorded reply (its id replaced) and not applied; a new one is applied through
        :func:`commands.apply`, which records its reply (:mod:`mooncake._core.dedup`).
        """
        return self.execute(req, now, matched)[0]

    def execute(
        self,
        req: rpc.Request,
        now: float,
        matched: list[str] | None = None,
        sock: socket.socket | None = None,
        *,
        fresh: bool = False,
    ) -> tuple[bytes, int]:
        """(framed reply, log ticket): with replication on, the reply may be sent only once
        :meth:`Replication.wait_durable` of the ticket returned True (0: send at once).
        ``fresh``: run a retried call again instead of answering it from the dedup ledger
        (:mod:`mooncake._store.heldwait`: its recorded refusal changed nothing).

        A mutating call waits for its own log entry, any other call for the entries of the
        mutations before it (so nothing not yet durable is ever shown to a client)."""
        max_frame = self.config.max_frame
        name = req.method
        ha = self.ha
        ticket = 0
        try:
            params = rpc.decode_params(req)
            self.requests[name] += 1
            self.tenant_bindings.check(sock, name, params)
            if sock is not None and name in _HEARTBEATS:
                cid = getattr(params, "client_id", "")
                seen = self._heartbeats.get(sock)
                self._heartbeats[sock] = (cid, seen[1] + 1 if seen and seen[0] == cid else 1)
            rid = req.rid if name in rpc.MUTATING else None
            refusal = ha.refusal() if ha is not None else None
            if refusal is not None and name != "ServiceReady":
                self.failures[name] += 1
                return rpc.encode_error(
                    req.id, ErrorCode.UNAVAILABLE_IN_CURRENT_MODE, refusal, max_frame=max_frame
                ), 0
            if rid is not None and not fresh:
                # a retried call: answered from the dedup ledger, neither applied nor logged
                # again (its reply still waits until everything before it is durable)
                recorded = self.state.dedup.lookup(rid)
                if recorded is not None:
                    self.deduplicated += 1
                    ticket = ha.barrier if ha is not None else 0
                    return rpc.encode_reply(req.id, recorded, max_frame=max_frame), ticket
            if ha is not None and refusal is None:
                ticket = self._log_call(ha, req, now, rid, matched)
            # the one apply path: what the standbys apply the log with (it settles; with a
            # request id it records the reply)
            result = commands.apply_call(
                self.state, name, now, params, req.params, rid, matched, rid is not None
            )
            try:
                return rpc.encode_result(req.id, result, max_frame=max_frame), ticket
            except InvalidArgumentError as e:  # answer too large for one frame
                self.failures[name] += 1
                return rpc.encode_error(req.id, e, max_frame=max_frame), ticket
        except MooncakeError as e:
            if name in self.failures:
                self.failures[name] += 1
            return rpc.encode_error(req.id, e, max_frame=max_frame), ticket
        except Exception as e:  # a bug here must not take the master down
            log.exception("master: %s failed", name)
            self.failures[name] = self.failures.get(name, 0) + 1
            return rpc.encode_error(
                req.id, ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}", max_frame=max_frame
            ), ticket

    @property
    def ha(self) -> Replication | None:
        """The replication this master logs its mutations to (None: a plain master)."""
        return self._ha

    @ha.setter
    def ha(self, ha: Replication | None) -> None:
        self._ha = ha
        # a replicated master never waits out held space (its standbys would skip the repeated
        # request id), so its batches must not be undone whole for it either
        self.state.held_waits = ha is None

    def held_refusal(self) -> float:
        """When the space the last put-start was refused for comes back (0.0: it was not
        refused for held space); resets the mark (:mod:`mooncake._store.heldwait`)."""
        return held_refusal(self.state)

    def _held_limit(self) -> float:
        """How long a put-start refused for held space may wait (:mod:`~mooncake._store.heldwait`);
        a replicated master does not wait (its standbys would skip the repeated request id)."""
        return 0.0 if self.ha is not None else float(self.state.config.default_kv_lease_ttl)

    def _log_call(
        self,
        ha: Replication,
        req: rpc.Request,
        now: float,
        rid: bytes | None,
        matched: list[str] | None,
    ) -> int:
        """Queue the call's command for the log (unless a pure read): the ticket its reply
        waits for (its own entry if mutating, else the mutations before it). A regex method's
        command carries the keys its pattern matched here, so no replica runs the pattern."""
        name = req.method
        kind = commands.durability(name)
        if kind is commands.Durability.PURE_READ:
            return ha.barrier
        if len(req.params) > MAX_LOGGED_PARAMS:
            raise InvalidArgumentError(
                f"{name} params of {len(req.params)} bytes exceed the "
                f"{MAX_LOGGED_PARAMS} a replicated master logs in one entry"
            )
        cmd = (
            commands.ScanApply(name, bytes(req.params), matched, now, rid)
            if matched is not None
            else commands.rpc_command(name, bytes(req.params), now, rid)
        )
        own = ha.append(cmd)
        return own if kind is commands.Durability.MUTATING else ha.barrier

    def run_command(self, command: commands.Command) -> Any:
        """Apply an internal command (sweep, stall credit, drain step), logging it when
        replicated; one that changed what reads see (objects, bytes, clients, segments) is a
        mutation. Returns what :func:`commands.apply` returns."""
        ha = self.ha
        if ha is None:
            return commands.apply(self.state, command)
        ha.append(command)
        s = self.state
        before = (s.object_count, s.used_bytes, s.client_count, s.segment_count)
        out = commands.apply(s, command)
        if (s.object_count, s.used_bytes, s.client_count, s.segment_count) != before:
            ha.mark_mutated()
        return out

    def close_connections(self) -> None:
        """Shut every client connection (a deposed leader does: clients re-resolve). Their
        clients are not gone: no :func:`commands.ConnectionLost` for them."""
        self._heartbeats.clear()
        for sock in list(self._socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    async def handle_scan(
        self, req: rpc.Request, sock: socket.socket | None = None
    ) -> tuple[bytes, int]:
        """Answer a regex request: match in a worker thread, then apply on the loop
        ((reply, ticket) as :meth:`execute`)."""
        try:
            params = rpc.decode_params(req)
            assert isinstance(params, rpc.RegexParams)
            keys = await self.scanner.matching(
                tenantscope.scan_keys(self.state, params.tenant), params.regex
            )
        except MooncakeError as e:
            self.requests[req.method] += 1
            self.failures[req.method] += 1
            return rpc.encode_error(req.id, e, max_frame=self.config.max_frame), 0
        except Exception as e:  # a bug here must not take the master down
            log.exception("master: %s failed", req.method)
            self.failures[req.method] += 1
            return rpc.encode_error(
                req.id,
                ErrorCode.INTERNAL_ERROR,
                f"{type(e).__name__}: {e}",
                max_frame=self.config.max_frame,
            ), 0
        return self.execute(req, self.now(), matched=keys, sock=sock)

    async def serve_connection(self, sock: socket.socket, slot: _accept.Slot) -> None:
        """Serve one RPC connection (a connected non-blocking socket, closed by the accept
        loop) until the peer closes it, sends garbage, or misses a deadline.

        Raw non-blocking socket calls, awaiting readiness only on ``EAGAIN``: a request costs
        one ``recv`` and one ``send`` and no scheduler round trip when the socket is ready
        (a checkpoint every ``_FAIR_ROUNDS`` busy rounds keeps other connections served).
        """
        self.connections += 1
        self._socks.add(sock)
        stopping = False
        try:
            resume = None
            if self.rpc_thread is not None:
                decoder = rpc.MessageDecoder(self.config.max_frame)
                resume = await self.rpc_thread.serve(sock, slot, decoder)
                if resume is None:
                    return
            await self._serve_socket(sock, slot, resume)
        except ProtocolError as e:
            self.connections_dropped += 1
            log.warning("master: dropping connection: %s", e)
        except OSError as e:  # reset, broken pipe
            self.connections_dropped += 1
            log.info("master: connection lost: %s", e)
        except anyio.get_cancelled_exc_class():
            stopping = True  # the master is stopping: its clients are not gone
            raise
        finally:
            self._socks.discard(sock)
            self.tenant_bindings.forget(sock)
            if stopping:
                self._heartbeats.pop(sock, None)
            else:
                self.connection_closed(sock)

    def connection_closed(self, sock: socket.socket, now: float | None = None) -> None:
        """``sock`` closed: if it was the last connection a client sent heartbeats on, that
        client's segments are quarantined and its writes in flight discarded at once
        (:func:`commands.ConnectionLost`) instead of at its client TTL. ``now``: the state's
        clock, for a caller off the loop (an RPC thread, holding the state lock)."""
        entry = self._heartbeats.pop(sock, None)
        if entry is None or entry[1] < HEARTBEAT_CONNECTION_CALLS or not entry[0]:
            return
        client_id = entry[0]
        if any(
            c == client_id and n >= HEARTBEAT_CONNECTION_CALLS for c, n in self._heartbeats.values()
        ):
            return
        ha = self.ha
        if ha is not None and ha.refusal() is not None:
            return  # not the leader: the leader (if any) sees its own connections
        try:
            when = self.now() if now is None else now
            self.run_command(commands.ConnectionLost(client_id, when))
        except Exception:
            log.exception("master: handling the lost connection of %s failed", client_id)

    async def _serve_socket(
        self, sock: socket.socket, slot: _accept.Slot, resume: Handoff | None = None
    ) -> None:
        """The loop path of a connection; ``resume``: one the RPC thread handed back."""
        cfg = self.config
        decoder = rpc.MessageDecoder(cfg.max_frame) if resume is None else resume.decoder
        busy = 0
        first = resume is None
        authed = self.secret is None if resume is None else resume.authed
        nonces: tuple[bytes, bytes] | None = None if resume is None else resume.nonces
        ticket = 0
        scratch = self._scratch
        what, timeout = "no request", cfg.request_timeout
        frame_start = anyio.current_time()
        # the requests still to answer when a batch stopped at ``reply_batch`` (no recv first)
        more: Iterator[rpc.Message] | None = None
        held: tuple[bytes, float] | None = None  # a serving thread's held refusal
        # One cancel scope for the connection's life instead of one per wait: its deadline is
        # moved only when it drifts out of [want, want + 2 slack] (a connection with steady
        # traffic never touches it), so a deadline fires at most 2 slack late and never
        # early. It is lifted (inf) before every await that is not the wait for a request.
        with anyio.CancelScope() as scope:
            while True:
                msgs: Iterator[rpc.Message] = decoder
                out: list[bytes] = []
                fresh = False
                if resume is not None:  # first its request, then what is still buffered
                    msgs, out = itertools.chain(resume.requests, decoder), resume.out
                    held, resume = resume.held, None
                    n = -1
                elif more is not None:
                    msgs, more = more, None
                    n = -1
                else:
                    try:
                        n = sock.recv_into(scratch)
                    except (BlockingIOError, InterruptedError):
                        n = -2
                if n == -2:
                    busy = 0
                    now = anyio.current_time()
                    if decoder.buffered:
                        slot.busy()
                        timeout, what = cfg.progress_timeout, "no progress inside a frame"
                        want = now + timeout
                        end = frame_deadline(
                            frame_start,
                            decoder.pending_length + 4,
                            cfg.progress_timeout,
                            cfg.min_rate,
                        )
                        if end < want:
                            want, what = end, "frame not done within its bound"
                    else:
                        slot.rest()
                        timeout = cfg.request_timeout if first else cfg.idle_timeout
                        what = "no request" if first else "idle"
                        want = now + timeout
                    slack = min(_DEADLINE_SLACK, timeout * 0.05)
                    if not want <= scope.deadline <= want + 2 * slack:
                        scope.deadline = want + slack
                    await anyio.wait_readable(sock)
                    continue
                if not n:
                    decoder.check_eof()
                    return
                if n > 0:
                    fresh = not decoder.buffered
                    decoder.feed(scratch[:n])  # copied out before the next await
                size = 0
                answered = False
                for msg in msgs:
                    first = False
                    answered = True
                    if not isinstance(msg, rpc.Request):
                        raise ProtocolError("a client sent a response frame")
                    if not authed or msg.method in rpc.AUTH_METHODS:
                        reply, authed, nonces, close = self.auth_step(msg, authed, nonces, sock)
                        out.append(reply)
                        if close:
                            scope.deadline = math.inf
                            await self._send_bounded(sock, b"".join(out), 0)
                            return
                    elif msg.method in SCAN_METHODS:
                        slot.busy()
                        scope.deadline = math.inf
                        reply, t = await self.handle_scan(msg, sock)
                        out.append(reply)
                        ticket = max(ticket, t)
                    elif msg.method in PUT_STARTS:
                        scope.deadline = math.inf
                        first_reply, until = held if held is not None else (None, 0.0)
                        held = None
                        reply, t = await answer_put_start(
                            self,
                            msg,
                            sock,
                            limit_s=self._held_limit(),
                            sweep_s=cfg.sweep_interval,
                            refused_until=until,
                            reply=first_reply,
                        )
                        out.append(reply)
                        ticket = max(ticket, t)
                    else:
                        reply, t = self.execute(msg, self.now(), sock=sock)
                        out.append(reply)
                        ticket = max(ticket, t)
                    size += len(out[-1])
                    if size >= cfg.reply_batch:  # the rest once this batch is sent
                        more = msgs
                        break
                if decoder.buffered and (fresh or answered) and more is None:
                    frame_start = anyio.current_time()  # a new frame began in this recv
                if ticket:
                    slot.busy()
                    ha = self.ha
                    if ha is not None:
                        scope.deadline = math.inf
                        if not await ha.wait_durable(ticket):
                            return  # deposed before its log entry was durable: no answer at all
                    ticket = 0
                if out:
                    slot.busy()
                    slot.progress()
                    reply = b"".join(out) if len(out) > 1 else out[0]
                    try:  # almost always all of it at once: no coroutine, no scheduler trip
                        sent = sock.send(reply)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    if sent < len(reply):
                        scope.deadline = math.inf
                        if not await self._send_bounded(sock, reply, sent):
                            return
                busy += 1
                if busy >= _FAIR_ROUNDS:
                    busy = 0
                    scope.deadline = math.inf
                    await anyio.lowlevel.checkpoint()
        if scope.cancelled_caught:
            self.connections_dropped += 1
            log.info("master: closing a connection: %s for %g s", what, timeout)

    async def _send_bounded(self, sock: socket.socket, data: bytes, sent: int) -> bool:
        """Send ``data[sent:]``, holding it in the reply budget meanwhile: True once sent;
        False (the connection is to be closed, counted dropped) if it does not fit the
        budget, or a byte does not go within ``progress_timeout``, or all of it within its
        bound (:func:`frame_deadline`)."""
        cfg = self.config
        view = memoryview(data)[sent:]
        left = len(view)
        if not self.replies.take(left):
            self.connections_dropped += 1
            log.warning(
                "master: closing a connection: %d bytes of answers not read, over the reply "
                "budget (%d bytes held for all connections)",
                left,
                self.replies.held,
            )
            return False
        end = frame_deadline(anyio.current_time(), left, cfg.progress_timeout, cfg.min_rate)
        try:
            while view:
                try:
                    n = sock.send(view)
                except (BlockingIOError, InterruptedError):
                    wait = min(cfg.progress_timeout, end - anyio.current_time())
                    with anyio.move_on_after(max(0.0, wait)) as waited:
                        await anyio.wait_writable(sock)
                    if waited.cancelled_caught:
                        self.connections_dropped += 1
                        log.info("master: closing a connection: reply not read in time")
                        return False
                    continue
                view = view[n:]
                self.replies.give(n)
                left -= n
            return True
        finally:
            self.replies.give(left)

    def auth_step(
        self,
        req: rpc.Request,
        authed: bool,
        nonces: tuple[bytes, bytes] | None,
        sock: socket.socket | None = None,
    ) -> tuple[bytes, bool, tuple[bytes, bytes] | None, bool]:
        """One request of a connection not yet authenticated (or an auth method):
        (reply, authenticated now, pending nonces, close the connection after the reply)
        (:func:`mooncake._store.master_auth.auth_step`)."""
        return master_auth.auth_step(self, req, authed, nonces, sock)

    async def sweeper(self) -> None:
        """Periodic time-driven work on the state (see :meth:`MasterState.sweep`).

        Each round measures how late it woke: lateness beyond one interval is time the loop
        could not run, credited to the clients (:meth:`MasterState.credit_stall`) first.
        A replicated master sweeps every :data:`HA_SWEEP_INTERVAL` at least (each sweep is a
        log entry).
        """
        last = anyio.current_time()
        while True:
            interval = self.config.sweep_interval
            if self.ha is not None:
                interval = max(interval, HA_SWEEP_INTERVAL)
            await anyio.sleep(interval)
            now = anyio.current_time()
            stalled, last = now - last - 2 * interval, now
            try:
                ha = self.ha
                now = self.now()  # the state's clock (a restored master goes on from its own)
                if ha is None:
                    if stalled > 0:
                        self.state.credit_stall(stalled + interval)
                    self.state.sweep(now)
                elif ha.refusal() is None:  # a replicated master sweeps only as the leader
                    if stalled > 0:
                        self.run_command(commands.CreditStall(stalled + interval, now))
                    self.run_command(commands.Sweep(now))
            except Exception:
                log.exception("master: sweep failed")

    # -- HTTP (/metrics, /health, /status, admin routes: mooncake._store.master_http) ----------

    def http_response(self, method: str, target: str, body: bytes = b"") -> tuple[int, str, bytes]:
        """(status, content type, body) for one admin HTTP request."""
        return master_http.http_response(self, method, target, body)

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (:func:`mooncake._store.master_http.status`)."""
        return master_http.status(self)

    def ha_status(self) -> dict[str, Any]:
        """Role, term/lease, applied seq, log lag, last snapshot (a master without HA leads)."""
        return master_http.ha_status(self)

    async def serve_http_connection(self, sock: socket.socket, slot: _accept.Slot) -> None:
        """One admin HTTP connection (:func:`mooncake._store.master_http.serve_http_connection`)."""
        await master_http.serve_http_connection(self, sock, slot)


async def _raw_listener(host: str, port: int) -> socket.socket:
    try:
        await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return _accept.listen_tcp(host, port, 1024)
    except OSError as e:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _serve_raw(
    lsock: socket.socket,
    slots: _accept.Slots,
    handler: Callable[[socket.socket, _accept.Slot], Awaitable[None]],
) -> None:
    try:
        await _accept.accept_loop(lsock, slots, handler)
    finally:
        lsock.close()


async def serve_master(
    config: MasterServerConfig | None = None,
    *,
    state: MasterState | None = None,
    task_status: anyio.abc.TaskStatus[MasterServer] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a master until cancelled; ``task_status.started(server)`` once every port is bound.

    Port 0 binds a free port (read it from ``server.rpc_port`` / ``server.metrics_port``).
    ``--enable-http-metadata-server`` embeds Mooncake's HTTP metadata protocol on its own port.
    """
    config = config or MasterServerConfig()
    local = None
    restored: tuple[MasterState, float] | None = None
    if config.snapshot is not None and config.ha is None:
        from mooncake._store.snapshots import DirSnapshots, restore_local

        local = DirSnapshots(
            config.snapshot.directory, config.snapshot.cluster_id, config.snapshot.retention
        )
        if config.snapshot.restore and state is None:
            restored = await restore_local(local, config.state)
    server = MasterServer(config, restored[0] if restored else state)
    if restored is not None:
        # the restored clock goes on from the snapshot; leases and clients get a fresh TTL
        server.clock_offset = restored[1] - anyio.current_time()
        server.state.promote(server.now())
    if config.kv_events is not None:
        from mooncake._store import kv_events

        server.kv_publisher = kv_events.KvEventPublisher(config.kv_events)
        if config.ha is None:
            kv_events.lead(server, time.time_ns() // 1_000_000)
    try:
        await _serve_master(server, config, local, task_status)
    finally:
        if server.kv_publisher is not None:
            server.kv_publisher.close()


async def _serve_master(
    server: MasterServer,
    config: MasterServerConfig,
    local: Any,
    task_status: anyio.abc.TaskStatus[MasterServer],
) -> None:
    async with anyio.create_task_group() as tg:
        if config.enable_metric_reporting and config.metrics_port >= 0:
            msock = await _raw_listener(config.metrics_host, config.metrics_port)
            server.metrics_port = int(msock.getsockname()[1])
            tg.start_soon(_serve_raw, msock, server.http_slots, server.serve_http_connection)
        if config.enable_http_metadata_server:
            from mooncake._engine.metadata.server import serve_http_metadata

            _, hport = await tg.start(
                partial(
                    serve_http_metadata,
                    config.http_metadata_server_host,
                    config.http_metadata_server_port,
                    secret=config.cluster_secret,
                )
            )
            server.http_metadata_port = int(hport)
        tg.start_soon(server.sweeper)
        tg.start_soon(server.drain_jobs.run, server)
        lsock = await _raw_listener(config.rpc_address, config.rpc_port)
        server.rpc_port = int(lsock.getsockname()[1])
        log.info(
            "master: RPC on %s:%d, metrics on %s",
            config.rpc_address,
            server.rpc_port,
            f"{config.metrics_host}:{server.metrics_port}" if server.metrics_port else "off",
        )
        if config.ha is not None:
            from mooncake._store.ha import HaNode

            node = HaNode(server, config.ha)
            server.ha = server.ha_node = node
            tg.start_soon(node.run)
        elif local is not None and config.snapshot is not None:
            from mooncake._store.snapshots import snapshot_loop

            tg.start_soon(
                snapshot_loop,
                server,
                local,
                config.snapshot.interval,
                config.snapshot.child_timeout,
            )
        if config.rpc_threads > 0 and config.ha is None and usable():
            server.rpc_thread = RpcThread(server, config.rpc_threads)
            server.rpc_thread.start()
        task_status.started(server)
        try:
            await _accept.accept_loop(lsock, server.slots, server.serve_connection, prepare=_tune)
        finally:
            lsock.close()
            if server.rpc_thread is not None:  # every connection's handler has returned
                server.rpc_thread.stop()
                server.rpc_thread = None
