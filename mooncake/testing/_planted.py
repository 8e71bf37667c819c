"""Hand-written buggy policies: the rare-condition bugs users write, for the mutation benchmark.

The AST mutants of :mod:`mooncake.testing._mutation` change one spot of a shipped policy; the
bugs here are whole, plausible optimisations that are wrong only under a rarer condition, the
shapes the fixed schedule of :func:`~mooncake.testing.check_policy` must reach on every run:

* ``uniform-fast-path``: when every tracked object has the same size ``s >= 2`` (uniform KV
  pages) and more than one page is asked for, take ``nbytes // s + 1`` pages, one too many when
  ``nbytes`` is exactly ``k * s``;
* ``exact-sum``: the general loop stops only once strictly *more* than ``nbytes`` is freed, so a
  request of exactly the sizes of the first ``k >= 2`` victims takes one victim more (one-victim
  requests, and caches holding an object of at most 8 bytes, take correct paths);
* ``cached-victims``: with ten or more keys tracked, the last answer is reused while no event
  has arrived since, but ``can_evict`` (a lease granted or expired) is not an event, so a lease
  change followed at once by an eviction gets the stale list;
* ``cached-pins``: the same cache, invalidated on lease changes (``can_evict`` is re-asked for
  the cached victims) but not on :meth:`set_pin`.

Each is an :class:`~mooncake.policies.LRUPolicy` subclass; :data:`PLANTED` maps the names to
the classes, and ``check_policy(cls, oracle=lru_oracle)`` must reject every one from its fixed
schedule alone.
"""

from __future__ import annotations

from mooncake._core.policies.base import CanEvict, Key, Pin, select_victims
from mooncake._core.policies.lru import LRUPolicy

__all__ = ["PLANTED"]


class _UniformFastPath(LRUPolicy):
    """Counts pages instead of bytes when every object has the same size (off by one)."""

    __slots__ = ()

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        sizes = set(self._order.values())
        if len(sizes) == 1 and (s := next(iter(sizes))) >= 2 and nbytes > s:
            pages = nbytes // s + 1  # the bug: ceil(nbytes / s) is -(-nbytes // s)
            return select_victims(self._order, self._order, self._pins, pages * s, can_evict)
        return super().victims(nbytes, can_evict)


class _ExactSum(LRUPolicy):
    """Stops once strictly more than ``nbytes`` is freed (wrong only for an exact k-sum)."""

    __slots__ = ()

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0:
            return []
        if min(self._order.values(), default=0) <= 8:
            return super().victims(nbytes, can_evict)
        out: list[Key] = []
        soft: list[Key] = []
        freed = 0
        for key, size in self._order.items():
            pin = self._pins.get(key)
            if pin is Pin.HARD or not can_evict(key):
                continue
            if pin is Pin.SOFT:
                soft.append(key)
                continue
            if not out and size >= nbytes:
                return [key]  # the one-victim fast path is right
            out.append(key)
            freed += size
            if freed > nbytes:  # the bug: >= is right
                return out
        for key in soft:
            out.append(key)
            freed += self._order[key]
            if freed >= nbytes:
                return out
        return out


class _CachedVictims(LRUPolicy):
    """Reuses the last answer while no event arrived (``can_evict`` changes are not events)."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        super().__init__()
        self._cache: tuple[int, list[Key]] | None = None

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        self._cache = None
        super().on_insert(key, size, parent=parent, now=now)

    def on_access(self, key: Key, now: float = 0.0) -> None:
        self._cache = None
        super().on_access(key, now)

    def on_remove(self, key: Key) -> None:
        self._cache = None
        super().on_remove(key)

    def set_pin(self, key: Key, pin: Pin) -> None:
        self._cache = None
        super().set_pin(key, pin)

    def _cached(self, nbytes: int, can_evict: CanEvict) -> list[Key] | None:
        cache = self._cache
        return cache[1] if cache is not None and cache[0] == nbytes else None

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if len(self._order) < 10:
            return super().victims(nbytes, can_evict)
        hit = self._cached(nbytes, can_evict)
        if hit is not None:
            return list(hit)
        out = super().victims(nbytes, can_evict)
        self._cache = (nbytes, list(out))
        return out


class _CachedPins(_CachedVictims):
    """The cache re-asks ``can_evict`` for its victims, but a pin change does not clear it."""

    __slots__ = ()

    def set_pin(self, key: Key, pin: Pin) -> None:
        LRUPolicy.set_pin(self, key, pin)  # the bug: the cached answer stays

    def _cached(self, nbytes: int, can_evict: CanEvict) -> list[Key] | None:
        hit = super()._cached(nbytes, can_evict)
        if hit is not None and all(can_evict(k) for k in hit):
            return hit
        return None


PLANTED: dict[str, type[LRUPolicy]] = {
    "uniform-fast-path": _UniformFastPath,
    "exact-sum": _ExactSum,
    "cached-victims": _CachedVictims,
    "cached-pins": _CachedPins,
}
"""The planted bugs by name; every one is an LRU policy that ``lru_oracle`` must reject."""
