"""The published ``ReplicateConfig`` and the descriptor types ``get_replica_desc`` returns.

These are the shapes of ``mooncake.store`` in the published wheel (mutable attributes, same
names, same defaults, same ``str()``), kept apart from the wire types in
:mod:`mooncake._core.store_types` so that the wire can evolve without breaking user code.
:func:`to_wire` turns either kind into the wire :class:`~mooncake._core.store_types.ReplicateConfig`.
"""

from __future__ import annotations

from typing import Any

from mooncake._core import store_types as st
from mooncake._core.store_types import ObjectDataType, ReplicaStatus, SoftPinAction
from mooncake.errors import InvalidArgumentError

_U64 = 1 << 64


def _u64(name: str, value: Any) -> int:
    if not isinstance(value, int) or not 0 <= value < _U64:
        raise TypeError(f"{name} must be an unsigned 64-bit int, got {value!r}")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if value is None or isinstance(value, (bool, int)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def _strs(name: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of str, got {value!r}")
    return list(value)


class ReplicateConfig:
    """Placement and pinning options of a put (published ``mooncake.store.ReplicateConfig``).

    ``replica_num`` replicas (best effort, each on a distinct segment); ``preferred_segments``
    (segment names as ``get_hostname()`` returns them) tried first; ``with_hard_pin`` objects
    are never evicted; ``soft_pin_action=ENABLE`` soft-pins for ``soft_pin_ttl_ms``;
    ``group_ids`` puts keys in groups (a batch: one per key) whose members share read leases.
    The NoF/DFS tier counts are accepted for compatibility; only ``0`` is supported.

    Assignments are type-checked as the published binding checks them: a value of the wrong
    type, a negative count or one of 2**64 or more raises ``TypeError``.
    """

    __slots__ = (
        "_data_type",
        "_dfs_replica_num",
        "_group_ids",
        "_nof_replica_num",
        "_prefer_alloc_in_same_node",
        "_preferred_nof_segments",
        "_preferred_segment",
        "_preferred_segments",
        "_replica_num",
        "_soft_pin_action",
        "_soft_pin_ttl_ms",
        "_with_hard_pin",
    )

    def __init__(self) -> None:
        self._replica_num = 1
        self._nof_replica_num = 0
        self._dfs_replica_num = 0
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self._with_hard_pin = False
        self._preferred_segments: list[str] = []
        self._preferred_segment = ""
        self._preferred_nof_segments: list[str] = []
        self._prefer_alloc_in_same_node = False
        self._data_type = ObjectDataType.UNKNOWN
        self._group_ids: list[str] | None = None

    @property
    def replica_num(self) -> int:
        return self._replica_num

    @replica_num.setter
    def replica_num(self, v: int) -> None:
        self._replica_num = _u64("replica_num", v)

    @property
    def nof_replica_num(self) -> int:
        return self._nof_replica_num

    @nof_replica_num.setter
    def nof_replica_num(self, v: int) -> None:
        self._nof_replica_num = _u64("nof_replica_num", v)

    @property
    def dfs_replica_num(self) -> int:
        return self._dfs_replica_num

    @dfs_replica_num.setter
    def dfs_replica_num(self, v: int) -> None:
        self._dfs_replica_num = _u64("dfs_replica_num", v)

    @property
    def soft_pin_action(self) -> SoftPinAction:
        return self._soft_pin_action

    @soft_pin_action.setter
    def soft_pin_action(self, v: SoftPinAction) -> None:
        if not isinstance(v, SoftPinAction):
            raise TypeError(f"soft_pin_action must be a SoftPinAction, got {v!r}")
        self._soft_pin_action = v

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, v: int | None) -> None:
        self._soft_pin_ttl_ms = None if v is None else _u64("soft_pin_ttl_ms", v)

    @property
    def with_hard_pin(self) -> bool:
        return self._with_hard_pin

    @with_hard_pin.setter
    def with_hard_pin(self, v: bool) -> None:
        self._with_hard_pin = _bool("with_hard_pin", v)

    @property
    def preferred_segments(self) -> list[str]:
        return self._preferred_segments

    @preferred_segments.setter
    def preferred_segments(self, v: list[str]) -> None:
        self._preferred_segments = _strs("preferred_segments", v)

    @property
    def preferred_segment(self) -> str:
        return self._preferred_segment

    @preferred_segment.setter
    def preferred_segment(self, v: str) -> None:
        if not isinstance(v, str):
            raise TypeError(f"preferred_segment must be a str, got {v!r}")
        self._preferred_segment = v

    @property
    def preferred_nof_segments(self) -> list[str]:
        return self._preferred_nof_segments

    @preferred_nof_segments.setter
    def preferred_nof_segments(self, v: list[str]) -> None:
        self._preferred_nof_segments = _strs("preferred_nof_segments", v)

    @property
    def prefer_alloc_in_same_node(self) -> bool:
        return self._prefer_alloc_in_same_node

    @prefer_alloc_in_same_node.setter
    def prefer_alloc_in_same_node(self, v: bool) -> None:
        self._prefer_alloc_in_same_node = _bool("prefer_alloc_in_same_node", v)

    @property
    def data_type(self) -> ObjectDataType:
        return self._data_type

    @data_type.setter
    def data_type(self, v: ObjectDataType) -> None:
        if not isinstance(v, ObjectDataType):
            raise TypeError(f"data_type must be an ObjectDataType, got {v!r}")
        self._data_type = v

    @property
    def group_ids(self) -> list[str] | None:
        return self._group_ids

    @group_ids.setter
    def group_ids(self, v: list[str] | None) -> None:
        self._group_ids = None if v is None else _strs("group_ids", v)

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        groups = "" if self.group_ids is None else f", group_ids: [{', '.join(self.group_ids)}]"
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
            f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: "
            f"{SoftPinAction(self.soft_pin_action).name}, soft_pin_ttl_ms: {ttl}, with_hard_pin: "
            f"{int(self.with_hard_pin)}, preferred_segments: {self.preferred_segments}, "
            f"preferred_nof_segments: {self.preferred_nof_segments}, prefer_alloc_in_same_node: "
            f"{int(self.prefer_alloc_in_same_node)}, data_type: "
            f"{ObjectDataType(self.data_type).name}{groups} }}"
        )

    def __repr__(self) -> str:
        return f"<{self}>"


