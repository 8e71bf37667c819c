"""The eviction-policy interface: a sans-I/O object told what happens and asked whom to evict.

A policy tracks a set of objects (any hashable key, usually ``str``) and their sizes in bytes.
The master (one policy per tier) and the trace replay feed it events; it never does I/O, never
reads a clock (``now`` is passed in and may be ignored) and never evicts on its own.

Events (all O(1) or O(log n) amortised in the shipped policies):

``on_insert(key, size, *, parent=None, now=0.0)``
    ``key`` became resident (a put completed). ``parent`` is the key of the object's prefix
    predecessor (a KV block's previous block) or ``None``; only prefix-aware policies use it.
    Inserting a key that is already tracked replaces it: as ``on_remove`` then ``on_insert``.
    ``size`` must be a non-negative ``int`` (else :class:`~mooncake.errors.InvalidArgumentError`).
``on_access(key, now=0.0)``
    ``key`` was read (a hit).
``on_remove(key)``
    ``key`` is gone: evicted by the caller after :meth:`~EvictionPolicy.victims` proposed it,
    removed explicitly, or lost with its owner.
``set_pin(key, pin)``
    change the pin of ``key``: :attr:`Pin.NONE`, :attr:`Pin.SOFT` (evicted only after every
    unpinned candidate) or :attr:`Pin.HARD` (never evicted). New objects are unpinned.

``on_access``, ``on_remove`` and ``set_pin`` on a key that is not tracked raise ``KeyError``.

Query:

``victims(nbytes, can_evict) -> list[key]``
    propose objects to evict to free ``nbytes``, in eviction order. ``can_evict(key)`` says
    whether the caller may evict ``key`` now (``False`` for a leased, incomplete or otherwise
    busy object); the policy itself knows pins. The contract, which
    :func:`mooncake.testing.check_policy` checks:

    - every victim is tracked, appears once, is not hard-pinned and has ``can_evict(key)``
      true (and, for a prefix-closed policy, has no tracked child that is not an earlier
      victim);
    - unpinned victims come first; a soft-pinned object is proposed only once every evictable
      unpinned object has been;
    - the victims' sizes sum to at least ``nbytes`` when the evictable objects allow it, and
      the list stops as soon as they do (every proper prefix frees less than ``nbytes``);
      when they cannot, every evictable object is proposed (best effort);
    - ``nbytes <= 0`` proposes nothing.

    ``victims`` may reorder the policy's internal state (move a SIEVE hand, promote an
    S3-FIFO entry) but never changes which keys are tracked: the caller calls ``on_remove``
    for each victim it actually evicts, and a victim it keeps stays tracked as before.

Introspection: ``name`` (registry name), ``len(policy)``, ``key in policy``, ``total_bytes``
(sum of tracked sizes), ``unreachable()`` (keys the policy considers dead and the caller may
drop eagerly; only prefix-closed policies return any) and ``self_check()`` (raise
``AssertionError`` if internal bookkeeping is inconsistent; used by the property harness).

Writing a policy: subclass :class:`EvictionPolicy`, implement the abstract methods, give it a
``name`` and run ``mooncake.testing.check_policy(YourPolicy)`` in your tests.
"""

from __future__ import annotations

import abc
import enum
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import ClassVar, Protocol

from mooncake.errors import InvalidArgumentError

__all__ = [
    "CanEvict",
    "EvictionPolicy",
    "Key",
    "Pin",
    "Sizes",
    "check_pin",
    "check_size",
    "select_victims",
]

Key = Hashable
CanEvict = Callable[[Hashable], bool]


class Sizes(Protocol):
    """What :func:`select_victims` reads sizes from: ``sizes[key]``."""

    def __getitem__(self, key: Key, /) -> int: ...


class Pin(enum.IntEnum):
    """How strongly an object is protected from eviction."""

    NONE = 0
    """Evictable by policy order."""
    SOFT = 1
    """Evicted only after every evictable unpinned object (Mooncake's soft pin)."""
    HARD = 2
    """Never evicted; only an explicit remove drops it (Mooncake's hard pin)."""


def check_size(key: Key, size: object) -> int:
    """Return ``size`` as an ``int``, or raise :class:`InvalidArgumentError` naming ``key``.

    Accepts ``int`` and integer-likes (``numpy.int64``: anything with ``__index__``), not
    ``bool``; the value must be non-negative. Policies call it only off their fast path
    (``type(size) is not int or size < 0``).
    """
    if isinstance(size, bool) or not hasattr(size, "__index__"):
        raise InvalidArgumentError(
            f"size of {key!r} must be an int, got {type(size).__name__}: {size!r}"
        )
    value = operator.index(size)
    if value < 0:
        raise InvalidArgumentError(f"size of {key!r} must be non-negative, got {value}")
    return value


