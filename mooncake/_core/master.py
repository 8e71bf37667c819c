"""The master's state machine (sans-I/O): objects, replicas, segments, clients, leases, eviction.

:class:`MasterState` holds all metadata of a Mooncake Store master and implements one method per
RPC (:mod:`mooncake._core.rpc`). Methods are synchronous, never block and take ``now`` (seconds
on the caller's clock; the server passes the event loop's clock, tests a ``MockClock``). They
return the RPC result or raise a :class:`~mooncake.errors.StoreError` subclass carrying the
Mooncake error code. The master never touches object bytes; it hands out address ranges.

Model
-----
* **Segment**: ``[base, base+size)`` of a client's memory, named by its transfer-engine segment
  name, with an :class:`~mooncake._core.allocator.OffsetAllocator`. A segment id is mounted by one
  client; ranges of segments with the same name must not overlap.
* **Object** ``key``: at most one *readable* version (size + replicas, every replica COMPLETE)
  and at most one *pending* write (PutStart/UpsertStart .. PutEnd/UpsertEnd or Revoke). Each
  replica of a version is one contiguous extent on a distinct segment. Readers only ever see the
  readable version: a half-written object is never returned.
* **Lease**: ``GetReplicaList``/``ExistKey`` (and their batch/regex forms) extend the object's
  lease to ``now + default_kv_lease_ttl``. A leased object is not evicted, and ``Remove`` /
  ``RemoveAll`` / ``RemoveByRegex`` refuse it (``OBJECT_HAS_LEASE``) unless ``force``.
* **Read window**: a ``GetReplicaList`` for reading also opens a short window (``read_fence_ttl``
  plus ``read_fence_s_per_mib`` per MiB, at most the lease) during which the space of that
  version is not reused, even if the object is force-removed or replaced; the client fails a
  read that finishes after the window (``read_ttl_ms``). So bytes a reader copies are never
  handed to another object while it copies them, without holding space for a whole lease.
* **Pins**: ``with_hard_pin`` objects are never evicted. A soft pin (``with_soft_pin`` or
  ``soft_pin_action=ENABLE``) lasts ``soft_pin_ttl_ms`` (default ``default_kv_soft_pin_ttl``,
  capped at ``max_kv_soft_pin_ttl``) from PutEnd; soft-pinned objects are evicted only after every
  unpinned candidate, and not at all if ``allow_evict_soft_pinned_objects`` is false.
* **Eviction** runs when the used ratio exceeds ``eviction_high_watermark_ratio`` (at PutStart
  and in :meth:`MasterState.sweep`) or when an allocation fails. It frees
  ``max(eviction_ratio, used_ratio - watermark + eviction_ratio)`` of the capacity, asking the
  policy (:mod:`mooncake._core.policies`, LRU by default) for victims among objects that are
  readable, have no pending write, no lease and no hard pin.
* **Zombie writes**: a pending write older than ``put_start_discard_timeout`` may be pre-empted
  by a new PutStart of the same key; its space is released ``put_start_release_timeout`` after
  its PutStart (the writer might still be writing into it until then). :meth:`sweep` also
  releases un-pre-empted zombies at that point.
* **Clients**: ``Ping``, ``MountSegment`` and ``ReMountSegment`` keep a client alive until
  ``now + client_ttl``. :meth:`sweep` drops clients past their deadline: their segments are
  unmounted, replicas on them dropped, objects left without replicas removed. ``Ping`` from an
  unknown (new or expired) client answers ``NEED_REMOUNT``. Time the master itself was
  unresponsive is credited to every client (:meth:`credit_stall`), so a stall of the master
  never reads as silence of its clients.

Upsert: ``UpsertStart`` on a readable key allocates a new version (fresh extents) beside the old
one; readers keep getting the old version until ``UpsertEnd`` swaps them.
"""

from __future__ import annotations

import itertools
import random
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from mooncake._core.allocator import DEFAULT_ALIGNMENT, OffsetAllocator
from mooncake._core.misses import Miss, MissLedger, MissReason
from mooncake._core.policies import EvictionPolicy, Pin, make_policy
from mooncake._core.quarantine import Quarantine
from mooncake._core.rpc import Item
from mooncake._core.store_types import (
    ClientStatus,
    DemoteTask,
    DiskDrop,
    GetReplicaListResponse,
    ObjectInfo,
    PingResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicaTask,
    ReplicateConfig,
    Segment,
    SegmentInfo,
    SoftPinAction,
    TaskStartResponse,
    TaskStatus,
    TaskType,
    TierTasks,
)
from mooncake._core.tiers import TierCounters
from mooncake.errors import (
    ClientNotFoundError,
    IllegalClientError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidWriteError,
    MooncakeError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectHasLeaseError,
    ObjectHasReplicationTaskError,
    ObjectNotFoundError,
    ReplicaNotFoundError,
    ReplicaNotReadyError,
    SegmentAlreadyExistsError,
    SegmentNotFoundError,
)

__all__ = [
    "ALLOCATION_STRATEGIES",
    "MasterConfig",
    "MasterState",
    "MasterStats",
    "format_miss",
    "parse_miss",
]

ALLOCATION_STRATEGIES = ("random", "free_ratio_first")
MAX_KEY_LENGTH = 1 << 20
_EVICT_RETRIES = 4


