"""Listings of the master's keys and segments: all at once (bounded) or in pages.

See :mod:`mooncake._core.paging` for the limits and the scan's guarantees.
"""

from __future__ import annotations

from collections.abc import Iterator

from mooncake._core import paging
from mooncake._core.master.base import _StateBase
from mooncake._core.master.tenants import PREFIX, tenant_keys
from mooncake._core.store_types import SegmentInfo


class _Listing(_StateBase):
    """``GetAllKeys(Page)`` and ``GetAllSegments(Page)``."""

    def all_keys_bounded(self, tenant: str | None = None) -> list[str]:
        """Every readable key (of ``tenant``, a checked name, as that tenant names them; None:
        every key of the table), or ``INVALID_PARAMS`` past the one-answer limit."""
        keys = self._objects.readable_keys()
        if tenant is not None:
            keys = list(tenant_keys(tenant, keys))
        return paging.bounded(keys, paging.key_bytes, "GetAllKeys", "GetAllKeysPage")

    def all_segments_bounded(self) -> list[SegmentInfo]:
        """Every mounted segment, or ``INVALID_PARAMS`` past the one-answer limit."""
        return paging.bounded(
            self.all_segments(),
            lambda _s: paging.SEGMENT_INFO_BYTES,
            "GetAllSegments",
            "GetAllSegmentsPage",
        )

    def all_keys_page(
        self, cursor: int, limit: int, tenant: str | None = None
    ) -> tuple[list[str], int]:
        """Readable keys from ``cursor`` on (at most ``limit``) and the next cursor (-1: done);
        with ``tenant`` (a checked name) only that tenant's keys, as it names them."""
        objects = self._objects
        rows: Iterator[tuple[int, str]] = objects.readable_from(cursor)
        if tenant is not None:
            rows = _of_tenant(tenant, rows)
        return paging.page(rows, limit, paging.key_bytes, objects.table.capacity)

    def all_segments_page(self, cursor: int, limit: int) -> tuple[list[SegmentInfo], int]:
        """Mounted segments from index ``cursor`` on (at most ``limit``) and the next cursor."""
        segs = self.all_segments()
        return paging.page(
            ((i, segs[i]) for i in range(max(0, cursor), len(segs))),
            limit,
            lambda _s: paging.SEGMENT_INFO_BYTES,
            len(segs),
        )


def _of_tenant(tenant: str, rows: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """The ``(handle, key)`` rows of ``tenant``'s keys, its prefix taken off (the default
    tenant: the keys without a tenant prefix)."""
    if not tenant:
        return ((h, k) for h, k in rows if k[:1] != PREFIX)
    head = f"{PREFIX}{tenant}{PREFIX}"
    n = len(head)
    return ((h, k[n:]) for h, k in rows if k.startswith(head))
