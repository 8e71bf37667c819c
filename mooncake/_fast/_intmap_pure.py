"""Pure-Python twin of ``_intmap.pyx``: the same IntMap contracts over a dict.

Slower and three to four times larger per entry than the compiled map; correct everywhere.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterable
from typing import NoReturn, TypeVar, overload

COMPILED = False

_LO = -(1 << 63)
_HI = 1 << 63
_MISSING: object = object()
_T = TypeVar("_T")


def _i64(x: object) -> int:
    """``x`` as an int in the int64 range (``TypeError`` / ``OverflowError`` otherwise)."""
    i = operator.index(x)  # type: ignore[arg-type]
    if not _LO <= i < _HI:
        raise OverflowError(f"{i} does not fit in int64")
    return int(i)


class IntMap:
    """A dict of int64 keys to int64 values (see ``_intmap.pyx`` for the contracts)."""

    __slots__ = ("_d", "_total")

    def __init__(self) -> None:
        self._d: dict[int, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return _i64(key) in self._d

    def __getitem__(self, key: object) -> int:
        return self._d[_i64(key)]

    def __setitem__(self, key: object, value: object) -> None:
        k = _i64(key)
        v = _i64(value)
        old = self._d.get(k)
        if old is not None:
            self._total -= old
        self._d[k] = v
        self._total += v

    def __delitem__(self, key: object) -> None:
        self._total -= self._d.pop(_i64(key))

    def __iter__(self) -> NoReturn:
        raise TypeError("IntMap is not iterable in hash order; use items_sorted()")

    @overload
    def get(self, key: object) -> int | None: ...
    @overload
    def get(self, key: object, default: _T) -> int | _T: ...
    def get(self, key: object, default: object = None) -> object:
        """``m[key]`` if present, else ``default``."""
        return self._d.get(_i64(key), default)

    @overload
    def pop(self, key: object) -> int: ...
    @overload
    def pop(self, key: object, default: _T) -> int | _T: ...
    def pop(self, key: object, default: object = _MISSING) -> object:
        """Remove ``key`` and return its value; ``default`` if absent (``KeyError`` if none)."""
        k = _i64(key)
        v = self._d.pop(k, None)
        if v is None:
            if default is _MISSING:
                raise KeyError(k)
            return default
        self._total -= v
        return v

    def update(self, pairs: Iterable[tuple[object, object]]) -> None:
        """Set every ``(key, value)`` of the iterable ``pairs``, in order."""
        for k, v in pairs:
            self[k] = v

    def update_columns(self, keys: array[int], values: array[int]) -> None:
        """Set ``keys[j] -> values[j]`` for every ``j`` (two ``array('q')`` of one length), in
        order: :meth:`update` without a Python pair per entry."""
        if type(keys) is not array or type(values) is not array:
            raise TypeError("update_columns takes two array('q')")
        if keys.typecode != "q" or values.typecode != "q":
            raise TypeError(
                f"update_columns takes array('q'), got {keys.typecode!r}, {values.typecode!r}"
            )
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self[k] = v

    def clear(self) -> None:
        """Remove everything."""
        self._d = {}
        self._total = 0

    def total(self) -> int:
        """Sum of all values (exact)."""
        return self._total

    def memory_bytes(self) -> int:
        """Bytes held: the dict, its int objects and this object (ints shared with others are
        counted as if owned)."""
        d = self._d
        return (
            sys.getsizeof(self)
            + sys.getsizeof(d)
            + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())
        )

    def items_sorted(self) -> tuple[array[int], array[int]]:
        """``(keys, values)`` as ``array('q')``, ascending by key."""
        ks = sorted(self._d)
        d = self._d
        return array("q", ks), array("q", [d[k] for k in ks])

    def __canon__(self) -> tuple[list[int], list[int]]:
        """Content in key order (fingerprints of state; independent of insertion history)."""
        k, v = self.items_sorted()
        return k.tolist(), v.tolist()

    def __reduce__(self) -> tuple[object, ...]:
        k, v = self.items_sorted()
        return (_rebuild, (k.tobytes(), v.tobytes()))

    def __repr__(self) -> str:
        return f"<IntMap len={len(self)} (pure)>"


def _rebuild(kb: bytes, vb: bytes) -> IntMap:
    """An IntMap from the ``items_sorted()`` columns as bytes (unpickling)."""
    k, v = array("q"), array("q")
    k.frombytes(kb)
    v.frombytes(vb)
    if len(k) != len(v):
        raise ValueError("IntMap pickle: key and value columns differ in length")
    m = IntMap()
    m.update(zip(k, v, strict=True))
    return m
