"""Feeds a policy and the model the same steps and checks the policy after each."""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from typing import Any

from mooncake._core.policies.base import EvictionPolicy, Pin
from mooncake.errors import InvalidArgumentError
from mooncake.testing.policy._contract import check_victims
from mooncake.testing.policy._model import WIDE_KEYS, ModelEntry, PolicyModel, _parent_of

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
        self.last_nbytes = 1
        """``nbytes`` of the last eviction round (the shape schedule asks it again)."""
        self.last_victims: list[Hashable] = []
        """What the last eviction round proposed."""

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
        self.last_nbytes, self.last_victims = nbytes, list(victims)
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
        for key in WIDE_KEYS:
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