def check_pin(pin: Pin) -> Pin:
    """Coerce ``pin`` to :class:`Pin` or raise :class:`InvalidArgumentError`."""
    try:
        return Pin(pin)
    except ValueError:
        raise InvalidArgumentError(f"pin must be Pin.NONE, Pin.SOFT or Pin.HARD, got {pin!r}")


def record_pin(pins: dict[Key, Pin], key: Key, pin: Pin) -> None:
    """Store ``pin`` for ``key`` in a table that holds only pinned keys (``Pin.NONE`` unpins)."""
    pin = check_pin(pin)
    if pin is Pin.NONE:
        pins.pop(key, None)
    else:
        pins[key] = pin


def select_victims(
    order: Iterable[Key],
    sizes: Sizes,
    pins: dict[Key, Pin],
    nbytes: int,
    can_evict: CanEvict,
) -> list[Key]:
    """Pick victims from ``order`` (best eviction candidate first, each key at most once).

    Hard-pinned keys and keys with ``can_evict(key)`` false are skipped; soft-pinned keys are
    set aside and taken, in the order met, only after ``order`` is exhausted. Stops as soon as
    ``nbytes`` are covered. ``pins`` holds only pinned keys; ``sizes[key]`` is a key's size
    (a dict, or anything indexable so).
    """
    out: list[Key] = []
    freed = 0
    deferred: list[Key] = []
    for key in order:
        pin = pins.get(key)
        if pin is Pin.HARD or not can_evict(key):
            continue
        if pin is Pin.SOFT:
            deferred.append(key)
            continue
        out.append(key)
        freed += sizes[key]
        if freed >= nbytes:
            return out
    for key in deferred:
        out.append(key)
        freed += sizes[key]
        if freed >= nbytes:
            return out
    return out


class EvictionPolicy(abc.ABC):
    """Base class of eviction policies; see the module docstring for the contract."""

    __slots__ = ()

    name: ClassVar[str] = ""
    """Registry name (``make_policy(name)``)."""
    prefix_closed: ClassVar[bool] = False
    """True if the policy honours ``parent`` links: children are evicted before parents."""

    @abc.abstractmethod
    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        """Track ``key`` (``size`` bytes); replaces it if already tracked."""

    @abc.abstractmethod
    def on_access(self, key: Key, now: float = 0.0) -> None:
        """Record a hit on ``key``. ``KeyError`` if untracked."""

    @abc.abstractmethod
    def on_remove(self, key: Key) -> None:
        """Stop tracking ``key``. ``KeyError`` if untracked."""

    @abc.abstractmethod
    def set_pin(self, key: Key, pin: Pin) -> None:
        """Set the pin of ``key``. ``KeyError`` if untracked."""

    @abc.abstractmethod
    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        """Propose keys to evict to free ``nbytes``, best first (see module docstring)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of tracked keys."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    @property
    @abc.abstractmethod
    def total_bytes(self) -> int:
        """Sum of the sizes of tracked keys."""

    def unreachable(self) -> list[Key]:
        """Tracked keys that can never be hit again (only prefix-closed policies have any)."""
        return []

    def self_check(self) -> None:
        """Raise ``AssertionError`` if internal bookkeeping is inconsistent."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {len(self)} keys, {self.total_bytes} bytes>"


class SizedPolicy(EvictionPolicy):
    """An :class:`EvictionPolicy` whose tracked keys are the keys of one dict, with a running
    byte total and a pin table: the bookkeeping every shipped policy shares.

    A subclass calls ``super().__init__(tracked)`` with its own per-key dict (the object
    itself, which it keeps updating), keeps ``_bytes`` equal to the sum of the tracked sizes,
    and stores pins only through :meth:`set_pin` (``_pins`` holds no ``Pin.NONE``; a removed
    key's pin is popped by the subclass). It gets ``__len__``, ``__contains__``,
    ``total_bytes``, ``set_pin`` and :meth:`_check_sized`, the shared part of ``self_check``.
    """

    __slots__ = ("_bytes", "_pins", "_tracked")

    def __init__(self, tracked: Mapping[Key, object]) -> None:
        self._tracked = tracked
        self._pins: dict[Key, Pin] = {}
        self._bytes = 0

    def set_pin(self, key: Key, pin: Pin) -> None:
        if key not in self._tracked:
            raise KeyError(key)
        record_pin(self._pins, key, pin)

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, key: object) -> bool:
        return key in self._tracked

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def _check_sized(self, total: int) -> None:
        """Assert the byte total is ``total`` (the subclass sums its sizes) and the pin table
        holds tracked keys only, none at ``Pin.NONE``."""
        assert self._bytes == total, "byte total drifted"
        assert all(k in self._tracked for k in self._pins), "pin on an untracked key"
        assert all(p is not Pin.NONE for p in self._pins.values()), "Pin.NONE stored"
