"""The async Mooncake Store client.

::

    async with mooncake.open_store("127.0.0.1:50051", segment_size=256 << 20) as store:
        await store.put("k", b"value")
        assert await store.get("k") == b"value"

A client plays both Mooncake roles. As a *storage server* it contributes one segment: a
memfd-backed buffer of ``segment_size`` bytes (:class:`~mooncake._store.shm.SharedSegment`),
registered with its transfer engine and mounted at the master; it pings the master every second
and remounts when told to (``NEED_REMOUNT``). As a *requester* it runs the flows of the published
client:

* **put** = ``PutStart`` (the master allocates up to ``replica_num`` replicas on distinct
  segments) -> write every replica -> ``PutEnd`` if every write succeeded, else ``PutRevoke``.
  A key that already exists is not an error and is left unchanged (Mooncake's idempotent put); a
  half-written object is never readable.
* **get** = ``GetReplicaList`` (grants a read lease) -> read one ``COMPLETE`` replica (the own
  segment first, then same-host ones, then remote; on a transfer failure the next replica) ->
  **fence**: the read fails with :class:`~mooncake.errors.LeaseExpiredError` if it finished
  after the lease it was granted ran out (measured from before the request was sent), because
  the master may then have reused the space; a read from a same-host segment whose owner died
  while it was copying fails with :class:`~mooncake.errors.PeerDiedError`.

Where the bytes go: a replica on this client's own segment is a ``memcpy``; one on another
client of the same host is a ``memcpy`` into that client's memfd mapping
(:mod:`mooncake._store.shm`); anything else goes through the engine (TCP). ``MC_STORE_MEMCPY=0``
sends same-host replicas through the engine too.

GPU tier: with ``segment_location="cuda:N"`` the segment is device memory
(``engine.allocate(segment_size, location="cuda:N")``, a :class:`DeviceMemory`) and none of the
host paths above touch it: the client serves no memfd for it (same-host peers find no
:class:`ShmServer` and go through their engine: the ``cuda`` transport, or TCP staging through
pinned host memory), and replicas on the own device segment go through ``engine.transfer`` to
the own segment (copies on the engine's CUDA stream). Such a segment is mounted with
``Segment.location`` set, which the master reports per tier (``gpu``). Objects evicted from a
device segment are not demoted to the SSD tier (dropped, as without one).

Copying APIs (``put(key, bytes)``, ``get(key) -> bytes``) stage through a registered local buffer
of ``local_buffer_size`` bytes when a replica is remote; as in the published client a value (or
a batch) larger than that buffer is refused with ``INVALID_PARAMS``. Zero-copy APIs
(``put_from``, ``get_into`` and their batch forms) take buffers registered with
:meth:`Store.register_buffer` (or the engine) and never stage.

Errors raise :mod:`mooncake.errors` classes (their ``code`` is the published int code); batch
calls return one entry per key, an exception instance where that key failed.

Cancellation: cancelling a put revokes the object (if ``PutStart`` had succeeded) before
returning; cancelling a read leaves no side effect but the lease it was granted.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.gpu import device_of, parse_location
from mooncake._core.master import parse_miss
from mooncake._core.memory import Region
from mooncake._core.misses import Miss, MissReason
from mooncake._core.policies import EvictionPolicy
from mooncake._core.staging import RangeAllocator
from mooncake._core.tiers import Admission, SsdEntry, make_admission
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Buffer, DeviceMemory, Engine, open_engine
from mooncake._store.bounds import check_replica_list, own_extent
from mooncake._store.config import ReplicateConfig, to_wire
from mooncake._store.master_conn import MasterConnection
from mooncake._store.shm import MappedPeer, SharedSegment, ShmPeers, ShmServer
from mooncake._store.ssd import SsdTier, open_ssd_tier
from mooncake.errors import (
    ClosedError,
    InvalidArgumentError,
    LeaseExpiredError,
    MooncakeError,
    NoAvailableHandleError,
    NotRegisteredError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    PeerDiedError,
    RpcError,
    TierDataError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._fast.cuda import CudaRuntime

log = logging.getLogger("mooncake.store")

HEARTBEAT_S = 1.0
#: how often a client with an SSD tier asks the master for demotions to do
TIER_POLL_S = 0.02
#: copies below this many bytes run on the loop thread; larger ones in worker threads
INLINE_COPY = 1 << 20
#: copies at least this large are split over two worker threads
SPLIT_COPY = 8 << 20
MAX_KEY_BYTES = 1 << 20

Config = ReplicateConfig | st.ReplicateConfig | None


@dataclass(slots=True)
class _Op:
    """One replica read or write: ``length`` bytes between ``local`` and the replica."""

    write: bool
    local: int
    replica: st.ReplicaDescriptor
    length: int
    error: MooncakeError | None = None


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise InvalidArgumentError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("key must not be empty")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"key of {len(key)} characters is too long")
    return key


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


class Store:
    """A connected store client. Create with :func:`open_store`."""

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

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def segment_name(self) -> str:
        """This client's transfer-engine segment name (``get_hostname()`` in the sync API)."""
        return self.engine.segment_name

    async def _start(self, tg: anyio.abc.TaskGroup) -> None:
        eng = self.engine
        self._shm = ShmPeers(eng.segment_name)
        await self.master.connect()
        if self.local_buffer_size:
            self.local_buffer = await eng.allocate(self.local_buffer_size)
            self._staging = RangeAllocator(self.local_buffer.length)
        if self.segment_size and device_of(self.segment_location) is not None:
            # device memory: no memfd, no ShmServer -- every peer goes through its engine
            dm = await eng.allocate(self.segment_size, location=self.segment_location)
            assert isinstance(dm, DeviceMemory)
            self.device_segment = dm
            self.mounted = st.Segment(
                id=str(uuid.uuid4()),
                name=eng.segment_name,
                base=dm.addr,
                size=dm.length,
                te_endpoint=eng.segment_name,
                protocol="tcp",
                location=self.segment_location,
            )
        elif self.segment_size:
            seg = SharedSegment(self.segment_size)
            self.segment = seg
            await anyio.to_thread.run_sync(seg.prefault)
            region = await eng.register((seg.addr, seg.size))
            region.owner = seg
            if self._shm.enabled:
                await tg.start(ShmServer(seg, eng.segment_name).serve)
            self.mounted = st.Segment(
                id=str(uuid.uuid4()),
                name=eng.segment_name,
                base=seg.addr,
                size=seg.size,
                te_endpoint=eng.segment_name,
                protocol="tcp",
            )
        if self.mounted is not None:
            await self.master.call(
                "MountSegment",
                rpc.MountSegmentParams(client_id=self.client_id, segment=self.mounted),
            )
        self._tg = tg
        if self.ssd is not None:
            await self._start_ssd()
            tg.start_soon(self._tier_loop)
        tg.start_soon(self._heartbeat)

    # -- SSD tier ---------------------------------------------------------------------------

    def _on_ssd_drop(self, entry: SsdEntry, why: str) -> None:
        """The SSD tier let go of ``entry``: report evictions and losses to the master."""
        vid = self._ssd_vid.pop(entry.key, None)
        if vid is not None and why in ("evicted", "corrupt"):
            assert self.ssd is not None
            self._disk_evictions[entry.key] = (vid, self.ssd.index.policy.name, why)

    async def _start_ssd(self) -> None:
        """Mount the SSD tier at the master and re-announce what it recovered."""
        assert self.ssd is not None
        await self._announce_ssd([e.key for e in self.ssd.recovered])

    async def _announce_ssd(self, keys: Sequence[str]) -> None:
        """``MountLocalDisk``, then ``PutLocal`` each of ``keys`` still on the SSD tier (each
        gets a new version id); a key the master already has lives elsewhere now: its copy
        here is deleted, so no stale copy stays reachable."""
        tier = self.ssd
        assert tier is not None
        await self.master.call(
            "MountLocalDisk",
            rpc.LocalDiskParams(client_id=self.client_id, capacity=tier.capacity),
        )
        for key in keys:
            if key not in tier:
                continue
            try:
                vid: int = await self.master.call(
                    "PutLocal",
                    rpc.PutLocalParams(client_id=self.client_id, key=key, size=tier.size_of(key)),
                )
            except (ObjectAlreadyExistsError, InvalidArgumentError):
                # the key was written again meanwhile (or cannot be announced): drop our copy
                self._ssd_vid.pop(key, None)
                await tier.remove(key)
                continue
            self._ssd_vid[key] = vid

    async def _remount(self) -> None:
        """After ``NEED_REMOUNT`` (the master restarted, or expired this client): mount the
        segment again and re-announce every object of the SSD tier (the master has forgotten
        them, and the version ids it gave them)."""
        if self.mounted is not None:
            await self.master.call(
                "ReMountSegment",
                rpc.ReMountSegmentParams(client_id=self.client_id, segments=[self.mounted]),
            )
        if self.ssd is not None:
            async with self._tier_lock:
                self._unsettled.clear()
                self._disk_evictions.clear()  # versions the master no longer knows
                self._ssd_vid.clear()
                await self._announce_ssd(self.ssd.keys())

    async def _tier_loop(self) -> None:
        """Every ``TIER_POLL_S``: one :meth:`_tier_round`."""
        while True:
            try:
                await self._tier_round()
            except (MooncakeError, OSError) as e:
                log.warning("SSD tier round failed: %s", e)
            await anyio.sleep(TIER_POLL_S)

    async def _tier_round(self) -> None:
        """Report SSD evictions, delete copies the master no longer lists, do its demotions."""
        async with self._tier_lock:
            for t in list(self._unsettled.values()):
                await self._end_demotion(t)
            await self._report_disk_evictions()
            tasks: st.TierTasks = await self.master.call(
                "FetchTierTasks", rpc.ClientParams(client_id=self.client_id)
            )
            for d in tasks.drop:
                if self._ssd_vid.get(d.key) == d.vid:
                    del self._ssd_vid[d.key]
                    assert self.ssd is not None
                    await self.ssd.remove(d.key)
            for t in tasks.demote:
                await self._demote(t)

    async def _report_disk_evictions(self) -> None:
        while self._disk_evictions:
            key, (vid, policy, _) = next(iter(self._disk_evictions.items()))
            await self.master.call(
                "EvictDiskReplica",
                rpc.EvictDiskParams(client_id=self.client_id, key=key, vid=vid, policy=policy),
            )
            if self._disk_evictions.get(key, (None,))[0] == vid:
                del self._disk_evictions[key]

    async def _demote(self, t: st.DemoteTask) -> None:
        """Copy a DRAM replica of our segment to the SSD tier, then DemoteEnd (or Revoke)."""
        tier, seg = self.ssd, self.segment
        assert tier is not None
        params = rpc.TierKeyParams(client_id=self.client_id, key=t.key, vid=t.vid)
        ok = (
            seg is not None
            and t.segment_name == self.segment_name
            and t.size > 0
            and seg.addr <= t.addr
            and t.addr + t.size <= seg.addr + seg.size
        )
        if ok:
            assert seg is not None
            # The master keeps this extent allocated until DemoteEnd/Revoke: stable bytes.
            view = (ctypes.c_char * t.size).from_address(t.addr)
            try:
                await tier.put(t.key, memoryview(view).cast("B"))
            except (MooncakeError, OSError) as e:  # SSD full of busy objects, ENOSPC, EIO
                log.warning("demoting %r to the SSD tier failed: %s", t.key, e)
                ok = False
        if not ok:
            try:
                await self.master.call("DemoteRevoke", params)
            except MooncakeError:
                pass
            return
        self._ssd_vid[t.key] = t.vid
        await self._end_demotion(t)

    async def _end_demotion(self, t: st.DemoteTask) -> None:
        """``DemoteEnd`` for a copy on the SSD tier.

        The master's answer decides: success keeps the copy; an error answer (the version was
        removed or replaced, or the demotion was revoked) deletes it, since it must never be
        served. A *lost* answer (connection reset: the master may or may not have applied it)
        decides nothing: ``DemoteEnd`` is idempotent, so it is retried, and a copy whose outcome
        is still unknown is kept for the next tier round (it is served only while the master
        lists it, with its version).
        """
        tier = self.ssd
        assert tier is not None
        params = rpc.TierKeyParams(client_id=self.client_id, key=t.key, vid=t.vid)
        for attempt in range(3):
            try:
                await self.master.call("DemoteEnd", params)
            except RpcError as e:
                log.info("DemoteEnd of %r: answer lost (%s); retrying", t.key, e)
                await anyio.sleep(0.05 * (attempt + 1))
                continue
            except MooncakeError:
                if self._unsettled.get(t.key) is t:
                    del self._unsettled[t.key]
                if self._ssd_vid.get(t.key) == t.vid:
                    del self._ssd_vid[t.key]
                    await tier.remove(t.key)
                return
            if self._unsettled.get(t.key) is t:
                del self._unsettled[t.key]
            tier.counters.demotions += 1
            return
        self._unsettled[t.key] = t

    async def _read_ssd(self, key: str, resp: st.GetReplicaListResponse) -> bytes:
        """The bytes of an object the master lists only on SSD copies (ours, if any)."""
        tier = self.ssd
        lost = self._disk_evictions.get(key)
        if lost is not None and lost[0] == resp.vid and self.client_id in resp.disk_clients:
            # our SSD let it go and the master has not heard yet
            err = ObjectNotFoundError(f"object {key!r} left this client's SSD tier ({lost[2]})")
            if lost[2] == "evicted":
                err.miss = Miss(key, MissReason.EVICTED, policy=lost[1], tier="ssd")
            else:
                err.miss = Miss(key, MissReason.TRANSFER_FAILED, tier="ssd", detail=lost[2])
            raise err
        if (
            tier is None
            or self.client_id not in resp.disk_clients
            or self._ssd_vid.get(key) != resp.vid
        ):
            err = ObjectNotFoundError(
                f"object {key!r} is only on the SSD of client(s) {', '.join(resp.disk_clients)}; "
                "reading another client's SSD is not supported"
            )
            err.miss = Miss(key, MissReason.TRANSFER_FAILED, tier="ssd", detail="remote SSD")
            raise err
        try:
            data = await tier.get(key)
        except TierDataError:
            # already dropped from the tier; _on_ssd_drop queued the report to the master
            raise
        if self.admission.admit(key) and self._tg is not None:
            self._tg.start_soon(self._promote, key, resp.vid, data)
        return data

    async def _promote(self, key: str, vid: int, data: bytes) -> None:
        """Copy an SSD hit back to DRAM (PromoteStart -> write -> PromoteEnd)."""
        params = rpc.TierKeyParams(client_id=self.client_id, key=key, vid=vid)
        try:
            reps: list[st.ReplicaDescriptor] = await self.master.call("PromoteStart", params)
        except MooncakeError as e:
            log.debug("promotion of %r not started: %s", key, e)
            return
        try:
            addr, n, keep = _value_addr(data)
            r = reps[0]
            if r.length != n:
                raise TransferError(f"PromoteStart gave a {r.length}-byte replica for {n} bytes")
            seg = self.segment
            if seg is not None and r.segment_name == self.segment_name:
                ctypes.memmove(own_extent(seg.addr, seg.size, r.addr, n), addr, n)
            else:
                off = await self._stage(n)
                try:
                    assert self.local_buffer is not None
                    local = self.local_buffer.addr + off
                    ctypes.memmove(local, addr, n)
                    op = _Op(True, local, r, n)
                    await self._move([op])
                    if op.error is not None:
                        raise op.error
                finally:
                    self._unstage(off)
            del keep
            await self.master.call("PromoteEnd", params)
        except BaseException as e:
            # A background task: a failed promotion only leaves the object on SSD.
            with anyio.CancelScope(shield=True):
                try:
                    await self.master.call("PromoteRevoke", params)
                except MooncakeError:
                    pass
            if not isinstance(e, MooncakeError):
                raise
            log.debug("promotion of %r failed: %s", key, e)
            return
        assert self.ssd is not None
        self.ssd.counters.promotions += 1

    async def explain_miss(self, key: str) -> Miss:
        """Why ``key`` is not readable, as the master attributes it (no miss is counted)."""
        info: st.MissInfo = await self.master.call("ExplainMiss", rpc.KeyParams(key=key))
        return Miss(
            key,
            MissReason(info.reason),
            policy=info.policy,
            tier=info.tier,
            owner=info.owner,
            at=info.at or None,
        )

    async def tier_stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters: the master's view (``dram``, ``ssd``) and this client's SSD tier
        (``local_ssd``: hits, misses, evictions, demotions, promotions, errors, bytes...)."""
        out: dict[str, dict[str, int]] = await self.master.call("GetTierStats", rpc.Empty())
        if self.ssd is not None:
            out["local_ssd"] = self.ssd.stats()
        return out

    async def segment_tiers(self) -> dict[str, dict[str, int]]:
        """The master's mounted segments by memory tier (``dram``, ``gpu``): ``segments``,
        ``capacity`` and ``used`` bytes of each."""
        out: dict[str, dict[str, int]] = await self.master.call("GetSegmentTiers", rpc.Empty())
        return out

    async def _heartbeat(self) -> None:
        params = rpc.ClientParams(client_id=self.client_id)
        while True:
            await anyio.sleep(HEARTBEAT_S)
            try:
                resp: st.PingResponse = await self.master.call("Ping", params)
                if resp.client_status == st.ClientStatus.NEED_REMOUNT and (
                    self.mounted is not None or self.ssd is not None
                ):
                    log.warning("master asked %s to remount its segment", self.client_id)
                    await self._remount()
            except MooncakeError as e:
                log.warning("heartbeat to the master at %s failed: %s", self.master_address, e)

    async def _aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self.mounted is not None:
                try:
                    with anyio.move_on_after(2):
                        await self.master.call(
                            "UnmountSegment",
                            rpc.UnmountSegmentParams(
                                client_id=self.client_id, segment_id=self.mounted.id
                            ),
                        )
                except MooncakeError as e:
                    log.warning("unmounting from the master failed: %s", e)
            self.master.close()
            self._shm.close()
            dm, self.device_segment = self.device_segment, None
            if dm is not None and not self.engine._closed:
                # a shared engine outlives the store: give the device memory back now
                await self.engine.unregister(dm)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store client is closed")

    async def health(self) -> int:
        """0 healthy, 1 closed, 2 master unreachable (the published ``health_check`` codes)."""
        if self._closed:
            return 1
        try:
            with anyio.fail_after(5):
                await self.master.call("Ping", rpc.ClientParams(client_id=self.client_id))
        except (MooncakeError, TimeoutError):
            return 2
        return 0

    # -- buffers --------------------------------------------------------------------------

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

    # -- data movement --------------------------------------------------------------------

    def _route_cached(self, segment: str) -> MappedPeer | None:
        return self._shm.cached(segment)

    async def _move(self, ops: Sequence[_Op]) -> None:
        """Run ``ops`` (reads or writes of replicas); failures land in each op's ``error``."""
        own = self.segment_name
        copies: list[tuple[int, int, int]] = []
        copy_ops: list[tuple[_Op, MappedPeer | None]] = []
        net: dict[str, list[_Op]] = {}
        for op in ops:
            seg = op.replica.segment_name
            if seg == own and self.segment is not None:
                peer = None
                try:
                    remote_local = own_extent(
                        self.segment.addr, self.segment.size, op.replica.addr, op.length
                    )
                except TransferError as e:
                    op.error = e
                    continue
            else:
                peer = await self._shm.lookup(seg)
                if peer is None:
                    net.setdefault(seg, []).append(op)
                    continue
                try:
                    remote_local = peer.local(op.replica.addr, op.length)
                except MooncakeError as e:
                    op.error = e
                    continue
                if not peer.alive():
                    op.error = PeerDiedError(f"{seg}: its owner is gone")
                    continue
            dst, src = (remote_local, op.local) if op.write else (op.local, remote_local)
            copies.append((dst, src, op.length))
            copy_ops.append((op, peer))
        if net:
            async with anyio.create_task_group() as tg:
                for seg, seg_ops in net.items():
                    tg.start_soon(self._move_net, seg, seg_ops)
        if copies:
            peers = {id(p): p for _, p in copy_ops if p is not None}
            pinned = [p for p in peers.values() if p.acquire()]
            try:
                if len(pinned) < len(peers):  # one died since it was looked up
                    for op, mp in copy_ops:
                        if mp is not None and mp not in pinned:
                            op.error = PeerDiedError(f"{mp.segment}: its owner is gone")
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
            for p in peers.values():
                if p.dead:
                    self._shm.forget(p.segment)

    async def _copy(self, copies: list[tuple[int, int, int]], ops: list[_Op]) -> None:
        """Same-host copies: memcpy, except where the caller's buffer is GPU memory (registered
        with a ``cuda:N`` location), which goes through the engine's CUDA stream instead."""
        host: list[tuple[int, int, int]] = []
        device: dict[int, list[tuple[tuple[int, int, int], _Op]]] = {}
        for c, op in zip(copies, ops, strict=True):
            region = self.engine.registry.find(op.local, op.length)
            dev = device_of(region.location) if region is not None else None
            if dev is None:
                host.append(c)
            else:
                device.setdefault(dev, []).append((c, op))
        if host:
            await _memcpy_many(host)
        for dev, items in device.items():
            try:
                await self.engine.staging.copy_many([c for c, _ in items], dev)
            except MooncakeError as e:
                for _, op in items:
                    op.error = e

    async def _move_net(self, segment: str, ops: list[_Op]) -> None:
        reqs = [
            TransferRequest.write(op.local, op.replica.addr, op.length)
            if op.write
            else TransferRequest.read(op.local, op.replica.addr, op.length)
            for op in ops
        ]
        try:
            results = await self.engine.transfer(segment, reqs)
        except MooncakeError as e:
            for op in ops:
                op.error = e if isinstance(e, TransferError) else TransferError(str(e))
            return
        for op, res in zip(ops, results, strict=True):
            if not res.ok:
                op.error = (
                    res.error
                    if isinstance(res.error, TransferError)
                    else TransferError(str(res.error))
                )

    # -- put ------------------------------------------------------------------------------

    async def put(self, key: str, value: Any, config: Config = None) -> None:
        """Store ``value`` (any C-contiguous buffer) under ``key``; a no-op if ``key`` exists."""
        (err,) = await self._put_values([key], [value], config, upsert=False, batch=False)
        if err is not None:
            raise err

    async def upsert(self, key: str, value: Any, config: Config = None) -> None:
        """Insert or replace ``key`` with ``value``."""
        (err,) = await self._put_values([key], [value], config, upsert=True, batch=False)
        if err is not None:
            raise err

    async def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: Config = None
    ) -> list[MooncakeError | None]:
        """Store each ``values[i]`` under ``keys[i]``; one result (None = ok) per key."""
        return await self._put_values(keys, values, config, upsert=False, batch=True)

    async def upsert_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: Config = None
    ) -> list[MooncakeError | None]:
        return await self._put_values(keys, values, config, upsert=True, batch=True)

    async def put_from(self, key: str, addr: int, size: int, config: Config = None) -> None:
        """Store ``size`` bytes at registered address ``addr`` under ``key`` (zero-copy)."""
        self._require_local(addr, size, "put_from")
        (err,) = await self._put_addrs([key], [addr], [size], config, upsert=False, batch=False)
        if err is not None:
            raise err

    async def upsert_from(self, key: str, addr: int, size: int, config: Config = None) -> None:
        self._require_local(addr, size, "upsert_from")
        (err,) = await self._put_addrs([key], [addr], [size], config, upsert=True, batch=False)
        if err is not None:
            raise err

    async def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], config: Config = None
    ) -> list[MooncakeError | None]:
        """Zero-copy batch put; one result (None = ok) per key."""
        return await self._batch_from(keys, addrs, sizes, config, upsert=False)

    async def batch_upsert_from(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], config: Config = None
    ) -> list[MooncakeError | None]:
        return await self._batch_from(keys, addrs, sizes, config, upsert=True)

    async def _batch_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
    ) -> list[MooncakeError | None]:
        if not (len(keys) == len(addrs) == len(sizes)):
            err = InvalidArgumentError(
                f"batch lengths differ: {len(keys)} keys, {len(addrs)} buffers, {len(sizes)} sizes"
            )
            return [err] * max(len(keys), len(addrs), len(sizes))
        out: list[MooncakeError | None] = [None] * len(keys)
        good: list[int] = []
        for i, (a, n) in enumerate(zip(addrs, sizes, strict=True)):
            try:
                self._require_local(a, n, f"batch_put_from[{i}]")
                good.append(i)
            except MooncakeError as e:
                out[i] = e
        if good:
            res = await self._put_addrs(
                [keys[i] for i in good],
                [addrs[i] for i in good],
                [sizes[i] for i in good],
                config,
                upsert=upsert,
                batch=True,
            )
            for i, r in zip(good, res, strict=True):
                out[i] = r
        return out

    async def _put_values(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
    ) -> list[MooncakeError | None]:
        self._check_open()
        if len(keys) != len(values):
            err = InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
            return [err] * max(len(keys), len(values))
        if not keys:
            return []
        spans = [_value_addr(v) for v in values]
        total = sum(n for _, n, _ in spans)
        if any(n == 0 for _, n, _ in spans):
            # b"" could not be told apart from "missing" by get(), so Mooncake refuses it
            return [InvalidArgumentError("empty values cannot be stored")] * len(keys)
        # The published client stages every copying put through its local buffer: a value (or a
        # batch) larger than the buffer is refused up front, before anything is allocated.
        if total > self._staging.capacity:
            return [
                InvalidArgumentError(
                    f"{total} bytes exceed the local buffer ({self.local_buffer_size} bytes)"
                )
            ] * len(keys)
        addrs = [a for a, _, _ in spans]
        sizes = [n for _, n, _ in spans]
        try:
            return await self._put_addrs(
                keys, addrs, sizes, config, upsert=upsert, batch=batch, copy=True
            )
        finally:
            del spans  # the exports stay alive until every write has finished

    async def _put_addrs(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
        copy: bool = False,
    ) -> list[MooncakeError | None]:
        """:meth:`_put_addrs_once`; with an SSD tier, keys refused for lack of space are retried
        after doing the demotions the master has queued for this client (the space they hold
        comes back only when the copies are confirmed), while that makes progress."""
        errs = await self._put_addrs_once(
            keys, addrs, sizes, config, upsert=upsert, batch=batch, copy=copy
        )
        if self.ssd is None:
            return errs
        while True:  # while rounds make progress (each places at least one key)
            again = [i for i, e in enumerate(errs) if isinstance(e, NoAvailableHandleError)]
            if not again:
                break
            try:
                await self._tier_round()
            except (MooncakeError, OSError) as e:
                log.warning("SSD tier round failed: %s", e)
                break
            retried = await self._put_addrs_once(
                [keys[i] for i in again],
                [addrs[i] for i in again],
                [sizes[i] for i in again],
                config,
                upsert=upsert,
                batch=batch,
                copy=copy,
            )
            for i, result in zip(again, retried, strict=True):
                errs[i] = result
            if all(isinstance(r, NoAvailableHandleError) for r in retried):
                break
        return errs

    async def _put_addrs_once(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
        copy: bool = False,
    ) -> list[MooncakeError | None]:
        """PutStart -> writes -> PutEnd/PutRevoke for each key (sources already validated)."""
        self._check_open()
        wire = to_wire(config)
        out: list[MooncakeError | None] = [None] * len(keys)
        try:
            for k in keys:
                _check_key(k)
        except MooncakeError as e:
            return [e] * len(keys)
        prefix = "Upsert" if upsert else "Put"
        # -- start
        replicas: list[list[st.ReplicaDescriptor] | None] = [None] * len(keys)
        if not batch:
            try:
                replicas[0] = await self.master.call(
                    f"{prefix}Start",
                    rpc.PutStartParams(
                        client_id=self.client_id, key=keys[0], size=sizes[0], config=wire
                    ),
                )
            except ObjectAlreadyExistsError:
                return [None]  # Mooncake's put of an existing key succeeds and changes nothing
            except MooncakeError as e:
                return [e]
        else:
            try:
                items: list[rpc.Item[list[st.ReplicaDescriptor]]] = await self.master.call(
                    f"Batch{prefix}Start",
                    rpc.BatchPutStartParams(
                        client_id=self.client_id, keys=list(keys), sizes=list(sizes), config=wire
                    ),
                )
            except MooncakeError as e:
                return [e] * len(keys)
            for i, item in enumerate(items):
                if item.code == 0 and item.value is not None:
                    replicas[i] = item.value
                elif item.code != int(ObjectAlreadyExistsError.code):
                    from mooncake.errors import error_from_code

                    out[i] = error_from_code(item.code)
        started = [i for i in range(len(keys)) if replicas[i] is not None]
        if not started:
            return out
        # -- write
        staged: list[int] = []
        try:
            with anyio.CancelScope(shield=False):
                ops: list[tuple[int, _Op]] = []
                need_stage: list[int] = []
                for i in started:
                    reps = replicas[i]
                    assert reps is not None
                    if not reps:
                        out[i] = TransferError(f"master allocated no replica for {keys[i]!r}")
                    if copy:
                        await self._resolve(r.segment_name for r in reps)
                    for r in reps:
                        if copy and not self._is_copyable(r.segment_name):
                            need_stage.append(i)
                            break
                local = list(addrs)
                if need_stage:
                    # one staging range for the batch: remote replicas need registered sources
                    tot = sum(sizes[i] for i in need_stage)
                    off = await self._stage(tot)
                    staged.append(off)
                    assert self.local_buffer is not None
                    base = self.local_buffer.addr + off
                    copies = []
                    for i in need_stage:
                        copies.append((base, addrs[i], sizes[i]))
                        local[i] = base
                        base += sizes[i]
                    await _memcpy_many(copies)
                for i in started:
                    if out[i] is not None:
                        continue
                    reps = replicas[i]
                    assert reps is not None
                    for r in reps:
                        if r.length != sizes[i]:
                            out[i] = TransferError(
                                f"master allocated {r.length} bytes for {sizes[i]}-byte {keys[i]!r}"
                            )
                            break
                        ops.append((i, _Op(True, local[i], r, sizes[i])))
                await self._move([op for _, op in ops])
                for i, op in ops:
                    if op.error is not None and out[i] is None:
                        out[i] = op.error
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish(prefix, keys, started, [True] * len(keys), batch)
            raise
        finally:
            for off in staged:
                self._unstage(off)
        # -- end / revoke
        failed = [out[i] is not None for i in range(len(keys))]
        end_errs = await self._finish(prefix, keys, started, failed, batch)
        for i, end_err in end_errs.items():
            if out[i] is None:
                out[i] = end_err
        return out

    async def _resolve(self, segments: Any) -> None:
        """Map the same-host segments among ``segments`` (cheap once known)."""
        for seg in set(segments):
            if seg != self.segment_name:
                await self._shm.lookup(seg)

    async def _complete_put(
        self, prefix: str, key: str, addr: int, size: int, reps: list[st.ReplicaDescriptor]
    ) -> MooncakeError | None:
        """Write ``reps`` (already PutStart-ed elsewhere) from ``addr``, then End or Revoke."""
        err: MooncakeError | None = None
        staged: int | None = None
        try:
            await self._resolve(r.segment_name for r in reps)
            src = addr
            remote = any(not self._is_copyable(r.segment_name) for r in reps)
            if remote and self.engine.registry.find(addr, size) is None:
                staged = await self._stage(size)
                assert self.local_buffer is not None
                src = self.local_buffer.addr + staged
                await _memcpy_many([(src, addr, size)])
            if not reps:
                err = TransferError(f"master allocated no replica for {key!r}")
            elif any(r.length != size for r in reps):
                err = TransferError(f"master allocated a replica of the wrong size for {key!r}")
            else:
                ops = [_Op(True, src, r, size) for r in reps]
                await self._move(ops)
                err = next((op.error for op in ops if op.error is not None), None)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish(prefix, [key], [0], [True], False)
            raise
        finally:
            if staged is not None:
                self._unstage(staged)
        errs = await self._finish(prefix, [key], [0], [err is not None], False)
        return err or errs.get(0)

    def _is_copyable(self, segment: str) -> bool:
        """Whether writes to ``segment`` are memcpys (own or a live same-host mapping)."""
        if segment == self.segment_name:
            return self.segment is not None
        return self._route_cached(segment) is not None

    async def _finish(
        self,
        prefix: str,
        keys: Sequence[str],
        started: list[int],
        failed: list[bool],
        batch: bool,
    ) -> dict[int, MooncakeError]:
        """PutEnd the started keys that succeeded, PutRevoke the rest; errors per index."""
        errs: dict[int, MooncakeError] = {}
        ends = [i for i in started if not failed[i]]
        revokes = [i for i in started if failed[i]]
        for method, idx in ((f"{prefix}End", ends), (f"{prefix}Revoke", revokes)):
            if not idx:
                continue
            if not batch:
                try:
                    await self.master.call(
                        method, rpc.KeyClientParams(client_id=self.client_id, key=keys[idx[0]])
                    )
                except MooncakeError as e:
                    errs[idx[0]] = e
                continue
            try:
                codes: list[int] = await self.master.call(
                    f"Batch{method}",
                    rpc.BatchKeyClientParams(client_id=self.client_id, keys=[keys[i] for i in idx]),
                )
            except MooncakeError as e:
                for i in idx:
                    errs[i] = e
                continue
            from mooncake.errors import error_from_code

            for i, c in zip(idx, codes, strict=False):
                if c != 0:
                    errs[i] = error_from_code(c)
        return errs

    # -- get ------------------------------------------------------------------------------

    def _order(self, replicas: Sequence[st.ReplicaDescriptor]) -> list[st.ReplicaDescriptor]:
        """Readable replicas, cheapest first: own segment, same-host mapped, then the rest."""
        complete = [r for r in replicas if r.status == st.ReplicaStatus.COMPLETE]

        def rank(r: st.ReplicaDescriptor) -> int:
            if r.segment_name == self.segment_name:
                return 0
            return 1 if self._route_cached(r.segment_name) is not None else 2

        return sorted(complete, key=rank)

    async def _query(
        self, key: str, *, for_read: bool = True
    ) -> tuple[st.GetReplicaListResponse, float]:
        """GetReplicaList and the read's fence deadline (measured from before the request)."""
        t0 = anyio.current_time()
        try:
            resp: st.GetReplicaListResponse = await self.master.call(
                "GetReplicaList", rpc.KeyParams(key=_check_key(key), for_read=for_read)
            )
        except ObjectNotFoundError as e:
            e.miss = parse_miss(key, str(e))
            raise
        return check_replica_list(key, resp), t0 + _read_ttl(resp)

    async def _batch_query(
        self, keys: Sequence[str], *, for_read: bool = True
    ) -> tuple[list[st.GetReplicaListResponse | MooncakeError], float]:
        from mooncake.errors import error_from_code

        t0 = anyio.current_time()
        items: list[rpc.Item[st.GetReplicaListResponse]] = await self.master.call(
            "BatchGetReplicaList", rpc.KeysParams(keys=list(keys), for_read=for_read)
        )
        out: list[st.GetReplicaListResponse | MooncakeError] = []
        for key, it in zip(keys, items, strict=False):
            if it.code == 0 and it.value is not None:
                try:
                    out.append(check_replica_list(key, it.value))
                except TransferError as e:
                    out.append(e)
            else:
                out.append(error_from_code(it.code))
        return out, t0

    @staticmethod
    def _size_of(resp: st.GetReplicaListResponse) -> int:
        if resp.size:
            return resp.size
        return resp.replicas[0].length if resp.replicas else 0

    async def _read_one(
        self, resp: st.GetReplicaListResponse, local: int, n: int, deadline: float
    ) -> None:
        """Read ``n`` bytes of the object into ``local``, trying replicas in order; fenced."""
        order = self._order(resp.replicas)
        if not order:
            raise ObjectNotFoundError("no complete replica")
        err: MooncakeError | None = None
        for r in order:
            op = _Op(False, local, r, n)
            await self._move([op])
            if op.error is None:
                if anyio.current_time() > deadline:
                    self.lease_fences += 1
                    raise LeaseExpiredError(
                        "the read finished after its lease expired; the bytes may be stale"
                    )
                return
            err = op.error
        assert err is not None
        raise err

    def _note_miss(self, err: BaseException) -> None:
        """Count a failed read by reason/policy/tier (see :meth:`miss_stats`)."""
        if isinstance(err, ObjectNotFoundError):
            m = err.miss
            label = (m.reason.value, m.policy, m.tier) if m is not None else ("unknown", "", "")
        elif isinstance(err, LeaseExpiredError):
            label = (MissReason.LEASE_EXPIRED.value, "", "dram")
        elif isinstance(err, TierDataError):
            label = (MissReason.TRANSFER_FAILED.value, "", "ssd")
        elif isinstance(err, TransferError):
            label = (MissReason.TRANSFER_FAILED.value, "", "dram")
        else:
            return
        self._misses[label] += 1

    def miss_stats(self) -> dict[tuple[str, str, str], int]:
        """Failed reads of this client by (reason, policy, tier): misses the master attributed
        (``ObjectNotFoundError.miss``; batch misses carry no attribution: ``unknown``), reads
        fenced by their lease, transfers and SSD reads that failed. The master counts the
        misses it sees in ``master_misses_total``."""
        return dict(self._misses)

    async def get(self, key: str) -> bytes:
        """The value of ``key`` (raises :class:`ObjectNotFoundError` if there is none)."""
        try:
            return await self._get(key)
        except MooncakeError as e:
            self._note_miss(e)
            raise

    async def _get(self, key: str) -> bytes:
        self._check_open()
        resp, deadline = await self._query(key)
        if not resp.replicas and resp.disk_clients:
            return await self._read_ssd(key, resp)
        return await self._get_with(resp, deadline)

    async def _get_with(self, resp: st.GetReplicaListResponse, deadline: float) -> bytes:
        """The rest of :meth:`get` once ``GetReplicaList`` has answered ``resp``."""
        n = self._size_of(resp)
        # same-host or own replica: copy straight into a new bytes object
        await self._resolve(r.segment_name for r in resp.replicas)
        order = self._order(resp.replicas)
        if order and self._is_copyable(order[0].segment_name):
            r = order[0]
            peer = (
                None if r.segment_name == self.segment_name else self._route_cached(r.segment_name)
            )
            if peer is None:
                assert self.segment is not None  # _is_copyable of our own segment
                src = own_extent(self.segment.addr, self.segment.size, r.addr, n)
            else:
                src = peer.local(r.addr, n)
            if peer is not None and not peer.acquire():
                self._shm.forget(r.segment_name)
                raise PeerDiedError(f"{r.segment_name}: its owner is gone")
            try:
                data = ctypes.string_at(src, n)
            finally:
                if peer is not None:
                    peer.unpin()
            if peer is None or peer.alive():
                if anyio.current_time() > deadline:
                    self.lease_fences += 1
                    raise LeaseExpiredError("the read finished after its lease expired")
                return data
            self._shm.forget(r.segment_name)
            raise PeerDiedError(f"{r.segment_name}: its owner died while the read was in flight")
        if n > self._staging.capacity:
            raise InvalidArgumentError(
                f"a {n}-byte value does not fit the local buffer ({self.local_buffer_size} bytes)"
            )
        off = await self._stage(n)
        try:
            assert self.local_buffer is not None
            addr = self.local_buffer.addr + off
            await self._read_one(resp, addr, n, deadline)
            return ctypes.string_at(addr, n)
        finally:
            self._unstage(off)

    async def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into the registered buffer ``[addr, addr+size)``; returns its length."""
        try:
            return await self._get_into(key, addr, size)
        except MooncakeError as e:
            self._note_miss(e)
            raise

    async def _get_into(self, key: str, addr: int, size: int) -> int:
        self._check_open()
        self._require_local(addr, size, "get_into")
        resp, deadline = await self._query(key)
        n = self._size_of(resp)
        if n > size:
            raise InvalidArgumentError(f"buffer of {size} bytes is smaller than the {n}-byte value")
        if not resp.replicas and resp.disk_clients:
            data = await self._read_ssd(key, resp)
            if len(data) != n:
                raise TransferError(f"the SSD copy of {key!r} has {len(data)} bytes, not {n}")
            ctypes.memmove(addr, data, n)
            return n
        await self._read_one(resp, addr, n, deadline)
        return n

    async def get_batch(self, keys: Sequence[str]) -> list[bytes | MooncakeError]:
        """Values of ``keys`` (an exception instance where a key failed)."""
        self._check_open()
        if not keys:
            return []
        try:
            for k in keys:
                _check_key(k)
            resps, t0 = await self._batch_query(keys)
        except MooncakeError as e:
            return [e] * len(keys)
        from_ssd = await self._batch_ssd(keys, resps)
        out: list[bytes | MooncakeError] = [b""] * len(keys)
        sizes = [self._size_of(r) if not isinstance(r, MooncakeError) else 0 for r in resps]
        total = sum(sizes)
        if total > self._staging.capacity:
            err = InvalidArgumentError(
                f"{total} bytes exceed the local buffer ({self.local_buffer_size} bytes)"
            )
            return [err] * len(keys)
        off = await self._stage(total) if total else None
        try:
            addrs = []
            base = self.local_buffer.addr + off if (off is not None and self.local_buffer) else 0
            for n in sizes:
                addrs.append(base)
                base += n
            errs = await self._read_many(resps, addrs, sizes, t0)
            for i, r in enumerate(resps):
                if isinstance(r, MooncakeError):
                    out[i] = r
                elif (read_err := errs[i]) is not None:
                    out[i] = read_err
                else:
                    out[i] = ctypes.string_at(addrs[i], sizes[i])
        finally:
            if off is not None:
                self._unstage(off)
        for i, got in from_ssd.items():
            out[i] = got
        for value in out:
            if isinstance(value, MooncakeError):
                self._note_miss(value)
        return out

    async def _batch_ssd(
        self, keys: Sequence[str], resps: list[st.GetReplicaListResponse | MooncakeError]
    ) -> dict[int, bytes | MooncakeError]:
        """Serve the SSD-only answers of a batch; their slots in ``resps`` become errors so the
        memory path skips them (the caller puts the results back)."""
        out: dict[int, bytes | MooncakeError] = {}
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError) or r.replicas or not r.disk_clients:
                continue
            try:
                out[i] = await self._read_ssd(keys[i], r)
            except MooncakeError as e:
                out[i] = e
            resps[i] = ObjectNotFoundError("served from the SSD tier")
        return out

    async def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int | MooncakeError]:
        """Read each key into its registered buffer; bytes read (or an exception) per key."""
        self._check_open()
        if not (len(keys) == len(addrs) == len(sizes)):
            err = InvalidArgumentError(
                f"batch lengths differ: {len(keys)} keys, {len(addrs)} buffers, {len(sizes)} sizes"
            )
            return [err] * max(len(keys), len(addrs), len(sizes))
        if not keys:
            return []
        out: list[int | MooncakeError] = [0] * len(keys)
        try:
            for k in keys:
                _check_key(k)
            resps, t0 = await self._batch_query(keys)
        except MooncakeError as e:
            return [e] * len(keys)
        from_ssd = await self._batch_ssd(keys, resps)
        for i, got in from_ssd.items():
            if isinstance(got, MooncakeError):
                out[i] = got
                continue
            try:
                self._require_local(addrs[i], sizes[i], f"batch_get_into[{i}]")
                if len(got) > sizes[i]:
                    raise InvalidArgumentError(
                        f"buffer of {sizes[i]} bytes is smaller than the {len(got)}-byte value"
                    )
                ctypes.memmove(addrs[i], got, len(got))
                out[i] = len(got)
            except MooncakeError as e:
                out[i] = e
        lens: list[int] = []
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                if i not in from_ssd:
                    out[i] = r
                lens.append(0)
                continue
            n = self._size_of(r)
            try:
                self._require_local(addrs[i], sizes[i], f"batch_get_into[{i}]")
                if n > sizes[i]:
                    raise InvalidArgumentError(
                        f"buffer of {sizes[i]} bytes is smaller than the {n}-byte value"
                    )
            except MooncakeError as e:
                out[i] = e
                resps[i] = e
                lens.append(0)
                continue
            lens.append(n)
        errs = await self._read_many(resps, list(addrs), lens, t0)
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                continue
            read_err = errs[i]
            out[i] = read_err if read_err is not None else lens[i]
        return out

    async def _read_many(
        self,
        resps: Sequence[st.GetReplicaListResponse | MooncakeError],
        addrs: Sequence[int],
        sizes: Sequence[int],
        t0: float,
    ) -> list[MooncakeError | None]:
        """Read every answered key (first replica, then failover rounds); fenced per key."""
        errs: list[MooncakeError | None] = [None] * len(resps)
        orders: dict[int, list[st.ReplicaDescriptor]] = {}
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                continue
            o = self._order(r.replicas)
            if not o:
                errs[i] = ObjectNotFoundError("no complete replica")
                continue
            orders[i] = o
        attempt = 0
        todo = list(orders)
        while todo:
            ops = [(i, _Op(False, addrs[i], orders[i][attempt], sizes[i])) for i in todo]
            await self._move([op for _, op in ops])
            nxt = []
            for i, op in ops:
                if op.error is None:
                    errs[i] = None
                elif attempt + 1 < len(orders[i]):
                    nxt.append(i)
                else:
                    errs[i] = op.error
            todo = nxt
            attempt += 1
        now = anyio.current_time()
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError) or errs[i] is not None:
                continue
            if now > t0 + _read_ttl(r):
                self.lease_fences += 1
                errs[i] = LeaseExpiredError("the read finished after its lease expired")
        return errs

    # -- queries and removal --------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is readable (grants a lease when it is, as in Mooncake)."""
        self._check_open()
        return bool(await self.master.call("ExistKey", rpc.KeyParams(key=_check_key(key))))

    async def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / negative code per key."""
        self._check_open()
        if not keys:
            return []
        for k in keys:
            _check_key(k)
        codes: list[int] = await self.master.call("BatchExistKey", rpc.KeysParams(keys=list(keys)))
        return codes

    async def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value."""
        self._check_open()
        resp, _ = await self._query(key, for_read=False)
        return self._size_of(resp)

    async def replica_descriptors(self, key: str) -> list[st.ReplicaDescriptor]:
        """The object's replicas (grants a read lease)."""
        self._check_open()
        resp, _ = await self._query(key, for_read=False)
        return list(resp.replicas)

    async def batch_replica_descriptors(
        self, keys: Sequence[str]
    ) -> dict[str, list[st.ReplicaDescriptor]]:
        """Replicas of each readable key (keys that fail are left out)."""
        self._check_open()
        if not keys:
            return {}
        resps, _ = await self._batch_query(keys, for_read=False)
        return {
            k: list(r.replicas)
            for k, r in zip(keys, resps, strict=True)
            if not isinstance(r, MooncakeError)
        }

    async def remove(self, key: str, *, force: bool = False) -> None:
        self._check_open()
        await self.master.call("Remove", rpc.RemoveParams(key=_check_key(key), force=force))

    async def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        self._check_open()
        if not keys:
            return []
        codes: list[int] = await self.master.call(
            "BatchRemove", rpc.BatchRemoveParams(keys=list(keys), force=force)
        )
        return codes

    async def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        self._check_open()
        n: int = await self.master.call(
            "RemoveByRegex", rpc.RegexParams(regex=pattern, force=force)
        )
        return n

    async def remove_all(self, *, force: bool = False) -> int:
        self._check_open()
        n: int = await self.master.call("RemoveAll", rpc.ForceParams(force=force))
        return n


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


