"""The parallelism forms of the tensor API (``*_tensor_with_parallelism*``), as a mixin.

Write routes, as the published binding takes them:

* no request: the whole tensor under ``key``;
* ``writer_partition`` (rank, size, split_dim) with the *full* tensor: rank's slice under
  ``key__writer_<r>of<n>_sd<d>`` plus a manifest under ``key__writer_manifest``;
* a parallelism whose only axis is TP, with the rank's *local shard*: under ``key_tp_<rank>``
  (the global shape inferred as ``size`` shards) plus ``key__parallelism_manifest``;
* several axes including TP, with the *full* tensor: rank's slice under
  ``key__dp_..__tp_..`` plus the manifest;
* axes without TP: the tensor as is, as a shard, under ``key__<axes>``.

Reads take a ``ReadTarget``: ``as_stored`` (no parallelism) is ``get_tensor``; ``shard`` reads
the request's shard (checking its header matches the request), else a writer-partition shard
with the same TP split, else cuts it from the reconstructed full tensor; ``full`` concatenates
all shards along the split dimension (writer shards when no parallelism is given). Reconstruction
uses the shards as written (their count from the parallelism manifest, else the ``key_tp_0``
header), so a reader may ask for another TP size than the writers used: rank ``r`` of ``n``
gets ``full.chunk(n, split_dim)[r]``, and None when ``n`` does not divide the dimension. A manifest
write that finds the manifest already there (another rank wrote it) counts as success.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mooncake._core import tensor_layout as tl
from mooncake._store import tensor_support as ts
from mooncake._store.tensor_support import TorchMissingError
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError

if TYPE_CHECKING:
    from mooncake._store.tensor_host import TensorHost as _Host

    _Item = tuple[str, bytes, Any]
else:
    _Host = object

log = logging.getLogger("mooncake.store")

_INVALID = int(ErrorCode.INVALID_PARAMS)
_EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)


class ParallelTensorMethods(_Host):
    """Mixin: ``put/upsert/get_tensor_with_parallelism`` and their batch and buffer forms.

    While type checking it derives from :class:`~mooncake._store.tensor_host.TensorHost` (the
    byte-level methods the facade's other mixins provide); at run time from ``object``."""

    if TYPE_CHECKING:

        def get_tensor(self, key: str) -> Any: ...
        def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any: ...
        def _tm_write(self, items: Sequence[_Item], config: Any, upsert: bool) -> list[int]: ...
        def _tm_read(self, keys: Sequence[str]) -> list[tuple[tl.TensorMetadata, Any] | None]: ...
        def _tm_check_config(self, config: Any) -> None: ...
        def _tm_decode_at(self, buffer_ptr: int, size: int) -> Any: ...

    # -- writes -----------------------------------------------------------------------------

    def _tp_plan(
        self, key: str, tensor: Any, parallelism: Any, writer_partition: Any
    ) -> tuple[list[_Item], tuple[str, bytes] | None]:
        """The objects of one parallelism write and its manifest (key, bytes), if any."""
        t = ts.host_contiguous(tensor)
        code = ts.dtype_code(t)
        shape = tuple(int(d) for d in t.shape)
        if writer_partition is not None:
            if parallelism is not None:
                raise InvalidArgumentError("writer_partition cannot be combined with parallelism")
            r, n, d = ts.writer_of(writer_partition)
            shard = ts.narrow_shard(t, d, r, n)
            meta = tl.shard_metadata(code, shape, tuple(shard.shape), [tl.AxisSpec("tp", r, n, d)])
            man = tl.Manifest(code, shape, d, n).pack()
            return [(tl.writer_shard_key(key, r, n, d), meta.pack(), shard)], (
                tl.writer_manifest_key(key),
                man,
            )
        if parallelism is None:
            return [(key, tl.full_metadata(code, shape).pack(), t)], None
        axes = ts.axes_of(parallelism)
        ti = tl.tp_axis_index(axes)
        if ti is None:
            meta = tl.shard_metadata(code, shape, shape, axes)
            return [(tl.parallelism_key(key, axes), meta.pack(), t)], None
        tp = axes[ti]
        assert tp.split_dim is not None
        sd = tp.split_dim
        if not 0 <= sd < len(shape):
            raise InvalidArgumentError(f"split_dim {sd} out of range")
        if len(axes) == 1:  # the caller holds its local shard
            local, glob = t, list(shape)
            glob[sd] *= tp.size
        else:  # the caller holds the full tensor
            local, glob = ts.narrow_shard(t, sd, tp.rank, tp.size), list(shape)
        meta = tl.shard_metadata(code, glob, tuple(local.shape), axes)
        man = tl.Manifest(code, tuple(glob), sd, tp.size).pack()
        return [(tl.parallelism_key(key, axes), meta.pack(), local)], (
            tl.parallelism_manifest_key(key),
            man,
        )

    def _tp_write(
        self,
        key: str,
        tensor: Any,
        parallelism: Any,
        config: Any,
        writer_partition: Any,
        upsert: bool,
    ) -> int:
        try:
            self._tm_check_config(config)
            items, manifest = self._tp_plan(key, tensor, parallelism, writer_partition)
        except TorchMissingError:
            raise
        except (MooncakeError, RuntimeError) as e:
            log.error("tensor write with parallelism %r: %s", key, e)
            return _INVALID
        rc = next((c for c in self._tm_write(items, config, upsert) if c != 0), 0)
        if rc != 0 or manifest is None:
            return rc
        write = self.upsert if upsert else self.put
        rc = write(manifest[0], manifest[1], config)
        return 0 if rc == _EXISTS else rc

    def _tp_write_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any,
        config: Any,
        writer_partition: Any,
        upsert: bool,
    ) -> int:
        try:
            tensor = self._tm_decode_at(buffer_ptr, size)
        except MooncakeError as e:
            log.error("tensor write with parallelism from buffer %r: %s", key, e)
            return _INVALID
        return self._tp_write(key, tensor, parallelism, config, writer_partition, upsert)

    def _tp_batch(
        self,
        keys: list[str],
        count: int,
        parallelisms: Any,
        writer_partitions: Any,
        one: Callable[[int, Any, Any], int],
    ) -> list[int]:
        if count != len(keys):
            return [_INVALID] * len(keys)
        if parallelisms is not None and writer_partitions is not None:
            log.error("parallelisms cannot be combined with writer_partitions")
            return [_INVALID] * len(keys)
        reqs = parallelisms if parallelisms is not None else writer_partitions
        if reqs is not None and (not isinstance(reqs, list) or len(reqs) != len(keys)):
            log.error("keys and requests must be lists of the same length")
            return [_INVALID] * len(keys)
        out = []
        for i in range(len(keys)):
            p = parallelisms[i] if parallelisms is not None else None
            w = writer_partitions[i] if writer_partitions is not None else None
            out.append(one(i, p, w))
        return out

    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        """Put by a ``TensorParallelism`` or a ``writer_partition`` request; 0 or a code."""
        return self._tp_write(key, tensor, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        return self._tp_write(key, tensor, parallelism, config, writer_partition, True)

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        return self._tp_write_from(
            key, buffer_ptr, size, parallelism, config, writer_partition, False
        )

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        return self._tp_write_from(
            key, buffer_ptr, size, parallelism, config, writer_partition, True
        )

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        return self._tp_batch(
            keys,
            len(tensors_list),
            parallelisms,
            writer_partitions,
            lambda i, p, w: self._tp_write(keys[i], tensors_list[i], p, config, w, False),
        )

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        return self._tp_batch(
            keys,
            len(tensors_list),
            parallelisms,
            writer_partitions,
            lambda i, p, w: self._tp_write(keys[i], tensors_list[i], p, config, w, True),
        )

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        if len(buffer_ptrs) != len(sizes):
            return [_INVALID] * len(keys)
        return self._tp_batch(
            keys,
            len(buffer_ptrs),
            parallelisms,
            writer_partitions,
            lambda i, p, w: self._tp_write_from(
                keys[i], buffer_ptrs[i], sizes[i], p, config, w, False
            ),
        )

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        if len(buffer_ptrs) != len(sizes):
            return [_INVALID] * len(keys)
        return self._tp_batch(
            keys,
            len(buffer_ptrs),
            parallelisms,
            writer_partitions,
            lambda i, p, w: self._tp_write_from(
                keys[i], buffer_ptrs[i], sizes[i], p, config, w, True
            ),
        )

    # -- reads ------------------------------------------------------------------------------

    def _tp_concat(
        self, keys: Sequence[str], split_dim: int
    ) -> tuple[tl.TensorMetadata, Any] | None:
        parts = self._tm_read(keys)
        if any(p is None for p in parts) or not parts:
            return None
        tensors = [p[1] for p in parts if p is not None]
        full = ts.torch().cat(tensors, dim=split_dim)
        return tl.full_metadata(ts.dtype_code(full), tuple(full.shape)), full

    def _tp_full(
        self, key: str, axes: Sequence[tl.AxisSpec] | None
    ) -> tuple[tl.TensorMetadata, Any] | None:
        if axes is None or (len(axes) == 1 and tl.tp_axis_index(axes) == 0):
            if axes is not None:  # a lone TP axis: its shards, else writer shards
                a = axes[0]
                assert a.split_dim is not None
                r = self._tp_concat(self._tp_stored_keys(key, axes, 0), a.split_dim)
                if r is not None:
                    return r
            man_raw = self._tm_read_raw(tl.writer_manifest_key(key))
            if man_raw is None:
                return None
            m = tl.parse_manifest(man_raw)
            if axes is not None and (m.shard_count, m.split_dim) != (
                axes[0].size,
                axes[0].split_dim,
            ):
                return None
            return self._tp_concat(
                [
                    tl.writer_shard_key(key, i, m.shard_count, m.split_dim)
                    for i in range(m.shard_count)
                ],
                m.split_dim,
            )
        ti = tl.tp_axis_index(axes)
        if ti is None:
            log.error("full reconstruction requires a TP axis")
            return None
        return self._tp_concat(self._tp_stored_keys(key, axes, ti), axes[ti].split_dim or 0)

    def _tp_stored_keys(self, key: str, axes: Sequence[tl.AxisSpec], ti: int) -> list[str]:
        """Keys of the shards of ``key`` as they were *written*, for a request whose TP axis is
        ``axes[ti]``: the writers' shard count comes from the parallelism manifest, else (a
        lone TP axis) from the ``key_tp_0`` header, else it is the request's TP size. The
        request may then re-split the tensor with another TP size."""
        tp = axes[ti]
        count = tp.size
        man_raw = self._tm_read_raw(tl.parallelism_manifest_key(key))
        if man_raw is not None:
            m = tl.parse_manifest(man_raw)
            if m.split_dim != tp.split_dim:
                raise InvalidArgumentError(
                    f"split_dim {tp.split_dim} does not match the stored {m.split_dim}"
                )
            count = m.shard_count
        elif len(axes) == 1:
            first = self._tm_read([tl.tp_key(key, 0)])[0]
            if first is not None:
                stored = tl.axes_from_metadata(first[0])
                if len(stored) == 1 and stored[0].split_dim == tp.split_dim:
                    count = stored[0].size
        keys = []
        for rank in range(count):
            req = list(axes)
            req[ti] = tl.AxisSpec(tp.kind, rank, count, tp.split_dim, tp.expert_id, tp.stage_id)
            keys.append(tl.parallelism_key(key, req))
        return keys

    def _tm_read_raw(self, key: str) -> Any:
        hs = self.batch_get_buffer([key])  # type: ignore[attr-defined]
        return hs[0] if hs else None

    def _tp_read(self, key: str, target: Any) -> tuple[tl.TensorMetadata, Any] | None:
        mode, axes = ts.target_of(target)
        if mode == "as_stored" and axes is None:
            return self._tm_read([key])[0]
        if mode == "full":
            return self._tp_full(key, axes)
        if mode != "shard" or axes is None:
            log.error("unsupported ReadTarget mode %r", mode)
            return None
        r = self._tm_read([tl.parallelism_key(key, axes)])[0]
        if r is not None and tl.axes_match(axes, tl.axes_from_metadata(r[0])):
            return r
        ti = tl.tp_axis_index(axes)
        if ti is None:
            return None
        tp = axes[ti]
        assert tp.split_dim is not None
        if len(axes) == 1:
            w = self._tm_read([tl.writer_shard_key(key, tp.rank, tp.size, tp.split_dim)])[0]
            if w is not None and tl.axes_match(axes, tl.axes_from_metadata(w[0])):
                return w
        full = self._tp_full(key, axes)
        if full is None:
            return None
        shard = ts.narrow_shard(full[1], tp.split_dim, tp.rank, tp.size)
        meta = tl.shard_metadata(full[0].dtype, full[0].global_shape, tuple(shard.shape), axes)
        return meta, shard

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """The tensor a ``ReadTarget`` asks for (as stored, one shard or the full tensor)."""
        ts.torch()
        try:
            r = self._tp_read(key, target)
        except TorchMissingError:
            raise
        except (MooncakeError, RuntimeError) as e:
            log.error("get_tensor_with_parallelism(%r): %s", key, e)
            return None
        return None if r is None else r[1]

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list[Any]:
        if targets is None:
            return [self.get_tensor_with_parallelism(k) for k in keys]
        if not isinstance(targets, list) or len(targets) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets, strict=True)]

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: Any = None
    ) -> Any:
        """As :meth:`get_tensor_with_parallelism`, laid out ``[header][data]`` in the buffer;
        a tensor viewing the buffer, or None (also when it is too small)."""
        ts.torch()
        mode, axes = ts.target_of(target) if target is not None else ("as_stored", None)
        if mode == "as_stored" and axes is None:
            return self.get_tensor_into(key, buffer_ptr, size)
        try:
            r = self._tp_read(key, target)
        except (MooncakeError, RuntimeError) as e:
            log.error("get_tensor_with_parallelism_into(%r): %s", key, e)
            return None
        if r is None or not buffer_ptr:
            return None
        meta, t = r
        t = t.contiguous()
        total = tl.METADATA_SIZE + meta.data_bytes
        if total > size:
            log.error("get_tensor_with_parallelism_into: buffer of %d bytes < %d", size, total)
            return None
        ctypes.memmove(buffer_ptr, meta.pack(), tl.METADATA_SIZE)
        if meta.data_bytes:
            ctypes.memmove(buffer_ptr + tl.METADATA_SIZE, int(t.data_ptr()), meta.data_bytes)
        return ts.tensor_at(meta, buffer_ptr, total)

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: Any = None
    ) -> list[Any]:
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [None] * len(keys)
        if targets is not None and (not isinstance(targets, list) or len(targets) != len(keys)):
            return [None] * len(keys)
        return [
            self.get_tensor_with_parallelism_into(k, p, n, None if targets is None else targets[i])
            for i, (k, p, n) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True))
        ]
