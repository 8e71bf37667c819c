"""The bytes and zero-copy family: ``put``/``get`` of Python buffers, ``put_from``/``get_into``
of registered memory, their batch forms, existence, sizes and removal.

Put and upsert share every path here (``upsert=`` below); :mod:`mooncake.store._upsert` only
names the upsert forms. Small values take the caller-thread fast path
(:mod:`mooncake._store.fastpath`) when it is on; everything else is one loop crossing.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mooncake._core import rpc
from mooncake._core.gpu import device_of
from mooncake._store.client import Store
from mooncake._store.config import ReplicateConfig
from mooncake._store.fastpath import FAST_MAX
from mooncake._store.moves import _check_key, _value_addr
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError
from mooncake.store._base import StoreBase, _kw, fail
from mooncake.store._multi import MultiBufferMethods

log = logging.getLogger("mooncake.store")

_NO_FAST = object()  # _fast_rpc: the fast path is off, use the loop


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: ``ptr()``, ``size()`` and the buffer protocol.

    The bytes live in this object (a ``bytearray``); ``ptr()`` stays valid while it is alive and
    not resized.
    """

    def ptr(self) -> int:
        return int(np.frombuffer(self, dtype=np.uint8).ctypes.data) if len(self) else 0

    def size(self) -> int:
        return len(self)


def _joined(parts: tuple[Any, ...]) -> bytes:
    try:
        return b"".join(bytes(memoryview(p)) for p in parts)
    except TypeError as e:
        raise InvalidArgumentError(f"parts must support the buffer protocol: {e}") from None


