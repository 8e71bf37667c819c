"""Plain reference models of SIEVE and S3-FIFO for the property harness's oracles.

Each model is written for clarity (Python lists, linear scans), not speed, and follows the
behaviour the shipped policy documents: where its docstring leaves a choice open (where the
SIEVE hand rests after a round that ends on soft-pinned objects, when S3-FIFO's ghost queue
forgets a key), the model takes the shipped policy's choice, so the oracle is exact.

An oracle rebuilds its model from :attr:`mooncake.testing.policy.PolicyModel.log` (every event
the harness fed the policy, with the busy set of each past ``victims`` call) and asks it for the
victims of the current call: stateless, so it can be shared between examples.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mooncake._core.policies.base import Pin

Key = Hashable
CanEvict = Callable[[Hashable], bool]
Event = tuple[Any, ...]


class RefSieve:
    """SIEVE over a list (oldest first), a visited map and a hand (``None``: the tail)."""

    COUNTERS = ("laps",)

    def __init__(self) -> None:
        self.queue: list[Key] = []
        self.visited: dict[Key, bool] = {}
        self.size: dict[Key, int] = {}
        self.pins: dict[Key, Pin] = {}
        self.hand: Key | None = None
        self.laps = 0  # times the hand passed the newest object

    def insert(self, key: Key, size: int) -> None:
        if key in self.size:
            self.remove(key)
        self.queue.append(key)
        self.visited[key] = False
        self.size[key] = size

    def access(self, key: Key) -> None:
        self.visited[key] = True

    def remove(self, key: Key) -> None:
        i = self.queue.index(key)
        if self.hand == key:
            self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
            self.laps += self.hand is None
        del self.queue[i]
        del self.visited[key], self.size[key]
        self.pins.pop(key, None)

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        q = self.queue
        if nbytes <= 0 or not q:
            return []
        n = len(q)
        i = 0 if self.hand is None else q.index(self.hand)
        out: list[Key] = []
        deferred: list[Key] = []
        freed = 0
        idle = 0
        while idle < n:
            key = q[i]
            pin = self.pins.get(key, Pin.NONE)
            if key in out or pin is Pin.HARD or not can_evict(key):
                idle += 1
            elif pin is Pin.SOFT:
                if key not in deferred:
                    deferred.append(key)
                idle += 1
            elif self.visited[key]:
                self.visited[key] = False
                idle = 0
            else:
                out.append(key)
                freed += self.size[key]
                idle = 0
                if freed >= nbytes:
                    self.hand = q[i + 1] if i + 1 < n else None
                    self.laps += self.hand is None
                    return out
            i += 1
            if i == n:
                i = 0
                self.laps += 1
        self.hand = q[i]
        for key in deferred:
            out.append(key)
            freed += self.size[key]
            if freed >= nbytes:
                break
        return out


class RefS3FIFO:
    """S3-FIFO over lists: small queue S, main queue M, ghost queue G (oldest first)."""

    MAX_FREQ = 3
    GHOST_FLOOR = 16

    def __init__(self, small_ratio: float = 0.1) -> None:
        self.ratio = small_ratio
        self.small: list[Key] = []
        self.main: list[Key] = []
        self.ghost: list[Key] = []
        self.size: dict[Key, int] = {}
        self.freq: dict[Key, int] = {}
        self.pins: dict[Key, Pin] = {}
        self.evicting_small: set[Key] = set()

    def small_bytes(self) -> int:
        return sum(self.size[k] for k in self.small)

    def insert(self, key: Key, size: int) -> None:
        if key in self.size:
            self.remove(key)
        self.size[key] = size
        self.freq[key] = 0
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.append(key)
        else:
            self.small.append(key)

    def access(self, key: Key) -> None:
        self.freq[key] = min(self.freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: Key) -> None:
        del self.size[key], self.freq[key]
        self.pins.pop(key, None)
        if key in self.small:
            self.small.remove(key)
            if key in self.evicting_small:
                self.evicting_small.discard(key)
                self.ghost.append(key)
                limit = max(len(self.size), self.GHOST_FLOOR)
                del self.ghost[: max(0, len(self.ghost) - limit)]
        else:
            self.main.remove(key)
            self.evicting_small.discard(key)

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0 or not self.size:
            return []
        small, main, size, freq = self.small, self.main, self.size, self.freq
        s_bytes = self.small_bytes()
        all_bytes = sum(size.values())
        back_small: list[Key] = []
        back_main: list[Key] = []
        out: list[Key] = []
        from_small: set[Key] = set()
        deferred: list[tuple[Key, bool]] = []
        freed = 0
        while freed < nbytes and (small or main):
            if small and (not main or s_bytes >= self.ratio * all_bytes):
                key = small.pop(0)
                s_bytes -= size[key]
                if freq[key] > 0:
                    freq[key] = 0
                    main.append(key)
                    continue
                back_small.append(key)
                in_small = True
            else:
                key = main.pop(0)
                if freq[key] > 0:
                    freq[key] -= 1
                    main.append(key)
                    continue
                back_main.append(key)
                in_small = False
            all_bytes -= size[key]
            pin = self.pins.get(key, Pin.NONE)
            if pin is Pin.HARD or not can_evict(key):
                continue
            if pin is Pin.SOFT:
                deferred.append((key, in_small))
                continue
            out.append(key)
            freed += size[key]
            if in_small:
                from_small.add(key)
        for key, in_small in deferred:
            if freed >= nbytes:
                break
            out.append(key)
            freed += size[key]
            if in_small:
                from_small.add(key)
        self.small = back_small + small
        self.main = back_main + main
        self.evicting_small = from_small
        return out


Ref = RefSieve | RefS3FIFO


def _not_in(busy: frozenset[Key]) -> CanEvict:
    return lambda key: key not in busy


def replay(ref: Ref, log: Sequence[Event]) -> Ref:
    """Feed ``ref`` every event of a harness log (see ``PolicyModel.log``); return it."""
    for event in log:
        kind = event[0]
        if kind == "insert":
            ref.insert(event[1], event[2])
        elif kind == "access":
            ref.access(event[1])
        elif kind == "remove":
            ref.remove(event[1])
        elif kind == "pin":
            if event[2] is Pin.NONE:
                ref.pins.pop(event[1], None)
            else:
                ref.pins[event[1]] = event[2]
        elif kind == "victims":
            busy: frozenset[Key] = event[2]
            ref.victims(event[1], _not_in(busy))
    return ref
