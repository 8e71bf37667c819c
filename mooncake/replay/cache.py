"""A capacity-bounded prefix-block cache whose eviction order comes from a production policy.

:class:`BlockCache` holds which KV blocks (trace ``hash_ids``) are resident. It decides nothing
about *which* block goes: it reports every insert, hit and removal to an eviction policy object
from :mod:`mooncake._core.policies` (the same objects the master uses) and, when over capacity,
asks it for victims. Sizes are counted in blocks (every block has size 1), so ``capacity`` is a
block count.

The trace semantics (``shared/traces/REFERENCE.md``): a request's hit is the longest prefix of
its ids resident *before* its own blocks are admitted; then every block is touched or inserted
in prompt order (each with the previous id as its parent) and the cache is trimmed to capacity.
Nothing is protected from that trim: a request bigger than the cache evicts its own first blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from mooncake._core.policies import EvictionPolicy
from mooncake.errors import InvalidArgumentError

PolicyFactory = Callable[[], EvictionPolicy]


def _always(_key: Hashable) -> bool:
    return True


class BlockCache:
    """Resident-block set of bounded ``capacity`` (blocks) driving one policy object."""

    __slots__ = ("_policy", "_resident", "capacity", "evicted", "inserted")

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        if capacity < 0:
            raise InvalidArgumentError(f"cache capacity must be >= 0 blocks, got {capacity}")
        self._policy = policy
        self._resident: set[int] = set()
        self.capacity = capacity
        #: Blocks inserted / evicted so far (an insert of a block evicted earlier counts again).
        self.inserted = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: int) -> bool:
        return key in self._resident

    def prefix_hit(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of ``ids`` that is resident (no policy call)."""
        resident = self._resident
        k = 0
        for key in ids:
            if key not in resident:
                break
            k += 1
        return k

    def touch(self, ids: Sequence[int], now: float) -> None:
        """Report a read of resident ``ids`` (blocks not resident are ignored)."""
        resident = self._resident
        on_access = self._policy.on_access
        for key in ids:
            if key in resident:
                on_access(key, now)

    def admit(self, ids: Sequence[int], now: float) -> int:
        """Touch or insert every block of ``ids`` in order, then trim to capacity.

        Returns the request's hit: the resident prefix length *before* the admission (the same
        as :meth:`prefix_hit` just before; computed in the same pass).
        """
        resident = self._resident
        policy = self._policy
        on_access = policy.on_access
        on_insert = policy.on_insert
        parent: int | None = None
        hit = -1
        inserted = 0
        for pos, key in enumerate(ids):
            if key in resident:
                on_access(key, now)
            else:
                if hit < 0:
                    hit = pos
                on_insert(key, 1, parent=parent, now=now)
                resident.add(key)
                inserted += 1
            parent = key
        self.inserted += inserted
        over = len(resident) - self.capacity
        if over > 0:
            self._evict(over)
        return len(ids) if hit < 0 else hit

    def _evict(self, nblocks: int) -> None:
        policy = self._policy
        victims = policy.victims(nblocks, _always)
        resident = self._resident
        for key in victims:
            if key not in resident:  # a policy bug, not the trace's
                raise RuntimeError(f"eviction policy returned {key!r}, which is not resident")
            resident.remove(key)
            policy.on_remove(key)
        self.evicted += len(victims)
        if len(victims) < nblocks:
            raise RuntimeError(
                f"eviction policy freed {len(victims)} of {nblocks} blocks with nothing pinned"
            )


class InfiniteCache:
    """Every block ever admitted stays: the theoretical maximum hit."""

    __slots__ = ("_resident",)

    def __init__(self) -> None:
        self._resident: set[int] = set()

    def __len__(self) -> int:
        return len(self._resident)

    def prefix_hit(self, ids: Sequence[int]) -> int:
        resident = self._resident
        k = 0
        for key in ids:
            if key not in resident:
                break
            k += 1
        return k

    def admit(self, ids: Sequence[int], now: float) -> None:
        self._resident.update(ids)