def to_wire(config: ReplicateConfig | st.ReplicateConfig | None) -> st.ReplicateConfig:
    """The wire form of ``config`` (defaults when None); raises on out-of-range values."""
    if config is None:
        return _DEFAULT
    if isinstance(config, st.ReplicateConfig):
        wire = config
    elif isinstance(config, ReplicateConfig):
        if config.nof_replica_num or config.dfs_replica_num:
            raise InvalidArgumentError(
                "NoF/DFS replicas are not supported (nof/dfs_replica_num must be 0)"
            )
        wire = st.ReplicateConfig(
            replica_num=config.replica_num,
            with_hard_pin=bool(config.with_hard_pin),
            soft_pin_action=SoftPinAction(config.soft_pin_action),
            soft_pin_ttl_ms=config.soft_pin_ttl_ms,
            preferred_segments=list(config.preferred_segments),
            preferred_segment=config.preferred_segment,
            prefer_alloc_in_same_node=bool(config.prefer_alloc_in_same_node),
            data_type=ObjectDataType(config.data_type),
            group_ids=None if config.group_ids is None else list(config.group_ids),
        )
    else:
        raise InvalidArgumentError(f"config must be a ReplicateConfig, got {type(config).__name__}")
    if (
        isinstance(wire.replica_num, bool)
        or not isinstance(wire.replica_num, int)
        or wire.replica_num < 1
    ):
        raise InvalidArgumentError(f"replica_num must be an int >= 1, got {wire.replica_num!r}")
    return wire


