"""Batch calls split into chunks, so neither a request nor its answer nears the frame bound.

A batch call (``BatchExistKey``, ``BatchPutStart``, ``BatchRemove``...) carries one
entry per key and is answered with one per key, so its frames grow with the batch: a batch
over :data:`CHUNK_KEYS` keys or :data:`CHUNK_BYTES` bytes of keys is sent as several calls of
at most that much (each its own request id), their per-key answers joined in order. A chunked
call is not atomic: an error of one chunk's call (the master unreachable...) is raised after
the chunks before it were applied, as if the caller had sent them one by one (each key's own
result is per key anyway). ``BatchGetReplicaList`` is chunked by the read path itself
(``_Reads._batch_query``), which keeps each key's read window that of its own chunk's lease.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mooncake._core import store_types as st

#: keys of one chunk at most
CHUNK_KEYS = 4096
#: bytes of keys of one chunk at most (the rest of a request is small beside them)
CHUNK_BYTES = 2 << 20
#: batch methods whose answer is one list entry per key, in order
SPLITTABLE = frozenset(
    {
        "BatchExistKey",
        "BatchPutStart",
        "BatchPutEnd",
        "BatchPutRevoke",
        "BatchUpsertStart",
        "BatchUpsertEnd",
        "BatchUpsertRevoke",
        "BatchRemove",
    }
)


def chunks(keys: list[str]) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges of ``keys`` in chunks within the bounds (one when it fits)."""
    return _bounds(keys)


def _bounds(keys: list[str]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, k in enumerate(keys):
        n = len(k) + 8
        if i > start and (i - start >= CHUNK_KEYS or size + n > CHUNK_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += n
    out.append((start, len(keys)))
    return out


def split(method: str, params: Any) -> list[Any] | None:
    """``params`` of a batch ``method`` as the params of its chunks, or None when it fits in
    one call (or ``method`` is not a splittable batch)."""
    if method not in SPLITTABLE:
        return None
    keys = getattr(params, "keys", None)
    if not isinstance(keys, list) or len(keys) <= 1:
        return None
    bounds = _bounds(keys)
    if len(bounds) == 1:
        return None
    n = len(keys)
    out = []
    for lo, hi in bounds:
        changes: dict[str, Any] = {"keys": keys[lo:hi]}
        sizes = getattr(params, "sizes", None)
        if isinstance(sizes, list) and len(sizes) == n:
            changes["sizes"] = sizes[lo:hi]
        config = getattr(params, "config", None)
        groups = config.group_ids if isinstance(config, st.ReplicateConfig) else None
        if isinstance(config, st.ReplicateConfig) and groups is not None and len(groups) == n:
            changes["config"] = msgspec.structs.replace(config, group_ids=groups[lo:hi])
        out.append(msgspec.structs.replace(params, **changes))
    return out


__all__ = ["CHUNK_BYTES", "CHUNK_KEYS", "SPLITTABLE", "chunks", "split"]