def _copy_all(copies: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, n in copies:
        _fast.memcpy_at(dst, src, n)


@asynccontextmanager
async def open_store(
    master: str = "127.0.0.1:50051",
    *,
    hostname: str = "127.0.0.1",
    metadata: str = "P2PHANDSHAKE",
    segment_size: int = 16 << 20,
    local_buffer_size: int = 16 << 20,
    protocol: str = "tcp",
    engine: Engine | None = None,
    ssd_path: str | None = None,
    ssd_capacity: int = 0,
    ssd_policy: EvictionPolicy | str = "lru",
    promotion: Admission | str = "hits:2",
    ssd_direct_io: bool | None = None,
    ssd_sync: bool = True,
    segment_location: str = "cpu:0",
    cuda_runtime: CudaRuntime | None = None,
) -> AsyncIterator[Store]:
    """Connect to the master at ``master``, mount a segment and yield a :class:`Store`.

    ``segment_size`` 0 makes a pure client (contributes no memory); ``local_buffer_size`` 0
    disables the copying APIs' staging for remote replicas. ``hostname`` is this client's
    address for peers (its engine binds it). Pass ``engine`` to share an existing engine (it is
    not closed on exit). On exit the segment is unmounted (objects stored in it disappear) and
    everything the client started stops.

    ``ssd_path`` (with ``ssd_capacity`` bytes) gives the client a local SSD tier
    (:mod:`mooncake._store.ssd`, evicting by ``ssd_policy``): objects the master evicts from this
    client's segment are demoted to it instead of dropped, gets of objects held only there are
    served from it (verified), and hits are promoted back to DRAM when ``promotion`` admits them
    (``"always"``, ``"never"``, ``"hits:N"``). Objects found in ``ssd_path`` at start are
    re-announced to the master (or dropped if their key was written again). See docs/tiers.md.

    ``segment_location`` ``"cuda:N"`` makes the segment GPU memory on device ``N`` (the GPU
    tier, see the module docstring); ``cuda_runtime`` is passed to the engine this opens (tests
    pass :class:`mooncake.testing.fake_cuda.FakeCudaRuntime`; ignored with ``engine``).
    """
    if protocol not in ("tcp", ""):
        raise InvalidArgumentError(f"protocol {protocol!r} is not supported (use 'tcp')")
    store = Store(
        master,
        segment_size=segment_size,
        local_buffer_size=local_buffer_size,
        segment_location=segment_location,
    )
    store.admission = make_admission(promotion)
    async with AsyncExitStack() as stack:
        if ssd_path is not None:
            store.ssd = await stack.enter_async_context(
                open_ssd_tier(
                    ssd_path,
                    ssd_capacity,
                    policy=ssd_policy,
                    direct_io=ssd_direct_io,
                    sync=ssd_sync,
                    on_drop=store._on_ssd_drop,
                )
            )
        async with _open_with_engine(store, engine, hostname, metadata, cuda_runtime) as opened:
            yield opened


@asynccontextmanager
async def _open_with_engine(
    store: Store,
    engine: Engine | None,
    hostname: str,
    metadata: str,
    cuda_runtime: CudaRuntime | None = None,
) -> AsyncIterator[Store]:
    async with _engine_for(engine, hostname, metadata, cuda_runtime) as eng:
        store.engine = eng
        try:
            async with anyio.create_task_group() as tg:
                try:
                    await store._start(tg)
                    yield store
                finally:
                    tg.cancel_scope.cancel()
        finally:
            if hasattr(store, "_shm"):
                await store._aclose()
            else:
                store.master.close()


@asynccontextmanager
async def _engine_for(
    engine: Engine | None, hostname: str, metadata: str, cuda_runtime: CudaRuntime | None = None
) -> AsyncIterator[Engine]:
    if engine is not None:
        yield engine
        return
    async with open_engine(hostname, metadata, cuda_runtime=cuda_runtime) as eng:
        yield eng


__all__ = ["Store", "open_store"]
