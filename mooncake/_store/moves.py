"""Data movement under every family of the store client: buffers, staging, replica moves.

The base of :class:`~mooncake._store.client.Store`: its state (``__init__``), the
registered buffers and the staging range allocator, and :meth:`_Mover._move`, which runs replica
reads and writes (memcpy into the own segment or a same-host mapping, the engine otherwise) for
every family above it. Helpers shared by the families (key and buffer checks, the copy
workers, ``ReplicateConfig`` subsets for batch subsets) live here too.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.gpu import device_of, parse_location
from mooncake._core.memory import Region
from mooncake._core.staging import RangeAllocator
from mooncake._core.tiers import Admission, make_admission
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Buffer, DeviceMemory, Engine
from mooncake._store.bounds import own_extent
from mooncake._store.config import ReplicateConfig, to_wire
from mooncake._store.master_conn import MasterConnection
from mooncake._store.shm import MappedPeer, SharedSegment, ShmPeers
from mooncake._store.ssd import SsdTier
from mooncake._store.verify import ReadVerifier
from mooncake.errors import (
    ClosedError,
    InvalidArgumentError,
    MooncakeError,
    NotRegisteredError,
    PeerDiedError,
    TransferError,
    TransferTimeoutError,
)

log = logging.getLogger("mooncake.store")

HEARTBEAT_S = 1.0
#: how often a client asks the master for copy/move tasks to run (at once after creating one)
TASK_POLL_S = 0.2
#: how often a client with an SSD tier asks the master for demotions to do
TIER_POLL_S = 0.02
#: copies below this many bytes run on the loop thread; larger ones in worker threads
INLINE_COPY = 1 << 20
#: copies at least this large are split over two worker threads
SPLIT_COPY = 8 << 20
#: a network transfer of replicas (one segment's ops) that has not finished after this floor
#: plus :data:`TRANSFER_S_PER_MIB` per MiB fails (TransferTimeoutError) and its segment is
#: reported: a stopped or cut-off holder must not hold a writer (or reader) forever
TRANSFER_FLOOR_S = 2.0
TRANSFER_S_PER_MIB = 0.01
#: a segment that failed a transfer is reported to the master at most this often per client
REPORT_EVERY_S = 0.5

Config = ReplicateConfig | st.ReplicateConfig | None
Source = int | Sequence[tuple[int, int]]
"""A put's source: one address, or ``(address, length)`` parts whose concatenation is the value."""


def _subset(config: Config, idx: Sequence[int], n: int) -> Config:
    """``config`` for the keys ``idx`` of an ``n``-key batch (its per-key group ids follow)."""
    wire = to_wire(config)
    if wire.group_ids is None or len(wire.group_ids) != n or len(idx) == n:
        return wire
    return msgspec.structs.replace(wire, group_ids=[wire.group_ids[i] for i in idx])


def _parts_of(src: Source, size: int) -> list[tuple[int, int]]:
    """``src`` as ``(address, length)`` parts."""
    if isinstance(src, int):
        return [(src, size)]
    return list(src)


@dataclass(slots=True)
class _Op:
    """One replica read or write: ``length`` bytes between ``local`` and the replica, at
    ``offset`` bytes into it (the ranged and multi-buffer forms use several ops per replica)."""

    write: bool
    local: int
    replica: st.ReplicaDescriptor
    length: int
    error: MooncakeError | None = None
    offset: int = 0
    sum: bool = False
    """Asks for the CRC32C of the bytes as they landed (verified reads), fused with the copy
    where the op is a same-host copy; ``crc`` stays ``-1`` where it was not computed (a
    network transfer: the caller checksums in a pass of its own)."""
    crc: int = -1

    @property
    def remote(self) -> int:
        """The replica-side address of this op."""
        return self.replica.addr + self.offset


#: the store's name for the one key rule (imported by its families and facades)
_check_key = st.check_key


def staging_refusal(total: int, local_buffer_size: int) -> str:
    """Why a copying put/get of ``total`` bytes is refused, naming the setting to change."""
    if local_buffer_size == 0:
        return (
            f"{total} bytes to copy but local_buffer_size is 0 (copying put/get is off): pass "
            "local_buffer_size > 0 to setup/open_store, or use put_from/get_into on a "
            "registered buffer"
        )
    return (
        f"{total} bytes exceed the local buffer (local_buffer_size={local_buffer_size} bytes), "
        "which copying put/get stage through: raise local_buffer_size in setup/open_store, "
        "or use put_from/get_into on a registered buffer"
    )


