"""The engine's batch execution: validate, route, execute, and the engine's own segment.

A batch runs in four steps (:meth:`Batches.run`):

1. *validate* (:meth:`Batches.validate_regions`): every request is a :class:`TransferRequest`
   with sane ranges and a registered local range; what is wrong regardless of the peer raises
   before anything moves;
2. *look the peer up* (through the host, so a refreshed descriptor is seen): remote ranges
   outside its buffers fail per request, after one refresh;
3. *pin and route*: the local regions are pinned again after the lookup's ``await``
   (:meth:`~mooncake._engine.memory.Pins.pin_locals`), and each request goes to the first
   transport (by priority) that reaches the peer and accepts the remote buffer;
4. *execute* per transport (device memory staged through pinned host chunks for host-only
   transports), recording telemetry and metrics.

Requests against the engine's own segment are copies between two local regions
(:meth:`Batches.local`), both pinned for the copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

import anyio

from mooncake import _fast
from mooncake._core.descriptor import BufferDesc, SegmentDescriptor
from mooncake._core.gpu import device_of
from mooncake._core.memory import Region, check_range
from mooncake._core.transfer import (
    Opcode,
    TransferRequest,
    TransferResult,
    completed,
    failed,
)
from mooncake._engine import telemetry as _tel
from mooncake._engine.metrics import LOG_MAX
from mooncake._engine.transports.base import EngineHost, PeerInfo, Transport
from mooncake.errors import (
    InvalidArgumentError,
    MooncakeError,
    NotSupportedError,
    PeerDiedError,
    PeerUnreachableError,
    RemoteAccessError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._engine.memory import Pins
    from mooncake._engine.metrics import EngineMetrics
    from mooncake._engine.peers import PeerCache

_U64 = 1 << 64


class BatchHost(EngineHost, Protocol):
    """What :class:`Batches` asks of its engine, beyond what a transport may."""

    @property
    def pins(self) -> Pins:
        """The pin protocol of the engine's registry."""

    @property
    def metrics(self) -> EngineMetrics | None:
        """The engine's metrics (``None`` when off)."""

    def check_open(self) -> None:
        """Raise :class:`~mooncake.errors.ClosedError` once the engine is closed."""


