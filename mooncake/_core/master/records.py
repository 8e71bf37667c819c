"""The master's internal records (objects, versions, replicas, segments, clients, tasks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake._core.allocator import OffsetAllocator
from mooncake._core.store_types import (
    DemoteTask,
    DiskDrop,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicaTask,
    ReplicateConfig,
    Segment,
    TaskStatus,
    TaskType,
)


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
    disk: tuple[str, ...] = ()
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
    h: int = -1
    """Its handle in the object table (set when the record joins the table)."""


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


class KeySet(dict[str, None]):
    """A set of strings iterated in insertion order. A plain ``set[str]``'s order depends on
    the process's string hashing (and on how the set was built, e.g. by a snapshot restore);
    the master's state must not, so that replicas applying the same commands agree (the order
    decides policy insertion order, preferred segments, what a sweep does first)."""

    __slots__ = ()

    def add(self, key: str) -> None:
        self[key] = None

    def discard(self, key: str) -> None:
        self.pop(key, None)


@dataclass(slots=True, eq=False)
class _Seg:
    segment: Segment
    client_id: str
    alloc: OffsetAllocator
    num: int = -1
    """Its number in the object table's cold rows (unique among the state's segments)."""
    mounted: bool = True
    draining: bool = False
    """Being drained by its owner (``DrainSegment``): readable, but nothing is allocated on it."""
    reads_until: float = 0.0
    """While draining: the end of the last read lease granted on a replica that left it."""


@dataclass(slots=True)
class _Client:
    deadline: float
    segments: KeySet = field(default_factory=KeySet)
    ssd_capacity: int = 0
    ssd_keys: KeySet = field(default_factory=KeySet)
    demote_tasks: list[DemoteTask] = field(default_factory=list)
    disk_drops: list[DiskDrop] = field(default_factory=list)
    ssd_tier_id: str = ""
    """The identity of its SSD tier's directory (kept across the client's restarts)."""
    stale_ssd: set[str] = field(default_factory=set)
    """Keys whose copies on that directory a previous instance was told to delete."""


# A deferred free: (until, sequence number, extents); ``MasterState._deferred`` is a heap of them.
_Deferred = tuple[float, int, list[_Replica]]
# Extents of an expired client's segment that others may still touch: (until, addr, length).
_InUse = list[tuple[float, int, int]]
