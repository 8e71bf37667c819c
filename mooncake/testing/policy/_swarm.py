"""The fixed schedule's generator: one swarm configuration per sequence, steps drawn from
the state."""

from __future__ import annotations

import random

from mooncake._core.policies.base import Key, Pin
from mooncake.testing.policy._driver import IntLike, Op
from mooncake.testing.policy._model import KEYS, WIDE_KEYS, PolicyModel, _parent_of

DEFAULT_SCHEDULE = 300
"""Sequences of the fixed schedule :func:`check_policy` runs before hypothesis' search."""

_NBYTES = -2
"""An eviction round's ``nbytes`` placeholder: drawn once the steps before it ran."""
_SAME_NBYTES = -3
"""Placeholder: the ``nbytes`` of the eviction round just before (a re-eviction)."""
_VICTIM = "<victim>"
"""Key placeholder: one of the keys the eviction round just before proposed."""
_BUSY = "<busy>"
"""Key placeholder: a tracked key ``can_evict`` refuses now (a lease that can expire)."""

_BAD_SIZES: tuple[object, ...] = (-1, 1.5, True, -64, IntLike(-2), "3")
_BAD_PINS: tuple[object, ...] = (7, -1, "HARD")
_WEIGHTS: dict[str, float] = {
    "insert": 3.0,
    "access": 2.0,
    "remove": 0.7,
    "set_pin": 1.2,
    "set_busy": 0.8,
    "victims": 2.0,
    "bad_insert": 0.0,
    "bad_pin": 0.0,
    "bad_parent": 0.0,
}


class _Swarm:
    """One sequence's generator: a random configuration, then steps drawn from the state."""

    def __init__(self, rng: random.Random, bad_sizes: bool) -> None:
        self.rng = rng
        n = rng.choice((3, 5, 8, 16, 16, len(KEYS)))
        picked = set(rng.sample(range(len(KEYS)), n))
        self.pool = [k for i, k in enumerate(KEYS) if i in picked]
        weights = dict(_WEIGHTS)
        self.bad_sizes = bad_sizes
        if bad_sizes:
            weights["bad_insert"] = weights["bad_pin"] = weights["bad_parent"] = 0.8
        for kind in ("access", "remove", "set_pin", "set_busy"):
            weights[kind] = 0.0 if rng.random() < 0.3 else weights[kind] * rng.uniform(0.3, 2)
        self.kinds = list(weights)
        self.weights = list(weights.values())
        self.sizes = rng.choice(((1, 1), (0, 3), (0, 64), (0, 1), (2, 9)))
        self.p_chain = rng.choice((0.0, 0.6, 1.0, 1.0))
        self.p_burst = rng.choice((0.0, 0.15, 0.4))
        self.p_bias = rng.choice((0.0, 0.3, 0.6))

    def _size(self) -> int:
        return self.rng.randint(*self.sizes)

    def _insert(self, key: str) -> Op:
        size = self._size()
        sized: int | IntLike = size
        if self.bad_sizes and self.rng.random() < 0.3:
            sized = IntLike(size)
        return ("insert", key, sized, self.rng.random() < self.p_chain)

    def _key(self, model: PolicyModel) -> str:
        tracked = [k for k in self.pool if k in model.entries]
        if tracked and self.rng.random() < 0.9:
            return self.rng.choice(tracked)
        return self.rng.choice(self.pool)

    def _chain(self, key: str) -> list[str]:
        chain = [key]
        while (parent := _parent_of(chain[-1])) is not None and parent in self.pool:
            chain.append(parent)
        chain.reverse()
        return chain

    def _nbytes(self, model: PolicyModel) -> int:
        rng = self.rng
        evictable = model.evictable()
        # In insertion order, not set order: the schedule must not depend on str hashing.
        sizes = [e.size for k, e in model.entries.items() if k in evictable]
        possible = sum(sizes)
        pick = rng.random()
        if pick < 0.05:
            return rng.choice((-1, 0))
        if pick < 0.2 or not sizes:
            return 1
        if pick < 0.35:
            return rng.choice(sizes) or 1
        if pick < 0.55:
            return possible + rng.choice((0, 0, 1))
        if pick < 0.65:
            return max(1, possible - 1)
        return rng.randint(1, possible + 2)

    def steps(self, model: PolicyModel) -> list[Op]:
        rng = self.rng
        kind = rng.choices(self.kinds, self.weights)[0]
        if kind == "insert":
            untracked = [k for k in self.pool if k not in model.entries]
            if rng.random() < self.p_burst:
                if rng.random() < 0.5:
                    keys = self._chain(rng.choice(self.pool))
                    if rng.random() < 0.2:
                        keys.reverse()  # children before their parents
                else:
                    keys = rng.sample(self.pool, rng.randint(2, len(self.pool)))
                return [self._insert(k) for k in keys]
            pool = untracked if untracked and rng.random() < 0.7 else self.pool
            return [self._insert(rng.choice(pool))]
        if kind == "bad_insert":
            return [("bad_insert", self._key(model), rng.choice(_BAD_SIZES))]
        if kind == "bad_pin":
            return [("bad_pin", self._key(model), rng.choice(_BAD_PINS))]
        if kind == "bad_parent":
            key = self._key(model)
            below = [d for d in model.descendants(key) if d in model.entries]
            return [("bad_parent", key, rng.choice(below) if below and rng.random() < 0.7 else key)]
        if kind == "access" and model.entries and rng.random() < self.p_burst:
            # A run of hits (a hot key set): lazy structures grow and compact.
            hot: list[Key] = list(model.entries)
            return [("access", k) for k in rng.choices(hot, k=rng.randint(8, 60))]
        if kind in ("access", "remove"):
            return [(kind, self._key(model))]
        if kind == "set_pin":
            return [("set_pin", self._key(model), rng.choice((Pin.NONE, Pin.SOFT, Pin.HARD)))]
        if kind == "set_busy":
            return [("set_busy", self._key(model), rng.random() < 0.6)]
        out: list[Op] = []
        if rng.random() < self.p_bias and model.entries:
            # Eviction rounds in states that have pins and busy keys.
            target: Key = rng.choice(list(model.entries))
            if rng.random() < 0.5 and self.weights[self.kinds.index("set_pin")]:
                out.append(("set_pin", target, rng.choice((Pin.SOFT, Pin.HARD))))
            elif self.weights[self.kinds.index("set_busy")]:
                out.append(("set_busy", target, True))
        evict = rng.choice(("all", "all", "none", "first"))
        out.append(("victims", _NBYTES, evict))
        return out

    def resolve(self, op: Op, model: PolicyModel, last_nbytes: int, last: list[Key]) -> Op:
        """Fill in ``op``'s placeholders from the state the steps before it left."""
        if op[0] == "victims" and op[1] == _NBYTES:
            return ("victims", self._nbytes(model), op[2])
        return op


