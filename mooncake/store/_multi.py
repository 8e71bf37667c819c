"""The multi-buffer family (vLLM's and SGLang's data path): one object per key, made of several
registered buffers.

``batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, config)``: key ``i``'s value
is the concatenation, in order, of ``all_sizes[i][j]`` bytes at ``all_buffer_ptrs[i][j]``.
``batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node)``
scatters the value over the buffers in the same order and answers the value's length per key
(negative where the key is missing or the buffers together are smaller). Both are one batch of
master calls and one batch of copies: from the caller's thread when the fast path is on and
the buffers are host memory (:meth:`~mooncake._store.fastpath.FastPath.batch_put_parts`, one
GIL-free ``memcpy_batch`` for every part of every key), else on the loop, on the put/get paths
of the other families.
"""

from __future__ import annotations

import operator
from typing import Any

from mooncake._core.gpu import device_of
from mooncake._core.memory import Region
from mooncake._store.config import ReplicateConfig
from mooncake._store.moves import _check_key
from mooncake.errors import ErrorCode, MooncakeError, to_code
from mooncake.store._base import StoreBase, fail

_INT = {int}


def _shape_ok(ptrs: list[list[int]], sizes: list[list[int]], n: int) -> bool:
    """One buffer list and one size list per key, of equal lengths."""
    if len(ptrs) != n or len(sizes) != n:
        return False
    return all(len(p) == len(s) for p, s in zip(ptrs, sizes, strict=True))


def _parts(ptrs: list[list[int]], sizes: list[list[int]]) -> list[list[tuple[int, int]]]:
    return [list(zip(p, s, strict=True)) for p, s in zip(ptrs, sizes, strict=True)]


class MultiBufferMethods(StoreBase):
    """``batch_put_from_multi_buffers`` and ``batch_get_into_multi_buffers``."""

    def _fast_parts(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], what: str
    ) -> tuple[list[int], list[int], list[int]] | None:
        """For the caller-thread path: (indexes of the valid keys, their byte totals, codes
        per key) when the fast path is on and every buffer is host memory; else None (the
        loop path validates and answers)."""
        fp, store = self._fast, self._store
        if fp is None or store is None or store._closed or store.ssd is not None:
            return None
        codes = [0] * len(keys)
        good: list[int] = []
        totals: list[int] = []
        regions: list[Region] = []
        find = store.engine.registry.find
        for i, (k, p, n) in enumerate(zip(keys, ptrs, sizes, strict=True)):
            try:
                _check_key(k)
                # one lookup when the key's buffers lie in one registered region (the usual
                # layout: slices of a KV cache); else part by part, naming the bad one
                if p and set(map(type, p)) == _INT == set(map(type, n)) and min(p) > 0 < min(n):
                    lo = min(p)
                    region = find(lo, max(map(operator.add, p, n)) - lo)
                    if region is not None:
                        regions.append(region)
                        totals.append(sum(n))
                        good.append(i)
                        continue
                totals.append(
                    store._check_parts(list(zip(p, n, strict=True)), f"{what}[{i}]", regions)
                )
                good.append(i)
            except MooncakeError as e:
                codes[i] = to_code(e)
        if any(device_of(r.location) is not None for r in regions):
            return None  # GPU buffers: the loop path copies through the engine's stream
        return good, totals, codes

    def _fast_put_parts(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: ReplicateConfig | None,
        what: str,
    ) -> list[int] | None:
        """Put key ``i`` from its parts on the caller's thread; a code per key, or None when
        the loop path must answer (fast path off, GPU buffers, no valid key, a per-key
        config that cannot be split). Shapes must already be checked."""
        fast = self._fast_parts(keys, ptrs, sizes, what)
        if fast is None or self._fast is None:
            return None
        good, totals, codes = fast
        if not good or not _plain_config(config, len(keys), len(good)):
            return None
        try:
            res: list[Any] = self._fast.batch_put_parts(
                [keys[i] for i in good],
                [ptrs[i] for i in good],
                [sizes[i] for i in good],
                totals,
                config,
            )
        except Exception as e:
            res = [e] * len(good)
        for i, c in zip(good, self._codes(res), strict=True):
            codes[i] = c
        return codes

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store key ``i`` as the concatenation of its buffers; a code per key."""
        if not _shape_ok(all_buffer_ptrs, all_sizes, len(keys)):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        codes = self._fast_put_parts(
            keys, all_buffer_ptrs, all_sizes, config, "batch_put_from_multi_buffers"
        )
        if codes is not None:
            return codes
        parts = _parts(all_buffer_ptrs, all_sizes)
        try:
            fn = self._s.batch_put_parts
        except Exception as e:
            return [fail("batch_put_from_multi_buffers", e)] * len(keys)
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
        if not _shape_ok(all_buffer_ptrs, all_sizes, len(keys)):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        fast = self._fast_parts(keys, all_buffer_ptrs, all_sizes, "batch_get_into_multi_buffers")
        if fast is not None and self._fast is not None:
            good, totals, codes = fast
            if good:
                try:
                    got: list[Any] = self._fast.batch_get_parts(
                        [keys[i] for i in good],
                        [all_buffer_ptrs[i] for i in good],
                        [all_sizes[i] for i in good],
                        totals,
                    )
                except Exception as e:
                    got = [e] * len(good)
                for i, c in zip(good, self._codes(got), strict=True):
                    codes[i] = c
            return codes
        parts = _parts(all_buffer_ptrs, all_sizes)
        try:
            fn = self._s.batch_get_parts
        except Exception as e:
            return [fail("batch_get_into_multi_buffers", e)] * len(keys)
        return self._batch_codes(len(keys), fn, keys, parts)


def _plain_config(config: ReplicateConfig | None, n: int, good: int) -> bool:
    """Whether ``config`` applies unchanged to a subset of ``good`` of ``n`` keys (per-key
    ``group_ids`` follow their keys on the loop path)."""
    if good == n or config is None:
        return True
    return not getattr(config, "group_ids", None)
