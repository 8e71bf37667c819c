"""SIEVE eviction (Zhang et al., NSDI'24): a FIFO queue, one visited bit and a moving hand."""

from __future__ import annotations

from mooncake._core.policies.base import (
    CanEvict,
    Key,
    Pin,
    SizedPolicy,
    check_size,
)

__all__ = ["SIEVEPolicy"]


class _Node:
    __slots__ = ("key", "newer", "older", "size", "visited")

    def __init__(self, key: Key, size: int) -> None:
        self.key = key
        self.size = size
        self.visited = False
        self.newer: _Node | None = None
        self.older: _Node | None = None


class SIEVEPolicy(SizedPolicy):
    """SIEVE: new objects enter at the head of a queue; a hit only sets a visited bit.

    To evict, a hand walks from the tail (oldest) toward the head: a visited object loses
    its bit and stays where it is, the first unvisited one is the victim, and the hand keeps
    its place for the next round (wrapping to the tail past the head). Objects the hand may
    not evict now (hard-pinned, or ``can_evict`` false) are passed over with their bit kept;
    soft-pinned ones are taken, in the order met, after one full lap finds nothing else.

    Doubly linked list + dict: every event is O(1); ``victims`` walks at most about two laps
    past non-evictable objects, O(v + s) amortised in practice.

    ``laps`` counts how often the hand has passed the newest object and wrapped to the oldest.
    With nothing pinned or refused by ``can_evict``, until the first wrap SIEVE proposes
    exactly what LFU (least-recently-used ties) would: every object behind the hand was hit
    since its insert, so the first unvisited one ahead of it is the oldest never-hit object,
    LFU's first victim (``docs/replay.md`` works this through).
    """

    __slots__ = ("_hand", "_head", "_nodes", "_tail", "laps")
    name = "sieve"

    def __init__(self) -> None:
        self._nodes: dict[Key, _Node] = {}
        super().__init__(self._nodes)
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None  # next node the hand examines; None = the tail
        self.laps = 0

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        if key in self._nodes:
            self.on_remove(key)
        node = _Node(key, size)
        head = self._head
        node.older = head
        if head is None:
            self._tail = node
        else:
            head.newer = node
        self._head = node
        self._nodes[key] = node
        self._bytes += size

    def on_access(self, key: Key, now: float = 0.0) -> None:
        self._nodes[key].visited = True

    def on_remove(self, key: Key) -> None:
        node = self._nodes.pop(key)
        self._pins.pop(key, None)
        self._bytes -= node.size
        newer, older = node.newer, node.older
        if self._hand is node:
            # SIEVE: after evicting at the hand, the hand continues toward the head.
            self._hand = newer
            if newer is None:
                self.laps += 1
        if newer is None:
            self._head = older
        else:
            newer.older = older
        if older is None:
            self._tail = newer
        else:
            older.newer = newer
        node.newer = node.older = None

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0 or self._tail is None:
            return []
        pins = self._pins
        tail = self._tail
        node: _Node = self._hand or tail
        n = len(self._nodes)
        out: list[Key] = []
        chosen: set[Key] = set()
        deferred: list[_Node] = []
        deferred_keys: set[Key] = set()
        freed = 0
        idle = 0  # nodes passed since the last bit cleared or victim chosen
        while idle < n:
            key = node.key
            if key in chosen:
                idle += 1
            else:
                pin = pins.get(key)
                if pin is Pin.HARD or not can_evict(key):
                    idle += 1
                elif pin is Pin.SOFT:
                    if key not in deferred_keys:
                        deferred_keys.add(key)
                        deferred.append(node)
                    idle += 1
                elif node.visited:
                    node.visited = False
                    idle = 0
                else:
                    out.append(key)
                    chosen.add(key)
                    freed += node.size
                    idle = 0
                    if freed >= nbytes:
                        self._hand = node.newer
                        if node.newer is None:
                            self.laps += 1
                        return out
            if node.newer is None:
                self.laps += 1
            node = node.newer or tail
        self._hand = node
        for soft in deferred:
            out.append(soft.key)
            freed += soft.size
            if freed >= nbytes:
                break
        return out

    def self_check(self) -> None:
        seen = 0
        total = 0
        node = self._tail
        prev: _Node | None = None
        while node is not None:
            assert self._nodes.get(node.key) is node, f"list node {node.key!r} not in the map"
            assert node.older is prev, f"broken back link at {node.key!r}"
            seen += 1
            total += node.size
            assert seen <= len(self._nodes), "cycle in the queue"
            prev, node = node, node.newer
        assert prev is self._head, "head is not the newest node"
        assert seen == len(self._nodes), "queue length differs from the map"
        self._check_sized(total)
        hand = self._hand
        assert hand is None or self._nodes.get(hand.key) is hand, "hand on a removed node"