_DEFAULT = st.ReplicateConfig()


class Descriptor:
    """A memory replica's buffer (published ``mooncake.store.Descriptor``)."""

    __slots__ = ("buffer_address", "size", "transport_endpoint")

    def __init__(self, buffer_address: int, size: int, transport_endpoint: str) -> None:
        self.buffer_address = buffer_address
        self.size = size
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (
            f"Descriptor(transport_endpoint={self.transport_endpoint!r}, "
            f"buffer_address={self.buffer_address:#x}, size={self.size})"
        )


class MemoryDescriptor:
    """Published ``mooncake.store.MemoryDescriptor``: ``.buffer_descriptor``."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor

    def __repr__(self) -> str:
        return f"MemoryDescriptor({self.buffer_descriptor!r})"


class DiskDescriptor:
    """Published ``mooncake.store.DiskDescriptor`` (never produced: no disk tier here)."""

    __slots__ = ("file_path", "object_size")

    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica as ``get_replica_desc`` reports it (published ``ReplicaDescriptor``).

    A memory replica (``is_memory_replica``: ``get_memory_descriptor`` names its segment,
    address and size) or, from :meth:`local_disk`, a copy on a client's local SSD tier
    (``is_local_disk_replica``; the published ``LOCAL_DISK`` replica an ``offload_on_evict``
    eviction leaves). Asking a replica for the other kind's descriptor raises
    ``InvalidArgumentError``.
    """

    __slots__ = ("_memory", "local_disk_client", "local_disk_size", "status")

    def __init__(self, wire: st.ReplicaDescriptor | None) -> None:
        self.status = ReplicaStatus(wire.status) if wire is not None else ReplicaStatus.COMPLETE
        self._memory = (
            MemoryDescriptor(Descriptor(wire.addr, wire.length, wire.segment_name))
            if wire is not None
            else None
        )
        self.local_disk_client = ""
        self.local_disk_size = 0

    @classmethod
    def local_disk(cls, client_id: str, size: int) -> ReplicaDescriptor:
        """A complete copy of ``size`` bytes on client ``client_id``'s local SSD tier."""
        out = cls(None)
        out.local_disk_client = client_id
        out.local_disk_size = size
        return out

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return self._memory is None

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise InvalidArgumentError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise InvalidArgumentError("not a disk replica")

    def __repr__(self) -> str:
        if self._memory is None:
            return (
                f"ReplicaDescriptor(status={self.status.name}, local_disk="
                f"{self.local_disk_client!r}, size={self.local_disk_size})"
            )
        return f"ReplicaDescriptor(status={self.status.name}, {self._memory.buffer_descriptor!r})"


def parse_size(value: Any, what: str) -> int:
    """Sizes as the published ``setup(dict)`` accepts them: ints or ``"16MB"``, ``"16 MB"``, ``"1GiB"``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgumentError(f"{what} must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what}: expected an int or a size string, got {value!r}")
    s = value.strip().upper().replace(" ", "")
    if "%" in s or not s:
        raise InvalidArgumentError(f"{what}: bad size {value!r}")
    units = {
        "": 1,
        "B": 1,
        "K": 1 << 10,
        "KB": 1 << 10,
        "KIB": 1 << 10,
        "M": 1 << 20,
        "MB": 1 << 20,
        "MIB": 1 << 20,
        "G": 1 << 30,
        "GB": 1 << 30,
        "GIB": 1 << 30,
        "T": 1 << 40,
        "TB": 1 << 40,
        "TIB": 1 << 40,
    }
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:]
    if unit not in units or not num:
        raise InvalidArgumentError(f"{what}: bad size {value!r}")
    try:
        n = float(num)
    except ValueError:
        raise InvalidArgumentError(f"{what}: bad size {value!r}") from None
    return int(n * units[unit])
