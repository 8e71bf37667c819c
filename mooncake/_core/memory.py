"""The local memory registry: which address ranges this process exposes.

A :class:`Region` is one registered, contiguous range. The registry keeps them sorted and
disjoint: registering an overlapping range raises :class:`AddressOverlapError`, a zero-length one
:class:`InvalidArgumentError`. Lookups (`find`) are O(log n) and answer "which one region holds all
of ``[addr, addr+length)``", the check every remote request goes through: a range that straddles
two adjacent regions is refused, exactly as the published engine does.

Regions count in-flight users (``acquire``/``release``) so that unregistering a range never frees
it under a transfer still touching it; the async layer waits on that count.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from mooncake.errors import AddressOverlapError, InvalidArgumentError, NotRegisteredError

U64 = 1 << 64


@dataclass(eq=False, slots=True)
class Region:
    """One registered range. ``owner`` keeps the exporting object alive while registered."""

    addr: int
    length: int
    location: str = "cpu:0"
    owner: Any = None
    remote_accessible: bool = True
    users: int = 0
    closing: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end


def check_range(addr: int, length: int, what: str = "range") -> None:
    """Raise :class:`InvalidArgumentError` unless ``[addr, addr+length)`` is a sane, non-empty range."""
    if isinstance(addr, bool) or not isinstance(addr, int) or addr < 0:
        raise InvalidArgumentError(f"{what}: address must be a non-negative int, got {addr!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise InvalidArgumentError(f"{what}: length must be a positive int, got {length!r}")
    if addr + length > U64:
        raise InvalidArgumentError(f"{what}: [{addr:#x}, +{length}) runs past the address space")


class MemoryRegistry:
    """Sorted, disjoint registered regions."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[Region] = []

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._regions))

    def add(self, region: Region) -> Region:
        check_range(region.addr, region.length, "register")
        i = bisect.bisect_right(self._starts, region.addr)
        if i > 0 and self._regions[i - 1].end > region.addr:
            prev = self._regions[i - 1]
            raise AddressOverlapError(
                f"[{region.addr:#x}, +{region.length}) overlaps registered "
                f"[{prev.addr:#x}, +{prev.length})"
            )
        if i < len(self._regions) and self._regions[i].addr < region.end:
            nxt = self._regions[i]
            raise AddressOverlapError(
                f"[{region.addr:#x}, +{region.length}) overlaps registered "
                f"[{nxt.addr:#x}, +{nxt.length})"
            )
        self._starts.insert(i, region.addr)
        self._regions.insert(i, region)
        return region

    def get(self, addr: int) -> Region:
        """The region starting exactly at ``addr`` (:class:`NotRegisteredError` otherwise)."""
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._starts[i] == addr:
            return self._regions[i]
        raise NotRegisteredError(f"no registered region starts at {addr:#x}")

    def remove(self, addr: int) -> Region:
        region = self.get(addr)
        i = self._regions.index(region)
        del self._starts[i]
        del self._regions[i]
        return region

    def find(self, addr: int, length: int) -> Region | None:
        """The one region holding all of ``[addr, addr+length)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            r = self._regions[i]
            if r.covers(addr, length) and not r.closing:
                return r
        return None

    def require(self, addr: int, length: int, what: str = "local") -> Region:
        """Like :meth:`find` but raises :class:`NotRegisteredError` naming the range."""
        r = self.find(addr, length)
        if r is None:
            raise NotRegisteredError(
                f"{what} range [{addr:#x}, +{length}) is not inside one registered region"
            )
        return r

    def regions(self) -> list[Region]:
        return list(self._regions)
