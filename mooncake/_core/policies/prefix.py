"""Prefix-closed LRU: KV blocks chained by ``parent`` are evicted tail first, orphans first.

Under longest-prefix lookup (vLLM, SGLang, LMCache chunk chains) block *k+1* can only be hit
if blocks *0..k* are all present. A flat policy that evicts a chain's head strands every block
behind it: they occupy memory and can never be hit again. This policy keeps the cache
*prefix-closed*:

- only leaves (objects with no tracked child) are proposed, so a chain is evicted tail first
  and a parent stays as long as any child it leads to;
- an object whose prefix is gone (its parent, or an ancestor's, is not tracked: removed
  explicitly, lost with its owner, or never inserted) is *unreachable*: unreachable leaves
  go before every reachable one, and :meth:`PrefixLRUPolicy.unreachable` lists them, tail
  first, for a caller that drops them eagerly;
- among equals, least recently used first (an insert counts as a use);
- soft pins: a soft-pinned leaf, and every ancestor it keeps alive, is proposed only after
  all unpinned candidates; a hard-pinned or busy (``can_evict`` false) leaf keeps its whole
  chain of ancestors.

Objects inserted without a parent are roots. A child may be inserted before its parent (it is
unreachable until the parent arrives). A parent link that would close a cycle raises
:class:`~mooncake.errors.InvalidArgumentError`.

Cost: ``on_insert``/``on_access``/``on_remove`` of a leaf O(log n) (a lazy heap of leaves by
(reachable, last use)); removing or inserting an object that has tracked descendants is
O(descendants) (their reachability flips); ``victims`` O((v + s) log n).
"""

from __future__ import annotations

import heapq

