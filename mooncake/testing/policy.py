"""Property tests for eviction policies: :func:`check_policy` drives a policy and checks it.

The harness drives a policy through sequences of inserts (with and without prefix parents),
accesses, removals, pin changes, lease/incomplete flips, refused bad sizes and eviction rounds,
keeps its own model of what the policy should track, and after every step checks:

- bookkeeping: ``len(policy)``, ``key in policy``, ``total_bytes`` match the model, and
  ``policy.self_check()`` passes; events on untracked keys raise ``KeyError``; a negative,
  float or bool size raises :class:`~mooncake.errors.InvalidArgumentError` and changes nothing;
- every ``victims(nbytes, can_evict)`` answer: tracked keys only, no duplicates; never a
  hard-pinned key or one with ``can_evict(key)`` false (leased or incomplete); ``can_evict``
  asked only about tracked keys; soft-pinned keys only after every evictable unpinned key;
  at least ``nbytes`` freed when the evictable keys allow it and nothing past the first
  prefix that does, else every evictable key; nothing for ``nbytes <= 0``;
- for policies with ``prefix_closed = True``: children before parents (evicting the victims
  in order never removes a key that still has a tracked child), keys whose prefix is gone
  before keys still reachable, and a key whose descendant is pinned or busy counts as
  pinned or busy itself;
- an optional policy-specific oracle: ``oracle(model, nbytes)`` returns the exact victim list
  the policy must propose (or ``None`` to skip). :func:`lru_oracle`, :func:`fifo_oracle`,
  :func:`lfu_oracle`, :func:`sieve_oracle`, :func:`s3fifo_oracle` and
  :func:`prefix_lru_oracle` are the shipped policies' oracles (:data:`ORACLES` by name).

Two searches run, in order:

1. a fixed *schedule* of generated sequences (``schedule`` of them, from seeds 0, 1, 2, ...:
   the same sequences on every run, whatever the policy's name or the process state). Each
   sequence is a *swarm* configuration: it draws which kinds of step it uses and how often,
   a subset of the key pool, a size regime (unit, small, wide, zeros), how often inserts are
   chained to their prefix parent, and how often state is built in bulk (a burst of inserts,
   a whole chain at once); eviction rounds are biased to states with pins and busy keys and
   ask for boundary byte counts (1, one key's size, every evictable byte, one more). A
   violation is shrunk (steps removed, arguments simplified, same failure kept) and reported
   as hypothesis-style ``state.insert(...)`` steps plus a script to paste;
2. hypothesis' stateful search (``max_examples`` random sequences of up to
   ``stateful_step_count`` steps; ``derandomize`` and ``settings_`` as in hypothesis), which
   shrinks its own counter-examples.

A failure raises ``AssertionError`` naming the broken rule, with the shrunk sequence of steps
in its ``__notes__`` (pytest prints them). Needs the ``test`` extra (``hypothesis``); refuses
to run under ``python -O``, where its assertions would vanish.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mooncake._core.policies.base import EvictionPolicy, Key, Pin
from mooncake.errors import InvalidArgumentError
from mooncake.testing import _policy_ref

__all__ = [
    "DEFAULT_SCHEDULE",
    "KEYS",
    "ORACLES",
    "ModelEntry",
    "Oracle",
    "PolicyModel",
    "check_policy",
    "fifo_oracle",
    "lfu_oracle",
    "lru_oracle",
    "prefix_lru_oracle",
    "s3fifo_oracle",
    "sieve_oracle",
]

KEYS: tuple[str, ...] = (
    "a",
    "a/a",
    "a/b",
    "a/a/a",
    "a/a/b",
    "a/b/a",
    "a/a/a/a",
    "b",
    "b/a",
    "b/a/a",
    "a/a/a/a/a",
    "a/b/b",
    "b/b",
    "c",
    "c/a",
    "c/a/a",
    "d",
    "d/a",
    "d/a/a",
    "d/b",
    "e",
    "e/a",
    "e/a/a",
    "e/a/a/a",
    "f",
    "f/a",
    "g",
    "g/a",
    "h",
    "h/a",
    "h/b",
    "i",
)
"""The key pool: a prefix forest of 32 keys (chains up to five deep, fan-out up to two; more
keys than S3-FIFO's ghost queue keeps); a key's parent is the key without its last segment."""


def _parent_of(key: str) -> str | None:
    head, sep, _ = key.rpartition("/")
    return head if sep else None


@dataclass
class ModelEntry:
    """What the harness knows about one tracked key."""

    size: int
    parent: Key | None
    pin: Pin
    inserted: int
    """Logical time of the (last) insert."""
    last_use: int
    """Logical time of the last insert or access."""
    uses: int
    """1 + accesses since the last insert."""


@dataclass
class PolicyModel:
    """The harness's reference state; oracles read it.

    ``entries`` is in insertion order; ``busy`` holds keys the caller may not evict now
    (leased or incomplete: ``can_evict`` false), tracked or not. ``log`` lists every event
    fed to the policy so far, for oracles that replay a reference model:
    ``("insert", key, size, parent)``, ``("access", key)``, ``("remove", key)``,
    ``("pin", key, pin)`` and ``("victims", nbytes, frozenset(busy))``.
    """

    prefix_closed: bool
    entries: dict[Key, ModelEntry] = field(default_factory=dict)
    busy: set[Key] = field(default_factory=set)
    clock: int = 0
    log: list[tuple[Any, ...]] = field(default_factory=list)
    policy: Any = field(default=None, repr=False, compare=False)
    """The policy under test, for oracles that also compare its counters (SIEVE's ``laps``)."""
    refs: dict[str, tuple[Any, int]] = field(default_factory=dict, repr=False, compare=False)
    """Reference models the oracles keep up to date with ``log`` (name -> model, events fed)."""

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def can_evict(self, key: Key) -> bool:
        return key not in self.busy

    def children(self, key: Key) -> list[Key]:
        """Tracked keys whose parent is ``key`` (empty unless prefix-closed)."""
        if not self.prefix_closed:
            return []
        return [k for k, e in self.entries.items() if e.parent == key]

    def descendants(self, key: Key) -> list[Key]:
        out: list[Key] = []
        stack = self.children(key)
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self.children(k))
        return out

    def base_evictable(self, key: Key) -> bool:
        """Tracked, not hard-pinned, and ``can_evict``."""
        entry = self.entries.get(key)
        return entry is not None and entry.pin is not Pin.HARD and self.can_evict(key)

    def evictable(self) -> set[Key]:
        """Keys the policy may propose (for prefix-closed: with every descendant too)."""
        return {
            k
            for k in self.entries
            if self.base_evictable(k) and all(self.base_evictable(d) for d in self.descendants(k))
        }

    def soft(self, key: Key) -> bool:
        """Soft-pinned, or (prefix-closed) with a soft-pinned descendant."""
        keys = [key, *self.descendants(key)]
        return any(self.entries[k].pin is Pin.SOFT for k in keys)

    def reachable(self, key: Key) -> bool:
        """Every ancestor named by ``parent`` links is tracked (always true if not prefix-closed)."""
        if not self.prefix_closed:
            return True
        seen = {key}
        parent = self.entries[key].parent
        while parent is not None:
            entry = self.entries.get(parent)
            if entry is None or parent in seen:
                return False
            seen.add(parent)
            parent = entry.parent
        return True

    def select(self, order: Iterable[Key], nbytes: int) -> list[Key]:
        """The contract's victim list when the policy's preference order is ``order``."""
        if nbytes <= 0:
            return []
        out: list[Key] = []
        deferred: list[Key] = []
        freed = 0
        for phase in (0, 1):
            for key in order if phase == 0 else deferred:
                if not self.base_evictable(key):
                    continue
                if phase == 0 and self.entries[key].pin is Pin.SOFT:
                    deferred.append(key)
                    continue
                out.append(key)
                freed += self.entries[key].size
                if freed >= nbytes:
                    return out
        return out


Oracle = Callable[[PolicyModel, int], list[Key] | None]
"""``oracle(model, nbytes)``: the exact victims expected, or ``None`` to skip the check."""


def lru_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Least recently used (insert or access) first."""
    order = sorted(model.entries, key=lambda k: model.entries[k].last_use)
    return model.select(order, nbytes)


def fifo_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Oldest insert first."""
    order = sorted(model.entries, key=lambda k: model.entries[k].inserted)
    return model.select(order, nbytes)


def lfu_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Fewest uses first, then least recently used. A policy with a ``frequency(key)`` method
    (:class:`~mooncake.policies.LFUPolicy`) must also report each key's use count."""
    frequency = getattr(model.policy, "frequency", None)
    if frequency is not None:
        for k, e in model.entries.items():
            got = frequency(k)
            assert got == e.uses, f"frequency({k!r}) = {got!r}, but it was used {e.uses} times"
    order = sorted(model.entries, key=lambda k: (model.entries[k].uses, model.entries[k].last_use))
    return model.select(order, nbytes)


def prefix_lru_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """Leaves only, unreachable before reachable, least recently used first; soft pins last.

    Evicting a leaf may turn its parent into a leaf, which then competes by its own last use.
    Once no unpinned leaf is left, soft-pinned leaves (and the parents they free) follow.
    """
    if nbytes <= 0:
        return []
    remaining = set(model.entries)
    reach = {k: model.reachable(k) for k in remaining}
    out: list[Key] = []
    freed = 0
    soft_phase = False
    while freed < nbytes:
        candidates = [
            k
            for k in remaining
            if model.base_evictable(k)
            and not any(c in remaining for c in model.children(k))
            and (soft_phase or model.entries[k].pin is not Pin.SOFT)
        ]
        if not candidates:
            if soft_phase:
                break
            soft_phase = True
            continue
        key = min(candidates, key=lambda k: (reach[k], model.entries[k].last_use))
        out.append(key)
        remaining.discard(key)
        freed += model.entries[key].size
    return out


def _reference(model: PolicyModel, name: str, make: Callable[[], Any], nbytes: int) -> list[Key]:
    """Bring the reference model ``name`` up to date with ``model.log`` and ask it for the
    victims of the ``victims`` call being checked (the log's next event, which it then skips:
    the reference has already answered it, with the same busy set). The policy has answered
    that call already, so counters both keep (``COUNTERS``) must agree."""
    ref, fed = model.refs.get(name) or (make(), 0)
    _policy_ref.replay(ref, model.log[fed:])
    out: list[Key] = ref.victims(nbytes, model.can_evict)
    # Called after the policy answered the same call: its counters must agree now.
    for counter in getattr(ref, "COUNTERS", ()):
        if hasattr(model.policy, counter):
            got, want = getattr(model.policy, counter), getattr(ref, counter)
            assert got == want, f"{counter} = {got!r}, reference model says {want!r}"
    model.refs[name] = (ref, len(model.log) + 1)
    return out


def sieve_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """SIEVE (NSDI'24) as :class:`~mooncake.policies.SIEVEPolicy` documents it, hand and all:
    the model's log replayed on a plain reference model."""
    return _reference(model, "sieve", _policy_ref.RefSieve, nbytes)


def s3fifo_oracle(model: PolicyModel, nbytes: int) -> list[Key]:
    """S3-FIFO (SOSP'23) with ``small_ratio=0.1`` as :class:`~mooncake.policies.S3FIFOPolicy`
    documents it: the model's log replayed on a plain reference model."""
    return _reference(model, "s3fifo", _policy_ref.RefS3FIFO, nbytes)


ORACLES: dict[str, Oracle] = {
    "lru": lru_oracle,
    "lfu": lfu_oracle,
    "fifo": fifo_oracle,
    "sieve": sieve_oracle,
    "s3fifo": s3fifo_oracle,
    "prefix-lru": prefix_lru_oracle,
}
"""The exact oracle of each shipped policy (default parameters), by registry name."""


def check_victims(
    model: PolicyModel, nbytes: int, victims: Sequence[Key], oracle: Any = None
) -> None:
    """Assert that ``victims`` keeps the contract for ``model`` (see module docstring)."""
    assert isinstance(victims, list), f"victims() returned {type(victims).__name__}, not a list"
    assert len(set(victims)) == len(victims), f"duplicate victims: {victims!r}"
    phantom = [k for k in victims if k not in model.entries]
    assert not phantom, f"victims not tracked (phantom): {phantom!r}"
    if nbytes <= 0:
        assert victims == [], f"victims({nbytes}) must be empty, got {victims!r}"
        return
    for k in victims:
        pin = model.entries[k].pin
        assert pin is not Pin.HARD, f"proposed hard-pinned {k!r}"
        assert model.can_evict(k), f"proposed {k!r} although can_evict({k!r}) is false"
    if model.prefix_closed:
        gone: set[Key] = set()
        for k in victims:
            kids = [c for c in model.children(k) if c not in gone]
            assert not kids, f"proposed {k!r} before its children {kids!r} (not tail first)"
            gone.add(k)
    evictable = model.evictable()
    outside = [k for k in victims if k not in evictable]
    assert not outside, f"proposed {outside!r}, which a busy or pinned descendant protects"
    sizes = [model.entries[k].size for k in victims]
    freed = sum(sizes)
    possible = sum(model.entries[k].size for k in evictable)
    if possible >= nbytes:
        assert freed >= nbytes, (
            f"asked {nbytes} bytes, {possible} evictable, victims {victims!r} free only {freed}"
        )
        assert freed - sizes[-1] < nbytes, (
            f"asked {nbytes} bytes; victims {victims!r} go past the first prefix that frees them"
        )
    else:
        missing = evictable - set(victims)
        assert not missing, (
            f"asked {nbytes} > {possible} evictable bytes: every evictable key should be "
            f"proposed, missing {sorted(map(repr, missing))}"
        )
    softs = [model.soft(k) for k in victims]
    if True in softs:
        first_soft = softs.index(True)
        late = [k for k, s in zip(victims[first_soft:], softs[first_soft:], strict=True) if not s]
        assert not late, f"unpinned {late!r} proposed after a soft-pinned victim: {victims!r}"
        unpinned_left = [k for k in evictable if not model.soft(k) and k not in victims]
        assert not unpinned_left, (
            f"soft-pinned victim proposed while unpinned {unpinned_left!r} stay: {victims!r}"
        )
    if model.prefix_closed:
        hard = [k for k, s in zip(victims, softs, strict=True) if not s]
        reach = [model.reachable(k) for k in hard]
        if True in reach:
            before = set(hard[: reach.index(True)])
            dead = [
                k
                for k in evictable
                if not model.soft(k) and not model.reachable(k) and k not in before
            ]
            assert not dead, (
                f"reachable {hard[reach.index(True)]!r} proposed before unreachable {dead!r}"
            )
    if oracle is not None:
        expected = oracle(model, nbytes)
        if expected is not None:
            assert victims == expected, f"victims({nbytes}) = {victims!r}, oracle says {expected!r}"


Op = tuple[Any, ...]
"""One step of a sequence: ``(rule, *args)``, the rules of :class:`PolicyMachine`."""

_ARGS: dict[str, tuple[str, ...]] = {
    "insert": ("key", "size", "chained"),
    "access": ("key",),
    "remove": ("key",),
    "set_pin": ("key", "pin"),
    "set_busy": ("key", "busy"),
    "victims": ("nbytes", "evict"),
    "bad_insert": ("key", "size"),
    "bad_pin": ("key", "pin"),
    "bad_parent": ("key", "parent"),
}


class IntLike:
    """An integer-like size that is not an ``int`` (as ``numpy.int64``): ``__index__`` only."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"IntLike({self.value})"


class _Driver:
    """Feeds one policy and the model the same steps and checks the policy after each."""

    def __init__(self, policy: EvictionPolicy, oracle: Any) -> None:
        self.policy = policy
        self.oracle = oracle
        self.model = PolicyModel(prefix_closed=bool(getattr(policy, "prefix_closed", False)))
        self.model.policy = policy

    def apply(self, op: Op) -> None:
        getattr(self, op[0])(*op[1:])

    def _expect_key_error(self, call: Callable[[], object], what: str) -> None:
        try:
            call()
        except KeyError:
            return
        raise AssertionError(f"{what} on an untracked key did not raise KeyError")

    def insert(self, key: str, size: int, chained: bool) -> None:
        parent = _parent_of(key) if chained else None
        model = self.model
        now = model.tick()
        self.policy.on_insert(key, size, parent=parent, now=float(now))
        size = operator.index(size)
        model.entries.pop(key, None)
        model.entries[key] = ModelEntry(size, parent, Pin.NONE, now, now, 1)
        model.log.append(("insert", key, size, parent))

    def bad_insert(self, key: str, size: object) -> None:
        try:
            self.policy.on_insert(key, size, now=0.0)  # type: ignore[arg-type]
        except InvalidArgumentError:
            return
        raise AssertionError(f"on_insert({key!r}, {size!r}) did not raise InvalidArgumentError")

    def bad_parent(self, key: str, parent: str) -> None:
        """A parent link that closes a cycle (``parent`` is ``key`` or descends from it): a
        prefix-closed policy refuses it and changes nothing; others ignore parents."""
        model = self.model
        if not model.prefix_closed:
            return
        try:
            self.policy.on_insert(key, 1, parent=parent, now=0.0)
        except InvalidArgumentError:
            return
        raise AssertionError(
            f"on_insert({key!r}, parent={parent!r}) closes a cycle but did not raise "
            "InvalidArgumentError"
        )

    def bad_pin(self, key: str, pin: object) -> None:
        entry = self.model.entries.get(key)
        try:
            self.policy.set_pin(key, pin)  # type: ignore[arg-type]
        except (InvalidArgumentError, KeyError) as exc:
            if isinstance(exc, KeyError) and entry is not None:
                raise
            return
        raise AssertionError(f"set_pin({key!r}, {pin!r}) did not raise InvalidArgumentError")

    def access(self, key: str) -> None:
        model = self.model
        entry = model.entries.get(key)
        if entry is None:
            self._expect_key_error(lambda: self.policy.on_access(key, 0.0), "on_access")
            return
        now = model.tick()
        self.policy.on_access(key, float(now))
        entry.last_use = now
        entry.uses += 1
        model.log.append(("access", key))

    def remove(self, key: str) -> None:
        model = self.model
        if key not in model.entries:
            self._expect_key_error(lambda: self.policy.on_remove(key), "on_remove")
            return
        self.policy.on_remove(key)
        del model.entries[key]
        model.log.append(("remove", key))

    def set_pin(self, key: str, pin: Pin) -> None:
        model = self.model
        entry = model.entries.get(key)
        if entry is None:
            self._expect_key_error(lambda: self.policy.set_pin(key, pin), "set_pin")
            return
        self.policy.set_pin(key, pin)
        entry.pin = pin
        model.log.append(("pin", key, pin))

    def set_busy(self, key: str, busy: bool) -> None:
        if busy:
            self.model.busy.add(key)
        else:
            self.model.busy.discard(key)

    def victims(self, nbytes: int, evict: str) -> None:
        model = self.model
        asked: list[Hashable] = []

        def can_evict(key: Hashable) -> bool:
            asked.append(key)
            return model.can_evict(key)

        victims = self.policy.victims(nbytes, can_evict)
        strays = [k for k in asked if k not in model.entries]
        assert not strays, f"can_evict asked about untracked keys {strays!r}"
        check_victims(model, nbytes, victims, self.oracle)
        model.log.append(("victims", nbytes, frozenset(model.busy)))
        chosen = victims if evict == "all" else victims[:1] if evict == "first" else []
        for key in chosen:
            self.policy.on_remove(key)
            del model.entries[key]
            model.log.append(("remove", key))

    def check(self) -> None:
        policy, model = self.policy, self.model
        entries = model.entries
        assert len(policy) == len(entries), f"len(policy) = {len(policy)}, model {len(entries)}"
        for key in KEYS:
            assert (key in policy) == (key in entries), f"membership of {key!r} disagrees"
        total = sum(e.size for e in entries.values())
        assert policy.total_bytes == total, f"total_bytes {policy.total_bytes}, model {total}"
        policy.self_check()
        dead = policy.unreachable()
        assert len(set(dead)) == len(dead), f"unreachable() has duplicates: {dead!r}"
        if model.prefix_closed:
            expected = {k for k in entries if not model.reachable(k)}
            assert set(dead) == expected, (
                f"unreachable() = {dead!r}, model {sorted(map(repr, expected))}"
            )
            for i, gone in enumerate(dead):
                later = [c for c in model.children(gone) if c in dead[i:]]
                assert not later, f"unreachable() lists {gone!r} before its children {later!r}"
        else:
            assert dead == [], f"unreachable() = {dead!r} from a policy that is not prefix-closed"


class PolicyMachine(RuleBasedStateMachine):
    """The state machine :func:`check_policy` runs; subclassed per policy factory."""

    factory: Callable[[], EvictionPolicy]
    oracle: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.driver = _Driver(type(self).factory(), type(self).oracle)
        self.policy = self.driver.policy
        self.model = self.driver.model

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 64), chained=st.booleans())
    def insert(self, key: str, size: int, chained: bool) -> None:
        self.driver.insert(key, size, chained)

    @rule(key=st.sampled_from(KEYS))
    def access(self, key: str) -> None:
        self.driver.access(key)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        self.driver.remove(key)

    @rule(key=st.sampled_from(KEYS), pin=st.sampled_from(Pin))
    def set_pin(self, key: str, pin: Pin) -> None:
        self.driver.set_pin(key, pin)

    @rule(key=st.sampled_from(KEYS), busy=st.booleans())
    def set_busy(self, key: str, busy: bool) -> None:
        """A lease granted or expired, or a put started or completed: ``can_evict`` flips."""
        self.driver.set_busy(key, busy)

    @rule(nbytes=st.integers(-1, 300), evict=st.sampled_from(("all", "none", "first")))
    def victims(self, nbytes: int, evict: str) -> None:
        self.driver.victims(nbytes, evict)

    @invariant()
    def bookkeeping(self) -> None:
        self.driver.check()


# -- the fixed schedule ---------------------------------------------------------------------

_SHRINK = True  # the mutation run turns it off: it only needs to know that a failure exists

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


def _run(
    factory: Callable[[], EvictionPolicy], oracle: Any, ops: Sequence[Op]
) -> BaseException | None:
    """Replay ``ops`` on a fresh policy; the first failure, or ``None``."""
    try:
        driver = _Driver(factory(), oracle)
        driver.check()
        for op in ops:
            driver.apply(op)
            driver.check()
    except Exception as exc:
        return exc
    return None


def _explore(
    factory: Callable[[], EvictionPolicy], oracle: Any, seed: int, length: int, bad_sizes: bool
) -> tuple[list[Op], BaseException] | None:
    """Run the schedule's sequence ``seed``; the steps and the failure, or ``None``."""
    rng = random.Random(seed)
    swarm = _Swarm(rng, bad_sizes)
    ops: list[Op] = []
    try:
        driver = _Driver(factory(), oracle)
        driver.check()
        for _ in range(rng.randint(length // 3, length)):
            for op in swarm.steps(driver.model):
                if op[0] == "victims" and op[1] == -2:
                    op = ("victims", swarm._nbytes(driver.model), op[2])
                ops.append(op)
                driver.apply(op)
                driver.check()
    except Exception as exc:
        return ops, exc
    return None


_NOISE = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|\([^)]*\)|-?\d+")


def _kind(exc: BaseException) -> str:
    """What a failure is, without the keys and numbers of one example."""
    return f"{type(exc).__name__}:{_NOISE.sub('_', str(exc))}"


def _simpler(op: Op) -> list[Op]:
    """Candidate simplifications of one step (smaller sizes, plainer arguments)."""
    name = op[0]
    out: list[Op] = []
    if name == "insert":
        _, key, size, chained = op
        out += [("insert", key, s, chained) for s in (0, 1, size // 2) if s < size]
        if chained:
            out.append(("insert", key, size, False))
    elif name == "victims":
        _, nbytes, evict = op
        out += [("victims", n, evict) for n in (1, nbytes // 2, nbytes - 1) if 0 < n < nbytes]
        if evict != "all":
            out.append(("victims", nbytes, "all"))
    elif name == "set_pin" and op[2] is Pin.SOFT:
        out.append(("set_pin", op[1], Pin.HARD))
    return out


def _weight(ops: list[Op]) -> tuple[int, int]:
    """What shrinking minimises: steps, then the sizes and byte counts in them."""
    return len(ops), sum(
        abs(op[2])
        if op[0] == "insert" and type(op[2]) is int
        else abs(op[1])
        if op[0] == "victims"
        else 0
        for op in ops
    )


def _bulk_candidates(ops: list[Op]) -> Iterator[list[Op]]:
    """Whole-sequence simplifications single-step edits cannot reach (an early eviction round
    that only works with these exact sizes): every size 0 or 1, no eviction round but the
    last, both; then every step of one key dropped."""
    last = max((i for i, op in enumerate(ops) if op[0] == "victims"), default=-1)

    def sized(size: int, seq: list[Op]) -> list[Op]:
        return [("insert", op[1], size, op[3]) if op[0] == "insert" else op for op in seq]

    no_rounds = [op for i, op in enumerate(ops) if op[0] != "victims" or i == last]
    for size in (0, 1):
        yield sized(size, ops)
    if len(no_rounds) < len(ops):
        yield no_rounds
        for size in (0, 1):
            yield sized(size, no_rounds)
    keys = {op[1] for op in ops if op[0] not in ("victims",)}
    for key in sorted(keys, key=str):
        yield [op for op in ops if op[0] == "victims" or op[1] != key]


def _shrink(
    factory: Callable[[], EvictionPolicy], oracle: Any, ops: list[Op], exc: BaseException
) -> tuple[list[Op], BaseException]:
    """Delete steps and simplify arguments while the same kind of failure stays."""
    kind = _kind(exc)

    def fails(cand: list[Op]) -> BaseException | None:
        got = _run(factory, oracle, cand)
        return got if got is not None and _kind(got) == kind else None

    changed = True
    while changed:
        changed = False
        for cand in _bulk_candidates(ops):
            if _weight(cand) >= _weight(ops):
                continue
            got = fails(cand)
            if got is not None:
                ops, exc, changed = cand, got, True
                break
        chunk = max(1, len(ops) // 2)
        while chunk >= 1:
            i = len(ops) - chunk
            while i >= 0:
                cand = ops[:i] + ops[i + chunk :]
                got = fails(cand)
                if got is not None:
                    ops, exc, changed = cand, got, True
                i -= chunk
            chunk //= 2
        for i in range(len(ops)):
            for simpler in _simpler(ops[i]):
                cand = [*ops[:i], simpler, *ops[i + 1 :]]
                got = fails(cand)
                if got is not None:
                    ops, exc, changed = cand, got, True
                    break
    return ops, exc


def _step_note(op: Op) -> str:
    args = dict(zip(_ARGS[op[0]], op[1:], strict=True))
    return f"state.{op[0]}({', '.join(f'{k}={args[k]!r}' for k in sorted(args))})"


def _script(factory: Callable[[], EvictionPolicy], ops: Sequence[Op], message: str) -> str:
    """The shrunk sequence as a script a user can paste to reproduce the failure."""
    name = getattr(factory, "__qualname__", "")
    make = f"{name}()" if name.isidentifier() else "factory()  # the factory under test"
    lines = [
        "from mooncake.policies import Pin",
        *(
            ["from mooncake.testing.policy import IntLike"]
            if any("IntLike(" in repr(op) for op in ops)
            else []
        ),
        f"policy = {make}",
        "busy = set()  # keys can_evict refuses (leased, put not completed)",
    ]
    for n, op in enumerate(ops, 1):
        kind = op[0]
        if kind == "insert":
            _, key, size, chained = op
            parent = _parent_of(key) if chained else None
            lines.append(f"policy.on_insert({key!r}, {size!r}, parent={parent!r})")
        elif kind == "bad_parent":
            lines.append(
                f"policy.on_insert({op[1]!r}, 1, parent={op[2]!r})  # cycle: must raise "
                "InvalidArgumentError"
            )
        elif kind == "bad_pin":
            lines.append(f"policy.set_pin({op[1]!r}, {op[2]!r})  # must raise InvalidArgumentError")
        elif kind == "bad_insert":
            lines.append(
                f"policy.on_insert({op[1]!r}, {op[2]!r})  # must raise InvalidArgumentError"
            )
        elif kind in ("access", "remove"):
            lines.append(f"policy.on_{kind}({op[1]!r})  # KeyError if {op[1]!r} is not tracked")
        elif kind == "set_pin":
            lines.append(f"policy.set_pin({op[1]!r}, Pin.{op[2].name})")
        elif kind == "set_busy":
            lines.append(f"busy.{'add' if op[2] else 'discard'}({op[1]!r})")
        else:
            _, nbytes, evict = op
            lines.append(f"victims = policy.victims({nbytes!r}, lambda key: key not in busy)")
            if n == len(ops):
                lines.append("print(victims)")
            elif evict == "all":
                lines.append("for key in victims:\n    policy.on_remove(key)")
            elif evict == "first":
                lines.append("for key in victims[:1]:\n    policy.on_remove(key)")
    if ops and ops[-1][0] != "victims":
        lines.append("print(len(policy), policy.total_bytes, policy.unreachable())")
    lines.append(f"# check_policy: {message}")
    return "\n".join(lines)


def _run_schedule(
    factory: Callable[[], EvictionPolicy],
    oracle: Any,
    count: int,
    length: int,
    *,
    bad_sizes: bool = False,
    first_seed: int = 0,
) -> None:
    """Run the fixed schedule; raise the first failure, shrunk, as ``AssertionError``."""
    for seed in range(first_seed, first_seed + count):
        found = _explore(factory, oracle, seed, length, bad_sizes)
        if found is None:
            continue
        ops, exc = _shrink(factory, oracle, *found) if _SHRINK else found
        message = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
        err = AssertionError(message)
        # __notes__ as hypothesis writes them (pytest and Python >= 3.11 print them).
        err.__notes__ = [
            f"Failing sequence of check_policy's schedule (seed {seed}), shrunk:",
            "state = PolicyMachine()",
            *(_step_note(op) for op in ops),
            "To reproduce, paste:\n" + _script(factory, ops, message),
        ]
        raise err from (None if isinstance(exc, AssertionError) else exc)


def check_policy(
    policy_factory: Callable[[], EvictionPolicy],
    *,
    oracle: Oracle | None = None,
    max_examples: int = 100,
    stateful_step_count: int = 50,
    derandomize: bool = False,
    settings_: settings | None = None,
    schedule: int = DEFAULT_SCHEDULE,
) -> None:
    """Property-test the policy that ``policy_factory()`` builds (a class works).

    First runs the fixed schedule (``schedule`` generated sequences of up to 60 rounds,
    identical on every run; ``0`` skips it), then hypothesis' search: ``max_examples`` random
    sequences of up to ``stateful_step_count`` steps. Raises ``AssertionError`` on the first
    violation of the contract (see the module docstring), after shrinking it: the error's
    ``__notes__`` (printed by pytest) list the steps as ``state.insert(...)`` calls, and the
    schedule's failures add a script to paste. ``oracle(model, nbytes)`` adds a
    policy-specific exact check (:func:`lru_oracle` ...). ``derandomize=True`` makes
    hypothesis' part repeatable; ``settings_`` replaces every hypothesis setting.
    """
    if not __debug__:
        # The checks are assert statements: under -O they would all pass vacuously.
        raise RuntimeError("check_policy needs assertions enabled (do not run python -O)")
    if schedule:
        _run_schedule(policy_factory, oracle, schedule, 60)
        # Input checks after the contract: a contract bug is reported before a missing
        # size check.
        _run_schedule(
            policy_factory, oracle, max(1, schedule // 6), 30, bad_sizes=True, first_seed=10**6
        )
    label = re.sub(r"\W", "_", getattr(policy_factory, "__name__", "Policy"))
    machine = type(
        f"{label}Machine",
        (PolicyMachine,),
        {
            "factory": staticmethod(policy_factory),
            "oracle": staticmethod(oracle) if oracle else None,
        },
    )
    if settings_ is None:
        settings_ = settings(
            max_examples=max_examples,
            stateful_step_count=stateful_step_count,
            deadline=None,
            derandomize=derandomize,
            suppress_health_check=[HealthCheck.too_slow],
            report_multiple_bugs=False,
            # The explain phase costs more than the search and shrink together here, and a
            # shrunk sequence of steps already says what went wrong.
            phases=[p for p in Phase if p is not Phase.explain],
        )
    run_state_machine_as_test(machine, settings=settings_)
