"""Tensor I/O under the published tensor methods: the staging buffer, the direct route, and the
object paths they share (:mod:`mooncake._store.facade_tensors` is the published surface).

A put writes ``header + data`` objects (:meth:`TensorIO.write`): straight from the header bytes
and the tensor's memory into memcpy-able replicas when the caller-thread path has them (a
two-part put, no staging copy), else through one registered staging buffer handed to the
byte-level ``put_from`` / ``batch_put_from``. A get (:meth:`TensorIO.read`) copies the data once
from a pinned replica into a fresh tensor, or reads into the staging buffer and copies out once.
The staging buffer grows on demand and is guarded by its lock.

Every function takes the facade object (a
:class:`~mooncake._store.tensor_host.TensorHost`: the published byte-level methods) as an argument; a :class:`TensorIO` holds only the staging state, so the facade and its
TensorIO form no reference cycle (the facade's ``__del__`` runs when its last reference goes).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake import _fast
from mooncake._core import tensor_layout as tl
from mooncake._store import tensor_support as ts
from mooncake._store.moves import _check_key
from mooncake._store.tensor_host import TensorHost
from mooncake._store.tensor_support import TorchMissingError
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError, to_code

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._store.fastpath import FastPath

log = logging.getLogger("mooncake.store")

_INVALID = int(ErrorCode.INVALID_PARAMS)
_MIN_STAGING = 1 << 20

# (key, header, data tensor or None): one object to write
_Item = tuple[str, bytes, Any]


class _Staging:
    """A registered, pre-faulted host buffer the tensor methods copy through."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf: np.ndarray[Any, Any] | None = None
        self.addr = 0
        self.owner: object = None  # the client the buffer is registered with
        self.free: Callable[[int], int] | None = None  # frees buf's memory (a dummy's)
        self.slot = _MIN_STAGING  # bytes per key in batch reads (the largest object seen)


