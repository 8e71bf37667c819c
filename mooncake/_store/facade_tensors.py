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
Those object paths and the staging buffer live in :mod:`mooncake._store.tensor_io` (a
:class:`~mooncake._store.tensor_io.TensorIO` per store object); this module is the published
surface over them.

Return shapes and codes are the published ones: puts return ``0`` or a negative code (``-600``
INVALID_PARAMS for a bad tensor, shape or request), batch puts a list of codes of
``len(keys)``, gets a tensor or ``None``, ``get_tensor_into_cuda`` the bytes copied or a code.
Device tensors are copied to host memory to be stored; reads return CPU tensors (the
``_into`` forms read into whatever registered memory they are given, device memory included).
torch is needed only when a tensor method is called (:class:`TorchMissingError` otherwise).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mooncake._core import tensor_layout as tl
from mooncake._store import tensor_io as tio
from mooncake._store import tensor_support as ts
from mooncake._store.facade_parallel import ParallelTensorMethods
from mooncake._store.tensor_io import TensorIO, _Item
from mooncake._store.tensor_support import (
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
    TorchMissingError,
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
from mooncake.errors import ErrorCode, MooncakeError, to_code

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
_FILE_NOT_FOUND = -1100  # the published ErrorCode::FILE_NOT_FOUND
_GUARD = threading.Lock()


def _code(fn: Callable[[], int]) -> int:
    try:
        return fn()
    except TorchMissingError:
        raise
    except MooncakeError as e:
        log.error("%s", e)
        return to_code(e)


class TensorMethods(ParallelTensorMethods):
    """Mixin: the published tensor API over the byte-level methods of ``self`` (a
    :class:`~mooncake._store.tensor_host.TensorHost`, see :class:`ParallelTensorMethods`)."""

    # -- the object paths (mooncake._store.tensor_io) ------------------------------------

    def _tm_io(self) -> TensorIO:
        """This object's :class:`TensorIO` (its staging buffer), made on first use."""
        io: TensorIO | None = self.__dict__.get("_tm_io_state")
        if io is None:
            with _GUARD:
                io = self.__dict__.setdefault("_tm_io_state", TensorIO())
        return io

    def _tm_write(self, items: Sequence[_Item], config: Any, upsert: bool) -> list[int]:
        """Write objects ``header + data``; one code per item."""
        return self._tm_io().write(self, items, config, upsert)

    def _tm_read(
        self, keys: Sequence[str], staged: bool = False
    ) -> list[tuple[tl.TensorMetadata, Any] | None]:
        """``(header, tensor)`` per key, or None (see :meth:`TensorIO.read`)."""
        return self._tm_io().read(self, keys, staged)

    def _tm_check_config(self, config: Any) -> None:
        tio.check_config(config)

    def _tm_decode_at(self, buffer_ptr: int, size: int) -> Any:
        return tio.decode_at(buffer_ptr, size)

    def _tm_batch(
        self,
        keys: Sequence[str],
        tensors: Sequence[Any],
        config: Any,
        upsert: bool,
        per_key: Callable[[str, Any], list[_Item]],
    ) -> list[int]:
        return self._tm_io().batch(self, keys, tensors, config, upsert, per_key)

    # -- single tensors ---------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Put a PyTorch tensor into the store; 0 or a negative code."""
        return _code(lambda: self._tm_write([tio.full_item(key, tensor)], None, False)[0])

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Upsert a PyTorch tensor (insert or replace); 0 or a negative code."""
        return _code(lambda: self._tm_write([tio.full_item(key, tensor)], None, True)[0])

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """Put a tensor with a ``ReplicateConfig``; 0 or a negative code."""

        def run() -> int:
            self._tm_check_config(config)
            return self._tm_write([tio.full_item(key, tensor)], config, False)[0]

        return _code(run)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """Upsert a tensor with a ``ReplicateConfig``; 0 or a negative code."""

        def run() -> int:
            self._tm_check_config(config)
            return self._tm_write([tio.full_item(key, tensor)], config, True)[0]

        return _code(run)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (a CPU tensor), or None."""
        ts.torch()
        try:
            return self._tm_io().get(self, key)
        except MooncakeError as e:
            log.error("get_tensor(%r): %s", key, e)
            return None

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._tm_batch(keys, tensors_list, None, False, lambda k, t: [tio.full_item(k, t)])

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._tm_batch(keys, tensors_list, None, True, lambda k, t: [tio.full_item(k, t)])

    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        return self._tm_batch(keys, tensors_list, config, False, lambda k, t: [tio.full_item(k, t)])

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        return self._tm_batch(keys, tensors_list, config, True, lambda k, t: [tio.full_item(k, t)])

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """One tensor (or None) per key."""
        ts.torch()
        try:
            return self._tm_io().get_many(self, keys)
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
        return tio.first_error(
            self._tm_batch(
                [key],
                [tensor],
                None,
                False,
                lambda k, t: tio.tp_items(k, t, tp_size, split_dim),
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
        return tio.first_error(
            self._tm_batch(
                [key],
                [tensor],
                config,
                False,
                lambda k, t: tio.tp_items(k, t, tp_size, split_dim),
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
            lambda k, t: tio.tp_items(k, t, tp_size, split_dim),
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
            lambda k, t: tio.tp_items(k, t, tp_size, split_dim),
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
        return tio.into(self, key, buffer_ptr, size)

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
            out.append(tio.view(key, ptr, n))
        return out

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

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Put a registered buffer laid out as ``[TensorMetadata][data]`` (checked) as is."""
        return tio.write_from(self, key, buffer_ptr, size, None, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return tio.write_from(self, key, buffer_ptr, size, None, True)

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return tio.batch_write_from(self, keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return tio.batch_write_from(self, keys, buffer_ptrs, sizes, True)

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
            lambda k, t: tio.tp_items(k, t, tp_size, split_dim),
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