class Batches:
    """Runs the transfer batches of one engine."""

    def __init__(self, host: BatchHost, peers: PeerCache) -> None:
        self._host = host
        self._peers = peers

    def validate(self, requests: Iterable[TransferRequest]) -> list[TransferRequest]:
        """The requests, checked (see :meth:`validate_regions`)."""
        return self.validate_regions(requests)[0]

    def validate_regions(
        self, requests: Iterable[TransferRequest]
    ) -> tuple[list[TransferRequest], list[Region]]:
        """Check every request; returns them and the local region of each.

        Hot path: a batch's requests usually share one local region, so the last one found is
        tried first, and plain-int ranges skip the general checks (same outcomes, fewer calls).
        """
        out: list[TransferRequest] = []
        regs: list[Region] = []
        last: Region | None = None
        for i, r in enumerate(requests):
            if not isinstance(r, TransferRequest):
                raise InvalidArgumentError(
                    f"requests[{i}] is {type(r).__name__}, not TransferRequest"
                )
            la, ra, n = r.local_addr, r.remote_addr, r.length
            if not (
                type(la) is int
                and type(ra) is int
                and type(n) is int
                and n > 0
                and la >= 0
                and ra >= 0
                and la + n <= _U64
                and ra + n <= _U64
            ):
                check_range(la, n, f"requests[{i}] local")
                check_range(ra, n, f"requests[{i}] remote")
            if last is None or last.closing or la < last.addr or la + n > last.addr + last.length:
                last = self._host.registry.require(la, n, f"requests[{i}] local")
            out.append(r)
            regs.append(last)
        return out, regs

    async def run(
        self,
        segment: str,
        requests: Sequence[TransferRequest],
        transport: str | None = None,
    ) -> list[TransferResult]:
        """Run a batch against ``segment`` (steps in the module docstring); one result per
        request, in order. Bad arguments raise; peer-dependent outcomes are results."""
        self._host.check_open()
        reqs, regs = self.validate_regions(requests)
        if not reqs:
            return []
        if segment == self._host.segment_name:
            return await self.local(reqs, regs)
        try:
            peer = await self._host.peer(segment)
            missing = _uncovered(peer.descriptor, reqs, range(len(reqs)))
            if missing:  # the peer may have registered more since we cached its descriptor
                rec = _tel.CURRENT.get()
                if rec is not None:
                    rec.retries += 1
                peer = await self._host.peer(segment, refresh=True)
                missing = _uncovered(peer.descriptor, reqs, missing)
        except InvalidArgumentError:
            raise
        except MooncakeError as e:  # unreachable, unknown or malformed: every request fails
            self._host.forget(segment)
            if self._host.metrics is not None:
                self._host.metrics.failed_batch("", segment, _op(reqs), len(reqs), e)
            return [failed(e) for _ in reqs]
        results: list[TransferResult | None] = [None] * len(reqs)
        for i in missing:
            r = reqs[i]
            results[i] = failed(
                RemoteAccessError(
                    f"{segment}: [{r.remote_addr:#x}, +{r.length}) is not inside one "
                    "of its registered buffers"
                )
            )
        if missing and self._host.metrics is not None:
            err = results[missing[0]]
            assert err is not None and err.error is not None
            self._host.metrics.failed_batch("", segment, _op(reqs), len(missing), err.error)
        send_idx = (
            [i for i in range(len(reqs)) if results[i] is None]
            if missing
            else list(range(len(reqs)))
        )
        if send_idx:
            # The peer lookup above awaited: a local region may have been unregistered (or
            # replaced at the same address) since validation. Re-validate and pin in one step,
            # with no await in between; unregister waits for the pins.
            held = self._host.pins.pin_locals(reqs, regs, send_idx)
            try:
                routes = self._route(peer, reqs, send_idx, transport, results)
                if len(routes) == 1:
                    ((t, idx),) = routes.items()
                    await self._execute(t, peer, reqs, regs, idx, results)
                elif routes:
                    async with anyio.create_task_group() as tg:
                        for t, idx in routes.items():
                            tg.start_soon(self._execute_part, t, peer, reqs, regs, idx, results)
            finally:
                self._host.pins.release_all(held)
            for i in send_idx:
                res = results[i]
                if res is not None and isinstance(res.error, (PeerDiedError, PeerUnreachableError)):
                    self._host.forget(segment)
                    break
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    def _route(
        self,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        idx: list[int],
        name: str | None,
        results: list[TransferResult | None],
    ) -> dict[Transport, list[int]]:
        """Pick a transport per request: the first (by priority) that reaches the peer and
        accepts the buffer holding the remote range. Unroutable requests get a failed result."""
        cands = (
            [self._peers.pick(peer, name)]
            if name
            else [t for t in self._host.transports if t.can_reach(peer)]
        )
        if not cands:
            raise NotSupportedError(f"no installed transport reaches {peer.segment}")
        routes: dict[Transport, list[int]] = {}
        for i in idx:
            r = reqs[i]
            buf = peer.descriptor.find_buffer(r.remote_addr, r.length)
            assert buf is not None
            t = next((t for t in cands if t.accepts(peer, buf)), None)
            if t is None:
                results[i] = failed(
                    NotSupportedError(
                        f"{peer.segment}: no transport among {[c.name for c in cands]} reaches "
                        f"its {buf.name} buffer [{buf.addr:#x}, +{buf.length})"
                    )
                )
            else:
                routes.setdefault(t, []).append(i)
        return routes

    async def _execute_part(
        self,
        t: Transport,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        regs: list[Region],
        idx: list[int],
        results: list[TransferResult | None],
    ) -> None:
        """One transport's share of a batch split over several: a batch-level failure of that
        transport fails its requests only (and never leaves as an exception group)."""
        try:
            await self._execute(t, peer, reqs, regs, idx, results)
        except MooncakeError as e:
            for i in idx:
                results[i] = failed(e)

    async def _execute(
        self,
        t: Transport,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        regs: list[Region],
        idx: list[int],
        results: list[TransferResult | None],
    ) -> None:
        sub = [reqs[i] for i in idx]
        t0 = perf_counter()
        # the local regions were looked up (and pinned) by transfer(): no second lookup here
        devices = [] if t.device_memory else [device_of(regs[i].location) for i in idx]
        try:
            if t.device_memory or all(d is None for d in devices):
                out = await t.execute(peer, sub)
            else:
                out = await self._host.staging.run(partial(t.execute, peer), sub, devices)
        except MooncakeError as e:
            if self._host.metrics is not None:
                self._host.metrics.failed_batch(t.name, peer.segment, _op(sub), len(sub), e)
            raise
        t1 = perf_counter()
        rec = _tel.CURRENT.get()
        if rec is not None:
            rec.add_group(
                t.name,
                _nic(t, self._host.hostname),
                len(sub),
                sum(r.length for r in sub),
                t0,
                t1,
                sum(1 for r in out if not r.ok),
            )
        m = self._host.metrics
        if m is not None:
            m.log.append((t.name, peer.segment, sub, out, t1 - t0))
            if len(m.log) > LOG_MAX:
                m.drain()
        for i, res in zip(idx, out, strict=True):
            results[i] = res

    async def local(self, reqs: list[TransferRequest], regs: list[Region]) -> list[TransferResult]:
        """Requests against this engine's own segment: copies between two local regions.

        Both regions of every request are pinned (looked up with no ``await`` since) before the
        first copy and released once the last one is done, so ``unregister`` of either waits
        for the copies, worker-thread ones included.
        """
        results: list[TransferResult | None] = [None] * len(reqs)
        t0 = perf_counter()
        held = self._host.pins.pin_locals(reqs, regs, range(len(reqs)))
        remotes: list[Region | None] = []
        try:
            for i, r in enumerate(reqs):
                remote = self._host.registry.find(r.remote_addr, r.length)
                if remote is None or not remote.remote_accessible:
                    results[i] = failed(
                        RemoteAccessError(f"[{r.remote_addr:#x}, +{r.length}) not registered")
                    )
                    remotes.append(None)
                    continue
                self._host.pins.pin(remote)
                held.append(remote)
                remotes.append(remote)
            for i, r in enumerate(reqs):
                remote = remotes[i]
                if remote is None:
                    continue
                src, dst = (
                    (r.remote_addr, r.local_addr)
                    if r.opcode is Opcode.READ
                    else (r.local_addr, r.remote_addr)
                )
                dev = device_of(regs[i].location)
                if dev is None:
                    dev = device_of(remote.location)
                if dev is not None:
                    try:
                        await self._host.staging.copy(dst, src, r.length, dev)  # shielded wait
                    except MooncakeError as e:
                        results[i] = failed(e)
                        continue
                elif r.length >= (1 << 20):
                    # not abandoned on cancellation: returns only once the thread is done
                    await anyio.to_thread.run_sync(_fast.memcpy_at, dst, src, r.length)
                else:
                    _fast.memcpy_at(dst, src, r.length)
                results[i] = completed(r.length)
        finally:
            self._host.pins.release_all(held)
        out = [r if r is not None else failed(TransferError("not attempted")) for r in results]
        t1 = perf_counter()
        rec = _tel.CURRENT.get()
        if rec is not None:
            nbytes = sum(r.length for r in reqs)
            nfail = sum(1 for r in out if not r.ok)
            rec.add_group("local", self._host.hostname, len(reqs), nbytes, t0, t1, nfail)
        m = self._host.metrics
        if m is not None:
            m.log.append(("local", self._host.segment_name, reqs, out, t1 - t0))
            if len(m.log) > LOG_MAX:
                m.drain()
        return out


def _nic(t: Transport, host: str) -> str:
    """The NIC(s) a transport's share could use: an RDMA transport's rails, else the host."""
    nics = getattr(t, "nics", None)
    if nics:
        return ",".join(str(getattr(n, "name", n)) for n in nics)
    return host


def _op(reqs: Sequence[TransferRequest]) -> str:
    """The ``op`` metrics label of a batch: ``read``, ``write`` or ``mixed``."""
    first = reqs[0].opcode
    if len(reqs) > 1 and any(r.opcode is not first for r in reqs):
        return "mixed"
    return "read" if first is Opcode.READ else "write"


def _uncovered(
    desc: SegmentDescriptor, reqs: Sequence[TransferRequest], idx: Iterable[int]
) -> list[int]:
    """Indices of ``idx`` whose remote range is not inside one buffer of ``desc``."""
    out = []
    last: BufferDesc | None = None
    for i in idx:
        r = reqs[i]
        ra = r.remote_addr
        if last is not None and last.addr <= ra and ra + r.length <= last.addr + last.length:
            continue
        last = desc.find_buffer(ra, r.length)
        if last is None:
            out.append(i)
    return out
