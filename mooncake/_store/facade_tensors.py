"""The tensor methods of the published ``MooncakeDistributedStore`` (all 42), as a mixin.

Every tensor is stored as one object in the published layout (:mod:`mooncake._core.tensor_layout`:
a 304-byte header, then the bytes), under the published key names, so tensors and shards
written by either implementation read back in the other. The mixin is built only on the
published byte-level methods of the class it is mixed into (``put_from``, ``upsert_from``,
``batch_put_from``, ``batch_upsert_from``, ``get_into``, ``batch_get_buffer``, ``get_size``,
``put``, ``upsert``, ``register_buffer``, ``unregister_buffer``), plus, on a set-up real client
with the caller-thread path on (:mod:`mooncake._store.fastpath`), a direct route: a put writes
header and tensor memory as two parts straight into memcpy-able replicas and a get copies the
data once from the pinned replica into the new tensor (then the read fences). What the direct
route cannot copy (a remote replica, an upsert, an SSD tier) goes through one registered
staging buffer (grown on demand, guarded by a lock): a put copies header and data into it once
and hands it to ``put_from``; a get reads into it and copies the data out once into a fresh
tensor. The ``_into``/``_from`` forms use the caller's registered buffer as is (no copy).

Return shapes and codes are the published ones: puts return ``0`` or a negative code (``-600``
INVALID_PARAMS for a bad tensor, shape or request), batch puts a list of codes of
``len(keys)``, gets a tensor or ``None``, ``get_tensor_into_cuda`` the bytes copied or a code.
Device tensors are copied to host memory to be stored; reads return CPU tensors (the
``_into`` forms read into whatever registered memory they are given, device memory included).
torch is needed only when a tensor method is called (:class:`TorchMissingError` otherwise).
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
from mooncake._store.facade_parallel import ParallelTensorMethods
from mooncake._store.moves import _check_key
from mooncake._store.tensor_support import (
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
    TorchMissingError,
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError, to_code

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._store.fastpath import FastPath

__all__ = [
    "ParallelAxis",
    "ReadTarget",
    "TensorMethods",
    "TensorParallelism",
    "TorchMissingError",
    "_deserialize_tensor",
    "_serialize_tensor",
    "_tensor_metadata_size",
]

log = logging.getLogger("mooncake.store")

_INVALID = int(ErrorCode.INVALID_PARAMS)
_EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
_FILE_NOT_FOUND = -1100  # the published ErrorCode::FILE_NOT_FOUND
_MIN_STAGING = 1 << 20
_GUARD = threading.Lock()

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


def _code(fn: Callable[[], int]) -> int:
    try:
        return fn()
    except TorchMissingError:
        raise
    except MooncakeError as e:
        log.error("%s", e)
        return to_code(e)


class TensorMethods(ParallelTensorMethods):
    """Mixin: the published tensor API over the byte-level methods of ``self``."""

    if TYPE_CHECKING:

        def put(self, key: str, value: Any, config: Any = None) -> int: ...
        def upsert(self, key: str, value: Any, config: Any = None) -> int: ...
        def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def batch_put_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
        ) -> list[int]: ...
        def batch_upsert_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
        ) -> list[int]: ...
        def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
        def get_size(self, key: str) -> int: ...
        def batch_get_into(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
        ) -> list[int]: ...
        def batch_get_buffer(self, keys: list[str]) -> list[Any]: ...
        def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
        def unregister_buffer(self, buffer_ptr: int) -> int: ...

    # -- staging and the object paths -----------------------------------------------------

    def _tm_staging(self) -> _Staging:
        st: _Staging | None = self.__dict__.get("_tm_stage")
        if st is None:
            with _GUARD:
                st = self.__dict__.setdefault("_tm_stage", _Staging())
        return st

    def _tm_reserve(self, st: _Staging, nbytes: int) -> int:
        """Address of >= ``nbytes`` registered staging bytes (call with ``st.lock`` held).
        On a dummy client the buffer is shared memory, which its ``register_buffer`` shares
        with the standalone client (plain memory it refuses)."""
        dummy = getattr(self, "_dummy", None)
        owner = dummy if dummy is not None else getattr(self, "_store", None)
        if st.buf is not None and st.owner is owner and st.buf.nbytes >= nbytes:
            return st.addr
        if st.buf is not None and st.owner is owner:
            self.unregister_buffer(st.addr)
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
        rc = self.register_buffer(addr, size)
        if rc != 0:
            if free is not None:
                free(addr)
            raise MooncakeError(f"could not register a {size}-byte tensor staging buffer ({rc})")
        st.buf, st.addr, st.owner, st.free = buf, addr, owner, free
        return addr

    def _tm_direct(self) -> tuple[FastPath, Store] | None:
        """The caller-thread path and client, when this object has them (a set-up real
        client with the fast path on and no SSD tier); else None."""
        fp, store = getattr(self, "_fast", None), getattr(self, "_store", None)
        if fp is None or store is None or store._closed or store.ssd is not None:
            return None
        return fp, store

    def _tm_write_direct(
        self, items: Sequence[_Item], sizes: list[int], config: Any
    ) -> list[int] | None:
        """Put each ``header + data`` straight from the header bytes and the tensor's memory
        (a two-part put: no staging copy) when every replica is memcpy-able; keys with a
        remote replica are staged into the registered buffer and written by the async
        client. None: not available here (the caller stages everything)."""
        direct = self._tm_direct()
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
            st = self._tm_staging()
            try:
                with st.lock:
                    off = self._tm_reserve(st, sum(sizes[i] for i in slow))
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

    def _tm_write(self, items: Sequence[_Item], config: Any, upsert: bool) -> list[int]:
        """Write objects ``header + data``; one code per item."""
        if not items:
            return []
        sizes = [len(h) + (0 if d is None else d.numel() * d.element_size()) for _, h, d in items]
        if not upsert:
            codes = self._tm_write_direct(items, sizes, config)
            if codes is not None:
                return codes
        st = self._tm_staging()
        with st.lock:
            base = self._tm_reserve(st, sum(sizes))
            ptrs, off = [], base
            for (_, header, data), n in zip(items, sizes, strict=True):
                ctypes.memmove(off, header, len(header))
                if data is not None and n > len(header):
                    ctypes.memmove(off + len(header), int(data.data_ptr()), n - len(header))
                ptrs.append(off)
                off += n
            keys = [k for k, _, _ in items]
            if len(items) == 1:
                fn = self.upsert_from if upsert else self.put_from
                return [fn(keys[0], ptrs[0], sizes[0], config)]
            bfn = self.batch_upsert_from if upsert else self.batch_put_from
            return list(bfn(keys, ptrs, sizes, config))

    def _tm_get(self, key: str) -> Any:
        """The tensor stored under ``key`` (a fresh CPU tensor) or None."""
        r = self._tm_read([key])[0]
        return None if r is None else r[1]

    def _tm_read(
        self, keys: Sequence[str], staged: bool = False
    ) -> list[tuple[tl.TensorMetadata, Any] | None]:
        """``(header, tensor)`` per key, or None: read into the staging buffer (one slot per
        key, sized by the largest object seen so far; a key that does not fit is read again on
        its own at its size) and copied out once into memory of the tensor's own."""
        out: list[tuple[tl.TensorMetadata, Any] | None] = [None] * len(keys)
        if not keys:
            return out
        direct = None if staged else self._tm_direct()
        if direct is not None:  # straight from memcpy-able replicas into the new tensors
            rest = []
            for i, k in enumerate(keys):

                def copy_out(
                    a: int, n: int, k: str = k
                ) -> tuple[tuple[tl.TensorMetadata, Any] | None]:
                    return (self._tm_copy_out(k, a, n),)

                try:
                    got = direct[0].read_with(k, copy_out)
                except MooncakeError as e:
                    log.debug("tensor read %r: %s", k, e)
                    continue
                if got is None:
                    rest.append(i)
                else:
                    out[i] = got[0]
            if not rest:
                return out
            for i, r in zip(rest, self._tm_read([keys[i] for i in rest], staged=True), strict=True):
                out[i] = r
            return out
        st = self._tm_staging()
        with st.lock:
            slot = st.slot
            base = self._tm_reserve(st, slot * len(keys))
            ptrs = [base + i * slot for i in range(len(keys))]
            if len(keys) == 1:
                codes = [self.get_into(keys[0], ptrs[0], slot)]
            else:
                codes = list(self.batch_get_into(list(keys), ptrs, [slot] * len(keys)))
            retry = []
            for i, (k, n) in enumerate(zip(keys, codes, strict=True)):
                if n == _INVALID:  # maybe larger than its slot
                    retry.append(i)
                elif n >= 0:
                    out[i] = self._tm_copy_out(k, ptrs[i], n)
            for i in retry:
                size = self.get_size(keys[i])
                if size <= slot:
                    continue
                st.slot = max(st.slot, 1 << (size - 1).bit_length())
                addr = self._tm_reserve(st, size)
                n = self.get_into(keys[i], addr, size)
                if n >= 0:
                    out[i] = self._tm_copy_out(keys[i], addr, n)
        return out

    @staticmethod
    def _tm_copy_out(key: str, addr: int, n: int) -> tuple[tl.TensorMetadata, Any] | None:
        try:
            meta = tl.parse_metadata(
                memoryview((ctypes.c_char * n).from_address(addr)).cast("B"), n
            )
        except tl.TensorLayoutError as e:
            log.error("tensor read %r: %s", key, e)
            return None
        return meta, ts.tensor_copy(meta, addr)

    def _tm_get_many(self, keys: Sequence[str]) -> list[Any]:
        return [None if r is None else r[1] for r in self._tm_read(keys)]

    def _tm_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        if not buffer_ptr:
            log.error("Buffer pointer cannot be null")
            return None
        return self._tm_view(key, buffer_ptr, self.get_into(key, buffer_ptr, size))

    @staticmethod
    def _tm_full_item(key: str, tensor: Any) -> _Item:
        t = ts.host_contiguous(tensor)
        return key, ts.full_header(t).pack(), t

    @staticmethod
    def _tm_tp_items(
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

    @staticmethod
    def _tm_check_config(config: Any) -> None:
        segs = getattr(config, "preferred_segments", None)
        if segs and len(segs) != getattr(config, "replica_num", 1):
            raise InvalidArgumentError(
                f"Preferred segments size ({len(segs)}) must match replica_num "
                f"({config.replica_num})"
            )

    @staticmethod
    def _tm_first_error(codes: Sequence[int]) -> int:
        return next((c for c in codes if c != 0), 0)

    def _tm_batch(
        self,
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
            self._tm_check_config(config)
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
        for i, c in zip(owner, self._tm_write(flat, config, upsert), strict=True):
            if c != 0 and codes[i] == 0:
                codes[i] = c
        return codes

    # -- single tensors ---------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Put a PyTorch tensor into the store; 0 or a negative code."""
        return _code(lambda: self._tm_write([self._tm_full_item(key, tensor)], None, False)[0])

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Upsert a PyTorch tensor (insert or replace); 0 or a negative code."""
        return _code(lambda: self._tm_write([self._tm_full_item(key, tensor)], None, True)[0])

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """Put a tensor with a ``ReplicateConfig``; 0 or a negative code."""

        def run() -> int:
            self._tm_check_config(config)
            return self._tm_write([self._tm_full_item(key, tensor)], config, False)[0]

        return _code(run)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """Upsert a tensor with a ``ReplicateConfig``; 0 or a negative code."""

        def run() -> int:
            self._tm_check_config(config)
            return self._tm_write([self._tm_full_item(key, tensor)], config, True)[0]

        return _code(run)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (a CPU tensor), or None."""
        ts.torch()
        try:
            return self._tm_get(key)
        except MooncakeError as e:
            log.error("get_tensor(%r): %s", key, e)
            return None

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._tm_batch(
            keys, tensors_list, None, False, lambda k, t: [self._tm_full_item(k, t)]
        )

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._tm_batch(
            keys, tensors_list, None, True, lambda k, t: [self._tm_full_item(k, t)]
        )

    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        return self._tm_batch(
            keys, tensors_list, config, False, lambda k, t: [self._tm_full_item(k, t)]
        )

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        return self._tm_batch(
            keys, tensors_list, config, True, lambda k, t: [self._tm_full_item(k, t)]
        )

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """One tensor (or None) per key."""
        ts.torch()
        try:
            return self._tm_get_many(keys)
        except MooncakeError as e:
            log.error("batch_get_tensor: %s", e)
            return [None] * len(keys)

    # -- tensor parallelism (key_tp_<rank>) -------------------------------------------------

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Split ``tensor`` along ``split_dim`` into ``tp_size`` shards ``key_tp_<r>``."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._tm_first_error(
            self._tm_batch(
                [key],
                [tensor],
                None,
                False,
                lambda k, t: self._tm_tp_items(k, t, tp_size, split_dim),
            )
        )

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: Any,
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._tm_first_error(
            self._tm_batch(
                [key],
                [tensor],
                config,
                False,
                lambda k, t: self._tm_tp_items(k, t, tp_size, split_dim),
            )
        )

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._tm_batch(
            base_keys,
            tensors_list,
            None,
            False,
            lambda k, t: self._tm_tp_items(k, t, tp_size, split_dim),
        )

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._tm_batch(
            base_keys,
            tensors_list,
            config,
            False,
            lambda k, t: self._tm_tp_items(k, t, tp_size, split_dim),
        )

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """Rank ``tp_rank``'s shard (``key_tp_<rank>``), or the tensor when ``tp_size <= 1``."""
        return self.get_tensor(key if tp_size <= 1 else tl.tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        if tp_size <= 1:
            return self.batch_get_tensor(base_keys)
        return self.batch_get_tensor([tl.tp_key(k, tp_rank) for k in base_keys])

    # -- zero-copy forms (registered buffers laid out as header + data) ---------------------

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read ``key`` into the registered buffer; a tensor viewing it, or None."""
        ts.torch()
        return self._tm_into(key, buffer_ptr, size)

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[Any]:
        """One tensor viewing its buffer (None on failure); all ``-600`` on bad lists."""
        ts.torch()
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes) or not all(buffer_ptrs):
            return [_INVALID] * len(keys)
        out: list[Any] = []
        for key, ptr, n in zip(
            keys, buffer_ptrs, self.batch_get_into(keys, buffer_ptrs, sizes), strict=True
        ):
            out.append(self._tm_view(key, ptr, n))
        return out

    @staticmethod
    def _tm_view(key: str, ptr: int, n: int) -> Any:
        """A tensor viewing the ``n``-byte object read to ``ptr`` (None if ``n`` is a code)."""
        if n < 0:
            return None
        try:
            meta = tl.parse_metadata(memoryview((ctypes.c_char * n).from_address(ptr)).cast("B"), n)
        except tl.TensorLayoutError as e:
            log.error("tensor read %r: %s", key, e)
            return None
        return ts.tensor_at(meta, ptr, n)

    def get_tensor_with_tp_into(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> Any:
        return self.get_tensor_into(
            key if tp_size <= 1 else tl.tp_key(key, tp_rank), buffer_ptr, size
        )

    def batch_get_tensor_with_tp_into(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> list[Any]:
        keys = base_keys if tp_size <= 1 else [tl.tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def _tm_from(self, key: str, buffer_ptr: int, size: int, config: Any, upsert: bool) -> int:
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
        fn = self.upsert_from if upsert else self.put_from
        return fn(key, buffer_ptr, size, config)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Put a registered buffer laid out as ``[TensorMetadata][data]`` (checked) as is."""
        return self._tm_from(key, buffer_ptr, size, None, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._tm_from(key, buffer_ptr, size, None, True)

    def _tm_batch_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], upsert: bool
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
        fn = self.batch_upsert_from if upsert else self.batch_put_from
        return list(fn(keys, buffer_ptrs, sizes, None))

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._tm_batch_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self._tm_batch_from(keys, buffer_ptrs, sizes, True)

    def _tm_decode_at(self, buffer_ptr: int, size: int) -> Any:
        if not buffer_ptr or size < tl.METADATA_SIZE:
            raise InvalidArgumentError("buffer too small for tensor metadata")
        meta = tl.parse_metadata(
            memoryview((ctypes.c_char * size).from_address(buffer_ptr)).cast("B"), size
        )
        return ts.tensor_at(meta, buffer_ptr, size)

    def put_tensor_with_tp_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """Split the full tensor in the buffer and store all ``key_tp_<r>`` shards."""
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        return _code(
            lambda: self.put_tensor_with_tp(
                key, self._tm_decode_at(buffer_ptr, size), tp_rank, tp_size, split_dim
            )
        )

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not base_keys or len(base_keys) != len(buffer_ptrs) or len(base_keys) != len(sizes):
            return [_INVALID] * len(base_keys)
        tensors: list[Any] = []
        for ptr, n in zip(buffer_ptrs, sizes, strict=True):
            try:
                tensors.append(self._tm_decode_at(ptr, n))
            except MooncakeError:
                tensors.append(None)
        return self._tm_batch(
            base_keys,
            tensors,
            None,
            False,
            lambda k, t: self._tm_tp_items(k, t, tp_size, split_dim),
        )

    # -- into CUDA tensors ------------------------------------------------------------------

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Copy the stored tensor's data into ``tensor`` (same dtype and shape, contiguous);
        the bytes copied or a negative code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        ts.torch()
        results = [_INVALID] * len(keys)
        if len(keys) != len(tensors_list):
            log.error("batch_get_tensor_into_cuda: keys and tensors size mismatch")
            return results
        for i, r in enumerate(self._tm_read(keys)):
            dst = tensors_list[i]
            if r is None or not ts.is_tensor(dst) or not dst.is_contiguous():
                continue
            meta, src = r
            if ts.dtype_code(dst) != meta.dtype or tuple(dst.shape) != meta.local_shape:
                log.error(
                    "batch_get_tensor_into_cuda: destination tensor mismatch for key %s", keys[i]
                )
                continue
            dst.copy_(src)
            results[i] = meta.data_bytes
        return results

    # -- safetensors ------------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: str, file_name: Any = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (name: ``file_name`` or the
        key); 0, ``-1100`` if there is no tensor, ``-600`` if the file cannot be written."""
        from mooncake._core import safetensors_format as sf

        t = self.get_tensor(key)
        if t is None:
            log.error("Failed to fetch tensor for key: %s", key)
            return _FILE_NOT_FOUND
        path = key if file_name is None else str(file_name)
        try:
            header = sf.encode_header(
                {
                    key: (
                        tl.TensorDtype(ts.dtype_code(t)),
                        tuple(t.shape),
                        t.numel() * t.element_size(),
                    )
                }
            )
            with open(path, "wb") as f:
                f.write(header)
                f.write(t.contiguous().view(ts.torch().uint8).numpy().tobytes())
        except (OSError, MooncakeError) as e:
            log.error("Failed to save tensor to safetensor file: %s", e)
            return _INVALID
        return 0

    def load_tensor_from_safetensor(self, key: Any = None, file_name: str | None = None) -> Any:
        """Read a safetensors file, put its tensor named ``key`` (else its first tensor) under
        ``key`` (default: the file name) and return it; None on failure."""
        from mooncake._core import safetensors_format as sf

        t = ts.torch()
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument 'file_name'")
        try:
            with open(file_name, "rb") as f:
                data = bytearray(f.read())
            entries = sf.decode(data)
        except (OSError, MooncakeError) as e:
            log.error("Failed to load tensor from safetensor file: %s", e)
            return None
        if not entries:
            log.error("No tensors found in safetensor file: %s", file_name)
            return None
        store_key = file_name if key is None else str(key)
        name = store_key if store_key in entries else next(iter(entries))
        if key is not None and name != store_key:
            log.warning("Key %s not found in safetensor file; using first entry", store_key)
        dtype, shape, start, end = entries[name]
        tensor = (
            t.frombuffer(data, dtype=t.uint8, count=end - start, offset=start)
            .view(getattr(t, dtype.torch_name))
            .reshape(shape)
            .clone()
            if end > start
            else t.empty(shape, dtype=getattr(t, dtype.torch_name))
        )
        rc = self.put_tensor(store_key, tensor)
        if rc != 0:
            log.error("Failed to store tensor for key %s, rc=%d", store_key, rc)
            return None
        return tensor
