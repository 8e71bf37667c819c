"""Caller-thread transfers for the sync facade: small synchronous calls without a loop crossing.

``mooncake.engine.TransferEngine`` runs the async engine on a loop thread; handing every call to
that thread and back costs two thread wake-ups on top of the I/O, which on a loaded host is most
of a 4 KiB call. :class:`SyncPath` does small, simple batches on the *calling* thread instead:

* ``tcp``: the Mooncake TCP v2 protocol through the compiled client state machine
  (``_fast.ClientPipe.run_blocking``: GIL released, waiting in ``poll``) on a connection the
  thread checks out of a small per-peer pool (:class:`LanePool`) and returns when the batch is
  done; a connection that timed out or failed is closed, never reused.
* ``shm``: ``memcpy`` into/out of the peer's memfd mapped by the shm transport, or
  ``process_vm_readv``/``writev`` for the peer's other buffers.

Guarantees are the async path's: every local range lies inside one registered host region and
every region is pinned (``users``) for the whole I/O, so ``unregister`` waits for it; every remote
range lies inside one buffer of the peer's descriptor (TCP: the peer's server checks again) or of
the shm server's own list; the whole call is bounded by ``MC_TRANSFER_TIMEOUT`` (the facade's
deadline: ``TimeoutError``); request outcomes are the same :class:`TransferResult` values.

:meth:`SyncPath.transfer` returns None, leaving the batch to the loop path unchanged, for
anything not small and simple: a peer not contacted yet (the loop fetches its descriptor), a
remote range outside the cached descriptor (the loop refreshes it), device memory, a batch that
spans transports or goes to rdma/cuda, more than :data:`MAX_REQUESTS` requests or
:data:`SMALL_MAX` bytes, a region being unregistered, an shm session not established or closed,
and any connection failure (the loop path then retries, forgets a dead peer and reports it, as
it always has). Re-running a batch is safe: a READ or WRITE of the same bytes to the same place.
A request the peer's server refuses is a failed result here too (its connection is closed: the
published server closes after a refusal). :meth:`SyncPath.close` refuses new calls and waits for
the running ones, which end by their deadline at the latest, before the engine unmaps memory.

Pins are counted in the same ``users`` fields the loop thread uses (``Region.users``,
shm ``_Entry.users``). A pin is taken first and the ``closing``/``dead`` flag checked after it;
the loop sets the flag first and reads the count after it, so one of the two always sees the
other. The count changes are single ``+= 1``/``-= 1`` on slot attributes, which CPython runs
without releasing the GIL in between; without a GIL (a free-threaded build) :func:`enabled` is
false and the path never runs. Whatever the loop waits on (an ``unregister``, a revoke)
is woken on the loop thread (``call_soon_threadsafe``) when a caller-thread pin ends.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mooncake import _fast
from mooncake._core.gpu import device_of
from mooncake._core.memory import Region
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult
from mooncake._engine import _sockio, _unix
from mooncake._engine.metrics import LOG_MAX
from mooncake._engine.transports import shm_session as shm_mod
from mooncake._engine.transports import tcp as tcp_mod
from mooncake._engine.transports.base import PeerInfo
from mooncake.errors import MooncakeError

if TYPE_CHECKING:
    from mooncake._engine.engine import Engine
    from mooncake._sync import LoopThread

log = logging.getLogger("mooncake.engine.sync")

#: batches up to this many bytes in all take the caller-thread path (the loop path sends bigger
#: ones over several lanes at once)
SMALL_MAX = 256 << 10
#: ... and up to this many requests (one pipelined group: the TCP client's depth)
MAX_REQUESTS = tcp_mod.PIPELINE_DEPTH
#: idle connections kept per peer; more threads at once open more, closed when they return
IDLE_LANES = 16
#: how long the first wait for a TCP reply spins before sleeping in poll; measured on loopback
#: (2-core VM): no gain at 25 or 60 us, so off
SPIN_US = 0


def gil_enabled() -> bool:
    """Whether the GIL serialises Python code here: always on builds without
    ``sys._is_gil_enabled`` (before 3.13), else its answer (a free-threaded build may run with
    or without it)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def enabled() -> bool:
    """Whether the facade uses the caller-thread path (``MOONCAKE_SYNC_FASTPATH=0`` turns it off).

    Never without the GIL: the path's pins are plain ``+= 1``/``-= 1`` on counters the loop
    thread changes too (``Region.users``, shm ``_Entry.users``, ``_Session.busy``), which only
    the GIL makes atomic; on a free-threaded build running without it a lost decrement would
    hang an ``unregister`` and a lost increment unmap memory in use, so everything goes through
    the loop thread instead (logged once)."""
    if os.environ.get("MOONCAKE_SYNC_FASTPATH", "1") in ("0", ""):
        return False
    if not gil_enabled():
        global _WARNED_NOGIL
        if not _WARNED_NOGIL:
            _WARNED_NOGIL = True
            log.warning("sync fast path off: this interpreter runs without the GIL")
        return False
    return True