class TensorIO:
    """The tensor object paths of one facade object (its staging buffer)."""

    def __init__(self) -> None:
        self.staging = _Staging()

    def reserve(self, host: TensorHost, st: _Staging, nbytes: int) -> int:
        """Address of >= ``nbytes`` registered staging bytes (call with ``st.lock`` held).
        On a dummy client the buffer is shared memory, which its ``register_buffer`` shares
        with the standalone client (plain memory it refuses)."""
        dummy = getattr(host, "_dummy", None)
        owner = dummy if dummy is not None else getattr(host, "_store", None)
        if st.buf is not None and st.owner is owner and st.buf.nbytes >= nbytes:
            return st.addr
        if st.buf is not None and st.owner is owner:
            host.unregister_buffer(st.addr)
        old_free, old_addr = st.free, st.addr
        st.buf, st.addr, st.owner, st.free = None, 0, None, None
        if old_free is not None:
            old_free(old_addr)
        size = max(_MIN_STAGING, 1 << max(nbytes - 1, 1).bit_length())
        free: Callable[[int], int] | None = None
        if dummy is not None:  # a dummy registers only memory its standalone client can map
            addr = int(dummy.overflow.alloc(size))  # shared (memfd) host memory
            free = dummy.overflow.free
            if addr == 0:
                raise MooncakeError(f"could not allocate a {size}-byte shared staging buffer")
            buf = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(addr))
        else:
            buf = np.empty(size, dtype=np.uint8)
            addr = int(buf.ctypes.data)
        buf.fill(0)  # pre-fault: first touch of fresh pages is slow
        rc = host.register_buffer(addr, size)
        if rc != 0:
            if free is not None:
                free(addr)
            raise MooncakeError(f"could not register a {size}-byte tensor staging buffer ({rc})")
        st.buf, st.addr, st.owner, st.free = buf, addr, owner, free
        return addr

    def write_direct(
        self, host: TensorHost, items: Sequence[_Item], sizes: list[int], config: Any
    ) -> list[int] | None:
        """Put each ``header + data`` straight from the header bytes and the tensor's memory
        (a two-part put: no staging copy) when every replica is memcpy-able; keys with a
        remote replica are staged into the registered buffer and written by the async
        client. None: not available here (the caller stages everything)."""
        direct = direct_route(host)
        if direct is None:
            return None
        fp, store = direct
        keys = [k for k, _, _ in items]
        try:
            for k in keys:
                _check_key(k)
        except MooncakeError:
            return None
        heads = [np.frombuffer(h, dtype=np.uint8) for _, h, _ in items]
        ptrs: list[list[int]] = []
        plens: list[list[int]] = []
        for (_, h, d), hd, n in zip(items, heads, sizes, strict=True):
            if d is not None and n > len(h):
                ptrs.append([int(hd.ctypes.data), int(d.data_ptr())])
                plens.append([len(h), n - len(h)])
            else:
                ptrs.append([int(hd.ctypes.data)])
                plens.append([len(h)])
        try:
            out, slow, reps = fp.put_parts_local(keys, ptrs, plens, sizes, config)
        except MooncakeError as e:
            return [to_code(e)] * len(items)
        if slow:
            st = self.staging
            try:
                with st.lock:
                    off = self.reserve(host, st, sum(sizes[i] for i in slow))
                    srcs: list[int] = []
                    for i in slow:
                        srcs.append(off)
                        dsts = list(itertools.accumulate(plens[i][:-1], initial=off))
                        _fast.memcpy_batch(dsts, ptrs[i], plens[i])
                        off += sizes[i]
                    res: list[MooncakeError | None] = fp.loop.call(
                        store._complete_puts,
                        "Put",
                        [keys[i] for i in slow],
                        srcs,
                        [sizes[i] for i in slow],
                        reps,
                    )
            except BaseException:
                fp.revoke([keys[i] for i in slow])
                raise
            for i, r in zip(slow, res, strict=True):
                out[i] = r
        del heads
        return [0 if e is None else to_code(e) for e in out]

    def write(
        self, host: TensorHost, items: Sequence[_Item], config: Any, upsert: bool
    ) -> list[int]:
        """Write objects ``header + data``; one code per item."""
        if not items:
            return []
        sizes = [len(h) + (0 if d is None else d.numel() * d.element_size()) for _, h, d in items]
        if not upsert:
            codes = self.write_direct(host, items, sizes, config)
            if codes is not None:
                return codes
        st = self.staging
        with st.lock:
            base = self.reserve(host, st, sum(sizes))
            ptrs, off = [], base
            for (_, header, data), n in zip(items, sizes, strict=True):
                ctypes.memmove(off, header, len(header))
                if data is not None and n > len(header):
                    ctypes.memmove(off + len(header), int(data.data_ptr()), n - len(header))
                ptrs.append(off)
                off += n
            keys = [k for k, _, _ in items]
            if len(items) == 1:
                fn = host.upsert_from if upsert else host.put_from
                return [fn(keys[0], ptrs[0], sizes[0], config)]
            bfn = host.batch_upsert_from if upsert else host.batch_put_from
            return list(bfn(keys, ptrs, sizes, config))

    def get(self, host: TensorHost, key: str) -> Any:
        """The tensor stored under ``key`` (a fresh CPU tensor) or None."""
        r = self.read(host, [key])[0]
        return None if r is None else r[1]

    def read(
        self, host: TensorHost, keys: Sequence[str], staged: bool = False
    ) -> list[tuple[tl.TensorMetadata, Any] | None]:
        """``(header, tensor)`` per key, or None: read into the staging buffer (one slot per
        key, sized by the largest object seen so far; a key that does not fit is read again on
        its own at its size) and copied out once into memory of the tensor's own."""
        out: list[tuple[tl.TensorMetadata, Any] | None] = [None] * len(keys)
        if not keys:
            return out
        direct = None if staged else direct_route(host)
        if direct is not None:  # straight from memcpy-able replicas into the new tensors
            rest = []
            for i, k in enumerate(keys):

                def copy(a: int, n: int, k: str = k) -> tuple[tuple[tl.TensorMetadata, Any] | None]:
                    return (copy_out(k, a, n),)

                try:
                    got = direct[0].read_with(k, copy)
                except MooncakeError as e:
                    log.debug("tensor read %r: %s", k, e)
                    continue
                if got is None:
                    rest.append(i)
                else:
                    out[i] = got[0]
            if not rest:
                return out
            for i, r in zip(
                rest, self.read(host, [keys[i] for i in rest], staged=True), strict=True
            ):
                out[i] = r
            return out
        st = self.staging
        with st.lock:
            slot = st.slot
            base = self.reserve(host, st, slot * len(keys))
            ptrs = [base + i * slot for i in range(len(keys))]
            if len(keys) == 1:
                codes = [host.get_into(keys[0], ptrs[0], slot)]
            else:
                codes = list(host.batch_get_into(list(keys), ptrs, [slot] * len(keys)))
            retry = []
            for i, (k, n) in enumerate(zip(keys, codes, strict=True)):
                if n == _INVALID:  # maybe larger than its slot
                    retry.append(i)
                elif n >= 0:
                    out[i] = copy_out(k, ptrs[i], n)
            for i in retry:
                size = host.get_size(keys[i])
                if size <= slot:
                    continue
                st.slot = max(st.slot, 1 << (size - 1).bit_length())
                addr = self.reserve(host, st, size)
                n = host.get_into(keys[i], addr, size)
                if n >= 0:
                    out[i] = copy_out(keys[i], addr, n)
        return out

    def get_many(self, host: TensorHost, keys: Sequence[str]) -> list[Any]:
        return [None if r is None else r[1] for r in self.read(host, keys)]

    def batch(
        self,
        host: TensorHost,
        keys: Sequence[str],
        tensors: Sequence[Any],
        config: Any,
        upsert: bool,
        per_key: Callable[[str, Any], list[_Item]],
    ) -> list[int]:
        """Write each key's items; a key's code is its first failing item's (0 if none)."""
        if len(keys) != len(tensors) or not keys:
            if keys:
                log.error("batch tensor write: keys and tensors size mismatch")
            return [_INVALID] * len(keys)
        try:
            check_config(config)
        except InvalidArgumentError:
            return [_INVALID] * len(keys)
        codes = [0] * len(keys)
        flat: list[_Item] = []
        owner: list[int] = []
        for i, (k, t) in enumerate(zip(keys, tensors, strict=True)):
            try:
                items = per_key(k, t)
            except TorchMissingError:
                raise
            except (MooncakeError, RuntimeError) as e:
                log.error("batch tensor write %r: %s", k, e)
                codes[i] = _INVALID
                continue
            flat.extend(items)
            owner.extend([i] * len(items))
        for i, c in zip(owner, self.write(host, flat, config, upsert), strict=True):
            if c != 0 and codes[i] == 0:
                codes[i] = c
        return codes


