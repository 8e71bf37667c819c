"""The multi-buffer family (vLLM's and SGLang's data path): one object per key, made of several
registered buffers.

``batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, config)``: key ``i``'s value
is the concatenation, in order, of ``all_sizes[i][j]`` bytes at ``all_buffer_ptrs[i][j]``.
``batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node)``
scatters the value over the buffers in the same order and answers the value's length per key
(negative where the key is missing or the buffers together are smaller). Both are one batch of
master calls and one batch of transfers, on the put/get paths of the other families.
"""

from __future__ import annotations

from mooncake._store.config import ReplicateConfig
from mooncake.errors import ErrorCode, to_code
from mooncake.store._base import StoreBase


def _parts(
    ptrs: list[list[int]], sizes: list[list[int]], n: int
) -> list[list[tuple[int, int]]] | None:
    if len(ptrs) != n or len(sizes) != n:
        return None
    out = []
    for p, s in zip(ptrs, sizes, strict=True):
        if len(p) != len(s):
            return None
        out.append(list(zip(p, s, strict=True)))
    return out


class MultiBufferMethods(StoreBase):
    """``batch_put_from_multi_buffers`` and ``batch_get_into_multi_buffers``."""

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store key ``i`` as the concatenation of its buffers; a code per key."""
        parts = _parts(all_buffer_ptrs, all_sizes, len(keys))
        if parts is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        try:
            fn = self._s.batch_put_parts
        except Exception as e:
            return [to_code(e)] * len(keys)
        return self._batch_codes(len(keys), fn, keys, parts, config)

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Scatter key ``i`` over its buffers in order; the bytes read (or a code) per key.
        Replicas are always tried own segment first, then same-host, then remote, so
        ``prefer_alloc_in_same_node`` changes nothing here."""
        parts = _parts(all_buffer_ptrs, all_sizes, len(keys))
        if parts is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        try:
            fn = self._s.batch_get_parts
        except Exception as e:
            return [to_code(e)] * len(keys)
        return self._batch_codes(len(keys), fn, keys, parts)
