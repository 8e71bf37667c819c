"""The harness's key pool and reference model of what a policy should track."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mooncake._core.policies.base import Key, Pin

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


WIDE_KEYS: tuple[str, ...] = KEYS + tuple(
    f"{root}{tail}" for root in "jklmnopq" for tail in ("", "/a", "/a/a", "/b")
)
"""The shape schedule's wider pool: :data:`KEYS` and eight more small trees, 64 keys."""


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
    _kids: tuple[int, dict[Key, list[Key]]] = field(
        default=(-1, {}), init=False, repr=False, compare=False
    )
    """Children by parent, valid while ``len(log)`` is the first item (every change of
    ``entries`` is logged)."""

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def can_evict(self, key: Key) -> bool:
        return key not in self.busy

    def children(self, key: Key) -> list[Key]:
        """Tracked keys whose parent is ``key`` (empty unless prefix-closed)."""
        if not self.prefix_closed:
            return []
        version, kids = self._kids
        if version != len(self.log):
            kids = {}
            for k, e in self.entries.items():
                if e.parent is not None:
                    kids.setdefault(e.parent, []).append(k)
            self._kids = (len(self.log), kids)
        return list(kids.get(key, ()))

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
