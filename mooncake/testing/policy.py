"""Property tests for eviction policies: :func:`check_policy` runs a hypothesis state machine.

The machine drives a policy through random sequences of inserts (with and without prefix
parents), accesses, removals, pin changes, lease/incomplete flips and eviction rounds, keeps
its own model of what the policy should track, and after every step checks:

- bookkeeping: ``len(policy)``, ``key in policy``, ``total_bytes`` match the model, and
  ``policy.self_check()`` passes; events on untracked keys raise ``KeyError``;
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
  :func:`lfu_oracle` and :func:`prefix_lru_oracle` are the shipped policies' oracles.

A failure raises ``AssertionError`` naming the broken rule, with hypothesis' shrunk sequence
of steps in its ``__notes__`` (pytest prints them). Needs the ``test`` extra (``hypothesis``);
refuses to run under ``python -O``, where its assertions would vanish.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mooncake._core.policies.base import EvictionPolicy, Key, Pin

__all__ = [
    "KEYS",
    "ModelEntry",
    "Oracle",
    "PolicyModel",
    "check_policy",
    "fifo_oracle",
    "lfu_oracle",
    "lru_oracle",
    "prefix_lru_oracle",
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
)
"""The key pool: a small prefix forest; a key's parent is the key without its last segment."""


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
    (leased or incomplete: ``can_evict`` false), tracked or not.
    """

    prefix_closed: bool
    entries: dict[Key, ModelEntry] = field(default_factory=dict)
    busy: set[Key] = field(default_factory=set)
    clock: int = 0

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
    """Fewest uses first, then least recently used."""
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


class PolicyMachine(RuleBasedStateMachine):
    """The state machine :func:`check_policy` runs; subclassed per policy factory."""

    factory: Callable[[], EvictionPolicy]
    oracle: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.policy = type(self).factory()
        self.model = PolicyModel(prefix_closed=bool(getattr(self.policy, "prefix_closed", False)))

    def _expect_key_error(self, call: Callable[[], object], what: str) -> None:
        try:
            call()
        except KeyError:
            return
        raise AssertionError(f"{what} on an untracked key did not raise KeyError")

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 64), chained=st.booleans())
    def insert(self, key: str, size: int, chained: bool) -> None:
        parent = _parent_of(key) if chained else None
        now = self.model.tick()
        self.policy.on_insert(key, size, parent=parent, now=float(now))
        self.model.entries.pop(key, None)
        self.model.entries[key] = ModelEntry(size, parent, Pin.NONE, now, now, 1)

    @rule(key=st.sampled_from(KEYS))
    def access(self, key: str) -> None:
        entry = self.model.entries.get(key)
        if entry is None:
            self._expect_key_error(lambda: self.policy.on_access(key, 0.0), "on_access")
            return
        now = self.model.tick()
        self.policy.on_access(key, float(now))
        entry.last_use = now
        entry.uses += 1

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        if key not in self.model.entries:
            self._expect_key_error(lambda: self.policy.on_remove(key), "on_remove")
            return
        self.policy.on_remove(key)
        del self.model.entries[key]

    @rule(key=st.sampled_from(KEYS), pin=st.sampled_from(Pin))
    def set_pin(self, key: str, pin: Pin) -> None:
        entry = self.model.entries.get(key)
        if entry is None:
            self._expect_key_error(lambda: self.policy.set_pin(key, pin), "set_pin")
            return
        self.policy.set_pin(key, pin)
        entry.pin = pin

    @rule(key=st.sampled_from(KEYS), busy=st.booleans())
    def set_busy(self, key: str, busy: bool) -> None:
        """A lease granted or expired, or a put started or completed: ``can_evict`` flips."""
        if busy:
            self.model.busy.add(key)
        else:
            self.model.busy.discard(key)

    @rule(
        nbytes=st.integers(-1, 300),
        evict=st.sampled_from(("all", "none", "first")),
    )
    def victims(self, nbytes: int, evict: str) -> None:
        model = self.model
        asked: list[Hashable] = []

        def can_evict(key: Hashable) -> bool:
            asked.append(key)
            return model.can_evict(key)

        victims = self.policy.victims(nbytes, can_evict)
        strays = [k for k in asked if k not in model.entries]
        assert not strays, f"can_evict asked about untracked keys {strays!r}"
        check_victims(model, nbytes, victims, type(self).oracle)
        chosen = victims if evict == "all" else victims[:1] if evict == "first" else []
        for key in chosen:
            self.policy.on_remove(key)
            del model.entries[key]

    @invariant()
    def bookkeeping(self) -> None:
        policy, entries = self.policy, self.model.entries
        assert len(policy) == len(entries), f"len(policy) = {len(policy)}, model {len(entries)}"
        for key in KEYS:
            assert (key in policy) == (key in entries), f"membership of {key!r} disagrees"
        total = sum(e.size for e in entries.values())
        assert policy.total_bytes == total, f"total_bytes {policy.total_bytes}, model {total}"
        policy.self_check()
        dead = policy.unreachable()
        assert len(set(dead)) == len(dead), f"unreachable() has duplicates: {dead!r}"
        if self.model.prefix_closed:
            expected = {k for k in entries if not self.model.reachable(k)}
            assert set(dead) == expected, (
                f"unreachable() = {dead!r}, model {sorted(map(repr, expected))}"
            )
            for i, gone in enumerate(dead):
                later = [c for c in self.model.children(gone) if c in dead[i:]]
                assert not later, f"unreachable() lists {gone!r} before its children {later!r}"
        else:
            assert dead == [], f"unreachable() = {dead!r} from a policy that is not prefix-closed"


def check_policy(
    policy_factory: Callable[[], EvictionPolicy],
    *,
    oracle: Oracle | None = None,
    max_examples: int = 100,
    stateful_step_count: int = 50,
    derandomize: bool = False,
    settings_: settings | None = None,
) -> None:
    """Property-test the policy that ``policy_factory()`` builds (a class works).

    Runs ``max_examples`` random sequences of up to ``stateful_step_count`` steps and raises
    ``AssertionError`` on the first violation of the contract (see the module docstring),
    after hypothesis has shrunk it to a minimal sequence of steps: the error's ``__notes__``
    (printed by pytest) list them as ``state.insert(...)`` calls. ``oracle(model, nbytes)``
    adds a policy-specific exact check (:func:`lru_oracle` ...). ``derandomize=True`` makes
    the run repeatable; ``settings_`` replaces every hypothesis setting.
    """
    if not __debug__:
        # The checks are assert statements: under -O they would all pass vacuously.
        raise RuntimeError("check_policy needs assertions enabled (do not run python -O)")
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
