"""The record of one miss and its reasons: a leaf (it imports nothing of the package).

:class:`Miss` is what a failed lookup carries (``ObjectNotFoundError.miss``) and what the
client API returns; :class:`MissReason` names the causes. The ledger that produces them is
:mod:`mooncake._core.misses`, which re-exports both names.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Miss", "MissReason"]


class MissReason(enum.Enum):
    """Why a key could not be read. Values are the metric label values."""

    NEVER_STORED = "never_stored"
    """No put of this key ever completed (or its record aged out before the filter existed)."""
    EVICTED = "evicted"
    """An eviction policy chose it (``policy``) to free space in a tier (``tier``)."""
    REMOVED = "removed"
    """Removed explicitly (remove, remove-by-regex, remove-all)."""
    OWNER_DIED = "owner_died"
    """The client holding its replicas stopped pinging or unmounted (``owner``)."""
    LEASE_EXPIRED = "lease_expired"
    """It existed, but the read outlived its lease and was failed closed."""
    TRANSFER_FAILED = "transfer_failed"
    """It existed, but moving the bytes failed."""
    UNKNOWN = "unknown"
    """It was lost long ago and the ledger has forgotten how (capacity)."""


@dataclass(frozen=True, slots=True)
class Miss:
    """The attribution of one miss: the reason and what the ledger knows about it."""

    key: Hashable
    reason: MissReason
    policy: str = ""
    """Eviction policy name (``EVICTED`` only)."""
    tier: str = ""
    """Tier the object was lost from or read from, when known."""
    owner: str = ""
    """Client whose death lost it (``OWNER_DIED``)."""
    at: float | None = None
    """Caller time of the loss (or of the failed read)."""
    detail: str = ""
    """Free-form detail (what failed, the ledger's note)."""
    tenant: str = ""
    """The key's tenant (``""``: the default tenant)."""
