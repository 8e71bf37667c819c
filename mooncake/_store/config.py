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


class ReplicateConfig:
    """Placement and pinning options of a put (published ``mooncake.store.ReplicateConfig``).

    ``replica_num`` replicas (best effort, each on a distinct segment); ``preferred_segments``
    (segment names as ``get_hostname()`` returns them) tried first; ``with_hard_pin`` objects
    are never evicted; ``soft_pin_action=ENABLE`` soft-pins for ``soft_pin_ttl_ms``. The NoF/DFS
    tier counts are accepted for compatibility; only ``0`` is supported.
    """

    __slots__ = (
        "data_type",
        "dfs_replica_num",
        "group_ids",
        "nof_replica_num",
        "prefer_alloc_in_same_node",
        "preferred_nof_segments",
        "preferred_segment",
        "preferred_segments",
        "replica_num",
        "soft_pin_action",
        "soft_pin_ttl_ms",
        "with_hard_pin",
    )

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.nof_replica_num: int = 0
        self.dfs_replica_num: int = 0
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin: bool = False
        self.preferred_segments: list[str] = []
        self.preferred_segment: str = ""
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node: bool = False
        self.data_type: ObjectDataType = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
            f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: "
            f"{SoftPinAction(self.soft_pin_action).name}, soft_pin_ttl_ms: {ttl}, with_hard_pin: "
            f"{int(self.with_hard_pin)}, preferred_segments: {self.preferred_segments}, "
            f"preferred_nof_segments: {self.preferred_nof_segments}, prefer_alloc_in_same_node: "
            f"{int(self.prefer_alloc_in_same_node)}, data_type: "
            f"{ObjectDataType(self.data_type).name} }}"
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
    """One replica as ``get_replica_desc`` reports it (published ``ReplicaDescriptor``)."""

    __slots__ = ("_memory", "status")

    def __init__(self, wire: st.ReplicaDescriptor) -> None:
        self.status = ReplicaStatus(wire.status)
        self._memory = MemoryDescriptor(Descriptor(wire.addr, wire.length, wire.segment_name))

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise InvalidArgumentError("not a disk replica")

    def __repr__(self) -> str:
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