@dataclass
class MasterConfig:
    """Tunables of the master (times in seconds; names follow ``mooncake_master``'s flags)."""

    default_kv_lease_ttl: float = 10.0
    default_kv_soft_pin_ttl: float = 30 * 60.0
    max_kv_soft_pin_ttl: float = 24 * 3600.0
    allow_evict_soft_pinned_objects: bool = True
    eviction_high_watermark_ratio: float = 0.90
    eviction_ratio: float = 0.05
    eviction_policy: str = "lru"
    client_ttl: float = 10.0
    put_start_discard_timeout: float = 30.0
    put_start_release_timeout: float = 600.0
    read_fence_ttl: float = 0.5
    read_fence_s_per_mib: float = 0.01
    pending_task_timeout: float = 300.0
    processing_task_timeout: float = 300.0
    max_finished_tasks: int = 10000
    allocation_strategy: str = "random"
    alignment: int = DEFAULT_ALIGNMENT
    seed: int | None = None
    offload_on_evict: bool = True
    """Demote evicted objects to the SSD tier of the client owning their bytes, if it has one."""
    demote_timeout: float = 30.0
    """A demotion not ended within this many seconds is revoked (the object is dropped)."""
    max_disk_drops: int = 1 << 16
    """Bound of each client's queue of SSD copies to delete (oldest notices dropped beyond)."""
    put_revoke_hold: float = 10.0
    """Space of a revoked write (PutRevoke/UpsertRevoke, PromoteRevoke, TaskRevoke) is reused
    only this many seconds later: the writer's transfer may have been cancelled mid-way, and
    the segment owner's server may still be copying bytes it had already received."""
    quarantine_grace: float = 0.1
    """A quarantined segment's holder lifts it with a heartbeat arriving at least this long
    after the report (an earlier one may have been sent before it died)."""
    quarantine_refute_hold: float = 10.0
    """A reporter whose report a heartbeat refuted is not heard on that segment for this long."""

    def validate(self) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad setting."""
        for name in (
            "default_kv_lease_ttl",
            "default_kv_soft_pin_ttl",
            "max_kv_soft_pin_ttl",
            "client_ttl",
            "put_start_discard_timeout",
            "put_start_release_timeout",
            "read_fence_ttl",
            "read_fence_s_per_mib",
            "demote_timeout",
            "pending_task_timeout",
            "processing_task_timeout",
            "put_revoke_hold",
            "quarantine_grace",
            "quarantine_refute_hold",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.eviction_high_watermark_ratio <= 1.0:
            raise InvalidArgumentError(
                f"eviction_high_watermark_ratio must be in (0, 1], got {self.eviction_high_watermark_ratio}"
            )
        if not 0.0 <= self.eviction_ratio <= 1.0:
            raise InvalidArgumentError(
                f"eviction_ratio must be in [0, 1], got {self.eviction_ratio}"
            )
        if self.allocation_strategy not in ALLOCATION_STRATEGIES:
            raise InvalidArgumentError(
                f"allocation_strategy must be one of {', '.join(ALLOCATION_STRATEGIES)}, "
                f"got {self.allocation_strategy!r}"
            )
        if self.put_start_release_timeout < self.put_start_discard_timeout:
            raise InvalidArgumentError(
                "put_start_release_timeout must be >= put_start_discard_timeout"
            )


@dataclass
class MasterStats:
    """Monotonic counters (exported as Prometheus metrics by the server)."""

    puts_started: int = 0
    puts_ended: int = 0
    puts_revoked: int = 0
    put_failures_no_space: int = 0
    gets: int = 0
    get_misses: int = 0
    removes: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_runs: int = 0
    lease_refusals: int = 0
    zombies_discarded: int = 0
    zombies_released: int = 0
    clients_expired: int = 0
    stall_seconds: float = 0.0
    """Time credited to clients because the master was unresponsive (:meth:`credit_stall`)."""


# -- internal records ------------------------------------------------------------------------


@dataclass(slots=True)
class _Replica:
    seg: _Seg
    addr: int
    length: int

    def descriptor(self, status: ReplicaStatus) -> ReplicaDescriptor:
        return ReplicaDescriptor(
            segment_name=self.seg.segment.name,
            addr=self.addr,
            length=self.length,
            status=status,
            protocol=self.seg.segment.protocol,
        )


@dataclass(slots=True)
class _Version:
    size: int
    replicas: list[_Replica]
    vid: int = 0
    disk: list[str] = field(default_factory=list)
    """Client ids holding an SSD copy of this version."""


@dataclass(slots=True)
class _Demote:
    client_id: str
    deadline: float
    size: int


@dataclass(slots=True)
class _Promote:
    client_id: str
    replicas: list[_Replica]
    started: float


@dataclass(slots=True)
class _Pending:
    client_id: str
    version: _Version
    started: float
    config: ReplicateConfig


@dataclass(slots=True)
class _Object:
    key: str
    readable: _Version | None = None
    pending: _Pending | None = None
    writer: str = ""
    lease_deadline: float = 0.0
    read_deadline: float = 0.0
    hard_pinned: bool = False
    soft_pin_deadline: float | None = None
    demoting: _Demote | None = None
    promoting: _Promote | None = None
    task: _Task | None = None
    group: str = ""


@dataclass(slots=True, eq=False)
class _Task:
    id: str
    type: TaskType
    key: str
    source: _Replica
    targets: list[_Seg]
    executor: str
    created: float
    status: TaskStatus = TaskStatus.PENDING
    started: float = 0.0
    allocated: list[_Replica] = field(default_factory=list)
    message: str = ""

    def info(self) -> ReplicaTask:
        return ReplicaTask(
            id=self.id,
            type=self.type,
            key=self.key,
            source=self.source.seg.segment.name,
            targets=[s.segment.name for s in self.targets],
            status=self.status,
            executor=self.executor,
            message=self.message,
        )


@dataclass(slots=True, eq=False)
class _Seg:
    segment: Segment
    client_id: str
    alloc: OffsetAllocator
    keys: set[str] = field(default_factory=set)
    mounted: bool = True


@dataclass(slots=True)
class _Client:
    deadline: float
    segments: set[str] = field(default_factory=set)
    ssd_capacity: int = 0
    ssd_keys: set[str] = field(default_factory=set)
    demote_tasks: list[DemoteTask] = field(default_factory=list)
    disk_drops: list[DiskDrop] = field(default_factory=list)


_Deferred = tuple[float, list[_Replica]]
# Extents of an expired client's segment that others may still touch: (until, addr, length).
_InUse = list[tuple[float, int, int]]


class MasterState:
    """All master metadata; one method per RPC (see the module docstring for the rules)."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or MasterConfig()
        self.config.validate()
        self.policy = policy if policy is not None else make_policy(self.config.eviction_policy)
        self.rng = rng or random.Random(self.config.seed)
        self.stats = MasterStats()
        self.view_version_id = uuid.uuid4().int & ((1 << 63) - 1)
        self._objects: dict[str, _Object] = {}
        self._segments: dict[str, _Seg] = {}
        self._seg_list: list[_Seg] = []
        self._clients: dict[str, _Client] = {}
        self._deferred: list[_Deferred] = []
        # segment id -> (segment as mounted, extents still in use when its owner expired)
        self._in_use: dict[str, tuple[Segment, _InUse]] = {}
        self._soft_pinned: set[str] = set()
        self._writing: set[str] = set()  # keys that had a pending write (pruned by sweep)
        self._tasks: dict[str, _Task] = {}
        self._groups: dict[str, set[str]] = {}  # group id -> keys of its readable members
        self._active_tasks: dict[str, _Task] = {}
        self._finished_tasks: deque[str] = deque()
        self._used = 0
        self._capacity = 0
        self._next_vid = 0
        self._demoting_bytes = 0
        self.misses = MissLedger()
        """How lost keys were lost; classifies every GetReplicaList miss."""
        self.tiers = {"dram": TierCounters(), "ssd": TierCounters()}
        """Per-tier counters as the master sees them (SSD reads themselves are counted by the
        owning client)."""
        self.quarantine = Quarantine(
            self.config.quarantine_grace, self.config.quarantine_refute_hold
        )
        """Segments reported unreachable (:mod:`mooncake._core.quarantine`)."""

    # -- introspection ---------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes allocated over all mounted segments (readable, pending and deferred extents)."""
        return self._used

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all mounted segments."""
        return self._capacity

    def segment_tiers(self) -> dict[str, dict[str, int]]:
        """Mounted segments by memory tier: ``gpu`` for ``cuda:N`` segments, ``dram`` for host
        ones; for each, ``segments``, ``capacity`` and ``used`` bytes."""
        out = {t: {"segments": 0, "capacity": 0, "used": 0} for t in ("dram", "gpu")}
        for seg in self._segments.values():
            t = out["gpu" if seg.segment.location.startswith("cuda:") else "dram"]
            t["segments"] += 1
            t["capacity"] += seg.alloc.capacity
            t["used"] += seg.alloc.used
        return out

    @property
    def object_count(self) -> int:
        """Objects with a readable version."""
        return len(self.policy)  # the policy tracks exactly the readable objects

    @property
    def client_count(self) -> int:
        return len(self._clients)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def has_client(self, client_id: str) -> bool:
        return client_id in self._clients

    # -- liveness and segments -------------------------------------------------------------

    def ping(self, client_id: str, now: float) -> PingResponse:
        """Keep ``client_id`` alive; ``NEED_REMOUNT`` if the master did not know it."""
        _check_client_id(client_id)
        client = self._clients.get(client_id)
        if client is None:
            self._clients[client_id] = _Client(now + self.config.client_ttl)
            return PingResponse(
                view_version_id=self.view_version_id, client_status=ClientStatus.NEED_REMOUNT
            )
        client.deadline = now + self.config.client_ttl
        if self.quarantine:
            self._holder_alive(client, now)
        return PingResponse(view_version_id=self.view_version_id, client_status=ClientStatus.OK)

    def _holder_alive(self, client: _Client, now: float) -> None:
        """``client`` was heard from: lift the quarantine of its segments (see
        :class:`~mooncake._core.quarantine.Quarantine` for the grace)."""
        names = {seg.segment.name for sid in client.segments if (seg := self._segments.get(sid))}
        self.quarantine.alive(names, now)

    def report_segment_failure(
        self, client_id: str, segment_name: str, reason: str, now: float
    ) -> bool:
        """``client_id`` failed a transfer to ``segment_name``: quarantine it (no new
        allocations there; reads are not given its replicas) until its holder's next heartbeat
        or the holder's expiry. Whether it is quarantined now (False: this reporter was refuted
        on that segment within ``quarantine_refute_hold``).

        ``CLIENT_NOT_FOUND`` from a client the master does not know, ``SEGMENT_NOT_FOUND`` for
        a name no mounted segment has, ``INVALID_PARAMS`` for a client's own segment."""
        _check_client_id(client_id)
        if client_id not in self._clients:
            raise ClientNotFoundError(f"client {client_id} is not known to this master")
        owners = {s.client_id for s in self._seg_list if s.segment.name == segment_name}
        if not owners:
            raise SegmentNotFoundError(f"no mounted segment is named {segment_name!r}")
        if client_id in owners:
            raise InvalidArgumentError(f"client {client_id} cannot report its own segment")
        return self.quarantine.report(client_id, segment_name, now, reason)

    def _touch_client(self, client_id: str, now: float) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(now + self.config.client_ttl)
        else:
            client.deadline = now + self.config.client_ttl
        return client

    def _renew_known(self, client_id: str, now: float) -> _Client | None:
        """Renew ``client_id`` if the master knows it; None (and no record made) if not, so
        that its next ``Ping`` still answers ``NEED_REMOUNT``."""
        client = self._clients.get(client_id)
        if client is not None:
            client.deadline = now + self.config.client_ttl
        return client

    def mount_segment(self, client_id: str, segment: Segment, now: float) -> None:
        """Mount ``segment`` for ``client_id`` (idempotent for the same client and range)."""
        _check_client_id(client_id)
        if not segment.id or not segment.name:
            raise InvalidArgumentError("segment id and name must be non-empty")
        if segment.base < 0 or segment.size <= 0:
            raise InvalidArgumentError(
                f"segment {segment.name!r} range must have base >= 0 and size > 0, "
                f"got base={segment.base} size={segment.size}"
            )
        existing = self._segments.get(segment.id)
        if existing is not None:
            if existing.client_id != client_id or existing.segment != segment:
                raise SegmentAlreadyExistsError(
                    f"segment id {segment.id} is already mounted by client {existing.client_id}"
                )
            self._touch_client(client_id, now)
            return
        for other in self._seg_list:
            o = other.segment
            if (
                o.name == segment.name
                and segment.base < o.base + o.size
                and o.base < segment.base + segment.size
            ):
                raise SegmentAlreadyExistsError(
                    f"segment {segment.name!r} range {segment.base:#x}+{segment.size} overlaps "
                    f"mounted segment {o.id} ({o.base:#x}+{o.size})"
                )
        client = self._touch_client(client_id, now)
        seg = _Seg(
            segment,
            client_id,
            OffsetAllocator(segment.base, segment.size, alignment=self.config.alignment),
        )
        self._segments[segment.id] = seg
        self._seg_list.append(seg)
        client.segments.add(segment.id)
        self._capacity += segment.size
        self._hold_in_use(seg, now)

    def _remember_in_use(self, seg: _Seg, now: float) -> None:
        """Before an expired client's segment is dropped: note the extents that other clients
        may still write (pending writes, replica tasks, promotions) or read (open read
        windows), and until when, so that a re-mount of the same segment does not hand them
        out while they do (:meth:`_hold_in_use`)."""
        held: _InUse = []
        cfg = self.config

        def note(until: float, reps: list[_Replica]) -> None:
            if until > now:
                held.extend((until, r.addr, r.length) for r in reps if r.seg is seg)

        for key in seg.keys:
            obj = self._objects.get(key)
            if obj is None:
                continue
            if obj.pending is not None:
                note(
                    obj.pending.started + cfg.put_start_release_timeout,
                    obj.pending.version.replicas,
                )
            if obj.readable is not None:
                note(obj.read_deadline, obj.readable.replicas)
            if obj.promoting is not None:
                note(obj.promoting.started + cfg.put_start_release_timeout, obj.promoting.replicas)
        for task in self._active_tasks.values():
            note(task.started + cfg.processing_task_timeout, task.allocated)
        for until, reps in self._deferred:
            note(until, reps)
        if held:
            self._in_use[seg.segment.id] = (seg.segment, held)

    def _hold_in_use(self, seg: _Seg, now: float) -> None:
        """A re-mounted segment: keep what was in use when its owner expired allocated (as
        deferred frees) until then."""
        entry = self._in_use.pop(seg.segment.id, None)
        if entry is None or entry[0] != seg.segment:
            return
        for until, addr, length in entry[1]:
            if until > now and seg.alloc.reserve(addr, length):
                self._used += seg.alloc.extent(addr)
                self._deferred.append((until, [_Replica(seg, addr, length)]))

    def remount_segments(self, client_id: str, segments: Iterable[Segment], now: float) -> None:
        """Mount each of ``segments`` not mounted yet (after ``NEED_REMOUNT``)."""
        _check_client_id(client_id)
        client = self._touch_client(client_id, now)
        for seg in segments:
            self.mount_segment(client_id, seg, now)
        if self.quarantine:
            self._holder_alive(client, now)

    def unmount_segment(self, client_id: str, segment_id: str, now: float) -> None:
        """Unmount a segment of ``client_id``: its replicas vanish at once."""
        seg = self._segments.get(segment_id)
        if seg is None:
            raise SegmentNotFoundError(f"segment id {segment_id!r} is not mounted")
        if seg.client_id != client_id:
            raise IllegalClientError(
                f"segment {segment_id} belongs to client {seg.client_id}, not {client_id}"
            )
        self._touch_client(client_id, now)
        self._drop_segment(seg)

    def _drop_segment(self, seg: _Seg, *, owner_died: bool = False) -> None:
        for task in list(self._active_tasks.values()):
            if task.source.seg is seg or seg in task.targets:
                self._fail_task(task, f"segment {seg.segment.name!r} was unmounted")
        seg.mounted = False
        del self._segments[seg.segment.id]
        self._seg_list.remove(seg)
        client = self._clients.get(seg.client_id)
        if client is not None:
            client.segments.discard(seg.segment.id)
        self._capacity -= seg.segment.size
        self._used -= seg.alloc.used
        name = seg.segment.name
        if name in self.quarantine and not any(s.segment.name == name for s in self._seg_list):
            self.quarantine.end(name)
        for key in list(seg.keys):
            obj = self._objects.get(key)
            if obj is None:
                continue
            for ver in (obj.readable, obj.pending.version if obj.pending else None):
                if ver is not None:
                    ver.replicas = [r for r in ver.replicas if r.seg is not seg]
            ver = obj.readable
            if obj.demoting is not None and obj.demoting.client_id == seg.client_id:
                self._clear_demoting(obj)  # its source extent went with the segment
                if ver is not None and ver.replicas and obj.promoting is None:
                    self.policy.on_insert(key, ver.size)  # back under the DRAM policy
            if ver is not None and not ver.replicas:
                self._untrack(obj)
                if not ver.disk:  # else it is still on an SSD
                    obj.readable = None
                    self._end_tier_moves(obj)
                    if owner_died:
                        self.misses.record_owner_death([key], owner=seg.client_id)
                    else:
                        self.misses.record_removal(
                            key, detail=f"segment {seg.segment.id} unmounted"
                        )
            if obj.pending is not None and not obj.pending.version.replicas:
                obj.pending = None
            if obj.readable is None and obj.pending is None:
                del self._objects[key]
        seg.keys.clear()
        # deferred extents on this segment went with it (their bytes were counted in alloc.used)
        self._deferred = [
            (t, kept)
            for t, reps in self._deferred
            if (kept := [r for r in reps if r.seg is not seg])
        ]

    def credit_stall(self, seconds: float) -> None:
        """The master itself could not serve requests for ``seconds`` (its loop was busy or
        the process was stopped): that time does not count toward any client's silence, so
        every client deadline moves by it. A client is expired only after ``client_ttl`` of
        time during which the master was responsive and heard nothing from it."""
        if seconds > 0:
            for client in self._clients.values():
                client.deadline += seconds
            self.stats.stall_seconds += seconds

    def expire_clients(self, now: float) -> list[str]:
        """Drop clients whose deadline passed (their segments and replicas); returns their ids."""
        dead = [cid for cid, c in self._clients.items() if c.deadline < now]
        for cid in dead:
            client = self._clients.pop(cid)
            for sid in list(client.segments):
                seg = self._segments.get(sid)
                if seg is not None:
                    self._remember_in_use(seg, now)
                    self._drop_segment(seg, owner_died=True)
            lost = []
            for key in client.ssd_keys:
                obj = self._objects.get(key)
                if obj is None or obj.readable is None or cid not in obj.readable.disk:
                    continue
                obj.readable.disk.remove(cid)
                if not obj.readable.replicas and not obj.readable.disk:
                    self._drop_object(obj, now)
                    lost.append(key)
            self.misses.record_owner_death(lost, owner=cid, now=now)
        self.stats.clients_expired += len(dead)
        return dead

    # -- writes ----------------------------------------------------------------------------

    def put_start(
        self, client_id: str, key: str, size: int, config: ReplicateConfig, now: float
    ) -> list[ReplicaDescriptor]:
        """Allocate replicas for a new object; it becomes readable at :meth:`put_end`.

        ``OBJECT_ALREADY_EXISTS`` if ``key`` is readable or being written (unless that write
        is a zombie older than ``put_start_discard_timeout``, which is pre-empted).
        ``NO_AVAILABLE_HANDLE`` if not even one replica fits after eviction.
        """
        _check_client_id(client_id)
        _check_key(key)
        self._check_put(size, config)
        obj = self._objects.get(key)
        if obj is not None:
            if obj.readable is not None:
                raise ObjectAlreadyExistsError(f"object {key!r} already exists")
            self._preempt_pending(obj, now)
        return self._start_write(client_id, key, size, config, now, obj)

    def upsert_start(
        self, client_id: str, key: str, size: int, config: ReplicateConfig, now: float
    ) -> list[ReplicaDescriptor]:
        """Like :meth:`put_start`, but a readable ``key`` gets a new version at :meth:`put_end`.

        ``REPLICA_IS_NOT_READY`` while another (non-zombie) write of ``key`` is in progress,
        ``OBJECT_HAS_REPLICATION_TASK`` while a copy/move of it is.
        """
        _check_client_id(client_id)
        _check_key(key)
        self._check_put(size, config)
        obj = self._objects.get(key)
        if obj is not None:
            if obj.task is not None:
                raise ObjectHasReplicationTaskError(
                    f"object {key!r} has task {obj.task.id} in flight"
                )
            self._preempt_pending(obj, now, upsert=True)
        return self._start_write(client_id, key, size, config, now, obj)

    def _check_put(self, size: int, config: ReplicateConfig) -> None:
        if size <= 0:
            raise InvalidArgumentError(f"object size must be positive, got {size}")
        if config.replica_num < 1:
            raise InvalidArgumentError(f"replica_num must be >= 1, got {config.replica_num}")
        if config.group_ids is not None and len(config.group_ids) != 1:
            raise InvalidArgumentError(
                f"a put of one key takes one group id, got {len(config.group_ids)}"
            )
        if config.soft_pin_ttl_ms is not None:
            if config.soft_pin_action != SoftPinAction.ENABLE:
                raise InvalidArgumentError(
                    "soft_pin_ttl_ms is only valid with soft_pin_action=ENABLE"
                )
            if config.soft_pin_ttl_ms < 0:
                raise InvalidArgumentError(
                    f"soft_pin_ttl_ms must be >= 0, got {config.soft_pin_ttl_ms}"
                )

    def _preempt_pending(self, obj: _Object, now: float, *, upsert: bool = False) -> None:
        pending = obj.pending
        if pending is None:
            return
        if now - pending.started < self.config.put_start_discard_timeout:
            if upsert:  # not "exists": the upsert did not happen, the caller must not assume it did
                raise ReplicaNotReadyError(f"object {obj.key!r} is being written; retry later")
            raise ObjectAlreadyExistsError(f"object {obj.key!r} is being written")
        # zombie: the writer may still be writing, so its space waits for the release timeout
        obj.pending = None
        self._unlink(obj.key, pending.version)
        self._deferred.append(
            (pending.started + self.config.put_start_release_timeout, pending.version.replicas)
        )
        self.stats.zombies_discarded += 1

    def _start_write(
        self,
        client_id: str,
        key: str,
        size: int,
        config: ReplicateConfig,
        now: float,
        obj: _Object | None,
    ) -> list[ReplicaDescriptor]:
        # Objects are not striped: one larger than every segment can never fit, and evicting
        # for it would only empty the cache.
        if not any(seg.alloc.size >= size for seg in self._seg_list):
            self.stats.put_failures_no_space += 1
            raise NoAvailableHandleError(
                f"object {key!r} of {size} bytes is larger than every mounted segment "
                f"({len(self._seg_list)} segments)"
            )
        if (
            self._used - self._demoting_bytes + size
            > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now, need=size)
        replicas = self._allocate(size, config)
        # Eviction frees bytes anywhere, but the object needs one contiguous extent: retry with
        # growing targets while eviction makes progress.
        need = max(size, int(self.config.eviction_ratio * self._capacity))
        for _ in range(_EVICT_RETRIES):
            if replicas or not self.evict(now, need=need):
                break
            replicas = self._allocate(size, config)
            need *= 2
        if not replicas:
            self.stats.put_failures_no_space += 1
            raise NoAvailableHandleError(
                f"no mounted segment has {size} free bytes for {key!r} "
                f"({len(self._seg_list)} segments, {self._used}/{self._capacity} bytes used, "
                f"{self._demoting_bytes} being demoted to SSD)"
            )
        if obj is not None and self._objects.get(key) is not obj:
            obj = None  # the eviction above dropped the very object being upserted
        if obj is None:
            obj = self._objects[key] = _Object(key)
        self._next_vid += 1
        version = _Version(size, replicas, self._next_vid)
        obj.pending = _Pending(client_id, version, now, config)
        self._writing.add(key)
        for r in replicas:
            r.seg.keys.add(key)
        self.stats.puts_started += 1
        return [r.descriptor(ReplicaStatus.PROCESSING) for r in replicas]

    def _allocate(self, size: int, config: ReplicateConfig) -> list[_Replica]:
        want = config.replica_num
        out: list[_Replica] = []
        used_segs: set[int] = set()
        quarantined = self.quarantine
        for seg in self._candidates(config):
            if id(seg) in used_segs or (quarantined and seg.segment.name in quarantined):
                continue
            addr = seg.alloc.allocate(size)
            if addr is None:
                continue
            used_segs.add(id(seg))
            self._used += seg.alloc.extent(addr)
            out.append(_Replica(seg, addr, size))
            if len(out) == want:
                break
        return out

    def _candidates(self, config: ReplicateConfig) -> Iterable[_Seg]:
        preferred = config.preferred()
        if preferred:
            for name in preferred:
                for seg in self._seg_list:
                    if seg.segment.name == name:
                        yield seg
        segs = self._seg_list
        n = len(segs)
        if n == 0:
            return
        if self.config.allocation_strategy == "free_ratio_first":
            yield from sorted(segs, key=lambda s: s.alloc.used / s.alloc.capacity)
            return
        start = self.rng.randrange(n)
        for i in range(n):
            yield segs[(start + i) % n]

    def put_end(self, client_id: str, key: str, now: float) -> None:
        """Make the pending write of ``key`` readable (replaces an older version, if any)."""
        obj, pending = self._pending_of(client_id, key)
        old = obj.readable
        if old is not None:
            self._unlink(key, old)
            self._release_after_lease(obj, old, now)
            self._untrack(obj)
            self._end_tier_moves(obj)
            self._forget_disk(key, old)
        obj.readable = pending.version
        obj.pending = None
        obj.writer = client_id
        cfg = pending.config
        self._set_group(obj, cfg.group_ids[0] if cfg.group_ids else "")
        obj.hard_pinned = cfg.with_hard_pin
        kept = obj.soft_pin_deadline if old is not None else None
        obj.soft_pin_deadline = None
        if not cfg.soft_pinned() and cfg.soft_pin_action == SoftPinAction.PRESERVE:
            # an upsert keeps the soft pin its key had (Mooncake's PRESERVE)
            if kept is not None and kept > now:
                obj.soft_pin_deadline = kept
        elif cfg.soft_pinned():
            ttl = (
                cfg.soft_pin_ttl_ms / 1000.0
                if cfg.soft_pin_ttl_ms is not None
                else self.config.default_kv_soft_pin_ttl
            )
            ttl = min(ttl, self.config.max_kv_soft_pin_ttl)
            if ttl > 0:
                obj.soft_pin_deadline = now + ttl
        self.policy.on_insert(key, pending.version.size, now=now)
        if obj.hard_pinned:
            self.policy.set_pin(key, Pin.HARD)
        elif obj.soft_pin_deadline is not None:
            self.policy.set_pin(key, Pin.SOFT)
            self._soft_pinned.add(key)
        self.misses.record_stored(key)
        self.stats.puts_ended += 1

    upsert_end = put_end

    def put_revoke(self, client_id: str, key: str, now: float) -> None:
        """Abandon the pending write of ``key``; its space is freed after ``put_revoke_hold``
        (an older version stays)."""
        obj, pending = self._pending_of(client_id, key)
        obj.pending = None
        self._unlink(key, pending.version)
        self._hold_written(pending.version.replicas, now)
        if obj.readable is None:
            del self._objects[key]
        self.stats.puts_revoked += 1

    upsert_revoke = put_revoke

    def _pending_of(self, client_id: str, key: str) -> tuple[_Object, _Pending]:
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        pending = obj.pending
        if pending is None:
            raise InvalidWriteError(f"object {key!r} has no write in progress")
        if pending.client_id != client_id:
            raise IllegalClientError(
                f"object {key!r} is being written by client {pending.client_id}, not {client_id}"
            )
        return obj, pending

    def batch_put_start(
        self,
        client_id: str,
        keys: list[str],
        sizes: list[int],
        config: ReplicateConfig,
        now: float,
        *,
        upsert: bool = False,
    ) -> list[Item[list[ReplicaDescriptor]]]:
        """PutStart (or UpsertStart) per key; per-key codes, never one failure for all."""
        if len(keys) != len(sizes):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
        groups = config.group_ids
        if groups is not None and len(groups) != len(keys):
            raise InvalidArgumentError(f"{len(groups)} group_ids for {len(keys)} keys")
        start = self.upsert_start if upsert else self.put_start
        out: list[Item[list[ReplicaDescriptor]]] = []
        for n, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            cfg = (
                config if groups is None else msgspec.structs.replace(config, group_ids=[groups[n]])
            )
            try:
                out.append(Item(code=0, value=start(client_id, key, size, cfg, now)))
            except MooncakeError as e:
                out.append(Item(code=int(e.code)))
        return out

    def batch_put_end(self, client_id: str, keys: list[str], now: float) -> list[int]:
        return _codes(lambda k: self.put_end(client_id, k, now), keys)

    def batch_put_revoke(self, client_id: str, keys: list[str], now: float) -> list[int]:
        return _codes(lambda k: self.put_revoke(client_id, k, now), keys)

    # -- reads -----------------------------------------------------------------------------

    def get_replica_list(
        self, key: str, now: float, *, for_read: bool = True
    ) -> GetReplicaListResponse:
        """Replicas of the readable version of ``key``; extends its lease.

        ``for_read`` also opens a *read window* of ``read_fence_ttl`` plus ``read_fence_s_per_mib``
        per MiB of the object (at most the lease; i.e. reads slower than ~100 MB/s fail): until it
        closes, the space of this version is not reused even if the object is force-removed or
        replaced, and the client fails any read that finishes after it (``read_ttl_ms``). A
        descriptor-only query (``for_read=False``) opens none.
        """
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            # A key whose only version is still being written has no complete version to
            # read: not found (as ExistKey says), not "not ready" -- the write is ordered after
            # this read.
            self.stats.get_misses += 1
            self.tiers["dram"].misses += 1
            raise ObjectNotFoundError(
                f"object {key!r} not found {format_miss(self.misses.classify(key))}"
            )
        ver = obj.readable
        replicas = ver.replicas
        if self.quarantine and replicas:
            replicas = [r for r in replicas if r.seg.segment.name not in self.quarantine]
            if not replicas and not ver.disk:
                self.stats.get_misses += 1
                self.tiers["dram"].misses += 1
                names = sorted({r.seg.segment.name for r in ver.replicas})
                raise ReplicaNotFoundError(
                    f"object {key!r} has no reachable replica: its holder(s) {', '.join(names)} "
                    "failed a transfer and have not been heard from since"
                )
        ttl = self.config.default_kv_lease_ttl
        self._extend_lease(obj, now + ttl)
        read_ttl = min(
            ttl,
            self.config.read_fence_ttl + self.config.read_fence_s_per_mib * ver.size / (1 << 20),
        )
        if for_read:
            obj.read_deadline = max(obj.read_deadline, now + read_ttl)
        if key in self.policy:
            self.policy.on_access(key, now)
        self.stats.gets += 1
        if replicas:
            self.tiers["dram"].hits += 1
        else:
            self.tiers["dram"].misses += 1
            self.tiers["ssd"].hits += 1
        return GetReplicaListResponse(
            replicas=[r.descriptor(ReplicaStatus.COMPLETE) for r in replicas],
            lease_ttl_ms=int(ttl * 1000),
            size=ver.size,
            read_ttl_ms=int(read_ttl * 1000),
            vid=ver.vid,
            disk_clients=list(ver.disk),
        )

    def batch_get_replica_list(
        self, keys: list[str], now: float, *, for_read: bool = True
    ) -> list[Item[GetReplicaListResponse]]:
        out: list[Item[GetReplicaListResponse]] = []
        for key in keys:
            try:
                out.append(Item(code=0, value=self.get_replica_list(key, now, for_read=for_read)))
            except MooncakeError as e:
                out.append(Item(code=int(e.code)))
        return out

    def get_replica_list_by_regex(
        self, regex: str, now: float
    ) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of every readable key matching ``regex`` (``re.search``); leases them.

        Runs the pattern over every key in the caller's thread: the server does not call this
        (it matches in a worker thread within a time budget, :mod:`mooncake._store.keyscan`,
        then calls :meth:`replica_lists_of`).
        """
        pattern = _compile(regex)
        return self.replica_lists_of([k for k in self.readable_keys() if pattern.search(k)], now)

    def readable_keys(self) -> list[str]:
        """A snapshot of the keys with a readable version (for matching outside the state)."""
        return [key for key, obj in self._objects.items() if obj.readable is not None]

    def replica_lists_of(
        self, keys: Iterable[str], now: float
    ) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of those of ``keys`` still readable (leasing them, as ``GetReplicaList``)."""
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key in keys:
            obj = self._objects.get(key)
            if obj is not None and obj.readable is not None:
                out[key] = self.get_replica_list(key, now).replicas
        return out

    def exist_key(self, key: str, now: float) -> bool:
        """Whether ``key`` is readable; a true answer extends its lease (as Mooncake does)."""
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            return False
        self._extend_lease(obj, now + self.config.default_kv_lease_ttl)
        return True

    def _extend_lease(self, obj: _Object, deadline: float) -> None:
        """Lease ``obj`` until ``deadline`` -- and every current member of its group."""
        obj.lease_deadline = max(obj.lease_deadline, deadline)
        if not obj.group:
            return
        members = self._groups.get(obj.group, set())
        for key in list(members):
            other = self._objects.get(key)
            if other is None or other.group != obj.group or other.readable is None:
                members.discard(key)
                continue
            other.lease_deadline = max(other.lease_deadline, deadline)

    def _set_group(self, obj: _Object, group: str) -> None:
        if obj.group and obj.group != group:
            self._groups.get(obj.group, set()).discard(obj.key)
        obj.group = group
        if group:
            self._groups.setdefault(group, set()).add(obj.key)

    def batch_exist_key(self, keys: list[str], now: float) -> list[int]:
        return [1 if self.exist_key(k, now) else 0 for k in keys]

    # -- removal ---------------------------------------------------------------------------

    def remove(self, key: str, force: bool, now: float) -> None:
        """Remove the readable version of ``key``.

        ``OBJECT_HAS_LEASE`` while leased unless ``force`` (then its space waits for the lease
        to end). A write of ``key`` still in progress is ordered after the removal: it is not
        touched and becomes readable at its End; a key with nothing readable (only such a
        write) is ``OBJECT_NOT_FOUND``.
        """
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.task is not None:
            raise ObjectHasReplicationTaskError(f"object {key!r} has task {obj.task.id} in flight")
        if obj.lease_deadline > now and not force:
            self.stats.lease_refusals += 1
            raise ObjectHasLeaseError(
                f"object {key!r} is leased for another {obj.lease_deadline - now:.3f} s"
            )
        self._drop_object(obj, now)
        self.misses.record_removal(key, now=now)
        self.stats.removes += 1

    def batch_remove(self, keys: list[str], force: bool, now: float) -> list[int]:
        return _codes(lambda k: self.remove(k, force, now), keys)

    def remove_by_regex(self, regex: str, force: bool, now: float) -> int:
        """Remove every removable readable key matching ``regex``; returns how many."""
        pattern = _compile(regex)
        return self.remove_keys([k for k in self.readable_keys() if pattern.search(k)], force, now)

    def remove_keys(self, keys: Iterable[str], force: bool, now: float) -> int:
        """``RemoveAll``'s rules applied to ``keys`` only (each re-checked now); how many went."""
        objs = (self._objects.get(k) for k in dict.fromkeys(keys))
        return self._remove_objects([o for o in objs if o is not None], force, now)

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every removable readable object; returns how many (leased ones stay unless ``force``)."""
        return self._remove_matching(lambda k: True, force, now)

    def _remove_matching(self, match: Callable[[str], bool], force: bool, now: float) -> int:
        return self._remove_objects(
            [obj for key, obj in self._objects.items() if match(key)], force, now
        )

    def _remove_objects(self, objs: list[_Object], force: bool, now: float) -> int:
        n = 0
        for obj in objs:
            key = obj.key
            if obj.readable is None or obj.task:
                continue
            if obj.lease_deadline > now and not force:
                self.stats.lease_refusals += 1
                continue
            self._drop_object(obj, now)
            self.misses.record_removal(key, now=now)
            n += 1
        self.stats.removes += n
        return n

    def _drop_object(self, obj: _Object, now: float) -> None:
        """Drop the readable version of ``obj``; the object goes with it unless a write of it
        is in progress (that write stays, and becomes the readable version at its End)."""
        ver = obj.readable
        if obj.pending is None:
            del self._objects[obj.key]
        if obj.group:
            members = self._groups.get(obj.group)
            if members is not None:
                members.discard(obj.key)
                if not members:
                    del self._groups[obj.group]
        if ver is not None:
            self._unlink(obj.key, ver)
            self._release_after_lease(obj, ver, now)
            self._untrack(obj)
            self._end_tier_moves(obj)
            self._forget_disk(obj.key, ver)
            obj.readable = None
        if obj.pending is not None:  # the record stays for the write: nothing of the old one
            obj.group = ""
            obj.lease_deadline = 0.0
            obj.hard_pinned = False
            obj.soft_pin_deadline = None

    def batch_replica_clear(
        self, client_id: str, keys: list[str], segment_name: str, now: float
    ) -> list[str]:
        """Clear the replicas of ``client_id``'s objects among ``keys`` whose lease has ended.

        With ``segment_name`` empty every cleared object is removed; otherwise only its
        replicas on that segment are dropped (the object goes when none is left). Objects
        written by another client, leased, being written, or with a task in flight are left
        alone. Returns the keys cleared, in order.
        """
        out: list[str] = []
        for key in dict.fromkeys(keys):
            obj = self._objects.get(key)
            if (
                obj is None
                or obj.readable is None
                or obj.pending is not None
                or obj.task is not None
                or obj.writer != client_id
                or obj.lease_deadline > now
            ):
                continue
            ver = obj.readable
            if segment_name:
                gone = [r for r in ver.replicas if r.seg.segment.name == segment_name]
                if not gone:
                    continue
                if len(gone) < len(ver.replicas):
                    ver.replicas = [r for r in ver.replicas if r not in gone]
                    for r in gone:
                        if not any(o.seg is r.seg for o in ver.replicas):
                            r.seg.keys.discard(key)
                    if obj.read_deadline > now:
                        self._deferred.append((obj.read_deadline, gone))
                    else:
                        self._free_replicas(gone)
                    out.append(key)
                    continue
            self._drop_object(obj, now)
            self.misses.record_removal(key, now=now)
            self.stats.removes += 1
            out.append(key)
        return out

    # -- replica tasks (copy / move) -----------------------------------------------------

    def create_copy_task(self, key: str, targets: list[str], now: float) -> str:
        """Queue a copy of ``key`` onto each of ``targets`` (segment names without a replica of
        it); executed by the client owning the first replica's segment. Returns the task id."""
        obj = self._task_object(key)
        assert obj.readable is not None
        if not targets:
            raise InvalidArgumentError("a copy task needs at least one target segment")
        source = obj.readable.replicas[0]
        return self._new_task(obj, TaskType.REPLICA_COPY, source, targets, now)

    def create_move_task(self, key: str, source: str, target: str, now: float) -> str:
        """Queue a move of ``key``'s replica on segment ``source`` to segment ``target``."""
        obj = self._task_object(key)
        assert obj.readable is not None
        src = next((r for r in obj.readable.replicas if r.seg.segment.name == source), None)
        if src is None:
            raise ReplicaNotFoundError(f"object {key!r} has no replica on segment {source!r}")
        return self._new_task(obj, TaskType.REPLICA_MOVE, src, [target], now)

    def _task_object(self, key: str) -> _Object:
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.pending is not None:
            raise ReplicaNotReadyError(f"object {key!r} has a write in progress")
        if obj.task is not None:
            raise ObjectHasReplicationTaskError(f"object {key!r} has task {obj.task.id} in flight")
        return obj

    def _new_task(
        self, obj: _Object, ttype: TaskType, source: _Replica, targets: list[str], now: float
    ) -> str:
        assert obj.readable is not None
        held = {id(r.seg) for r in obj.readable.replicas}
        held_names = {r.seg.segment.name for r in obj.readable.replicas}
        segs: list[_Seg] = []
        for name in targets:
            seg = next(
                (
                    s
                    for s in self._seg_list
                    if s.segment.name == name and id(s) not in held and s not in segs
                ),
                None,
            )
            if seg is None:
                if ttype is TaskType.REPLICA_COPY and name in held_names:
                    continue  # a copy onto a segment that holds one already: nothing to do there
                raise SegmentNotFoundError(
                    f"no mounted segment {name!r} without a replica of {obj.key!r}"
                )
            segs.append(seg)
        task = _Task(uuid.uuid4().hex, ttype, obj.key, source, segs, source.seg.client_id, now)
        self._tasks[task.id] = task
        if not segs:  # every target holds a replica already: done, as Mooncake answers it
            self._finish_task(task, TaskStatus.SUCCESS, "every target already holds a replica")
            return task.id
        self._active_tasks[task.id] = task
        obj.task = task
        return task.id

    def query_task(self, task_id: str) -> ReplicaTask:
        task = self._tasks.get(task_id)
        if task is None:
            raise InvalidArgumentError(f"no task {task_id!r}")
        return task.info()

    def fetch_tasks(self, client_id: str, now: float) -> list[ReplicaTask]:
        """Pending tasks this client executes; they become PROCESSING."""
        out = []
        for task in self._active_tasks.values():
            if task.executor == client_id and task.status is TaskStatus.PENDING:
                task.status = TaskStatus.PROCESSING
                task.started = now
                out.append(task.info())
        return out

    def task_start(self, client_id: str, task_id: str, now: float) -> TaskStartResponse:
        """Allocate the task's targets; the executor then writes ``source`` into each."""
        task = self._active_task(client_id, task_id)
        if task.allocated:
            raise InvalidWriteError(f"task {task_id} already started")
        size = task.source.length
        for seg in task.targets:
            addr = seg.alloc.allocate(size)
            if addr is None:
                self._fail_task(task, f"no space for {size} bytes on {seg.segment.name!r}")
                raise NoAvailableHandleError(task.message)
            self._used += seg.alloc.extent(addr)
            task.allocated.append(_Replica(seg, addr, size))
        if task.status is TaskStatus.PENDING:
            task.started = now
        task.status = TaskStatus.PROCESSING
        return TaskStartResponse(
            size=size,
            source=task.source.descriptor(ReplicaStatus.COMPLETE),
            targets=[r.descriptor(ReplicaStatus.PROCESSING) for r in task.allocated],
        )

    def task_end(self, client_id: str, task_id: str, now: float) -> None:
        """The targets hold the bytes: they become replicas (a move also drops its source)."""
        task = self._active_task(client_id, task_id)
        if not task.allocated:
            raise InvalidWriteError(f"task {task_id} was not started")
        obj = self._objects[task.key]
        assert obj.readable is not None and obj.task is task
        for r in task.allocated:
            obj.readable.replicas.append(r)
            r.seg.keys.add(task.key)
        task.allocated = []
        if task.type is TaskType.REPLICA_MOVE:
            src = task.source
            obj.readable.replicas.remove(src)
            if not any(r.seg is src.seg for r in obj.readable.replicas):
                src.seg.keys.discard(task.key)
            if obj.read_deadline > now:  # a reader may be copying from it
                self._deferred.append((obj.read_deadline, [src]))
            else:
                self._free_replicas([src])
        self._finish_task(task, TaskStatus.SUCCESS, "")

    def task_revoke(self, client_id: str, task_id: str, message: str, now: float) -> None:
        """The executor gave up: targets are freed, the task FAILED."""
        task = self._active_task(client_id, task_id)
        self._hold_written(task.allocated, now)
        task.allocated = []
        self._fail_task(task, message or "revoked by the executor")

    def _active_task(self, client_id: str, task_id: str) -> _Task:
        task = self._active_tasks.get(task_id)
        if task is None:
            if task_id in self._tasks:
                raise InvalidWriteError(f"task {task_id} is {self._tasks[task_id].status.name}")
            raise InvalidArgumentError(f"no task {task_id!r}")
        if task.executor != client_id:
            raise IllegalClientError(f"task {task_id} is executed by {task.executor}")
        return task

    def _fail_task(self, task: _Task, message: str) -> None:
        self._free_replicas(task.allocated)
        task.allocated = []
        self._finish_task(task, TaskStatus.FAILED, message)

    def _finish_task(self, task: _Task, status: TaskStatus, message: str) -> None:
        task.status = status
        task.message = message
        self._active_tasks.pop(task.id, None)
        obj = self._objects.get(task.key)
        if obj is not None and obj.task is task:
            obj.task = None
        self._finished_tasks.append(task.id)
        while len(self._finished_tasks) > self.config.max_finished_tasks:
            self._tasks.pop(self._finished_tasks.popleft(), None)

    def _expire_tasks(self, now: float) -> None:
        for task in list(self._active_tasks.values()):
            if task.status is TaskStatus.PENDING:
                if now - task.created >= self.config.pending_task_timeout:
                    self._fail_task(task, "not fetched by its executor in time")
            elif now - task.started >= self.config.processing_task_timeout:
                self._fail_task(task, "not finished by its executor in time")

    # -- admin -----------------------------------------------------------------------------

    def query_key(self, key: str) -> ObjectInfo:
        """Everything the master knows about ``key`` (no lease granted)."""
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.readable is not None:
            ver, status, complete = obj.readable, ReplicaStatus.COMPLETE, True
        else:
            assert obj.pending is not None
            ver, status, complete = obj.pending.version, ReplicaStatus.PROCESSING, False
        return ObjectInfo(
            key=key,
            size=ver.size,
            complete=complete,
            replicas=[r.descriptor(status) for r in ver.replicas],
            client_id=obj.writer or (obj.pending.client_id if obj.pending else ""),
            lease_deadline=obj.lease_deadline,
            hard_pinned=obj.hard_pinned,
            soft_pin_deadline=obj.soft_pin_deadline,
        )

    def all_keys(self) -> list[str]:
        """Keys with a readable version."""
        return [k for k, o in self._objects.items() if o.readable is not None]

    def all_segments(self) -> list[SegmentInfo]:
        return [
            SegmentInfo(
                segment=s.segment,
                client_id=s.client_id,
                used=s.alloc.used,
                capacity=s.alloc.capacity,
            )
            for s in self._seg_list
        ]

    # -- time-driven work ------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Everything that happens because time passed: client expiry, zombie release, deferred
        frees, soft-pin expiry, watermark eviction. Call it periodically (the server does)."""
        self.expire_clients(now)
        self._release_zombies(now)
        self._expire_tasks(now)
        self._release_deferred(now)
        if self._in_use:
            self._in_use = {
                sid: (sg, kept)
                for sid, (sg, held) in self._in_use.items()
                if (kept := [h for h in held if h[0] > now])
            }
        self._expire_soft_pins(now)
        self._expire_tier_moves(now)
        if self._capacity and (
            self._used - self._demoting_bytes
            > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now)

    def _release_zombies(self, now: float) -> None:
        limit = self.config.put_start_release_timeout
        for key in list(self._writing):
            obj = self._objects.get(key)
            p = obj.pending if obj is not None else None
            if obj is None or p is None:
                self._writing.discard(key)  # ended, revoked or dropped since
            elif now - p.started >= limit:
                self._writing.discard(key)
                obj.pending = None
                self._unlink(key, p.version)
                self._free_version(p.version)
                if obj.readable is None:
                    del self._objects[key]
                self.stats.zombies_released += 1

    def _release_deferred(self, now: float) -> None:
        if not self._deferred:
            return
        keep: list[_Deferred] = []
        for t, reps in self._deferred:
            if t <= now:
                self._free_replicas(reps)
            else:
                keep.append((t, reps))
        self._deferred = keep

    def _expire_soft_pins(self, now: float) -> None:
        for key in list(self._soft_pinned):
            obj = self._objects.get(key)
            if obj is None or obj.soft_pin_deadline is None:
                self._soft_pinned.discard(key)
            elif obj.soft_pin_deadline <= now:
                obj.soft_pin_deadline = None
                self._soft_pinned.discard(key)
                if key in self.policy:
                    self.policy.set_pin(key, Pin.NONE)

    def evict(self, now: float, need: int = 0) -> int:
        """Evict objects (policy order) to bring usage under the watermark, or to free ``need``
        bytes; returns the bytes freed. Never evicts leased, pinned-hard, or written objects."""
        cap = self._capacity
        if cap == 0:
            return 0
        wm = self.config.eviction_high_watermark_ratio
        ratio = self.config.eviction_ratio
        # Bytes being demoted come back when their owners confirm: count them as freed, or
        # every put would push another victim into demotion.
        pending = self._demoting_bytes
        used = self._used - pending
        target = max(int(ratio * cap), int(used - wm * cap + ratio * cap), need) - pending
        if target <= 0:
            return 0
        allow_soft = self.config.allow_evict_soft_pinned_objects
        objects = self._objects

        def can_evict(key: object) -> bool:
            obj = objects.get(key)  # type: ignore[call-overload]
            return (
                obj is not None
                and obj.readable is not None
                and obj.pending is None
                and obj.demoting is None
                and obj.promoting is None
                and obj.task is None
                and not obj.hard_pinned
                and obj.lease_deadline <= now
                and (allow_soft or obj.soft_pin_deadline is None)
            )

        self.stats.eviction_runs += 1
        freed = 0
        policy = self.policy.name
        for key in self.policy.victims(target, can_evict):
            obj = objects[key]  # type: ignore[index]
            ver = obj.readable
            assert ver is not None
            freed += ver.size * len(ver.replicas)
            self.stats.evicted_bytes += ver.size
            self.stats.evicted_objects += 1
            self.tiers["dram"].evictions += 1
            if ver.disk:
                # Already on an SSD: dropping the memory replicas is the whole demotion.
                self._to_disk_only(obj, now)
                continue
            owner = self._demotion_owner(ver)
            if owner is not None:
                self._start_demotion(obj, owner, now)
                continue
            self._drop_object(obj, now)
            self.misses.record_eviction(key, policy=policy, tier="dram", now=now)
        return freed

    # -- tiers: SSD copies, demotion, promotion ---------------------------------------------

    def mount_local_disk(self, client_id: str, capacity: int, now: float) -> None:
        """``client_id`` has an SSD tier of ``capacity`` bytes: evictions from its segments may
        be demoted to it (``offload_on_evict``). Capacity 0 unmounts it for new demotions."""
        _check_client_id(client_id)
        if capacity < 0:
            raise InvalidArgumentError(f"SSD capacity must be >= 0, got {capacity}")
        self._touch_client(client_id, now).ssd_capacity = capacity

    def fetch_tier_tasks(self, client_id: str, now: float) -> TierTasks:
        """Take ``client_id``'s queued demotions and SSD copies to delete (none for a client
        the master does not know: polling does not make it known, mounting does)."""
        _check_client_id(client_id)
        client = self._renew_known(client_id, now)
        if client is None:
            return TierTasks(demote=[], drop=[])
        out = TierTasks(demote=client.demote_tasks, drop=client.disk_drops)
        client.demote_tasks, client.disk_drops = [], []
        return out

    def _demotion_owner(self, ver: _Version) -> _Replica | None:
        if not self.config.offload_on_evict:
            return None
        for r in ver.replicas:
            c = self._clients.get(r.seg.client_id)
            if c is not None and c.ssd_capacity >= ver.size:
                return r
        return None

    def _start_demotion(self, obj: _Object, source: _Replica, now: float) -> None:
        ver = obj.readable
        assert ver is not None
        cid = source.seg.client_id
        obj.demoting = _Demote(cid, now + self.config.demote_timeout, ver.size)
        self._demoting_bytes += ver.size
        self._untrack(obj)
        self._clients[cid].demote_tasks.append(
            DemoteTask(
                key=obj.key,
                vid=ver.vid,
                segment_name=source.seg.segment.name,
                addr=source.addr,
                size=ver.size,
            )
        )

    def _to_disk_only(self, obj: _Object, now: float) -> None:
        ver = obj.readable
        assert ver is not None and ver.disk
        self._unlink(obj.key, ver)
        self._release_after_lease(obj, ver, now)
        ver.replicas = []
        self._untrack(obj)

    def _tier_object(self, client_id: str, key: str, vid: int) -> tuple[_Object, _Version]:
        _check_client_id(client_id)
        obj = self._objects.get(key)
        if obj is None or obj.readable is None or obj.readable.vid != vid:
            raise ObjectNotFoundError(f"object {key!r} version {vid} is gone (removed or replaced)")
        return obj, obj.readable

    def demote_end(self, client_id: str, key: str, vid: int, now: float) -> None:
        """``client_id`` holds version ``vid`` of ``key`` on its SSD: free the memory replicas.

        ``OBJECT_NOT_FOUND`` if that version is gone (the client must delete its copy);
        ``ILLEGAL_CLIENT`` if no demotion of it to this client is in progress. Idempotent: a
        repeat after it was applied (the client lost the first answer) succeeds.
        """
        obj, ver = self._tier_object(client_id, key, vid)
        if obj.demoting is None and client_id in ver.disk:
            self._touch_client(client_id, now)
            return
        if obj.demoting is None or obj.demoting.client_id != client_id:
            raise IllegalClientError(f"no demotion of {key!r} to client {client_id} is in progress")
        self._clear_demoting(obj)
        client = self._touch_client(client_id, now)
        ver.disk.append(client_id)
        client.ssd_keys.add(key)
        self._to_disk_only(obj, now)
        self.tiers["ssd"].demotions += 1

    def demote_revoke(self, client_id: str, key: str, vid: int, now: float) -> None:
        """The demotion of ``key`` failed: the object is dropped (evicted from DRAM)."""
        obj, _ = self._tier_object(client_id, key, vid)
        if obj.demoting is None or obj.demoting.client_id != client_id:
            raise IllegalClientError(f"no demotion of {key!r} to client {client_id} is in progress")
        self._drop_object(obj, now)
        self.misses.record_eviction(key, policy=self.policy.name, tier="dram", now=now)

    def promote_start(
        self, client_id: str, key: str, vid: int, now: float
    ) -> list[ReplicaDescriptor]:
        """Allocate a memory replica for the SSD-only version ``vid`` of ``key`` (on the
        client's own segments first); the client writes it and calls :meth:`promote_end`.

        ``OBJECT_ALREADY_EXISTS`` if it has memory replicas already, ``REPLICA_IS_NOT_READY``
        if a promotion is in progress, ``NO_AVAILABLE_HANDLE`` if no space (after eviction).
        """
        obj, ver = self._tier_object(client_id, key, vid)
        if ver.replicas:
            raise ObjectAlreadyExistsError(f"object {key!r} is already in memory")
        if obj.promoting is not None or obj.pending is not None:
            raise ReplicaNotReadyError(f"object {key!r} is being promoted or written")
        client = self._touch_client(client_id, now)
        mine = [self._segments[s].segment.name for s in client.segments if s in self._segments]
        config = ReplicateConfig(replica_num=1, preferred_segments=mine)
        if self._capacity and (
            self._used + ver.size > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now, need=ver.size)
        replicas = self._allocate(ver.size, config)
        if not replicas:
            raise NoAvailableHandleError(f"no segment has {ver.size} free bytes to promote {key!r}")
        obj.promoting = _Promote(client_id, replicas, now)
        return [r.descriptor(ReplicaStatus.PROCESSING) for r in replicas]

    def promote_end(self, client_id: str, key: str, vid: int, now: float) -> None:
        """The promoted replica is written: the object is in DRAM again."""
        obj, ver = self._tier_object(client_id, key, vid)
        p = obj.promoting
        if p is None or p.client_id != client_id:
            raise IllegalClientError(f"no promotion of {key!r} by client {client_id}")
        obj.promoting = None
        live = [r for r in p.replicas if r.seg.mounted]
        if not live:
            raise ObjectNotFoundError(f"the segment receiving {key!r} was unmounted")
        ver.replicas = live
        for r in live:
            r.seg.keys.add(key)
        self.policy.on_insert(key, ver.size, now=now)
        if obj.hard_pinned:
            self.policy.set_pin(key, Pin.HARD)
        elif obj.soft_pin_deadline is not None:
            self.policy.set_pin(key, Pin.SOFT)
        self.tiers["ssd"].promotions += 1

    def promote_revoke(self, client_id: str, key: str, vid: int, now: float) -> None:
        obj, _ = self._tier_object(client_id, key, vid)
        p = obj.promoting
        if p is None or p.client_id != client_id:
            raise IllegalClientError(f"no promotion of {key!r} by client {client_id}")
        obj.promoting = None
        self._hold_written(p.replicas, now)

    def evict_disk_replica(
        self, client_id: str, key: str, vid: int, policy: str, now: float
    ) -> None:
        """``client_id`` evicted (by ``policy``) or lost its SSD copy of ``key`` version ``vid``.

        The object is dropped if that was its last replica. A version already gone is a no-op.
        """
        _check_client_id(client_id)
        client = self._renew_known(client_id, now)
        obj = self._objects.get(key)
        if client is None or obj is None or obj.readable is None or obj.readable.vid != vid:
            return
        ver = obj.readable
        if client_id not in ver.disk:
            return
        ver.disk.remove(client_id)
        client.ssd_keys.discard(key)
        self.tiers["ssd"].evictions += 1
        if not ver.replicas and not ver.disk:
            # its last copy: gone (a promotion in flight fails at PromoteEnd)
            self._drop_object(obj, now)
            self.misses.record_eviction(key, policy=policy, tier="ssd", now=now)

    def put_local(self, client_id: str, key: str, size: int, now: float) -> int:
        """Announce an SSD copy ``client_id`` kept across a restart as a new object held only on
        its SSD; returns its version id. ``OBJECT_ALREADY_EXISTS`` if ``key`` exists (the client
        must drop its copy: the key has a newer life)."""
        _check_client_id(client_id)
        _check_key(key)
        if size <= 0:
            raise InvalidArgumentError(f"object size must be positive, got {size}")
        client = self._touch_client(client_id, now)
        if client.ssd_capacity <= 0:
            raise InvalidArgumentError(f"client {client_id} has no SSD tier mounted")
        if key in self._objects:
            raise ObjectAlreadyExistsError(f"object {key!r} already exists")
        self._next_vid += 1
        obj = self._objects[key] = _Object(key, writer=client_id)
        obj.readable = _Version(size, [], self._next_vid, [client_id])
        client.ssd_keys.add(key)
        self.misses.record_stored(key)
        return self._next_vid

    def explain_miss(self, key: str) -> Miss:
        """Why ``key`` is not readable (without counting a miss)."""
        return self.misses.explain(key)

    def _end_tier_moves(self, obj: _Object) -> None:
        """The readable version goes away: cancel its demotion, park its promotion's space."""
        self._clear_demoting(obj)
        p = obj.promoting
        if p is not None:
            obj.promoting = None
            # the promoter may still be writing: reuse only after the zombie release timeout
            self._deferred.append((p.started + self.config.put_start_release_timeout, p.replicas))

    def _clear_demoting(self, obj: _Object) -> None:
        if obj.demoting is not None:
            self._demoting_bytes -= obj.demoting.size
            obj.demoting = None

    def _forget_disk(self, key: str, ver: _Version) -> None:
        for cid in ver.disk:
            c = self._clients.get(cid)
            if c is None:
                continue
            c.ssd_keys.discard(key)
            c.disk_drops.append(DiskDrop(key=key, vid=ver.vid))
            if len(c.disk_drops) > self.config.max_disk_drops:
                del c.disk_drops[0]
        ver.disk = []

    def _expire_tier_moves(self, now: float) -> None:
        stale = self.config.put_start_discard_timeout
        for key, obj in list(self._objects.items()):
            d = obj.demoting
            if d is not None and d.deadline <= now:
                self._drop_object(obj, now)
                self.misses.record_eviction(key, policy=self.policy.name, tier="dram", now=now)
                continue
            p = obj.promoting
            if p is not None and now - p.started >= stale:
                self._end_tier_moves(obj)

    # -- helpers ---------------------------------------------------------------------------

    def _unlink(self, key: str, ver: _Version) -> None:
        obj = self._objects.get(key)
        others = []
        if obj is not None:
            others = [
                v
                for v in (obj.readable, obj.pending.version if obj.pending else None)
                if v is not None and v is not ver
            ]
        for r in ver.replicas:
            if not any(o.seg is r.seg for v in others for o in v.replicas):
                r.seg.keys.discard(key)

    def _release_after_lease(self, obj: _Object, ver: _Version, now: float) -> None:
        # Only a read window (not the policy lease) can have a reader copying these bytes.
        if obj.read_deadline > now:
            self._deferred.append((obj.read_deadline, ver.replicas))
        else:
            self._free_version(ver)

    def _hold_written(self, reps: list[_Replica], now: float) -> None:
        """Free extents a writer gave up on, after ``put_revoke_hold`` (bytes of its cancelled
        transfer may still land in them until then)."""
        if not reps:
            return
        if self.config.put_revoke_hold > 0:
            self._deferred.append((now + self.config.put_revoke_hold, reps))
        else:
            self._free_replicas(reps)

    def _free_version(self, ver: _Version) -> None:
        self._free_replicas(ver.replicas)

    def _free_replicas(self, reps: list[_Replica]) -> None:
        for r in reps:
            if r.seg.mounted:
                self._used -= r.seg.alloc.extent(r.addr)
                r.seg.alloc.free(r.addr)

    def _untrack(self, obj: _Object) -> None:
        if obj.key in self.policy:
            self.policy.on_remove(obj.key)
        self._soft_pinned.discard(obj.key)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if bookkeeping is inconsistent (tests)."""
        assert self._demoting_bytes == sum(
            o.demoting.size for o in self._objects.values() if o.demoting is not None
        ), "demoting bytes"
        assert self._capacity == sum(s.segment.size for s in self._seg_list)
        assert self._used == sum(s.alloc.used for s in self._seg_list)
        extents: dict[int, list[tuple[int, int]]] = {}
        for obj in self._objects.values():
            assert obj.readable is not None or obj.pending is not None
            for ver in (obj.readable, obj.pending.version if obj.pending else None):
                if ver is None:
                    continue
                segs = [id(r.seg) for r in ver.replicas]
                assert len(segs) == len(set(segs)), "two replicas on one segment"
                for r in ver.replicas:
                    assert r.seg.mounted and obj.key in r.seg.keys
                    extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
            in_dram = (
                obj.readable is not None and bool(obj.readable.replicas) and obj.demoting is None
            )
            assert in_dram == (obj.key in self.policy), f"policy tracking of {obj.key!r}"
            if obj.readable is not None:
                assert obj.readable.replicas or obj.readable.disk, f"{obj.key!r} has no replica"
                for cid in obj.readable.disk:
                    c = self._clients.get(cid)
                    assert c is None or obj.key in c.ssd_keys
            if obj.promoting is not None:
                for r in obj.promoting.replicas:
                    if r.seg.mounted:
                        extents.setdefault(id(r.seg), []).append(
                            (r.addr, r.seg.alloc.extent(r.addr))
                        )
        for task in self._active_tasks.values():
            assert self._objects[task.key].task is task
            for r in task.allocated:
                extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
        for _, reps in self._deferred:
            for r in reps:
                if r.seg.mounted:
                    extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
        for seg in self._seg_list:
            seg.alloc.self_check()
            spans = sorted(extents.get(id(seg), []))
            assert len(spans) == seg.alloc.allocations, "leaked or unaccounted extent"
            for (a, n), (b, _) in itertools.pairwise(spans):
                assert a + n <= b, "overlapping extents"


def _codes(fn: Callable[[str], object], keys: list[str]) -> list[int]:
    out = []
    for k in keys:
        try:
            fn(k)
            out.append(0)
        except MooncakeError as e:
            out.append(int(e.code))
    return out


def _check_key(key: str) -> None:
    if not key:
        raise InvalidArgumentError("key must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidArgumentError(f"key of {len(key)} characters exceeds {MAX_KEY_LENGTH}")


def _check_client_id(client_id: str) -> None:
    if not client_id:
        raise ClientNotFoundError("client_id must be non-empty")


def _compile(regex: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as e:
        raise InvalidKeyError(f"bad regular expression {regex!r}: {e}") from None


def format_miss(miss: Miss) -> str:
    """The attribution suffix of an ``OBJECT_NOT_FOUND`` message (parsed by :func:`parse_miss`)."""
    parts = [f"reason={miss.reason.value}"]
    for name in ("policy", "tier", "owner"):
        value = getattr(miss, name)
        if value:
            parts.append(f"{name}={value}")
    return "[miss " + " ".join(parts) + "]"


_MISS_RE = re.compile(r"\[miss ((?:\w+=[^\s\]]*\s?)+)\]")


def parse_miss(key: str, message: str) -> Miss | None:
    """The :class:`Miss` in an ``OBJECT_NOT_FOUND`` message, or None if it carries none."""
    m = _MISS_RE.search(message)
    if m is None:
        return None
    fields = dict(f.split("=", 1) for f in m.group(1).split())
    try:
        reason = MissReason(fields.get("reason", ""))
    except ValueError:
        return None
    return Miss(
        key,
        reason,
        policy=fields.get("policy", ""),
        tier=fields.get("tier", ""),
        owner=fields.get("owner", ""),
    )
