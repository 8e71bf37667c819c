"""Big answers in pages: the key and segment listings, and the one-frame limit of the rest.

``GetAllKeys`` and ``GetAllSegments`` answer everything in one frame; past
:data:`ONE_FRAME_ANSWER_MAX` bytes (estimated from the items) they are refused with
``INVALID_PARAMS`` naming the paged method to use instead, so no call builds a frame near the
16 MiB frame bound. ``GetAllKeysPage`` / ``GetAllSegmentsPage`` (:class:`PageParams`) answer
at most ``limit`` items (and about :data:`PAGE_MAX_BYTES`) from ``cursor`` on plus the cursor
of the next page (-1 after the last): the scan order is the object table's handle order (the
segment list's for segments), so an item present during the whole scan is listed exactly once,
and one added or removed meanwhile may or may not be (as Redis ``SCAN``). A master change
during a scan (failover, restart) may renumber handles: start the scan again.

This module is sans-I/O (the master's state and the client's chunking both use it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from mooncake.errors import InvalidArgumentError

T = TypeVar("T")

#: the estimated encoded size past which an all-at-once listing is refused
ONE_FRAME_ANSWER_MAX = 8 << 20
#: at most this many bytes (estimated) of items in one page
PAGE_MAX_BYTES = 4 << 20
#: the default and the largest ``limit`` of one page
PAGE_ITEMS = 10_000
PAGE_ITEMS_MAX = 100_000
#: per-item overhead of the estimate (msgpack headers, map keys of small structs)
_ITEM_OVERHEAD = 5
#: a SegmentInfo's encoded size, about (names and ids of usual lengths, counters)
SEGMENT_INFO_BYTES = 256


def key_bytes(key: str) -> int:
    """The estimated encoded size of ``key`` in a list."""
    return len(key) + _ITEM_OVERHEAD


def bounded(items: list[T], size_of: Callable[[T], int], what: str, paged: str) -> list[T]:
    """``items`` unchanged, or :class:`InvalidArgumentError` when their estimated size is over
    :data:`ONE_FRAME_ANSWER_MAX` (naming ``what``, the size and the ``paged`` method)."""
    total = 0
    for it in items:
        total += size_of(it)
        if total > ONE_FRAME_ANSWER_MAX:
            raise InvalidArgumentError(
                f"{what}: {len(items)} items, more than the {ONE_FRAME_ANSWER_MAX >> 20} MiB one "
                f"answer may carry; list them with {paged} (pages of up to {PAGE_ITEMS_MAX})"
            )
    return items


def check_limit(limit: int) -> int:
    """``limit`` if it is a page size this master serves, else :class:`InvalidArgumentError`."""
    if not 0 < limit <= PAGE_ITEMS_MAX:
        raise InvalidArgumentError(f"page limit must be in 1..{PAGE_ITEMS_MAX}, got {limit}")
    return limit


def page(
    candidates: Iterable[tuple[int, T]], limit: int, size_of: Callable[[T], int], end: int
) -> tuple[list[T], int]:
    """The first ``limit`` items (or :data:`PAGE_MAX_BYTES`) of ``(position, item)`` pairs in
    increasing position, and the cursor after the last one taken (-1 when the pairs ran out
    before the page was full, or the next position is ``end``)."""
    check_limit(limit)
    out: list[T] = []
    size = 0
    for pos, item in candidates:
        out.append(item)
        size += size_of(item)
        if len(out) >= limit or size >= PAGE_MAX_BYTES:
            nxt = pos + 1
            return out, (-1 if nxt >= end else nxt)
    return out, -1


__all__ = [
    "ONE_FRAME_ANSWER_MAX",
    "PAGE_ITEMS",
    "PAGE_ITEMS_MAX",
    "PAGE_MAX_BYTES",
    "bounded",
    "check_limit",
    "key_bytes",
    "page",
]
