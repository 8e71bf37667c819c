"""Master high availability through etcd (see :class:`HaConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HaConfig"]


@dataclass
class HaConfig:
    """Replication settings of a master (``--enable_ha`` and the snapshot flags)."""

    endpoints: list[str] = field(default_factory=list)
    cluster_id: str = "mooncake_cluster"
