"""The published ``mooncake._fast_copy``: concatenate numpy arrays into raw memory.

``concat_arrays_into(arrays, dest_ptr, dest_size, start=0, count=-1, nthreads=1)`` copies the
bytes of ``arrays[start:start + count]`` (all from ``start`` when ``count`` is negative or runs
past the end; ``start`` is clamped into the list) back to back to address ``dest_ptr`` and
returns the number of bytes copied. As published: ``arrays`` must be a list of C-contiguous
ndarrays (``TypeError`` naming the index that is not an ndarray, ``ValueError`` naming the one
that is not C-contiguous), and their total must fit in ``dest_size`` (``ValueError:
destination buffer too small: need N bytes, got M``), checked before anything is written.
``nthreads`` is accepted; each copy is one ``memmove`` that runs without the GIL.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["concat_arrays_into"]


def concat_arrays_into(
    arrays: list[Any],
    dest_ptr: int,
    dest_size: int,
    start: int = 0,
    count: int = -1,
    nthreads: int = 1,
) -> int:
    if not isinstance(arrays, list):
        raise TypeError(f"arrays must be a list, not {type(arrays).__name__}")
    for name, v in (("dest_ptr", dest_ptr), ("dest_size", dest_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TypeError(f"{name} must be a non-negative int, got {v!r}")
    n = len(arrays)
    start = min(max(start, 0), n)
    if count < 0 or start + count > n:
        count = n - start
    if count == 0:
        return 0
    chosen = arrays[start : start + count]
    total = 0
    for i, a in enumerate(chosen, start):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"arrays[{i}] is not an ndarray")
        if not a.flags.c_contiguous:
            raise ValueError(f"arrays[{i}] is not C-contiguous")
        total += a.nbytes
    if total > dest_size:
        raise ValueError(f"destination buffer too small: need {total} bytes, got {dest_size}")
    if total and not dest_ptr:
        raise ValueError("dest_ptr is NULL")
    off = 0
    for a in chosen:
        if a.nbytes:
            ctypes.memmove(dest_ptr + off, a.ctypes.data, a.nbytes)
            off += a.nbytes
    return off
