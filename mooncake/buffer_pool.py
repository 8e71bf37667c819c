"""The published ``mooncake.buffer_pool``: pools of registered local buffers for a store.

``BufferPool(store, max_bytes=0, min_size_class=64 KiB, max_size_class=None,
alignment=8 MiB, block_on_exhaustion=True, default_timeout=None, max_regions=None,
prewarm_size=None, prewarm_count=0)`` hands out *leases* of registered memory
(``store.register_buffer``) for the zero-copy calls (``put_from``, ``get_into``, the
multi-buffer and tensor ``_from``/``_into`` forms). Requests round up to a power-of-two size
class (at least ``min_size_class``); a released lease goes back to its class's free list and is
reused; a request above ``max_size_class`` gets a region of its own size, unregistered and freed
on release (counted against ``max_bytes`` while leased), as published; new regions are allocated (``alignment``-aligned, pre-faulted) while the pool holds
less than ``max_bytes`` (0: no limit) and fewer than ``max_regions``. When it is full,
``acquire`` waits for a release (``block=True``, up to ``timeout`` seconds) or raises
``RuntimeError("buffer pool is exhausted")``; a wait that runs out raises
``RuntimeError("timed out waiting for buffer")``, as the published pool does.

A lease has ``ptr``, ``size``, ``buffer`` (a writable ``memoryview`` of exactly ``size`` bytes,
exported by a :class:`BufferLeaseView`), ``release()`` and is a context manager; ``release()``
raises ``RuntimeError`` while a view it handed out is still alive (release the memoryview
first), and a released lease answers ``RuntimeError("buffer lease is closed")``. ``close()``
unregisters every region and fails while leases are out.

Arguments are checked as the published (C++) pool checks them: a negative size, count or byte
limit is a ``TypeError``; ``min_size_class`` or ``alignment`` of 0 is
``RuntimeError("min_size_class and alignment must be positive")``; an alignment that is not a
power of two of at least 8 (``sizeof(void*)``) is a ``RuntimeError`` naming it;
``acquire(0)`` hands out an empty lease. ``RegisteredBufferLease`` and
``RegisteredBufferLeaseView`` are the same classes under their published aliases.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

__all__ = [
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
]

_PTR_BYTES = 8  # sizeof(void*)


class BufferLeaseView(np.ndarray):  # type: ignore[type-arg]
    """The object behind a lease's ``buffer`` memoryview (made only by :class:`BufferLease`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> BufferLeaseView:
        raise TypeError("mooncake.store.BufferLeaseView: No constructor defined!")


RegisteredBufferLeaseView = BufferLeaseView