_WARNED_NOGIL = False


class LanePool:
    """Blocking-use TCP connections to one peer data port, checked out by one thread at a time."""

    def __init__(self, host: str, port: int, secret: bytes | None = None) -> None:
        self.host = host
        self.port = port
        #: the cluster secret the data port wants (new connections run its exchange first)
        self.secret = secret
        self._idle: list[tcp_mod._Lane] = []
        self._lock = threading.Lock()
        self.closed = False
        self.opened = 0  #: connections made so far (tests and logs)

    def get(self, timeout_s: float) -> tcp_mod._Lane:
        """An idle connection, or a new one (``OSError`` if the peer cannot be reached)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection((self.host, self.port), timeout=max(timeout_s, 0.001))
        try:
            if self.secret is not None:
                try:
                    tcp_mod.client_auth_blocking(sock, self.secret)
                except MooncakeError as e:  # the loop path reports it
                    raise OSError(str(e)) from None
            _sockio.tune(sock)  # non-blocking, no Nagle, keepalive
            lane = tcp_mod._Lane(sock)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.opened += 1
        return lane

    def put(self, lane: tcp_mod._Lane) -> None:
        """Return a connection that finished its batch cleanly."""
        with self._lock:
            if not self.closed and len(self._idle) < IDLE_LANES:
                self._idle.append(lane)
                return
        lane.sock.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for lane in idle:
            lane.sock.close()


class SyncPath:
    """The caller-thread path of one facade (see the module docstring). Thread-safe."""

    def __init__(self, engine: Engine, loop: LoopThread) -> None:
        self.engine = engine
        self.loop = loop
        self._pools: dict[tuple[str, int], LanePool] = {}
        self._lock = threading.Lock()
        self._idle_cv = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        # per peer: the last remote buffer used (descriptor, start, end, transport); the
        # descriptor object changes whenever the loop refreshes it, so a stale entry never hits
        self._routes: dict[int, tuple[Any, int, int, Any]] = {}
        self._last_region: Region | None = None
        self.hits = 0  #: batches done here (tests and logs)

    def close(self) -> None:
        """Refuse new calls, wait for the running ones (each ends by its deadline at the latest:
        the engine may unmap their memory next), then close the pooled connections."""
        with self._idle_cv:
            self._closed = True
            while self._inflight:
                self._idle_cv.wait()
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()

    # -- entry ----------------------------------------------------------------------------

    def transfer(
        self,
        segment: str,
        op: Opcode,
        las: Sequence[int],
        ras: Sequence[int],
        lens: Sequence[int],
        timeout_s: float,
    ) -> list[TransferResult] | None:
        """Run the batch ``op`` of ``lens[i]`` bytes between local ``las[i]`` and the peer's
        ``ras[i]`` on this thread: the *failed* results (empty: all done), or None if the batch
        belongs on the loop path.

        Raises ``TimeoutError`` when ``timeout_s`` passes first (the connection is dropped).
        """
        engine = self.engine
        n = len(lens)
        if not n or n > MAX_REQUESTS or engine._closed:
            return None
        peer = engine._peers.get(segment)
        if peer is None:
            return None  # first contact (or a forgotten peer, or ourselves): the loop path
        total = 0
        for la, ra, ln in zip(las, ras, lens, strict=True):
            if type(ln) is not int or type(la) is not int or type(ra) is not int or ln <= 0:
                return None  # the loop path says what is wrong
            total += ln
        if total > SMALL_MAX:
            return None
        with self._lock:
            if self._closed:
                return None
            self._inflight += 1
        out = None
        try:
            out = self._run(peer, op, las, ras, lens, timeout_s, total)
        finally:
            with self._lock:
                self._inflight -= 1
                if out is not None:
                    self.hits += 1
                if self._closed and not self._inflight:
                    self._idle_cv.notify_all()
        return out

    def _run(
        self,
        peer: PeerInfo,
        op: Opcode,
        las: Sequence[int],
        ras: Sequence[int],
        lens: Sequence[int],
        timeout_s: float,
        total: int = 0,
    ) -> list[TransferResult] | None:
        regions = self._local_regions(las, lens)
        if regions is None:
            return None
        transport = self._route(peer, ras, lens)
        if transport is None:
            return None
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        if not self._pin(regions):
            return None
        try:
            if transport.name == "tcp":
                out = self._tcp(peer, op, las, ras, lens, deadline)
            else:
                out = self._shm(transport, peer, op, las, ras, lens)
        finally:
            self._unpin(regions)
        tel = self.engine.telemetry
        if out is not None and tel is not None:
            t1 = time.perf_counter()
            tel.add_sync(
                peer.segment,
                "read" if op is Opcode.READ else "write",
                len(lens),
                total,
                transport.name,
                self.engine.hostname,
                t0,
                t1,
                len(out),
            )
        m = self.engine.metrics
        if out is not None and m is not None:  # counted once, here or on the loop path
            m.sync_log.append(
                (transport, peer, op, len(lens), total, out, time.perf_counter() - t0)
            )
            if len(m.sync_log) > LOG_MAX:
                m.drain()
        return out

    def _local_regions(self, las: Sequence[int], lens: Sequence[int]) -> list[Region] | None:
        """The distinct host regions holding every local range, or None (the loop path then
        raises the proper error, or stages device memory)."""
        out: list[Region] = []
        last = self._last_region  # a region stays valid until it is closing (unregister)
        try:
            for la, ln in zip(las, lens, strict=True):
                if (
                    last is not None
                    and last.addr <= la
                    and la + ln <= last.addr + last.length
                    and not last.closing
                ):
                    if not out or out[-1] is not last:
                        out.append(last)
                    continue
                # the loop thread may be changing the registry: a torn read is a miss here
                reg = self.engine.registry.find(la, ln)
                if reg is None or (reg.location != "cpu:0" and device_of(reg.location) is not None):
                    return None
                out.append(reg)
                last = self._last_region = reg
        except (IndexError, ValueError, TypeError):
            return None
        if len(out) > 1:
            out = list({id(r): r for r in out}.values())
        return out

    def _route(self, peer: PeerInfo, ras: Sequence[int], lens: Sequence[int]) -> Any:
        """The one tcp or shm transport the loop path would use for every request, or None
        (also when a remote range is outside the cached descriptor: the loop refreshes it)."""
        desc = peer.descriptor
        hit = self._routes.get(id(peer))  # (descriptor, buffer start, end, transport)
        chosen = None
        for ra, ln in zip(ras, lens, strict=True):
            if hit is not None and hit[0] is desc and hit[1] <= ra and ra + ln <= hit[2]:
                t = hit[3]
            else:
                buf = desc.find_buffer(ra, ln)
                if buf is None:
                    return None
                t = next(
                    (
                        t
                        for t in self.engine.transports
                        if t.can_reach(peer) and t.accepts(peer, buf)
                    ),
                    None,
                )
                hit = (desc, buf.addr, buf.addr + buf.length, t)
                if len(self._routes) > 4096:
                    self._routes.clear()
                self._routes[id(peer)] = hit
            if t is None or (chosen is not None and t is not chosen):
                return None
            chosen = t
        if chosen is None or chosen.name not in ("tcp", "shm"):
            return None
        if chosen.name == "tcp" and (getattr(chosen, "secret", None) is not None) != bool(
            desc.extra.get("tcp_auth")
        ):
            return None  # one side has the cluster secret, the other not: the loop path says so
        return chosen

    # -- pins -----------------------------------------------------------------------------

    def _pin(self, regions: list[Region]) -> bool:
        for k, reg in enumerate(regions):
            reg.users += 1
            if reg.closing:  # being unregistered: the loop path raises NotRegisteredError
                self._unpin(regions[: k + 1])
                return False
        return True

    def _unpin(self, regions: list[Region]) -> None:
        for reg in regions:
            reg.users -= 1
            if reg.closing:  # an unregister may be waiting for this pin on the loop thread
                _on_loop(self.loop, _settle_region, reg)

    # -- tcp ------------------------------------------------------------------------------

    def _pool(self, peer: PeerInfo) -> LanePool:
        key = (peer.data_host, peer.descriptor.tcp_data_port)
        pool = self._pools.get(key)
        if pool is None:
            with self._lock:
                pool = self._pools.get(key)
                if pool is None:
                    tcp = next((t for t in self.engine.transports if t.name == "tcp"), None)
                    secret = getattr(tcp, "secret", None)
                    pool = self._pools[key] = LanePool(*key, secret=secret)
        return pool

    def _tcp(
        self,
        peer: PeerInfo,
        op: Opcode,
        las: Sequence[int],
        ras: Sequence[int],
        lens: Sequence[int],
        deadline: float,
    ) -> list[TransferResult] | None:
        pool = self._pool(peer)
        try:
            lane = pool.get(deadline - time.monotonic())
        except OSError as e:
            log.debug("sync path: connecting to %s failed (%s); using the loop", peer.segment, e)
            return None
        try:
            pipe = _fast.ClientPipe(
                lane.sock.fileno(),
                op is Opcode.WRITE,
                peer.descriptor.tcp_proto_version >= 2,
                las,
                ras,
                lens,
                lane.stage_addr,
                _fast.STAGE_SIZE,
                lane.stage,
            )
            rc = int(pipe.run_blocking(max(int((deadline - time.monotonic()) * 1000), 0), SPIN_US))
        except BaseException:
            lane.sock.close()
            raise
        if rc == _fast.DONE:
            st = pipe.statuses
            if not any(st):
                pool.put(lane)
                return []
            # a refusal: a published server closes the connection after one
            lane.sock.close()
            out = []
            for s, ra, ln in zip(st, ras, lens, strict=True):
                if s:
                    out.append(tcp_mod._status_result(s, TransferRequest(op, 0, ra, ln)))
            return out
        lane.sock.close()
        if rc == -errno.ETIMEDOUT:
            raise TimeoutError(f"{peer.segment}: transfer did not finish within the deadline")
        # a failed connection (a stale pooled one, or the peer died): the loop path retries,
        # reports and forgets the peer as it always has
        log.debug("sync path: %s: step result %d; using the loop", peer.segment, rc)
        return None

    # -- shm ------------------------------------------------------------------------------

    def _shm(
        self,
        transport: Any,
        peer: PeerInfo,
        op: Opcode,
        las: Sequence[int],
        ras: Sequence[int],
        lens: Sequence[int],
    ) -> list[TransferResult] | None:
        s = peer.state.get(transport.name)
        if not isinstance(s, shm_mod._Session) or s.closed or not _unix.peer_alive(s.sock):
            return None  # not connected yet, or the peer went away: the loop path decides
        entries: list[shm_mod._Entry] = []
        plan: list[shm_mod._Entry] = []
        for ra, ln in zip(ras, lens, strict=True):
            try:
                e = s.find(ra, ln)
            except IndexError:  # the loop thread is replacing the list: a miss
                return None
            if e is None:
                return None  # the loop refreshes the list
            plan.append(e)
            if e not in entries:
                entries.append(e)
        # Count as one of the session's running copies (as the loop path's enter/leave does):
        # the client keeps its socket open until they end, so the serving engine cannot take
        # a closed session for finished copies while this thread still writes into its memory.
        s.busy += 1
        if s.closed:
            self._leave(s)
            return None
        for k, e in enumerate(entries):
            e.users += 1
            if e.dead:  # revoked or unmapped meanwhile
                self._unpin_entries(entries[: k + 1])
                self._leave(s)
                return None
        try:
            if any(e.mm is None for e in entries):
                if s.vm_denied:
                    return None
                vm = [i for i, e in enumerate(plan) if e.mm is None]
                fn = _fast.vm_readv_at if op is Opcode.READ else _fast.vm_writev_at
                rc = fn(s.pid, [las[i] for i in vm], [ras[i] for i in vm], [lens[i] for i in vm])
                if rc < 0:
                    return None  # EPERM and friends: the loop path warns and falls back to TCP
            dsts: list[int] = []
            srcs: list[int] = []
            mlens: list[int] = []
            for e, la, ra, ln in zip(plan, las, ras, lens, strict=True):
                if e.mm is None:
                    continue
                remote = e.base + (ra - e.addr)
                if op is Opcode.READ:
                    dsts.append(la)
                    srcs.append(remote)
                else:
                    dsts.append(remote)
                    srcs.append(la)
                mlens.append(ln)
            if mlens:
                _fast.memcpy_batch(dsts, srcs, mlens)
        finally:
            self._unpin_entries(entries)
            self._leave(s)
        return []

    def _leave(self, s: shm_mod._Session) -> None:
        s.busy -= 1
        if s.busy == 0 and s.closed:  # the loop deferred closing the socket for this copy
            _on_loop(self.loop, _settle_session, s)

    def _unpin_entries(self, entries: list[shm_mod._Entry]) -> None:
        for e in entries:
            e.users -= 1
            if e.dead or e.idle is not None:  # a revoke or an unmap may wait for this pin
                _on_loop(self.loop, _settle_entry, e)


def _on_loop(loop: LoopThread, fn: Any, arg: Any) -> None:
    try:
        loop.loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _settle_region(region: Region) -> None:
    """On the loop thread: wake an ``unregister`` waiting for the last pin of ``region``."""
    if region.users == 0 and region.closing:
        released = region.meta.get("released")
        if released is not None:
            released.set()


def _settle_session(s: shm_mod._Session) -> None:
    """On the loop thread: close a closed session's socket once no copy runs any more."""
    s.busy += 1  # leave() closes it at zero, on the loop thread as the loop path does
    s.leave()


def _settle_entry(e: shm_mod._Entry) -> None:
    """On the loop thread: wake a revoke waiting for ``e``, and unmap it once dead and idle."""
    if e.users == 0:
        if e.idle is not None:
            e.idle.set()
        if e.dead:
            e.unmap_when_idle()
