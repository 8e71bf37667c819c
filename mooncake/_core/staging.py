"""A first-fit range allocator for a client's staging ("local") buffer.

The copying store APIs (``put(key, bytes)``, ``get(key) -> bytes``) move bytes through the
client's registered local buffer, as the published client does. :class:`RangeAllocator` hands out
disjoint ``[offset, offset+length)`` ranges of it: first fit over an address-ordered free list,
neighbours coalesced on free, every range aligned to ``align`` bytes. It is small (a staging buffer
holds at most a few thousand in-flight ranges) and pure: no locking, no waiting; the async caller
decides what to do when :meth:`alloc` returns None.

Invariants (checked by the property tests): allocated ranges never overlap and lie inside
``[0, capacity)``; ``free`` of anything not currently allocated raises; after every range is
freed the free list is one range covering the whole capacity again.
"""

from __future__ import annotations

import bisect

from mooncake.errors import InvalidArgumentError


class RangeAllocator:
    """First-fit, coalescing allocator over ``[0, capacity)``."""

    def __init__(self, capacity: int, align: int = 64) -> None:
        if capacity < 0:
            raise InvalidArgumentError(f"capacity must be >= 0, got {capacity}")
        if align <= 0 or align & (align - 1):
            raise InvalidArgumentError(f"align must be a power of two, got {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._starts: list[int] = [0] if self.capacity else []
        self._lens: list[int] = [self.capacity] if self.capacity else []
        self._live: dict[int, int] = {}
        self.used = 0

    def _round(self, n: int) -> int:
        return (n + self.align - 1) & ~(self.align - 1)

    def alloc(self, length: int) -> int | None:
        """Offset of a fresh range of ``length`` bytes, or None if no free range is large enough."""
        if length <= 0:
            raise InvalidArgumentError(f"length must be positive, got {length}")
        n = self._round(length)
        for i, free in enumerate(self._lens):
            if free >= n:
                off = self._starts[i]
                if free == n:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = off + n
                    self._lens[i] = free - n
                self._live[off] = n
                self.used += n
                return off
        return None

    def free(self, offset: int) -> None:
        """Return the range starting at ``offset`` (which :meth:`alloc` returned)."""
        n = self._live.pop(offset, None)
        if n is None:
            raise InvalidArgumentError(f"offset {offset} is not an allocated range")
        self.used -= n
        i = bisect.bisect_left(self._starts, offset)
        # merge with the previous free range
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == offset:
            i -= 1
            self._lens[i] += n
        else:
            self._starts.insert(i, offset)
            self._lens.insert(i, n)
        # merge with the next one
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1]
            del self._lens[i + 1]

    def fits(self, length: int) -> bool:
        """Whether ``length`` bytes could ever be allocated (i.e. fits in an empty allocator)."""
        return 0 < self._round(length) <= self.capacity

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lens, strict=True))

    @property
    def live(self) -> int:
        return len(self._live)