def direct_route(host: TensorHost) -> tuple[FastPath, Store] | None:
    """The caller-thread path and client, when this object has them (a set-up real
    client with the fast path on and no SSD tier); else None."""
    fp, store = getattr(host, "_fast", None), getattr(host, "_store", None)
    if fp is None or store is None or store._closed or store.ssd is not None:
        return None
    return fp, store


def copy_out(key: str, addr: int, n: int) -> tuple[tl.TensorMetadata, Any] | None:
    try:
        meta = tl.parse_metadata(memoryview((ctypes.c_char * n).from_address(addr)).cast("B"), n)
    except tl.TensorLayoutError as e:
        log.error("tensor read %r: %s", key, e)
        return None
    return meta, ts.tensor_copy(meta, addr)


def into(host: TensorHost, key: str, buffer_ptr: int, size: int) -> Any:
    if not buffer_ptr:
        log.error("Buffer pointer cannot be null")
        return None
    return view(key, buffer_ptr, host.get_into(key, buffer_ptr, size))


def full_item(key: str, tensor: Any) -> _Item:
    t = ts.host_contiguous(tensor)
    return key, ts.full_header(t).pack(), t


def tp_items(
    key: str, tensor: Any, tp_size: int, split_dim: int, axes: Sequence[tl.AxisSpec] = ()
) -> list[_Item]:
    """The ``tp_size`` shard objects of a full tensor (keys ``key_tp_<r>`` or by axes)."""
    t = ts.host_contiguous(tensor)
    code = ts.dtype_code(t)
    ti = tl.tp_axis_index(axes) if axes else None
    out: list[_Item] = []
    for r in range(tp_size):
        chunk = ts.narrow_shard(t, split_dim, r, tp_size)
        if ti is None:
            req: Sequence[tl.AxisSpec] = [tl.AxisSpec("tp", r, tp_size, split_dim)]
            k = tl.tp_key(key, r)
        else:
            req = list(axes)
            a = req[ti]
            req[ti] = tl.AxisSpec(a.kind, r, a.size, a.split_dim, a.expert_id, a.stage_id)
            k = tl.parallelism_key(key, req)
        meta = tl.shard_metadata(code, tuple(t.shape), tuple(chunk.shape), req)
        out.append((k, meta.pack(), chunk))
    return out


