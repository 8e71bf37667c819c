"""Least-recently-used eviction (the default policy)."""

from __future__ import annotations

from collections import OrderedDict

from mooncake._core.policies.base import (
    CanEvict,
    Key,
    SizedPolicy,
    check_size,
    select_victims,
)

__all__ = ["LRUPolicy"]


class LRUPolicy(SizedPolicy):
    """Least recently used: evict the object whose last insert or access is oldest.

    One ``OrderedDict`` (oldest first): every event is O(1); ``victims`` is O(v + s), v the
    victims returned and s the pinned or busy keys it walks past.
    """

    __slots__ = ("_order",)
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()
        super().__init__(self._order)

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        order = self._order
        old = order.pop(key, None)
        if old is not None:
            self._bytes -= old
            self._pins.pop(key, None)
        order[key] = size
        self._bytes += size

    def on_access(self, key: Key, now: float = 0.0) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._bytes -= self._order.pop(key)
        self._pins.pop(key, None)

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0:
            return []
        return select_victims(self._order, self._order, self._pins, nbytes, can_evict)

    def self_check(self) -> None:
        self._check_sized(sum(self._order.values()))
