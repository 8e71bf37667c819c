"""torch glue for the tensor methods: dtype codes, tensors from/to the published layout.

torch is optional (``pip install 'mooncake-py[torch]'``); :func:`torch` imports it on first
use and raises :class:`TorchMissingError` (an ``ImportError`` and a ``NotSupportedError``)
naming the extra when it is absent. Also the published request types ``ParallelAxis``,
``TensorParallelism`` and ``ReadTarget`` and the module helpers ``_serialize_tensor``,
``_tensor_metadata_size`` and ``_deserialize_tensor``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from mooncake import _fast
from mooncake._core import tensor_layout as tl
from mooncake.errors import InvalidArgumentError, NotSupportedError

_torch: Any = None


class TorchMissingError(NotSupportedError, ImportError):
    """A tensor method was called but torch is not installed."""


def torch() -> Any:
    """The torch module (imported once)."""
    global _torch
    if _torch is None:
        try:
            import torch as t
        except ImportError as e:
            raise TorchMissingError(
                "the tensor methods need PyTorch: pip install 'mooncake-py[torch]'"
            ) from e
        _torch = t
    return _torch


def dtype_code(tensor: Any) -> int:
    """The published dtype code of a tensor (error for dtypes the layout has no code for)."""
    name = str(tensor.dtype).removeprefix("torch.")
    code = tl.DTYPE_BY_TORCH_NAME.get(name)
    if code is None:
        raise InvalidArgumentError(f"unsupported tensor dtype {tensor.dtype}")
    return int(code)


def is_tensor(obj: Any) -> bool:
    return "Tensor" in type(obj).__name__ and hasattr(obj, "data_ptr")


def host_contiguous(tensor: Any) -> Any:
    """A C-contiguous CPU tensor with the same values (device tensors are copied to host)."""
    if not is_tensor(tensor):
        raise InvalidArgumentError(f"expected a torch tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        tensor = tensor.detach().to("cpu")
    return tensor.detach().contiguous()


def full_header(tensor: Any) -> tl.TensorMetadata:
    return tl.full_metadata(dtype_code(tensor), tuple(tensor.shape))


def tensor_from_buffer(meta: tl.TensorMetadata, buf: Any, offset: int) -> Any:
    """A tensor viewing ``buf[offset : offset + meta.data_bytes]`` (``buf`` kept alive).

    A 0-dim tensor comes back 1-dim with its one element, as the published binding returns it.
    """
    t = torch()
    dtype = getattr(t, tl.TensorDtype(meta.dtype).torch_name)
    if meta.data_bytes == 0:
        return t.empty(meta.local_shape, dtype=dtype)
    raw = t.frombuffer(buf, dtype=t.uint8, count=meta.data_bytes, offset=offset)
    flat = raw.view(dtype)
    return flat.reshape(meta.local_shape) if meta.local_shape else flat


def tensor_at(meta: tl.TensorMetadata, addr: int, total: int) -> Any:
    """A tensor viewing memory at ``addr`` (the caller keeps that memory alive)."""
    arr = (ctypes.c_char * total).from_address(addr)
    return tensor_from_buffer(meta, arr, meta.data_offset)


def tensor_copy(meta: tl.TensorMetadata, addr: int) -> Any:
    """A tensor with its own copy of the data of the object at ``addr``.

    The copy lands in a numpy buffer (malloc reuses freed pages; torch's allocator hands out
    fresh, unfaulted pages for large tensors, which costs more than the copy itself here)."""
    t = torch()
    dtype = getattr(t, tl.TensorDtype(meta.dtype).torch_name)
    if meta.data_bytes == 0:
        return t.empty(meta.local_shape, dtype=dtype)
    arr = np.empty(meta.data_bytes, dtype=np.uint8)
    _fast.memcpy_at(int(arr.ctypes.data), addr + meta.data_offset, meta.data_bytes)
    flat = t.from_numpy(arr).view(dtype)
    return flat.reshape(meta.local_shape) if meta.local_shape else flat


def narrow_shard(tensor: Any, split_dim: int, rank: int, count: int) -> Any:
    if not 0 <= split_dim < tensor.dim():
        raise InvalidArgumentError(f"split_dim {split_dim} out of range for {tensor.dim()} dims")
    start, size = tl.shard_range(int(tensor.shape[split_dim]), rank, count)
    return tensor.narrow(split_dim, start, size).contiguous()


# -- the module-level helpers of the published binding --------------------------------------


def _serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """``(metadata_bytes, data_ptr, size, owner)`` of a tensor, as the published helper returns:
    the 304-byte header, the address and length of the (contiguous) data and the tensor that
    owns it. Raises ``ValueError`` for anything the layout cannot hold."""
    try:
        owner = host_contiguous(tensor)
        meta = full_header(owner)
    except (InvalidArgumentError, tl.TensorLayoutError) as e:
        raise ValueError(f"unsupported tensor for Mooncake tensor serialization: {e}") from e
    n = meta.data_bytes
    return meta.pack(), int(owner.data_ptr()) if n else 0, n, owner


def _tensor_metadata_size() -> int:
    """Bytes of the header in front of every stored tensor (304)."""
    return tl.METADATA_SIZE


def _deserialize_tensor(payload: bytes) -> Any:
    """The tensor of a ``header + data`` payload (a copy); ``ValueError`` if it is not one."""
    data = bytearray(payload)
    try:
        meta = tl.parse_metadata(data, len(data))
    except tl.TensorLayoutError as e:
        raise ValueError(f"invalid serialized Mooncake tensor payload: {e}") from e
    return tensor_from_buffer(meta, data, meta.data_offset)


# -- request types --------------------------------------------------------------------------


class ParallelAxis:
    """One axis of a parallelism request: ``kind`` (``"tp"``, ``"dp"``, ``"ep"``, ``"pp"``),
    ``rank``/``size``, ``split_dim`` (TP only), ``expert_id`` (EP), ``stage_id`` (PP)."""

    def __init__(self) -> None:
        self.kind: str = ""
        self.rank: int = 0
        self.size: int = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return (
            f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
            f"split_dim={self.split_dim}, expert_id={self.expert_id}, stage_id={self.stage_id})"
        )


class TensorParallelism:
    """A parallelism request: ``axes``, a list of :class:`ParallelAxis`."""

    def __init__(self) -> None:
        self.axes: list[Any] = []


_MODES = ("as_stored", "shard", "full")


class ReadTarget:
    """What a parallelism read returns: ``mode`` ``"as_stored"``, ``"shard"`` or ``"full"``
    (any case) and an optional ``parallelism``."""

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: Any = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        m = str(value).lower()
        if m not in _MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m


def axes_of(parallelism: Any) -> tuple[tl.AxisSpec, ...]:
    """The validated axes of a ``TensorParallelism``-like object (anything with ``axes``)."""
    if not hasattr(parallelism, "axes"):
        raise InvalidArgumentError("TensorParallelism must provide axes")
    out = []
    for a in list(parallelism.axes):
        if not all(hasattr(a, f) for f in ("kind", "rank", "size")):
            raise InvalidArgumentError("ParallelAxis must provide kind, rank, and size")

        def opt(name: str, a: Any = a) -> int | None:
            v = getattr(a, name, None)
            return None if v is None else int(v)

        out.append(
            tl.AxisSpec(
                str(a.kind),
                int(a.rank),
                int(a.size),
                opt("split_dim"),
                opt("expert_id"),
                opt("stage_id"),
            )
        )
    return tl.validate_axes(out)


def writer_of(obj: Any) -> tuple[int, int, int]:
    """``(rank, size, split_dim)`` of a writer_partition object."""
    if not all(hasattr(obj, f) for f in ("rank", "size", "split_dim")):
        raise InvalidArgumentError("writer_partition must provide rank, size, and split_dim")
    r, n, d = int(obj.rank), int(obj.size), int(obj.split_dim)
    if n <= 0 or not 0 <= r < n or d < 0:
        raise InvalidArgumentError("invalid writer partition")
    return r, n, d


def target_of(obj: Any) -> tuple[str, tuple[tl.AxisSpec, ...] | None]:
    """``(mode, axes or None)`` of a ReadTarget-like object (None: as stored)."""
    if obj is None:
        return "as_stored", None
    if not hasattr(obj, "mode") or not hasattr(obj, "parallelism"):
        raise InvalidArgumentError("ReadTarget must provide mode and parallelism")
    mode = str(obj.mode).lower()
    if mode not in _MODES:
        raise InvalidArgumentError(f"unsupported ReadTarget mode {obj.mode!r}")
    p = obj.parallelism
    return mode, None if p is None else axes_of(p)
