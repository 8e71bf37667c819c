"""The ranges and sessions family: byte ranges of objects, read or written without reading or
writing the whole object.

* ``get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)``:
  for buffer ``i``, key ``j``, range ``k``: ``all_sizes[i][j][k]`` bytes from object offset
  ``all_src_offsets[i][j][k]`` to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``; the result has
  the same nesting, bytes copied or a negative code per range (``INVALID_PARAMS`` for a range
  outside the registered buffer or the object, or lists whose lengths differ).
* Get sessions: ``batch_get_session_start(keys)`` queries once (a code per key; a lease is
  granted), ``batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, src_offsets)`` reads ranges
  with no master call (bytes per key; ``LEASE_EXPIRED`` once the lease has run out),
  ``batch_get_session_end(keys)`` forgets them (0).
* Put sessions: ``batch_put_session_start(keys, sizes, config)`` reserves the objects (a code
  per key), ``batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, dst_offsets)`` writes ranges
  into every replica (bytes per key), ``batch_put_session_end(keys)`` makes them readable and
  ``batch_put_session_revoke(keys)`` drops them (a code per key each).
"""

from __future__ import annotations

from mooncake._store.config import ReplicateConfig
from mooncake.errors import ErrorCode
from mooncake.store._base import StoreBase, _kw, fail


class RangeMethods(StoreBase):
    """``get_into_ranges`` and the get/put session calls."""

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        try:
            out: list[list[list[int]]] = self._call(
                self._s.get_into_ranges,
                buffer_ptrs,
                all_keys,
                all_dst_offsets,
                all_src_offsets,
                all_sizes,
            )
            return out
        except Exception as e:
            code = fail("get_into_ranges", e)
            return [
                [[code] * len(d) for d in dsts]
                for dsts in (all_dst_offsets if isinstance(all_dst_offsets, list) else [])
            ]

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        try:
            return list(self._call(self._s.get_session_start, keys))
        except Exception as e:
            return [fail("batch_get_session_start", e)] * len(keys)

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        try:
            return list(
                self._call(
                    self._s.get_session_ranges, keys, all_buffer_ptrs, all_sizes, all_src_offsets
                )
            )
        except Exception as e:
            return [fail("batch_get_into_multi_buffer_ranges", e)] * len(keys)

    def batch_get_session_end(self, keys: list[str]) -> int:
        store = self._store
        if store is None:
            return int(ErrorCode.INTERNAL_ERROR)
        store.get_session_end(keys)
        return 0

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        try:
            return list(self._call(self._s.put_session_start, keys, sizes, config))
        except Exception as e:
            return [fail("batch_put_session_start", e)] * len(keys)

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        try:
            return list(
                self._call(
                    self._s.put_session_ranges, keys, all_buffer_ptrs, all_sizes, all_dst_offsets
                )
            )
        except Exception as e:
            return [fail("batch_put_from_multi_buffer_ranges", e)] * len(keys)

    def _put_session_finish(self, keys: list[str], revoke: bool) -> list[int]:
        try:
            return list(self._call(_kw(self._s.put_session_finish, revoke=revoke), keys))
        except Exception as e:
            return [fail("_put_session_finish", e)] * len(keys)

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        return self._put_session_finish(keys, False)

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        return self._put_session_finish(keys, True)
