"""The victims contract every policy keeps, checked against the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake._core.policies.base import Key, Pin
from mooncake.testing.policy._model import PolicyModel


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
