"""Value types of the Mooncake Store, shared by the master, the client and the wire.

These are :mod:`msgspec` Structs, so the same classes are the in-memory API and the RPC payload
(see :mod:`mooncake._core.rpc`). They follow Mooncake's ``types.h`` / ``replica.h``:

* :class:`Segment` -- a range of a client's memory mounted at the master: ``[base, base+size)``
  inside the transfer-engine segment ``name`` (in P2P mode ``"ip:rpc_port"``). ``id`` is a UUID
  string chosen by the client; ``client_id`` is not part of it (it travels beside it).
* :class:`ReplicateConfig` -- per-put placement/pinning options, same field names and defaults as
  the published ``mooncake.store.ReplicateConfig``.
* :class:`ReplicaDescriptor` -- one memory replica: the contiguous range
  ``[addr, addr+length)`` inside transfer-engine segment ``segment_name``. The client reads or
  writes it with the engine (``engine.read(segment_name, local, addr + offset, n)``). ``status``
  is a :class:`ReplicaStatus`; only ``COMPLETE`` replicas are ever handed to readers.
* :class:`ObjectInfo` -- the master's view of one object for admin/introspection calls.
* :func:`check_key` -- the one rule for object keys, applied by the client before a call leaves
  and by the master when one arrives (the same checks, the same errors).

Struct encoding: every Struct here encodes as a msgpack map (``omit_defaults``), and decoders
ignore unknown fields, so fields can be added later without breaking older peers. Enums travel as
their integer values.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from mooncake.errors import InvalidArgumentError

MAX_KEY_LENGTH = 1 << 20
"""The longest key :func:`check_key` accepts, in characters."""


def check_key(key: Any) -> str:
    """Return ``key`` if it is a valid object key, else raise
    :class:`~mooncake.errors.InvalidArgumentError` saying what is wrong.

    A key is a non-empty ``str`` of at most :data:`MAX_KEY_LENGTH` characters that encodes as
    UTF-8 (no lone surrogates). ``bytes`` are refused with a hint to decode them. The SSD tier's
    on-disk header has its own, smaller limit in bytes (:data:`mooncake._core.tiers.MAX_KEY_BYTES`).
    """
    if not isinstance(key, str):
        raise InvalidArgumentError(
            f"key must be a str, got {type(key).__name__}"
            + (" (decode it first: key.decode())" if isinstance(key, bytes | bytearray) else "")
        )
    if not key:
        raise InvalidArgumentError("key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidArgumentError(
            f"key of {len(key)} characters is too long (at most {MAX_KEY_LENGTH})"
        )
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(
                f"key {key!r} is not valid UTF-8 (lone surrogate at index {e.start}); keys are"
                " text: decode bytes with errors='strict' or use their hex"
            ) from None
    return key


class ReplicaStatus(enum.IntEnum):
    """Mooncake's ``ReplicaStatus``."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (Mooncake's ``SoftPinAction``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's ``ObjectDataType`` (a hint; the master only records it)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ClientStatus(enum.IntEnum):
    """Answer of ``Ping``: ``NEED_REMOUNT`` when the master does not know the client's segments
    (it expired, or the master restarted); the client must ``ReMountSegment`` them."""

    UNDEFINED = 0
    OK = 1
    NEED_REMOUNT = 2


class TaskType(enum.IntEnum):
    """Kind of a replica task (the published ``TaskType``)."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """State of a replica task (the published ``TaskStatus``)."""

    PENDING = 0
    PROCESSING = 1
    SUCCESS = 2
    FAILED = 3


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class Segment(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A mounted range of a client's memory.

    ``name`` is the transfer-engine segment name readers and writers pass to the engine;
    ``te_endpoint`` is the engine's ``ip:port`` (the same string as ``name`` in P2P mode).
    """

    id: str
    name: str
    base: int
    size: int
    te_endpoint: str = ""
    protocol: str = "tcp"
    location: str = "cpu:0"
    """Where the segment's memory lives: ``cpu:N`` (host DRAM) or ``cuda:N`` (GPU memory).
    Omitted on the wire when ``cpu:0``, so host segments encode exactly as before."""


class ReplicateConfig(_Struct):
    """Placement and pinning options for a put (the published ``ReplicateConfig``).

    ``replica_num`` is best-effort: the master allocates up to that many replicas, each on a
    distinct segment, and succeeds with at least one. ``preferred_segments`` (transfer-engine
    segment names) are tried first, in order; ``preferred_segment`` is the deprecated single form.
    ``with_hard_pin`` objects are never evicted. ``with_soft_pin`` (legacy spelling) or
    ``soft_pin_action=ENABLE`` soft-pins for ``soft_pin_ttl_ms`` (master default when ``None``):
    soft-pinned objects are evicted only after every unpinned candidate.
    """

    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int | None = None
    preferred_segments: list[str] = msgspec.field(default_factory=list)
    preferred_segment: str = ""
    prefer_alloc_in_same_node: bool = False
    data_type: ObjectDataType = ObjectDataType.UNKNOWN
    group_ids: list[str] | None = None
    """Group of each key (a batch: one per key; a single put: one). A read lease granted on
    one member of a group extends to every current member."""

    def soft_pinned(self) -> bool:
        """Whether this put asks for a soft pin."""
        return self.with_soft_pin or self.soft_pin_action == SoftPinAction.ENABLE

    def preferred(self) -> list[str]:
        """Preferred segment names in order, the deprecated single one appended if new."""
        out = list(self.preferred_segments)
        if self.preferred_segment and self.preferred_segment not in out:
            out.append(self.preferred_segment)
        return out