class _ShapeSwarm(_Swarm):
    """The shape schedule's generator: the rarer states a policy's shortcuts break in.

    Each sequence tracks 10 to 64 keys of :data:`WIDE_KEYS` from its first step (a bulk
    insert), often all of one size (uniform KV pages of 2, 4, 16 or 64 bytes) or of sizes
    above 8 bytes; eviction rounds ask, half the time, for exactly the sizes of the first
    ``k >= 2`` unpinned evictable keys in an LRU, FIFO, LFU or random order, or one byte more
    or less; and *re-evictions* ask an eviction round, change a lease or pin (of a proposed
    victim, or a lease ending) and ask the same round again at once.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        n = rng.choice((10, 16, 24, 32, 48, 64))
        picked = set(rng.sample(range(len(WIDE_KEYS)), n))
        self.pool = [k for i, k in enumerate(WIDE_KEYS) if i in picked]
        self.bad_sizes = False
        weights = {**_WEIGHTS, "recheck": 2.5}
        for kind in ("access", "remove", "set_pin", "set_busy"):
            weights[kind] = 0.0 if rng.random() < 0.3 else weights[kind] * rng.uniform(0.3, 2)
        self.kinds = list(weights)
        self.weights = list(weights.values())
        self.sizes = rng.choice(
            ((2, 2), (4, 4), (16, 16), (64, 64), (2, 2), (16, 16), (9, 64), (0, 64), (1, 1))
        )
        self.p_chain = rng.choice((0.0, 0.6, 1.0))
        self.p_burst = rng.choice((0.3, 0.5))
        self.p_bias = rng.choice((0.3, 0.6))
        self.started = False

    def _nbytes(self, model: PolicyModel) -> int:
        rng = self.rng
        if rng.random() >= 0.5:
            return super()._nbytes(model)
        evictable = model.evictable()
        entries = model.entries
        keys = [k for k in entries if k in evictable and not model.soft(k)]
        order = rng.randrange(4)
        if order == 0:
            keys.sort(key=lambda k: entries[k].last_use)
        elif order == 1:
            keys.sort(key=lambda k: entries[k].inserted)
        elif order == 2:
            keys.sort(key=lambda k: (entries[k].uses, entries[k].last_use))
        else:
            rng.shuffle(keys)
        k = rng.randint(2, min(8, len(keys))) if len(keys) >= 2 else 1
        exact = sum(entries[key].size for key in keys[:k])
        return max(1, exact + rng.choice((-1, 0, 0, 1)))

    def steps(self, model: PolicyModel) -> list[Op]:
        rng = self.rng
        if not self.started or len(model.entries) < 10:
            self.started = True
            keys = rng.sample(self.pool, rng.randint(10, len(self.pool)))
            return [self._insert(k) for k in keys]
        kind = rng.choices(self.kinds, self.weights)[0]
        if kind != "recheck":
            return super().steps(model)
        change = rng.randrange(5)
        if change == 0:
            step: Op = ("set_busy", _VICTIM, True)  # a lease granted on a proposed victim
        elif change == 1:
            step = ("set_busy", _BUSY, False)  # a lease expires
        elif change == 2:
            step = ("set_pin", _VICTIM, rng.choice((Pin.SOFT, Pin.HARD)))
        elif change == 3:
            pinned = [k for k, e in model.entries.items() if e.pin is not Pin.NONE]
            step = ("set_pin", rng.choice(pinned) if pinned else _VICTIM, Pin.NONE)
        else:
            step = ("set_busy", self._key(model), True)
        evict = rng.choice(("all", "none", "first"))
        return [("victims", _NBYTES, "none"), step, ("victims", _SAME_NBYTES, evict)]

    def resolve(self, op: Op, model: PolicyModel, last_nbytes: int, last: list[Key]) -> Op:
        if op[0] == "victims" and op[1] == _SAME_NBYTES:
            return ("victims", last_nbytes, op[2])
        if op[1] == _VICTIM:
            pool = last or list(model.entries)
            return (op[0], self.rng.choice(pool), *op[2:])
        if op[1] == _BUSY:
            busy = [k for k in model.entries if k in model.busy]
            return (op[0], self.rng.choice(busy) if busy else self._key(model), *op[2:])
        return super().resolve(op, model, last_nbytes, last)
