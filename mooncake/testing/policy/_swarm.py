"""The fixed schedule's generator: one swarm configuration per sequence, steps drawn from
the state."""

from __future__ import annotations

import random

from mooncake._core.policies.base import Key, Pin
from mooncake.testing.policy._driver import IntLike, Op
from mooncake.testing.policy._model import KEYS, PolicyModel, _parent_of

DEFAULT_SCHEDULE = 300
"""Sequences of the fixed schedule :func:`check_policy` runs before hypothesis' search."""

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
        out.append(("victims", -2, evict))  # nbytes drawn once the steps before it ran
        return out
