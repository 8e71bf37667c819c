"""Eviction policies: the property harness on every shipped policy, broken policies it must
catch, and behaviour each policy is named for."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest

from mooncake.errors import InvalidArgumentError
from mooncake.policies import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    Pin,
    PrefixLRUPolicy,
    S3FIFOPolicy,
    SIEVEPolicy,
    make_policy,
)
from mooncake.testing import (
    check_policy,
    fifo_oracle,
    lfu_oracle,
    lru_oracle,
    prefix_lru_oracle,
)

# runs no code that has a compiled twin: the pure-Python pass leaves it out (docs/testing.md)
pytestmark = pytest.mark.twin_independent

ROOT = Path(__file__).resolve().parents[1]

ORACLES = {
    "lru": lru_oracle,
    "fifo": fifo_oracle,
    "lfu": lfu_oracle,
    "prefix-lru": prefix_lru_oracle,
}


def anything(key: Hashable) -> bool:
    return True


# -- the harness on the shipped policies -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_shipped_policy_passes_harness(name: str) -> None:
    check_policy(POLICIES[name], oracle=ORACLES.get(name), max_examples=150)


def test_every_shipped_policy_is_registered_under_its_name() -> None:
    assert set(POLICIES) == {"lru", "lfu", "fifo", "sieve", "s3fifo", "prefix-lru"}
    for name, cls in POLICIES.items():
        policy = make_policy(name.upper())
        assert type(policy) is cls
        assert policy.name == name
    assert type(make_policy()) is LRUPolicy


def test_make_policy_unknown_name_lists_known() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown eviction policy 'arc'.*lru"):
        make_policy("arc")


def test_make_policy_passes_arguments() -> None:
    policy = make_policy("s3fifo", small_ratio=0.25)
    assert isinstance(policy, S3FIFOPolicy)
    assert policy.small_ratio == 0.25
    for bad in (1.5, 1.0, 0.0, -0.1):
        with pytest.raises(InvalidArgumentError, match="small_ratio"):
            make_policy("s3fifo", small_ratio=bad)
    assert make_policy("s3fifo", small_ratio=0.999).small_ratio == 0.999


# -- the harness catches broken policies, with a shrunk counter-example -----------------------


def _failure(factory: Callable[[], EvictionPolicy], **kwargs: object) -> tuple[str, list[str]]:
    """Run the harness expecting a failure; return its message and the shrunk steps."""
    # Derandomized, yet the search path still depends on process state (object layout: other
    # test modules' imports shift it), so give the search room to find each bug.
    kwargs.setdefault("max_examples", 1000)
    with pytest.raises(AssertionError) as info:
        check_policy(factory, derandomize=True, **kwargs)  # type: ignore[arg-type]
    notes = getattr(info.value, "__notes__", [])
    steps = [
        n for n in notes if re.match(r"state\.(insert|access|remove|set_pin|set_busy|victims)\(", n)
    ]
    return str(info.value), steps


class IgnoresHardPins(LRUPolicy):
    """Treats a hard pin as no pin."""

    name = "ignores-hard-pins"

    def set_pin(self, key: Hashable, pin: Pin) -> None:
        super().set_pin(key, Pin.NONE if pin is Pin.HARD else pin)


class Duplicates(LRUPolicy):
    """Proposes its first victim twice."""

    name = "duplicates"

    def victims(self, nbytes: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        out = super().victims(nbytes, can_evict)
        return out + out[:1]


class IgnoresLeases(LRUPolicy):
    """Never asks ``can_evict``: evicts leased and incomplete objects."""

    name = "ignores-leases"

    def victims(self, nbytes: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        return super().victims(nbytes, lambda key: True)


class MostRecent(LRUPolicy):
    """Keeps the contract but evicts the most recently used first: not LRU."""

    name = "mru"

    def victims(self, nbytes: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        if nbytes <= 0:
            return []
        from mooncake._core.policies.base import select_victims

        return select_victims(reversed(self._order), self._order, self._pins, nbytes, can_evict)


class OverEvicts(LRUPolicy):
    """Proposes every evictable object, however little was asked."""

    name = "over-evicts"

    def victims(self, nbytes: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        return super().victims(10**9 if nbytes > 0 else 0, can_evict)


class SoftFirst(LRUPolicy):
    """Treats soft pins as no pins."""

    name = "soft-first"

    def set_pin(self, key: Hashable, pin: Pin) -> None:
        super().set_pin(key, Pin.NONE if pin is Pin.SOFT else pin)


class StaleBytes(LRUPolicy):
    """Forgets to subtract the old size when a key is re-inserted."""

    name = "stale-bytes"

    def on_insert(
        self, key: Hashable, size: int, *, parent: Hashable | None = None, now: float = 0.0
    ) -> None:
        if key in self._order:
            del self._order[key]
        self._order[key] = size
        self._bytes += size


class HeadFirst(LRUPolicy):
    """Claims prefix closure but evicts by plain LRU: chain heads before their tails."""

    name = "head-first"
    prefix_closed = True

    def unreachable(self) -> list[Hashable]:
        return []


BROKEN: list[tuple[type[EvictionPolicy], str, object]] = [
    (IgnoresHardPins, r"proposed hard-pinned", None),
    (Duplicates, r"duplicate victims", None),
    (IgnoresLeases, r"can_evict\(.*\) is false", None),
    (MostRecent, r"oracle says", lru_oracle),
    (OverEvicts, r"go past the first prefix", None),
    (SoftFirst, r"unpinned .* (proposed after a soft-pinned|stay)", lru_oracle),
    (StaleBytes, r"total_bytes", None),
    (HeadFirst, r"before its children|unreachable\(\)", None),
]


@pytest.mark.parametrize(("cls", "message", "oracle"), BROKEN, ids=[b[0].name for b in BROKEN])
def test_harness_catches_broken_policy(
    cls: type[EvictionPolicy], message: str, oracle: object
) -> None:
    text, steps = _failure(cls, oracle=oracle)
    assert re.search(message, text), text
    # Shrunk: a handful of steps, the last of which exposes the bug.
    assert 1 <= len(steps) <= 8, steps
    assert any(s.startswith("state.insert(") for s in steps), steps


def test_shrunk_example_for_ignored_hard_pin_is_minimal() -> None:
    text, steps = _failure(IgnoresHardPins)
    assert "proposed hard-pinned" in text
    assert [s.split("(")[0] for s in steps] == ["state.insert", "state.set_pin", "state.victims"]
    assert "Pin.HARD" in steps[1]


# -- input checking ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_bad_sizes_are_refused_by_name(name: str) -> None:
    policy = make_policy(name)
    with pytest.raises(InvalidArgumentError, match=r"size of 'k' must be non-negative, got -1"):
        policy.on_insert("k", -1)
    with pytest.raises(InvalidArgumentError, match=r"size of 'k' must be an int, got float"):
        policy.on_insert("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"got bool"):
        policy.on_insert("k", True)
    assert len(policy) == 0
    assert policy.total_bytes == 0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_integer_likes_are_sizes(name: str) -> None:
    np = pytest.importorskip("numpy")
    policy = make_policy(name)
    policy.on_insert("k", np.int64(7))
    assert policy.total_bytes == 7
    assert type(policy.total_bytes) is int


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_untracked_keys_raise_key_error(name: str) -> None:
    policy = make_policy(name)
    policy.on_insert("a", 1)
    with pytest.raises(KeyError):
        policy.on_access("b")
    with pytest.raises(KeyError):
        policy.on_remove("b")
    with pytest.raises(KeyError):
        policy.set_pin("b", Pin.SOFT)
    with pytest.raises(InvalidArgumentError, match="pin must be"):
        policy.set_pin("a", 7)  # type: ignore[arg-type]
    assert "a" in policy
    assert len(policy) == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_any_hashable_key(name: str) -> None:
    policy = make_policy(name)
    keys: list[Hashable] = [("model", 0, b"\x00"), 17, frozenset({1}), "s"]
    for i, key in enumerate(keys):
        policy.on_insert(key, i + 1)
    victims = policy.victims(100, anything)
    assert sorted(map(repr, victims)) == sorted(map(repr, keys))


def test_testing_package_imports_without_hypothesis() -> None:
    code = (
        "import sys, mooncake.testing\n"
        "assert 'hypothesis' not in sys.modules\n"
        "assert callable(mooncake.testing.check_policy)\n"
        "assert 'hypothesis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_check_policy_accepts_any_factory() -> None:
    check_policy(lambda: PrefixLRUPolicy(), max_examples=10)
    check_policy(lambda: make_policy("s3fifo", small_ratio=0.3), max_examples=10)


def test_core_policies_import_no_event_loop() -> None:
    code = (
        "import sys, mooncake.policies, mooncake._core.misses\n"
        "bad = {'anyio', 'trio', 'asyncio'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- behaviour each policy is named for --------------------------------------------------------


def fill(policy: EvictionPolicy, keys: str, size: int = 1) -> None:
    for key in keys:
        policy.on_insert(key, size)


def test_lru_order_follows_accesses() -> None:
    policy = LRUPolicy()
    fill(policy, "abcd")
    policy.on_access("a")
    policy.on_access("c")
    assert policy.victims(4, anything) == ["b", "d", "a", "c"]


def test_fifo_ignores_accesses() -> None:
    policy = FIFOPolicy()
    fill(policy, "abcd")
    policy.on_access("a")
    assert policy.victims(2, anything) == ["a", "b"]


def test_lfu_evicts_the_least_used_then_oldest() -> None:
    policy = LFUPolicy()
    fill(policy, "abcd")
    for key in "aab":
        policy.on_access(key)
    policy.on_access("d")
    assert [policy.frequency(k) for k in "abcd"] == [3, 2, 1, 2]
    assert policy.victims(4, anything) == ["c", "b", "d", "a"]


def test_sieve_visited_objects_survive_a_sweep() -> None:
    policy = SIEVEPolicy()
    fill(policy, "abcde")
    policy.on_access("a")
    policy.on_access("c")
    victims = policy.victims(1, anything)
    assert victims == ["b"]
    policy.on_remove("b")
    # The hand cleared a's bit and continues from where it stopped: c (visited) then d.
    assert policy.victims(1, anything) == ["d"]
    policy.on_remove("d")
    # Next sweep: e, then around to a (bit cleared last time).
    assert policy.victims(2, anything) == ["e", "a"]


def test_sieve_kept_victim_stays_tracked() -> None:
    policy = SIEVEPolicy()
    fill(policy, "abc")
    assert policy.victims(1, anything) == ["a"]
    assert policy.victims(1, anything) == ["a"] or "a" in policy
    policy.self_check()
    assert len(policy) == 3


def test_s3fifo_one_hit_wonders_go_before_reused_objects() -> None:
    policy = S3FIFOPolicy()
    fill(policy, "hot")  # h, o, t
    policy.on_access("h")
    fill(policy, "wxyz")
    # S holds everything; h was hit while on probation and is promoted to M, the others go.
    victims = policy.victims(6, anything)
    assert victims == ["o", "t", "w", "x", "y", "z"]
    assert "h" not in victims


def test_s3fifo_ghost_hit_readmits_to_main() -> None:
    policy = S3FIFOPolicy()
    fill(policy, "abcdefghij")
    victims = policy.victims(1, anything)
    assert victims == ["a"]
    policy.on_remove("a")
    policy.on_insert("a", 1)  # quick return: the ghost sends it to M
    fill(policy, "klmnopqrst")
    # S (b..j, k..t) holds more than 10% of the bytes: it is drained first; a sits in M.
    assert policy.victims(19, anything) == list("bcdefghijklmnopqrst")
    assert policy.victims(20, anything)[-1] == "a"


def test_prefix_evicts_chains_tail_first() -> None:
    policy = PrefixLRUPolicy()
    policy.on_insert("b0", 1)
    policy.on_insert("b1", 1, parent="b0")
    policy.on_insert("b2", 1, parent="b1")
    policy.on_insert("x", 1)
    policy.on_access("b0")
    policy.on_access("x")
    # b0 is the least recently used, but it leads to b1 and b2: they go first, tail first.
    assert policy.victims(3, anything) == ["b2", "b1", "b0"]


def test_prefix_orphans_go_first_and_are_listed() -> None:
    policy = PrefixLRUPolicy()
    policy.on_insert("old", 1)
    policy.on_insert("b0", 1)
    policy.on_insert("b1", 1, parent="b0")
    policy.on_insert("b2", 1, parent="b1")
    policy.on_remove("b0")  # removed explicitly: b1 and b2 can never be hit again
    assert policy.unreachable() == ["b2", "b1"]
    assert policy.victims(2, anything) == ["b2", "b1"]
    policy.on_insert("b0", 1)  # the prefix is back: the chain is reachable again
    assert policy.unreachable() == []
    assert policy.victims(1, anything) == ["old"]


def test_prefix_busy_tail_keeps_its_chain() -> None:
    policy = PrefixLRUPolicy()
    policy.on_insert("b0", 1)
    policy.on_insert("b1", 1, parent="b0")
    policy.on_insert("x", 1)
    leased = {"b1"}
    assert policy.victims(3, lambda k: k not in leased) == ["x"]
    policy.set_pin("b1", Pin.SOFT)
    assert policy.victims(3, anything) == ["x", "b1", "b0"]


def test_prefix_child_before_parent_then_cycle_refused() -> None:
    policy = PrefixLRUPolicy()
    policy.on_insert("b1", 1, parent="b0")
    assert policy.unreachable() == ["b1"]
    policy.on_insert("b0", 1, parent="root")
    assert policy.unreachable() == ["b1", "b0"]
    with pytest.raises(InvalidArgumentError, match="cycle"):
        policy.on_insert("root", 1, parent="b1")
    with pytest.raises(InvalidArgumentError, match="own parent"):
        policy.on_insert("z", 1, parent="z")
    assert "root" not in policy
    policy.self_check()


def test_prefix_reinsert_of_internal_node_keeps_children() -> None:
    policy = PrefixLRUPolicy()
    policy.on_insert("b0", 1)
    policy.on_insert("b1", 2, parent="b0")
    policy.on_insert("b0", 5)  # upsert with a new size
    policy.self_check()
    assert policy.total_bytes == 7
    assert policy.unreachable() == []
    assert policy.victims(1, anything) == ["b1"]


# -- the fixed schedule: bugs that need several keys in play, found on every run -----------------


def _hard_pinned_victim_past_four_keys(name: str) -> type[EvictionPolicy]:
    """An LRU that adds one hard-pinned key to its victims once more than four are tracked."""

    def victims(
        self: LRUPolicy, nbytes: int, can_evict: Callable[[Hashable], bool]
    ) -> list[Hashable]:
        out = LRUPolicy.victims(self, nbytes, can_evict)
        if len(self) > 4:
            out += [k for k, p in self._pins.items() if p is Pin.HARD and k not in out][:1]
        return out

    return type(name, (LRUPolicy,), {"name": name.lower(), "victims": victims})


@pytest.mark.parametrize("class_name", ["Sneaky", "MyPolicy", "X", "TenantAwareLRU"])
def test_schedule_catches_a_bug_that_needs_five_keys_whatever_the_name(class_name: str) -> None:
    cls = _hard_pinned_victim_past_four_keys(class_name)
    with pytest.raises(AssertionError) as info:
        check_policy(cls)  # the defaults: no derandomize, no extra examples
    notes = info.value.__notes__
    assert "check_policy's schedule" in notes[0]
    assert re.search(r"proposed hard-pinned|must be empty|go past", str(info.value))
    steps = [n for n in notes if n.startswith("state.")]
    assert sum(s.startswith("state.insert(") for s in steps) >= 5  # shrunk, still five keys


def test_shrunk_failure_is_a_script_that_reproduces_it() -> None:
    cls = _hard_pinned_victim_past_four_keys("Pasted")
    with pytest.raises(AssertionError) as info:
        check_policy(cls, schedule=50)
    script = next(n for n in info.value.__notes__ if n.startswith("To reproduce, paste:"))
    code = script.split("\n", 1)[1]
    assert "policy = Pasted()" in code
    assert code.rstrip().splitlines()[-2] == "print(victims)"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"Pasted": cls})  # runs as pasted, ending in the bad victims() answer
    got = eval(out.getvalue())
    pinned = re.findall(r"policy\.set_pin\('([^']*)', Pin\.HARD\)", code)
    assert set(got) & set(pinned) or "victims(0," in code, (got, code)


def test_schedule_checks_sizes_and_pins_of_bad_type() -> None:
    class NoSizeCheck(LRUPolicy):
        name = "no-size-check"

        def on_insert(
            self, key: Hashable, size: int, *, parent: Hashable | None = None, now: float = 0.0
        ) -> None:
            old = self._order.pop(key, None)
            if old is not None:
                self._bytes -= old
                self._pins.pop(key, None)
            self._order[key] = int(size)
            self._bytes += int(size)

    with pytest.raises(AssertionError, match="did not raise InvalidArgumentError"):
        check_policy(NoSizeCheck, max_examples=10)


def test_oracles_cover_every_shipped_policy() -> None:
    from mooncake.testing.policy import ORACLES

    assert set(ORACLES) == set(POLICIES)


@pytest.mark.parametrize("name", ["sieve", "s3fifo"])
def test_reference_oracles_catch_an_order_bug(name: str) -> None:
    """SIEVE and S3-FIFO keep the generic contract when their order is wrong; only their
    exact oracles catch it (here: victims proposed newest first)."""
    from mooncake.testing.policy import ORACLES

    base = POLICIES[name]

    def size(policy: EvictionPolicy, key: Hashable) -> int:
        nodes = getattr(policy, "_nodes", None)
        return nodes[key].size if nodes is not None else policy._size[key]  # type: ignore[attr-defined, no-any-return]

    def victims(self: EvictionPolicy, nbytes: int, can_evict: Callable[[Hashable], bool]) -> list:
        out = base.victims(self, nbytes, can_evict)
        # Newest first, where that keeps the contract: equal sizes, nothing pinned.
        if len({size(self, k) for k in out}) == 1 and not self._pins:  # type: ignore[attr-defined]
            return out[::-1]
        return out

    broken = type(f"Reversed{base.__name__}", (base,), {"victims": victims})
    check_policy(broken, max_examples=10)  # the contract alone cannot tell
    with pytest.raises(AssertionError, match="oracle says"):
        check_policy(broken, oracle=ORACLES[name], max_examples=10)


def test_a_policy_refusing_integer_like_sizes_is_reported_not_crashed() -> None:
    """The shrinker simplifies an integer-like size to its plain int (it used to raise
    ``TypeError`` on ``size // 2``), so the user sees the contract violation."""
    from mooncake.errors import InvalidArgumentError
    from mooncake.policies import LRUPolicy

    class IntsOnly(LRUPolicy):
        def on_insert(self, key: Any, size: Any, *, parent: Any = None, now: float = 0.0) -> None:
            if type(size) is not int:
                raise InvalidArgumentError(f"size of {key!r} must be an int")
            super().on_insert(key, size, parent=parent, now=now)

    with pytest.raises(AssertionError):
        check_policy(IntsOnly)
