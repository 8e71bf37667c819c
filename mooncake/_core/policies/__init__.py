"""Eviction policies (sans-I/O) and their registry.

The interface is :class:`~mooncake._core.policies.base.EvictionPolicy` (contract in that
module's docstring). :data:`POLICIES` maps each shipped policy's ``name`` to its class;
:func:`make_policy` builds one by name. The default is ``"lru"``.
"""

from __future__ import annotations

from typing import Any

from mooncake._core.policies.base import (
    CanEvict,
    EvictionPolicy,
    Key,
    Pin,
    SizedPolicy,
    select_victims,
)
from mooncake._core.policies.fifo import FIFOPolicy
from mooncake._core.policies.lfu import LFUPolicy
from mooncake._core.policies.lru import LRUPolicy
from mooncake._core.policies.prefix import PrefixLRUPolicy
from mooncake._core.policies.s3fifo import S3FIFOPolicy
from mooncake._core.policies.sieve import SIEVEPolicy
from mooncake.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CanEvict",
    "EvictionPolicy",
    "FIFOPolicy",
    "Key",
    "LFUPolicy",
    "LRUPolicy",
    "Pin",
    "PrefixLRUPolicy",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "SizedPolicy",
    "make_policy",
    "select_victims",
]

DEFAULT_POLICY = "lru"

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, SIEVEPolicy, S3FIFOPolicy, PrefixLRUPolicy)
}
"""Shipped policies by name."""


def make_policy(name: str = DEFAULT_POLICY, **kwargs: Any) -> EvictionPolicy:
    """Build the shipped policy called ``name`` (case-insensitive) with ``kwargs``.

    Raises :class:`~mooncake.errors.InvalidArgumentError` naming the known policies if
    ``name`` is not one of them.
    """
    try:
        cls = POLICIES[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(sorted(POLICIES))
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; known: {known}")
    return cls(**kwargs)