def _value_addr(value: Any) -> tuple[int, int, Any]:
    """(address, length, keep-alive) of a C-contiguous buffer export."""
    try:
        mv = memoryview(value)
    except TypeError:
        raise InvalidArgumentError(
            f"value must support the buffer protocol, got {type(value).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise InvalidArgumentError("value must be C-contiguous")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    return int(arr.ctypes.data), n, arr


class _Mover:
    """Data movement under every family of the store client (part of :class:`~mooncake._store.client.Store`)."""

    engine: Engine

    def __init__(
        self,
        master: str,
        *,
        segment_size: int,
        local_buffer_size: int,
        segment_location: str = "cpu:0",
    ) -> None:
        if segment_size < 0 or local_buffer_size < 0:
            raise InvalidArgumentError("segment_size and local_buffer_size must be >= 0")
        parse_location(segment_location)  # InvalidArgumentError naming a bad location
        self.segment_location = segment_location
        self.master_address = master
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        self.client_id = str(uuid.uuid4())
        self.master = MasterConnection(master)
        self.segment: SharedSegment | None = None
        """The host (memfd) segment; None for a pure client or a device segment."""
        self.device_segment: DeviceMemory | None = None
        """The device segment when ``segment_location`` is ``cuda:N``."""
        self.mounted: st.Segment | None = None
        self.extra_segments: dict[str, st.Segment] = {}
        self._extra_owners: dict[str, Any] = {}
        """Segments mounted after setup (``mount_segment``, ``allocate_and_mount_segment``), by id."""
        self.local_buffer: Buffer | None = None
        self._staging = RangeAllocator(0)
        self._staging_freed = anyio.Event()
        self._shm: ShmPeers
        self._closed = False
        self.lease_fences = 0  # reads refused because their lease ran out
        self.ssd: SsdTier | None = None
        """The local SSD tier, when opened with ``ssd_path``."""
        self.admission: Admission = make_admission("hits:2")
        self._ssd_vid: dict[str, int] = {}  # key -> master version id of our SSD copy
        # SSD copies lost (evicted or corrupt) not yet reported: key -> (vid, policy, why)
        self._disk_evictions: dict[str, tuple[int, str, str]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._tier_lock = anyio.Lock()
        # demotions whose DemoteEnd answer was lost: key -> task (settled in a later round)
        self._unsettled: dict[str, st.DemoteTask] = {}
        self._misses: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._get_sessions: dict[str, tuple[st.GetReplicaListResponse, float]] = {}
        self._put_sessions: dict[str, tuple[list[st.ReplicaDescriptor], int]] = {}
        self._task_kick = anyio.Event()
        self.offload_reads = 0
        self._ssd_draining = False
        """Reads served from the SSD (offload) tier (``get_offload_rpc_read_count``)."""
        self._reported: dict[str, float] = {}
        """Segment name -> when this client last reported a transfer failure to it."""
        self.segment_reports = 0
        self.verify = ReadVerifier()
        """Verified reads: the switch and the counters (:mod:`mooncake._store.verify`)."""
        """Transfer failures reported to the master (``ReportSegmentFailure``)."""

    @property
    def segment_name(self) -> str:
        """This client's transfer-engine segment name (``get_hostname()`` in the sync API)."""
        return self.engine.segment_name

    def mounted_segments(self) -> list[st.Segment]:
        """Every segment this client has mounted at the master (setup's first)."""
        out = [self.mounted] if self.mounted is not None else []
        return out + list(self.extra_segments.values())

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store client is closed")

    async def register_buffer(self, addr: int, length: int) -> None:
        """Register ``[addr, addr+length)`` for the zero-copy APIs (not exposed to peers)."""
        self._check_open()
        await self.engine.register((addr, length), remote_accessible=False)

    async def unregister_buffer(self, addr: int) -> None:
        """Unregister a buffer registered at ``addr`` (waits for transfers using it)."""
        await self.engine.unregister(addr)

    def _require_local(self, addr: int, length: int, what: str) -> Region:
        if isinstance(addr, bool) or not isinstance(addr, int) or addr <= 0:
            raise InvalidArgumentError(
                f"{what}: buffer address must be a positive int, got {addr!r}"
            )
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise InvalidArgumentError(f"{what}: size must be a positive int, got {length!r}")
        region = self.engine.registry.find(addr, length)
        if region is None:
            raise NotRegisteredError(
                f"{what}: [{addr:#x}, +{length}) is not inside a registered buffer "
                "(register_buffer it first)"
            )
        return region

    async def _stage(self, length: int) -> int:
        """Offset of ``length`` bytes in the local buffer (waits while it is busy)."""
        if not self._staging.fits(length):
            raise InvalidArgumentError(
                f"{length} bytes do not fit the local buffer ({self.local_buffer_size} bytes); "
                "use a larger local_buffer_size or the zero-copy APIs"
            )
        while True:
            off = self._staging.alloc(length)
            if off is not None:
                return off
            self._staging_freed = ev = (
                self._staging_freed if not self._staging_freed.is_set() else anyio.Event()
            )
            await ev.wait()

    def _unstage(self, off: int) -> None:
        self._staging.free(off)
        self._staging_freed.set()

    def _route_cached(self, segment: str) -> MappedPeer | None:
        return self._shm.cached(segment)

    async def _move(self, ops: Sequence[_Op], deadline: float | None = None) -> None:
        """Run ``ops`` (reads or writes of replicas); failures land in each op's ``error``.

        Network transfers stop at ``deadline`` (the loop clock; a read passes its read window's
        end, after which its bytes could not be used anyway), by default after
        :data:`TRANSFER_FLOOR_S` plus :data:`TRANSFER_S_PER_MIB` per MiB; the ops left fail
        with :class:`TransferTimeoutError`. Every segment another client holds that failed an
        op (unreachable, died, timed out) is reported to the master (:meth:`_suspect`)."""
        await self._move_ops(ops, deadline)

    def _suspect(self, segment: str, err: BaseException) -> None:
        """Report (in the background, at most every :data:`REPORT_EVERY_S` per segment) that a
        transfer to ``segment`` failed, so the master quarantines it for everyone."""
        now = anyio.current_time()
        last = self._reported.get(segment)
        if (last is not None and now - last < REPORT_EVERY_S) or self._tg is None or self._closed:
            return
        if len(self._reported) > 1024:
            self._reported = {k: t for k, t in self._reported.items() if now - t < REPORT_EVERY_S}
        self._reported[segment] = now
        self.segment_reports += 1
        self._tg.start_soon(self._report, segment, f"{type(err).__name__}: {err}"[:200])

    async def _report(self, segment: str, reason: str) -> None:
        try:
            with anyio.fail_after(5):
                await self.master.call(
                    "ReportSegmentFailure",
                    rpc.SegmentFailureParams(
                        client_id=self.client_id, segment_name=segment, reason=reason
                    ),
                )
        except (MooncakeError, TimeoutError) as e:
            log.debug("reporting segment %s failed: %s", segment, e)

    async def _move_ops(self, ops: Sequence[_Op], deadline: float | None) -> None:
        own = self.segment_name
        copies: list[tuple[int, int, int]] = []
        copy_ops: list[tuple[_Op, MappedPeer | None]] = []
        net: dict[str, list[_Op]] = {}
        for op in ops:
            seg = op.replica.segment_name
            if seg == own and self._owns_any():
                peer = None
                try:
                    remote_local = self._own_extent(op.remote, op.length)
                except TransferError as e:
                    op.error = e
                    continue
            else:
                peer = await self._shm.lookup(seg)
                if peer is None or not (
                    peer.base <= op.remote and op.remote + op.length <= peer.base + peer.size
                ):
                    # no mapping, or a segment of that client its memfd does not cover
                    # (mounted with mount_segment): the engine reaches every registered buffer
                    net.setdefault(seg, []).append(op)
                    continue
                try:
                    remote_local = peer.local(op.remote, op.length)
                except MooncakeError as e:
                    op.error = e
                    continue
                if not peer.alive():
                    op.error = PeerDiedError(f"{seg}: its owner is gone")
                    self._suspect(seg, op.error)
                    continue
            dst, src = (remote_local, op.local) if op.write else (op.local, remote_local)
            copies.append((dst, src, op.length))
            copy_ops.append((op, peer))
        if net:
            async with anyio.create_task_group() as tg:
                for seg, seg_ops in net.items():
                    tg.start_soon(self._move_net, seg, seg_ops, deadline)
        if copies:
            peers = {id(p): p for _, p in copy_ops if p is not None}
            pinned = [p for p in peers.values() if p.acquire()]
            try:
                if len(pinned) < len(peers):  # one died since it was looked up
                    for op, mp in copy_ops:
                        if mp is not None and mp not in pinned:
                            op.error = PeerDiedError(f"{mp.segment}: its owner is gone")
                            self._suspect(mp.segment, op.error)
                    keep = [
                        (c, o) for c, o in zip(copies, copy_ops, strict=True) if o[0].error is None
                    ]
                    copies = [c for c, _ in keep]
                    copy_ops = [o for _, o in keep]
                await self._copy(copies, [o for o, _ in copy_ops])
            finally:
                for p in pinned:
                    p.unpin()
            # the fence for same-host copies: the owner must have outlived the copy
            for op, mp in copy_ops:
                if mp is not None and not mp.alive():
                    op.error = PeerDiedError(
                        f"{mp.segment}: its owner died while the {'write' if op.write else 'read'} "
                        "was in flight"
                    )
                    self._suspect(mp.segment, op.error)
            for p in peers.values():
                if p.dead:
                    self._shm.forget(p.segment)

    async def _copy(self, copies: list[tuple[int, int, int]], ops: list[_Op]) -> None:
        """Same-host copies: memcpy, except where the caller's buffer is GPU memory (registered
        with a ``cuda:N`` location), which goes through the engine's CUDA stream instead."""
        host: list[tuple[int, int, int]] = []
        host_ops: list[_Op] = []
        device: dict[int, list[tuple[tuple[int, int, int], _Op]]] = {}
        region: Region | None = None
        dev: int | None = None
        for c, op in zip(copies, ops, strict=True):
            if region is None or not region.covers(op.local, op.length):
                region = self.engine.registry.find(op.local, op.length)
                dev = device_of(region.location) if region is not None else None
            if dev is None:
                host.append(c)
                host_ops.append(op)
            else:
                device.setdefault(dev, []).append((c, op))
        if host:
            if any(op.sum for op in host_ops):
                crcs = await _memcpy_many_crc(host, [op.sum for op in host_ops])
                for op, crc in zip(host_ops, crcs, strict=True):
                    op.crc = crc
            else:
                await _memcpy_many(host)
        for dev, items in device.items():
            try:
                await self.engine.staging.copy_many([c for c, _ in items], dev)
            except MooncakeError as e:
                for _, op in items:
                    op.error = e

    async def _move_net(self, segment: str, ops: list[_Op], deadline: float | None) -> None:
        reqs = [
            TransferRequest.write(op.local, op.remote, op.length)
            if op.write
            else TransferRequest.read(op.local, op.remote, op.length)
            for op in ops
        ]
        if deadline is None:
            mib = sum(op.length for op in ops) / (1 << 20)
            deadline = anyio.current_time() + TRANSFER_FLOOR_S + TRANSFER_S_PER_MIB * mib
        results = None
        try:
            # cancelling a transfer returns once nothing can touch the local memory any more
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                results = await self.engine.transfer(segment, reqs)
        except MooncakeError as e:
            for op in ops:
                op.error = e if isinstance(e, TransferError) else TransferError(str(e))
            if isinstance(e, TransferError):
                self._suspect(segment, e)
            return
        if results is None:
            err = TransferTimeoutError(f"{segment}: no answer before the transfer's deadline")
            for op in ops:
                op.error = err
            self._suspect(segment, err)
            return
        for op, res in zip(ops, results, strict=True):
            if not res.ok:
                op.error = (
                    res.error
                    if isinstance(res.error, TransferError)
                    else TransferError(str(res.error))
                )
                if isinstance(res.error, TransferError):
                    self._suspect(segment, res.error)

    async def _resolve(self, segments: Any) -> None:
        """Map the same-host segments among ``segments`` (cheap once known)."""
        for seg in set(segments):
            if seg != self.segment_name:
                await self._shm.lookup(seg)

    def _is_copyable(self, segment: str) -> bool:
        """Whether writes to ``segment`` are memcpys (own or a live same-host mapping)."""
        if segment == self.segment_name:
            return self._owns_any()
        return self._route_cached(segment) is not None

    def _owns_any(self) -> bool:
        """Whether this client holds any mounted memory of its own (host memory)."""
        return self.segment is not None or bool(self.extra_segments)

    def _owns(self, addr: int, length: int) -> bool:
        """Whether ``[addr, +length)`` lies inside one of this client's host segments."""
        try:
            self._own_extent(addr, length)
        except TransferError:
            return False
        return True

    def _own_extent(self, addr: int, length: int) -> int:
        """``addr`` if ``[addr, +length)`` lies inside one of this client's host segments
        (setup's or one mounted later), else :class:`TransferError` (see
        :mod:`mooncake._store.bounds`)."""
        seg = self.segment
        if seg is not None and seg.addr <= addr and addr + length <= seg.addr + seg.size:
            return own_extent(seg.addr, seg.size, addr, length)
        for e in self.extra_segments.values():
            if e.base <= addr and addr + length <= e.base + e.size:
                return own_extent(e.base, e.size, addr, length)
        base, size = (seg.addr, seg.size) if seg is not None else (0, 0)
        return own_extent(base, size, addr, length)  # raises, naming the extent

    def _release_extra(self) -> None:
        for sid in list(self._extra_owners):
            _close_owner(self._extra_owners.pop(sid))
        self.extra_segments.clear()


def _close_owner(owner: Any) -> None:
    """Close what kept a mounted segment's memory alive (an mmap, a SharedSegment)."""
    close = getattr(owner, "close", None)
    if close is None:
        return
    try:
        close()
    except (BufferError, OSError, ValueError) as e:  # still exported: dies with the process
        log.warning("releasing segment memory: %s", e)


def _read_ttl(resp: st.GetReplicaListResponse) -> float:
    """Seconds a read of ``resp``'s replicas may take before it must fail closed."""
    return (resp.read_ttl_ms or resp.lease_ttl_ms) / 1000.0


async def _memcpy_many(copies: Sequence[tuple[int, int, int]]) -> None:
    """Run ``(dst, src, n)`` copies: inline when small, else in one or two worker threads."""
    total = sum(n for _, _, n in copies)
    if total < INLINE_COPY:
        for dst, src, n in copies:
            _fast.memcpy_at(dst, src, n)
        return
    if total < SPLIT_COPY:
        await anyio.to_thread.run_sync(_copy_all, copies)
        return
    # two halves by bytes (splitting a single large copy in the middle if needed)
    half = total // 2
    a: list[tuple[int, int, int]] = []
    b: list[tuple[int, int, int]] = []
    acc = 0
    for dst, src, n in copies:
        if acc >= half:
            b.append((dst, src, n))
        elif acc + n <= half:
            a.append((dst, src, n))
        else:
            k = half - acc
            a.append((dst, src, k))
            b.append((dst + k, src + k, n - k))
        acc += n
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, _copy_all, a)
        tg.start_soon(anyio.to_thread.run_sync, _copy_all, b)


async def _memcpy_many_crc(
    copies: Sequence[tuple[int, int, int]], sums: Sequence[bool]
) -> list[int]:
    """:func:`_memcpy_many` that also returns the CRC32C of each copy as it landed where
    ``sums[i]`` (``-1`` elsewhere), computed in the same pass over the bytes
    (:func:`mooncake._fast.copy_crc32c_batch`); a large batch is split between two worker
    threads at copy boundaries."""
    total = sum(n for _, _, n in copies)

    def run(cs: Sequence[tuple[int, int, int]], ss: Sequence[bool]) -> list[int]:
        return list(
            _fast.copy_crc32c_batch(
                [d for d, _, _ in cs], [s for _, s, _ in cs], [n for _, _, n in cs], ss
            )
        )

    if total < INLINE_COPY:
        return run(copies, sums)
    if total < SPLIT_COPY or len(copies) < 2:
        return await anyio.to_thread.run_sync(run, copies, sums)
    acc, cut = 0, 1
    for j, (_, _, n) in enumerate(copies):
        acc += n
        if acc >= total // 2:
            cut = max(1, j + 1) if j + 1 < len(copies) else max(1, j)
            break
    out: list[list[int]] = [[], []]

    async def half(k: int, cs: Sequence[tuple[int, int, int]], ss: Sequence[bool]) -> None:
        out[k] = await anyio.to_thread.run_sync(run, cs, ss)

    async with anyio.create_task_group() as tg:
        tg.start_soon(half, 0, copies[:cut], sums[:cut])
        tg.start_soon(half, 1, copies[cut:], sums[cut:])
    return out[0] + out[1]


def _copy_all(copies: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, n in copies:
        _fast.memcpy_at(dst, src, n)
