"""Property-test your own eviction policy with ``mooncake.testing.check_policy``.

``LargestFirst`` evicts the biggest evictable objects first (a pool that would rather drop one
large blob than many small KV blocks). It keeps the policy contract (see
``mooncake/_core/policies/base.py``): hard pins are never proposed, soft-pinned objects come
after every evictable unpinned one, the caller's ``can_evict`` veto is honoured, and the list stops
as soon as enough bytes are covered. ``select_victims`` does that part for any candidate order.

``LeakyLargestFirst`` has the kind of bug people write: ``on_remove`` forgets the size table, so
``total_bytes`` drifts and a removed key can come back as a victim. ``check_policy`` runs random
sequences of inserts, hits, pins, removes and eviction rounds against a model, finds the bug and
shrinks it to a short sequence of steps. Run::

    python examples/custom_policy.py

In your own tests, one line per policy: ``check_policy(MyPolicy)`` raises ``AssertionError``
(with the shrunk steps in its notes) on a violation.
"""

from __future__ import annotations

import operator
import sys

from mooncake.errors import InvalidArgumentError
from mooncake.policies import CanEvict, EvictionPolicy, Key, Pin, select_victims
from mooncake.testing import check_policy


class LargestFirst(EvictionPolicy):
    """Evict the largest objects first; ties go to the oldest insert."""

    name = "largest-first"

    def __init__(self) -> None:
        self._sizes: dict[Key, int] = {}  # insertion-ordered: ties broken by age
        self._pins: dict[Key, Pin] = {}  # pinned keys only
        self._total = 0

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        # the contract: ints and integer-likes (numpy.int64: anything with __index__), not bool
        if isinstance(size, bool) or not hasattr(size, "__index__") or operator.index(size) < 0:
            raise InvalidArgumentError(f"size of {key!r} must be a non-negative int, got {size!r}")
        size = operator.index(size)
        if key in self._sizes:
            self.on_remove(key)
        self._sizes[key] = size
        self._total += size

    def on_access(self, key: Key, now: float = 0.0) -> None:
        if key not in self._sizes:
            raise KeyError(key)  # hits do not change the order

    def on_remove(self, key: Key) -> None:
        self._total -= self._sizes.pop(key)
        self._pins.pop(key, None)

    def set_pin(self, key: Key, pin: Pin) -> None:
        if key not in self._sizes:
            raise KeyError(key)
        try:
            pin = Pin(pin)
        except ValueError:  # the contract: a bad pin is the caller's error, named
            raise InvalidArgumentError(f"pin must be Pin.NONE, Pin.SOFT or Pin.HARD, got {pin!r}")
        if pin is Pin.NONE:
            self._pins.pop(key, None)
        else:
            self._pins[key] = pin

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0:
            return []
        # sorted() is stable: equal sizes stay in insertion order (oldest first)
        order = sorted(self._sizes, key=self._sizes.__getitem__, reverse=True)
        return select_victims(order, self._sizes, self._pins, nbytes, can_evict)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    @property
    def total_bytes(self) -> int:
        return self._total

    def self_check(self) -> None:
        assert self._total == sum(self._sizes.values())
        assert set(self._pins) <= set(self._sizes)


class LeakyLargestFirst(LargestFirst):
    """The bug: a removed key's size stays in the table (and in total_bytes)."""

    def on_remove(self, key: Key) -> None:
        if key not in self._sizes:
            raise KeyError(key)
        self._pins.pop(key, None)  # ... and forgets `self._total -= self._sizes.pop(key)`


def main() -> int:
    check_policy(LargestFirst)  # passes: raises nothing
    print("LargestFirst: contract holds")
    try:
        check_policy(LeakyLargestFirst)
    except AssertionError as e:
        steps = "\n    ".join(getattr(e, "__notes__", [])[:8])
        print(f"LeakyLargestFirst: caught: {str(e).splitlines()[0]}\n    {steps}")
        print("custom_policy: the harness passed the sound policy and caught the leaky one: OK")
        return 0
    print("LeakyLargestFirst: NOT caught")
    return 1


if __name__ == "__main__":
    sys.exit(main())