def _non_negative(name: str, value: Any) -> int:
    """``value`` as an int; TypeError (as the published unsigned arguments) if it is not a
    non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise TypeError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class BufferLease:
    """One buffer handed out by a :class:`BufferPool` (returned on :meth:`release`)."""

    def __init__(self, pool: BufferPool, region: _Region, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._region = region
        self._size = size
        self._views: list[weakref.ref[BufferLeaseView]] = []

    def _check(self) -> _Region:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return self._region

    @property
    def ptr(self) -> int:
        return self._check().addr

    @property
    def size(self) -> int:
        self._check()
        return self._size

    @property
    def buffer(self) -> memoryview:
        r = self._check()
        view = r.array[: self._size].view(BufferLeaseView)
        self._views = [w for w in self._views if w() is not None]
        self._views.append(weakref.ref(view))
        return view.data

    def release(self) -> None:
        """Give the buffer back (idempotent); RuntimeError while one of its views is alive."""
        if self._pool is not None and any(w() is not None for w in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._region)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


class _Region:
    __slots__ = ("addr", "array", "oversize", "owner", "size_class")

    def __init__(self, size_class: int, alignment: int) -> None:
        self.oversize = False  # above max_size_class: its own region, dropped on release
        raw = np.empty(size_class + alignment, dtype=np.uint8)
        start = (-int(raw.ctypes.data)) % alignment if alignment else 0
        self.owner = raw
        self.array = raw[start : start + size_class]
        self.array.fill(0)  # pre-fault
        self.addr = int(self.array.ctypes.data)
        self.size_class = size_class


class BufferPool:
    """Registered buffers for ``store``, reused by size class (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        max_bytes: int = 0,
        min_size_class: int = 64 * 1024,
        max_size_class: int | None = None,
        alignment: int = 8 * 1024 * 1024,
        block_on_exhaustion: bool = True,
        default_timeout: float | None = None,
        max_regions: int | None = None,
        prewarm_size: int | None = None,
        prewarm_count: int = 0,
    ) -> None:
        if store is None or not hasattr(store, "register_buffer"):
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        max_bytes = _non_negative("max_bytes", max_bytes)
        min_size_class = _non_negative("min_size_class", min_size_class)
        alignment = _non_negative("alignment", alignment)
        prewarm_count = _non_negative("prewarm_count", prewarm_count)
        for name, value in (
            ("max_size_class", max_size_class),
            ("max_regions", max_regions),
            ("prewarm_size", prewarm_size),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0
            ):
                raise RuntimeError(f"{name} must be a non-negative integer or None, got {value!r}")
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment & (alignment - 1) or alignment < _PTR_BYTES:
            raise RuntimeError(
                f"alignment must be a power of two and at least sizeof(void*) (got {alignment})"
            )
        if max_size_class is not None and max_size_class < min_size_class:
            raise RuntimeError("max_size_class must be at least min_size_class")
        if default_timeout is not None and default_timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        self._store = store
        self._max_bytes = int(max_bytes)
        self._min = int(min_size_class)
        self._max_class = None if max_size_class is None else int(max_size_class)
        self._alignment = int(alignment)
        self._block = bool(block_on_exhaustion)
        self._timeout = default_timeout
        self._max_regions = max_regions
        self._cond = threading.Condition()
        self._free: dict[int, list[_Region]] = {}
        self._regions: list[_Region] = []
        self._leased = 0
        self._closed = False
        if prewarm_count:
            self.prewarm(prewarm_size or self._min, prewarm_count)

    def _class_of(self, size: int) -> int:
        c = self._min
        while c < size:
            c <<= 1
        return c

    def _allocated(self) -> int:
        return sum(r.size_class for r in self._regions)

    def _can_grow(self, c: int) -> bool:
        if self._max_regions is not None and len(self._regions) >= self._max_regions:
            return False
        return not self._max_bytes or self._allocated() + c <= self._max_bytes

    def _new_region(self, c: int) -> _Region:
        r = _Region(c, self._alignment)
        rc = self._store.register_buffer(r.addr, c)
        if rc != 0:
            raise RuntimeError(f"buffer registration failed ({rc})")
        self._regions.append(r)
        return r

    def acquire(
        self, size: int, block: bool | None = None, timeout: float | None = None
    ) -> BufferLease:
        """A lease of at least ``size`` registered bytes (see the module docstring)."""
        size = _non_negative("size", size)
        timeout = self._timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        oversize = self._max_class is not None and size > self._max_class
        c = max(size, 1) if oversize else self._class_of(size)
        if (self._max_class is not None and c > self._max_class and not oversize) or (
            self._max_bytes and c > self._max_bytes
        ):
            raise RuntimeError("requested buffer size exceeds pool capacity")
        should_block = self._block if block is None else bool(block)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closing")
                free = None if oversize else self._free.get(c)
                if free:
                    region = free.pop()
                    break
                if self._can_grow(c):
                    region = self._new_region(c)
                    region.oversize = oversize
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)
            self._leased += 1
        return BufferLease(self, region, int(size))

    def buffer(
        self, size: int, block: bool | None = None, timeout: float | None = None
    ) -> BufferLease:
        """Same as :meth:`acquire`."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Allocate and register ``count`` buffers of ``size``'s class now."""
        c = self._class_of(_non_negative("size", size))
        count = _non_negative("count", count)
        with self._cond:
            for _ in range(count):
                if not self._can_grow(c):
                    raise RuntimeError("buffer pool capacity exceeded")
                self._free.setdefault(c, []).append(self._new_region(c))

    def _give_back(self, region: _Region) -> None:
        with self._cond:
            self._leased -= 1
            if region.oversize:  # not pooled: unregistered and freed
                self._regions.remove(region)
            else:
                self._free.setdefault(region.size_class, []).append(region)
            self._cond.notify_all()
        if region.oversize:
            self._store.unregister_buffer(region.addr)

    def close(self) -> None:
        """Unregister every region (``RuntimeError`` while leases are out); idempotent."""
        with self._cond:
            if self._leased:
                raise RuntimeError("cannot close buffer pool with active leases")
            if self._closed:
                return
            self._closed = True
            regions, self._regions, self._free = self._regions, [], {}
            self._cond.notify_all()
        for r in regions:
            self._store.unregister_buffer(r.addr)


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
