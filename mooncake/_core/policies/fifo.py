"""First-in first-out eviction: the oldest insert goes first; hits do not matter."""

from __future__ import annotations

from mooncake._core.policies.base import Key
from mooncake._core.policies.lru import LRUPolicy

__all__ = ["FIFOPolicy"]


class FIFOPolicy(LRUPolicy):
    """First in, first out: evict the object inserted longest ago.

    LRU's bookkeeping (one ``OrderedDict`` in insertion order, O(1) events, ``victims`` O(v + s))
    with hits ignored. Re-inserting a key moves it to the back of the queue.
    """

    __slots__ = ()
    name = "fifo"

    def on_access(self, key: Key, now: float = 0.0) -> None:
        if key not in self._order:
            raise KeyError(key)