def check_config(config: Any) -> None:
    segs = getattr(config, "preferred_segments", None)
    if segs and len(segs) != getattr(config, "replica_num", 1):
        raise InvalidArgumentError(
            f"Preferred segments size ({len(segs)}) must match replica_num ({config.replica_num})"
        )


def first_error(codes: Sequence[int]) -> int:
    return next((c for c in codes if c != 0), 0)


def view(key: str, ptr: int, n: int) -> Any:
    """A tensor viewing the ``n``-byte object read to ``ptr`` (None if ``n`` is a code)."""
    if n < 0:
        return None
    try:
        meta = tl.parse_metadata(memoryview((ctypes.c_char * n).from_address(ptr)).cast("B"), n)
    except tl.TensorLayoutError as e:
        log.error("tensor read %r: %s", key, e)
        return None
    return ts.tensor_at(meta, ptr, n)


def write_from(
    host: TensorHost, key: str, buffer_ptr: int, size: int, config: Any, upsert: bool
) -> int:
    if not buffer_ptr:
        log.error("Buffer pointer cannot be null")
        return _INVALID
    if size < tl.METADATA_SIZE:
        log.error("Buffer size too small for tensor metadata")
        return _INVALID
    try:
        tl.parse_metadata(
            memoryview((ctypes.c_char * size).from_address(buffer_ptr)).cast("B"), size
        )
    except tl.TensorLayoutError as e:
        log.error("Invalid tensor metadata: %s", e)
        return _INVALID
    fn = host.upsert_from if upsert else host.put_from
    return fn(key, buffer_ptr, size, config)


def batch_write_from(
    host: TensorHost, keys: list[str], buffer_ptrs: list[int], sizes: list[int], upsert: bool
) -> list[int]:
    if not keys:
        return []
    if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes):
        log.error("Size mismatch: keys, buffer_ptrs, and sizes must have the same length")
        return [_INVALID] * len(keys)
    for ptr, n in zip(buffer_ptrs, sizes, strict=True):
        if not ptr or n < tl.METADATA_SIZE:
            return [_INVALID] * len(keys)
        try:
            tl.parse_metadata(memoryview((ctypes.c_char * n).from_address(ptr)).cast("B"), n)
        except tl.TensorLayoutError:
            return [_INVALID] * len(keys)
    fn = host.batch_upsert_from if upsert else host.batch_put_from
    return list(fn(keys, buffer_ptrs, sizes, None))


def decode_at(buffer_ptr: int, size: int) -> Any:
    if not buffer_ptr or size < tl.METADATA_SIZE:
        raise InvalidArgumentError("buffer too small for tensor metadata")
    meta = tl.parse_metadata(
        memoryview((ctypes.c_char * size).from_address(buffer_ptr)).cast("B"), size
    )
    return ts.tensor_at(meta, buffer_ptr, size)