class BytesMethods(StoreBase):
    """``put``, ``get``, ``put_from``, ``get_into`` and friends (published semantics)."""

    # -- shared paths (put and upsert) -----------------------------------------------------

    def _fast_put(self, key: str, value: Any, config: Any, upsert: bool) -> int | None:
        """The caller-thread put for small values (None: take the loop path)."""
        fp, store = self._fast, self._store
        if fp is None or store is None or store._closed:
            return None
        try:
            addr, n, keep = _value_addr(value)
        except MooncakeError as e:
            return fail("upsert" if upsert else "put", e)
        if not 0 < n <= FAST_MAX or n > store._staging.capacity:
            return None  # empty or too large: the loop path gives the published answer
        try:
            fp.put(_check_key(key), addr, n, config, upsert)
        except Exception as e:
            return fail("upsert" if upsert else "put", e)
        finally:
            del keep
        return 0

    def _put_value(self, key: str, value: Any, config: Any, upsert: bool) -> int:
        rc = self._fast_put(key, value, config, upsert)
        if rc is not None:
            return rc
        try:
            return self._rc(self._s.upsert if upsert else self._s.put, key, value, config)
        except Exception as e:
            return fail("upsert" if upsert else "put", e)

    def _put_parts(self, key: str, parts: tuple[Any, ...], config: Any, upsert: bool) -> int:
        """The concatenation of ``parts`` put (or upserted) as one value; parts without the
        buffer protocol answer the invalid-argument code, logged as ``put_parts`` /
        ``upsert_parts``."""
        try:
            value = _joined(parts)
        except MooncakeError as e:
            return fail("upsert_parts" if upsert else "put_parts", e)
        return self._put_value(key, value, config, upsert)

    def _put_batch(self, keys: list[str], values: list[Any], config: Any, upsert: bool) -> int:
        try:
            res = self._call(
                self._s.upsert_batch if upsert else self._s.put_batch, keys, values, config
            )
        except Exception as e:
            return fail("upsert_batch" if upsert else "put_batch", e)
        for r in res:
            if r is not None:
                return fail("upsert_batch" if upsert else "put_batch", r)
        return 0

    def _put_from(self, key: str, ptr: int, size: int, config: Any, upsert: bool) -> int:
        fp, store = self._fast, self._store
        fast_ok = not upsert and isinstance(size, int) and 0 < size <= FAST_MAX
        if fp is not None and store is not None and not store._closed and fast_ok:
            try:
                region = store._require_local(ptr, size, "put_from")
                if device_of(region.location) is None:  # GPU buffers go through the loop
                    fp.put(_check_key(key), ptr, size, config, False)
                    return 0
            except Exception as e:
                return fail("upsert_from" if upsert else "put_from", e)
        try:
            return self._rc(
                self._s.upsert_from if upsert else self._s.put_from, key, ptr, size, config
            )
        except Exception as e:
            return fail("upsert_from" if upsert else "put_from", e)

    def _batch_from(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any, upsert: bool
    ) -> list[int]:
        if (
            not upsert
            and isinstance(self, MultiBufferMethods)
            and keys
            and len(keys) == len(ptrs) == len(sizes)
        ):
            # host buffers: one BatchPutStart, one memcpy_batch, one BatchPutEnd on this thread
            codes = self._fast_put_parts(
                keys, [[p] for p in ptrs], [[n] for n in sizes], config, "batch_put_from"
            )
            if codes is not None:
                return codes
        try:
            fn = self._s.batch_upsert_from if upsert else self._s.batch_put_from
        except Exception as e:
            return [fail("batch_upsert_from" if upsert else "batch_put_from", e)] * len(keys)
        return self._batch_codes(len(keys), fn, keys, ptrs, sizes, config)

    # -- bytes API ------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (any C-contiguous buffer) under ``key``; 0, or a negative code. A key
        that exists already is left unchanged and answers 0."""
        return self._put_value(key, value, config, False)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` under ``key``."""
        return self._put_parts(key, parts, config, False)

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """Store ``values[i]`` under ``keys[i]``; 0, or the first key's failure code."""
        return self._put_batch(keys, values, config, False)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` if it is missing or the read failed."""
        fp, store = self._fast, self._store
        if fp is not None and store is not None and not store._closed:
            try:
                return fp.get(_check_key(key))
            except Exception as e:
                fail("get", e)  # a miss is logged at DEBUG only
                return b""
        try:
            data: bytes = self._call(self._s.get, key)
            return data
        except Exception as e:
            fail("get", e)
            return b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """One value per key (``b""`` where it is missing or failed)."""
        try:
            res = self._call(self._s.get_batch, keys)
        except Exception:
            return [b""] * len(keys)
        return [r if isinstance(r, bytes) else b"" for r in res]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a :class:`BufferHandle`, or None."""
        data = self.get(key)
        return BufferHandle(data) if data else None

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [BufferHandle(d) if d else None for d in self.get_batch(keys)]

    def _fast_rpc(self, method: str, params: Any) -> Any:
        """One master RPC on the caller's thread when the fast path is on (else _NO_FAST)."""
        fp, store = self._fast, self._store
        if fp is None or store is None or store._closed:
            return _NO_FAST
        return fp.call(method, params)

    def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value, or a negative code."""
        try:
            resp = self._fast_rpc(
                "GetReplicaList", rpc.KeyParams(key=_check_key(key), for_read=False)
            )
            if resp is not _NO_FAST:
                return int(Store._size_of(resp))
            return int(self._call(self._s.get_size, key))
        except Exception as e:
            return fail("get_size", e)

    def is_exist(self, key: str) -> int:
        """1 exists, 0 does not, negative on error."""
        try:
            found = self._fast_rpc("ExistKey", rpc.KeyParams(key=_check_key(key)))
            if found is not _NO_FAST:
                return 1 if found else 0
            return 1 if self._call(self._s.exists, key) else 0
        except Exception as e:
            return fail("is_exist", e)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 / 0 / negative code per key."""
        try:
            if keys:
                codes = self._fast_rpc(
                    "BatchExistKey", rpc.KeysParams(keys=[_check_key(k) for k in keys])
                )
                if codes is not _NO_FAST:
                    if len(codes) != len(keys):
                        return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
                    return list(codes)
            return list(self._call(self._s.batch_exists, keys))
        except Exception as e:
            return [fail("batch_is_exist", e)] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        """0, or ``OBJECT_HAS_LEASE`` (-706) while leased unless ``force``, or another code."""
        try:
            done = self._fast_rpc(
                "Remove", rpc.RemoveParams(key=_check_key(key), force=bool(force))
            )
            if done is not _NO_FAST:
                return 0
            return self._rc(_kw(self._s.remove, force=force), key)
        except Exception as e:
            return fail("remove", e)

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        try:
            return list(self._call(_kw(self._s.batch_remove, force=force), keys))
        except Exception as e:
            return [fail("batch_remove", e)] * len(keys)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        try:
            return int(self._call(_kw(self._s.remove_by_regex, force=force), regex_pattern))
        except Exception as e:
            return fail("remove_by_regex", e)

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        try:
            return int(self._call(_kw(self._s.remove_all, force=force)))
        except Exception as e:
            return fail("remove_all", e)

    # -- zero-copy API --------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``[buffer_ptr, +size)`` for the zero-copy calls; 0 or a code."""
        try:
            return self._rc(self._s.register_buffer, buffer_ptr, size)
        except Exception as e:
            return fail("register_buffer", e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            return self._rc(self._s.unregister_buffer, buffer_ptr)
        except Exception as e:
            return fail("unregister_buffer", e)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Store ``size`` bytes of registered memory at ``buffer_ptr`` under ``key``."""
        return self._put_from(key, buffer_ptr, size, config, False)

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Store ``metadata`` then ``data`` (both registered) as one value: the object is the
        ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by the ``size`` bytes at
        ``buffer_ptr``. ``size`` 0 stores nothing and answers 0 (as published);
        ``prefer_alloc_in_same_node`` is refused with -1 (as published)."""
        if config is not None and getattr(config, "prefer_alloc_in_same_node", False):
            log.error("put_from_with_metadata: prefer_alloc_in_same_node is not supported")
            return -1
        if size == 0:
            return 0
        parts = [(metadata_buffer_ptr, metadata_size), (buffer_ptr, size)]
        if not metadata_size:
            parts = parts[1:]
        try:
            (res,) = self._call(self._s.batch_put_parts, [key], [parts], config)
        except Exception as e:
            return fail("put_from_with_metadata", e)
        return fail("put_from_with_metadata", res) if res is not None else 0

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Zero-copy batch put; a code per key (``len(keys)`` results, all negative when the
        lists' lengths differ)."""
        return self._batch_from(keys, buffer_ptrs, sizes, config, False)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into ``[buffer_ptr, +size)`` (negative code on failure)."""
        fp, store = self._fast, self._store
        if fp is not None and store is not None and not store._closed:
            try:
                region = store._require_local(buffer_ptr, size, "get_into")
                if device_of(region.location) is None:  # GPU buffers go through the loop
                    return fp.get_into(_check_key(key), buffer_ptr, size)
            except Exception as e:
                return fail("get_into", e)
        return self._int(self._s.get_into, key, buffer_ptr, size)

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """Bytes read (or a negative code) per key; ``len(keys)`` results."""
        try:
            fn = self._s.batch_get_into
        except Exception as e:
            return [fail("batch_get_into", e)] * len(keys)
        return self._batch_codes(len(keys), fn, keys, buffer_ptrs, sizes)
