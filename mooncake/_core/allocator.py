"""Offset allocator: hands out aligned, non-overlapping ranges of one segment.

The master owns one :class:`OffsetAllocator` per mounted segment, over ``[base, base+size)``;
it never touches the memory, it only does arithmetic on addresses.

Contract:

* ``allocate(n)`` returns the address of a free range of ``n`` bytes rounded up to
  ``alignment`` (the range's *extent*), aligned relative to ``base`` (and absolutely when
  ``base`` is aligned), or ``None`` when no free range is large enough (no exception: running out
  of space is the normal case the caller handles by evicting or trying another segment).
* Extents never overlap each other and always lie inside the segment.
* ``free(addr)`` returns the extent to the free list and coalesces it with free neighbours, so
  after freeing everything the allocator is one free block again (no leak, no fragmentation
  residue). Freeing an address that is not allocated raises
  :class:`~mooncake.errors.InvalidArgumentError` (double free, foreign address).
* Placement is best-fit (smallest free block that fits, lowest address among equals), which
  keeps large blocks intact for large objects.

Costs: ``allocate`` and ``free`` are O(log F) comparisons plus a list insert/delete (memmove) in
the two sorted free-block indexes, F the number of free blocks. Live extents are kept in an
:class:`~mooncake._fast.IntMap` (address -> length in C arrays: 16-32 bytes an extent, no
Python objects), since a master holds one per stored object.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable

from mooncake._fast import IntMap
from mooncake.errors import InvalidArgumentError

DEFAULT_ALIGNMENT = 64

__all__ = ["DEFAULT_ALIGNMENT", "OffsetAllocator"]


class OffsetAllocator:
    """Best-fit allocator with a coalescing free list over ``[base, base+size)``."""

    __slots__ = (
        "_alignment",
        "_allocated",
        "_by_size",
        "_free",
        "_starts",
        "_used",
        "base",
        "size",
    )

    def __init__(self, base: int, size: int, *, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if base < 0 or size <= 0:
            raise InvalidArgumentError(
                f"segment range must have base >= 0, size > 0: {base}, {size}"
            )
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
        self.base = base
        self.size = size
        self._alignment = alignment
        # Free blocks: start -> length, plus two sorted indexes: by start (coalescing) and by
        # (length, start) (best fit).
        self._free: dict[int, int] = {}
        self._starts: list[int] = []
        self._by_size: list[tuple[int, int]] = []
        self._allocated = IntMap()  # extent address -> rounded length
        self._used = 0
        usable = size - size % alignment if size >= alignment else size
        self._insert_free(base, usable)

    # -- queries ---------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes in allocated extents (rounded sizes)."""
        return self._used

    @property
    def alignment(self) -> int:
        """Extents start at multiples of this from ``base`` and are rounded up to it."""
        return self._alignment

    @property
    def capacity(self) -> int:
        """Bytes the segment has (``size``)."""
        return self.size

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated (includes a tail smaller than ``alignment``, never handed out)."""
        return self.size - self._used

    @property
    def largest_free(self) -> int:
        """Length of the largest free block (0 when full)."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def allocations(self) -> int:
        """Number of live extents."""
        return len(self._allocated)

    def extent(self, addr: int) -> int:
        """Rounded length of the extent allocated at ``addr`` (``KeyError`` if none)."""
        try:
            return self._allocated[addr]
        except OverflowError:  # outside int64: not an address this segment has
            raise KeyError(addr) from None

    def extents(self) -> tuple[array[int], array[int]]:
        """Live extents as two ``array('q')`` columns: addresses ascending, their lengths."""
        return self._allocated.items_sorted()

    def memory_bytes(self) -> int:
        """Bytes the live-extent map holds (the free-block indexes not counted)."""
        return self._allocated.memory_bytes()

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free ``(start, length)`` blocks in address order (for tests and admin views)."""
        return [(s, self._free[s]) for s in self._starts]

    # -- operations ------------------------------------------------------------------------

    def allocate(self, length: int) -> int | None:
        """Address of a new extent of ``length`` bytes (rounded up), or ``None`` if none fits."""
        if length <= 0:
            raise InvalidArgumentError(f"allocation length must be positive, got {length}")
        a = self._alignment
        # an aligned length is its own extent: keep that int (one object fewer per extent)
        need = length if not length & (a - 1) else (length + a - 1) & ~(a - 1)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        blen, start = self._by_size[i]
        self._remove_free(start, blen, i)
        if blen > need:
            self._insert_free(start + need, blen - need)
        self._allocated[start] = need
        self._used += need
        return start

    def reserve(self, addr: int, length: int) -> bool:
        """Allocate exactly the extent at ``addr`` (``length`` rounded up) if all of it is free
        and ``addr`` is aligned as :meth:`allocate` would place it; False otherwise."""
        if length <= 0:
            raise InvalidArgumentError(f"reservation length must be positive, got {length}")
        a = self._alignment
        need = (length + a - 1) & ~(a - 1)
        if (addr - self.base) % a:
            return False
        j = bisect.bisect_right(self._starts, addr) - 1
        if j < 0:
            return False
        start = self._starts[j]
        blen = self._free[start]
        if addr + need > start + blen:
            return False
        self._remove_free(start, blen)
        self._insert_free(start, addr - start)
        self._insert_free(addr + need, start + blen - addr - need)
        self._allocated[addr] = need
        self._used += need
        return True

    def free(self, addr: int) -> None:
        """Return the extent at ``addr``; coalesces with free neighbours."""
        try:
            length = self._allocated.pop(addr, None)
        except (OverflowError, TypeError):  # not an int64: certainly not an extent
            length = None
        if length is None:
            raise InvalidArgumentError(
                f"free of {addr:#x}: not an allocated extent of segment {self.base:#x}+{self.size}"
            )
        self._used -= length
        start = addr
        # merge with the following block
        nxt = self._free.get(addr + length)
        if nxt is not None:
            self._remove_free(addr + length, nxt)
            length += nxt
        # merge with the preceding block
        j = bisect.bisect_left(self._starts, addr) - 1
        if j >= 0:
            ps = self._starts[j]
            pl = self._free[ps]
            if ps + pl == addr:
                self._remove_free(ps, pl)
                start = ps
                length += pl
        self._insert_free(start, length)

    def self_check(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests)."""
        assert self._starts == sorted(self._free)
        assert self._by_size == sorted((n, s) for s, n in self._free.items())
        addrs, lengths = self._allocated.items_sorted()
        assert self._used == sum(lengths) == self._allocated.total()
        spans = sorted([*self._free.items(), *zip(addrs, lengths, strict=True)])
        pos = self.base
        prev_free = False
        for s, n in spans:
            assert s == pos, f"gap or overlap at {s:#x} (expected {pos:#x})"
            is_free = s in self._free
            assert not (is_free and prev_free), f"uncoalesced free blocks at {s:#x}"
            prev_free = is_free
            pos = s + n
        assert pos <= self.base + self.size

    @classmethod
    def restore(
        cls,
        base: int,
        size: int,
        alignment: int,
        *,
        allocated: Iterable[tuple[int, int]] | tuple[array[int], array[int]],
        free: Iterable[tuple[int, int]],
        used: int,
    ) -> OffsetAllocator:
        """An allocator in exactly the state described: ``allocated`` extents (any order) and
        ``free`` blocks (address order) as ``(start, length)``, ``used`` bytes (a snapshot's;
        :meth:`self_check` verifies the result); ``allocated`` may also be the two columns
        (addresses, lengths as ``array('q')``) :meth:`extents` returns."""
        a = cls(base, size, alignment=alignment)
        if isinstance(allocated, tuple) and len(allocated) == 2 and type(allocated[0]) is array:
            a._allocated.update_columns(allocated[0], allocated[1])
        else:
            a._allocated.update(allocated)  # type: ignore[arg-type]
        a._free = dict(free)
        a._starts = list(a._free)
        a._by_size = sorted((n, s) for s, n in a._free.items())
        a._used = used
        return a

    def state(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
        """``(allocated, free, used)`` as :meth:`restore` takes them (extents in address
        order)."""
        addrs, lengths = self._allocated.items_sorted()
        return list(zip(addrs, lengths, strict=True)), self.free_blocks(), self._used

    # -- internals -------------------------------------------------------------------------

    def _insert_free(self, start: int, length: int) -> None:
        if length <= 0:
            return
        self._free[start] = length
        bisect.insort(self._starts, start)
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int, size_index: int | None = None) -> None:
        del self._free[start]
        del self._starts[bisect.bisect_left(self._starts, start)]
        if size_index is None:
            size_index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[size_index]

    def __repr__(self) -> str:
        return (
            f"<OffsetAllocator {self.base:#x}+{self.size} used={self._used} "
            f"extents={len(self._allocated)} free_blocks={len(self._free)}>"
        )
