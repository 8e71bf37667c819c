"""Listings of the master's keys and segments: all at once (bounded) or in pages.

See :mod:`mooncake._core.paging` for the limits and the scan's guarantees.
"""

from __future__ import annotations

from mooncake._core import paging
from mooncake._core.master.base import _StateBase
from mooncake._core.store_types import SegmentInfo


class _Listing(_StateBase):
    """``GetAllKeys(Page)`` and ``GetAllSegments(Page)``."""

    def all_keys_bounded(self) -> list[str]:
        """Every readable key, or ``INVALID_PARAMS`` past the one-answer limit."""
        return paging.bounded(
            self._objects.readable_keys(), paging.key_bytes, "GetAllKeys", "GetAllKeysPage"
        )

    def all_segments_bounded(self) -> list[SegmentInfo]:
        """Every mounted segment, or ``INVALID_PARAMS`` past the one-answer limit."""
        return paging.bounded(
            self.all_segments(),
            lambda _s: paging.SEGMENT_INFO_BYTES,
            "GetAllSegments",
            "GetAllSegmentsPage",
        )

    def all_keys_page(self, cursor: int, limit: int) -> tuple[list[str], int]:
        """Readable keys from ``cursor`` on (at most ``limit``) and the next cursor (-1: done)."""
        objects = self._objects
        return paging.page(
            objects.readable_from(cursor), limit, paging.key_bytes, objects.table.capacity
        )

    def all_segments_page(self, cursor: int, limit: int) -> tuple[list[SegmentInfo], int]:
        """Mounted segments from index ``cursor`` on (at most ``limit``) and the next cursor."""
        segs = self.all_segments()
        return paging.page(
            ((i, segs[i]) for i in range(max(0, cursor), len(segs))),
            limit,
            lambda _s: paging.SEGMENT_INFO_BYTES,
            len(segs),
        )