from mooncake._core.policies.base import (
    CanEvict,
    Key,
    Pin,
    SizedPolicy,
    check_size,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["PrefixLRUPolicy"]

# A heap entry: (reachable 0/1, tick of last use, key). Ticks are unique, so keys are never
# compared. An entry is current iff the key is tracked, a leaf, has that tick and that
# reachability; stale entries are skipped and dropped when the heap is rebuilt.
_Entry = tuple[int, int, Key]


class PrefixLRUPolicy(SizedPolicy):
    """Prefix-closed LRU (see the module docstring)."""

    __slots__ = (
        "_clock",
        "_dead",
        "_heap",
        "_kids",
        "_parent",
        "_size",
        "_tick",
    )
    name = "prefix-lru"
    prefix_closed = True

    def __init__(self) -> None:
        self._size: dict[Key, int] = {}
        super().__init__(self._size)
        self._parent: dict[Key, Key | None] = {}
        self._kids: dict[Key, set[Key]] = {}  # parent key (tracked or not) -> tracked children
        self._dead: set[Key] = set()  # tracked keys with a missing ancestor
        self._tick: dict[Key, int] = {}
        self._clock = 0
        self._heap: list[_Entry] = []

    # -- helpers --------------------------------------------------------------------------

    def _push(self, key: Key) -> None:
        heap = self._heap
        heapq.heappush(heap, (0 if key in self._dead else 1, self._tick[key], key))
        if len(heap) > 2 * len(self._size) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        dead, tick, kids = self._dead, self._tick, self._kids
        self._heap = [(0 if k in dead else 1, tick[k], k) for k in self._size if k not in kids]
        heapq.heapify(self._heap)

    def _current(self, entry: _Entry) -> bool:
        reach, tick, key = entry
        return (
            self._tick.get(key) == tick
            and key not in self._kids
            and (key not in self._dead) == (reach == 1)
        )

    def _descendants(self, key: Key) -> list[Key]:
        out: list[Key] = []
        kids = self._kids
        stack = list(kids.get(key, ()))
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(kids.get(k, ()))
        return out

    def _set_dead(self, keys: list[Key], dead: bool) -> None:
        dead_set, kids = self._dead, self._kids
        for k in keys:
            if (k in dead_set) != dead:
                if dead:
                    dead_set.add(k)
                else:
                    dead_set.discard(k)
                if k not in kids:
                    self._push(k)

    # -- events ---------------------------------------------------------------------------

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        if parent is not None and parent == key:
            raise InvalidArgumentError(f"{key!r} cannot be its own parent")
        kids = self._kids
        if parent is not None and key in kids:
            # Children arrived first: refuse a parent link that closes a cycle.
            p: Key | None = parent
            while p is not None:
                if p == key:
                    raise InvalidArgumentError(
                        f"parent {parent!r} of {key!r} descends from {key!r} (cycle)"
                    )
                if p not in self._size:
                    break
                p = self._parent[p]
        if key in self._size:
            self.on_remove(key)
        self._size[key] = size
        self._bytes += size
        self._parent[key] = parent
        self._clock += 1
        self._tick[key] = self._clock
        if parent is not None:
            siblings = kids.get(parent)
            if siblings is None:
                kids[parent] = {key}
            else:
                siblings.add(key)
            if parent not in self._size or parent in self._dead:
                self._dead.add(key)
        if key in kids:
            if key not in self._dead:
                self._set_dead(self._descendants(key), False)
        else:
            self._push(key)

    def on_access(self, key: Key, now: float = 0.0) -> None:
        tick = self._tick
        if key not in tick:
            raise KeyError(key)
        self._clock += 1
        tick[key] = self._clock
        if key not in self._kids:
            self._push(key)

    def on_remove(self, key: Key) -> None:
        self._bytes -= self._size.pop(key)
        del self._tick[key]
        self._pins.pop(key, None)
        self._dead.discard(key)
        parent = self._parent.pop(key)
        kids = self._kids
        if parent is not None:
            siblings = kids[parent]
            siblings.discard(key)
            if not siblings:
                del kids[parent]
                if parent in self._size:
                    self._push(parent)  # the parent just became a leaf
        if key in kids:
            self._set_dead(self._descendants(key), True)

    # -- queries --------------------------------------------------------------------------

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0 or not self._size:
            return []
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        if heap:
            # Fast path, the common case: the best leaf alone is enough.
            key = heap[0][2]
            if key not in self._pins and self._size[key] >= nbytes and can_evict(key):
                return [key]
        heap, pins, size, parent_of, kids, dead, tick = (
            self._heap,
            self._pins,
            self._size,
            self._parent,
            self._kids,
            self._dead,
            self._tick,
        )
        popped: list[_Entry] = []  # current entries taken off the heap; pushed back at the end
        fresh: list[_Entry] = []  # parents whose children are all victims by now
        soft: list[_Entry] = []  # soft-pinned candidates, and parents they free
        kids_left: dict[Key, int] = {}
        seen: set[Key] = set()
        out: list[Key] = []
        freed = 0
        try:
            for phase in (0, 1):
                while freed < nbytes:
                    if phase == 0:
                        while heap and not self._current(heap[0]):
                            heapq.heappop(heap)
                        if heap and (not fresh or heap[0] < fresh[0]):
                            entry = heapq.heappop(heap)
                            popped.append(entry)
                        elif fresh:
                            entry = heapq.heappop(fresh)
                        else:
                            break
                    elif soft:
                        entry = heapq.heappop(soft)
                    else:
                        break
                    key = entry[2]
                    if key in seen:
                        continue
                    seen.add(key)
                    pin = pins.get(key)
                    if pin is Pin.HARD or not can_evict(key):
                        continue
                    if pin is Pin.SOFT and phase == 0:
                        heapq.heappush(soft, entry)
                        seen.discard(key)
                        continue
                    out.append(key)
                    freed += size[key]
                    parent = parent_of[key]
                    if parent is not None and parent in size:
                        left = kids_left.get(parent)
                        if left is None:
                            left = len(kids[parent])
                        kids_left[parent] = left = left - 1
                        if left == 0:
                            parent_entry = (0 if parent in dead else 1, tick[parent], parent)
                            heapq.heappush(soft if phase else fresh, parent_entry)
                # Freed parents not reached in phase 0 compete in phase 1 with the soft ones.
                for entry in fresh:
                    heapq.heappush(soft, entry)
                fresh = []
        finally:
            for entry in popped:
                heapq.heappush(heap, entry)
        return out

    def unreachable(self) -> list[Key]:
        """Tracked keys with a missing ancestor, children before parents."""
        dead, kids, size, parent_of = self._dead, self._kids, self._size, self._parent
        out: list[Key] = []
        for root in dead:
            p = parent_of[root]
            if p is not None and p in size:
                continue  # not the top of an unreachable subtree
            # Post-order: every key after all of its descendants.
            stack: list[tuple[Key, bool]] = [(root, False)]
            while stack:
                k, expanded = stack.pop()
                if expanded:
                    out.append(k)
                else:
                    stack.append((k, True))
                    stack.extend((c, False) for c in kids.get(k, ()))
        return out

    def self_check(self) -> None:
        size, parent_of, kids = self._size, self._parent, self._kids
        self._check_sized(sum(size.values()))
        assert size.keys() == parent_of.keys() == self._tick.keys(), "per-key maps differ"
        expected: dict[Key, set[Key]] = {}
        for k, p in parent_of.items():
            if p is not None:
                expected.setdefault(p, set()).add(k)
        assert kids == expected, "child index differs from parent links"
        for k in size:
            chain: set[Key] = set()
            p = parent_of[k]
            while p is not None and p in size:
                assert p not in chain and p != k, f"cycle through {k!r}"
                chain.add(p)
                p = parent_of[p]
            assert (k in self._dead) == (p is not None), f"reachability of {k!r} is stale"
        current = {e[2] for e in self._heap if self._current(e)}
        leaves = {k for k in size if k not in kids}
        assert current == leaves, f"leaves missing from the heap: {leaves - current!r}"