class ReplicaDescriptor(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """One memory replica: ``[addr, addr+length)`` in transfer-engine segment ``segment_name``."""

    segment_name: str
    addr: int
    length: int
    status: ReplicaStatus = ReplicaStatus.COMPLETE
    protocol: str = "tcp"
    id: int = 0

    def is_memory_replica(self) -> bool:
        """Always true here (disk/NoF replicas are not represented by this class)."""
        return True


class GetReplicaListResponse(_Struct):
    """Readable replicas of one object plus the read lease the call granted.

    A reader must finish within ``lease_ttl_ms`` of sending the request, else its bytes may be
    stale (the published client then returns ``LEASE_EXPIRED``).
    """

    replicas: list[ReplicaDescriptor]
    lease_ttl_ms: int
    size: int = 0
    read_ttl_ms: int = 0
    """The read window (0: ``lease_ttl_ms``): a read finishing later than this after the request
    was sent fails closed, since the space may then hold another object."""
    vid: int = 0
    """The master's id of this version of the object (changes with every put/upsert): the
    object's *generation*, strictly increasing per key."""
    disk_clients: list[str] = msgspec.field(default_factory=list)
    """Client ids holding a copy of this version on their local SSD tier (``LOCAL_DISK``)."""
    crc: int = -1
    """The CRC32C of this version's whole value as its writer had it (``-1``: none recorded,
    e.g. the writer sent none; absent on the wire then, and ignored by readers that predate
    it). Readers verify the bytes they land against it (``docs/store.md``, verified reads)."""


class PingResponse(_Struct):
    """Answer of ``Ping``: the master's view version and what the client must do."""

    view_version_id: int
    client_status: ClientStatus


class ObjectInfo(_Struct):
    """The master's record of one object, as admin calls report it.

    Times are seconds on the master's clock (``lease_deadline`` 0 = never leased).
    """

    key: str
    size: int
    complete: bool
    replicas: list[ReplicaDescriptor]
    client_id: str = ""
    lease_deadline: float = 0.0
    hard_pinned: bool = False
    soft_pin_deadline: float | None = None


class SegmentInfo(_Struct):
    """A mounted segment and its usage, as admin calls report it."""

    segment: Segment
    client_id: str
    used: int
    capacity: int
    status: str = "OK"
    """``OK``, or ``DRAINING`` once its owner asked for a drain (upstream's ``SegmentStatus``)."""


class DrainStatus(_Struct):
    """The answer to ``DrainSegment`` (see :mod:`mooncake._core.master.drain`).

    Counts of this call: ``released`` replicas left the replica lists (another copy exists),
    ``copies`` re-replication tasks and ``moves`` move tasks were queued, ``stranded`` objects
    are only on this segment and fit nowhere else (the unmount drops them). In flight: ``writes``
    puts still writing into the segment, ``tasks`` objects with a task or tier move under way
    (this call's moves included); ``read_wait_s`` is how long read leases granted on the
    segment's replicas still run. The drain is complete when ``writes``, ``tasks`` and
    ``read_wait_s`` are all 0.
    """

    released: int = 0
    copies: int = 0
    moves: int = 0
    stranded: int = 0
    writes: int = 0
    tasks: int = 0
    read_wait_s: float = 0.0

    @property
    def settled(self) -> bool:
        """Nothing in flight on the segment any more: it can be unmounted."""
        return self.writes == 0 and self.tasks == 0 and self.read_wait_s <= 0


class ReplicaTask(_Struct):
    """A copy or move of one object's replica, executed by the client owning the source.

    ``source`` and ``targets`` are transfer-engine segment names; ``executor`` the client id
    that fetches and runs it (``FetchTasks`` -> ``TaskStart`` -> engine writes -> ``TaskEnd``
    or ``TaskRevoke``).
    """

    id: str
    type: TaskType
    key: str
    source: str
    targets: list[str]
    status: TaskStatus = TaskStatus.PENDING
    executor: str = ""
    message: str = ""


class TaskStartResponse(_Struct):
    """What the executor moves: ``size`` bytes from ``source`` to every one of ``targets``."""

    size: int
    source: ReplicaDescriptor
    targets: list[ReplicaDescriptor]


__all__ = [
    "ClientStatus",
    "DemoteTask",
    "DiskDrop",
    "DrainStatus",
    "GetReplicaListResponse",
    "MissInfo",
    "ObjectDataType",
    "ObjectInfo",
    "PingResponse",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicaTask",
    "ReplicateConfig",
    "Segment",
    "SegmentInfo",
    "SoftPinAction",
    "TaskStartResponse",
    "TaskStatus",
    "TaskType",
    "TierTasks",
]


class DemoteTask(_Struct):
    """Master -> owning client: copy ``[addr, addr+size)`` of your segment ``segment_name`` (the
    object ``key``, version ``vid``) to your SSD tier, then ``DemoteEnd`` (or ``DemoteRevoke``)."""

    key: str
    vid: int
    segment_name: str
    addr: int
    size: int


class DiskDrop(_Struct):
    """Master -> client: your SSD copy of ``key`` version ``vid`` is no longer listed; delete it."""

    key: str
    vid: int


class TierTasks(_Struct):
    """Answer of ``FetchTierTasks``: demotions to do and SSD copies to delete."""

    demote: list[DemoteTask] = msgspec.field(default_factory=list)
    drop: list[DiskDrop] = msgspec.field(default_factory=list)


class MissInfo(_Struct):
    """Why a key is not readable (``ExplainMiss``); fields as :class:`mooncake._core.misses.Miss`."""

    reason: str
    policy: str = ""
    tier: str = ""
    owner: str = ""
    at: float = 0.0
