"""LRU and FIFO over object handles, kept in the object table's own recency list.

:class:`TablePolicy` is an :class:`~mooncake._core.policies.EvictionPolicy` whose keys are the
handles of an :class:`~mooncake._fast.ObjectTable` and whose order lives in that table (two
integers and a size per tracked object, no Python object per key). ``"lru"`` moves a key to
the back on access, ``"fifo"`` does not; everything else is :class:`LRUPolicy`'s contract
(pins, victims, replace-on-insert).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mooncake._core.policies import CanEvict, EvictionPolicy, Key, Pin, select_victims
from mooncake._core.policies.base import check_size, record_pin
from mooncake._fast import ObjectTable
from mooncake.errors import InvalidArgumentError

__all__ = ["TABLE_POLICIES", "TableFIFOPolicy", "TablePolicy", "make_table_policy"]

TABLE_POLICIES = frozenset({"lru", "fifo"})
"""Policy names the master keeps in its object table."""

_CHUNK = 256


class _Sizes:
    """A table's recency-list sizes, indexable by handle (for ``select_victims``)."""

    __slots__ = ("_size",)

    def __init__(self, table: ObjectTable) -> None:
        self._size = table.lru_size

    def __getitem__(self, h: Key) -> int:
        return self._size(h)  # type: ignore[arg-type]


def make_table_policy(name: str, table: ObjectTable) -> TablePolicy:
    """The table policy called ``name`` (``"lru"`` or ``"fifo"``) over ``table``."""
    if name == "lru":
        return TablePolicy(table)
    if name == "fifo":
        return TableFIFOPolicy(table)
    raise InvalidArgumentError(f"a table policy is lru or fifo, not {name!r}")


class TablePolicy(EvictionPolicy):
    """LRU over the handles of ``table`` (see the module docstring)."""

    __slots__ = ("_pins", "_table")
    name = "lru"
    _lru = True

    def __init__(self, table: ObjectTable) -> None:
        self._table = table
        self._pins: dict[Key, Pin] = {}

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        t = self._table
        if t.lru_contains(key):  # type: ignore[arg-type]
            t.lru_unlink(key)  # type: ignore[arg-type]
            self._pins.pop(key, None)
        t.lru_push(key, size)  # type: ignore[arg-type]

    def on_access(self, key: Key, now: float = 0.0) -> None:
        if self._lru:
            self._table.lru_touch(key)  # type: ignore[arg-type]
        elif not self._table.lru_contains(key):  # type: ignore[arg-type]
            raise KeyError(key)

    def on_remove(self, key: Key) -> None:
        self._table.lru_unlink(key)  # type: ignore[arg-type]
        self._pins.pop(key, None)

    def set_pin(self, key: Key, pin: Pin) -> None:
        if not self._table.lru_contains(key):  # type: ignore[arg-type]
            raise KeyError(key)
        record_pin(self._pins, key, pin)

    def _order(self) -> Iterator[int]:
        t = self._table
        chunk = t.lru_order(_CHUNK)
        while chunk:
            yield from chunk
            chunk = t.lru_after(chunk[-1], 4 * _CHUNK)

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0:
            return []
        return select_victims(self._order(), _Sizes(self._table), self._pins, nbytes, can_evict)

    def __len__(self) -> int:
        return self._table.lru_len

    def __contains__(self, key: object) -> bool:
        return self._table.lru_contains(key)  # type: ignore[arg-type]

    @property
    def total_bytes(self) -> int:
        return self._table.lru_bytes

    def self_check(self) -> None:
        self._table.self_check()
        assert all(self._table.lru_contains(k) for k in self._pins), "pin on an untracked key"  # type: ignore[arg-type]
        assert all(p is not Pin.NONE for p in self._pins.values()), "Pin.NONE stored"

    def __canon__(self) -> Any:
        t = self._table
        return (self.name, [(h, t.lru_size(h)) for h in t.lru_order()], sorted(self._pins.items()))

    def __getstate__(self) -> Any:
        raise TypeError("a table policy is saved with its table (see master.snapshot)")


class TableFIFOPolicy(TablePolicy):
    """FIFO over the handles of a table: hits do not move a key."""

    __slots__ = ()
    name = "fifo"
    _lru = False
