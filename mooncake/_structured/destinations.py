"""Gathered rows into caller destinations (a DataProto read with explicit row indices).

A read with ``rows=[i, j, ...]`` fetches the span covering those rows and picks them; when the
caller passed a destination for a field, the picked rows are written into it here, checked as
the published module checks them (dtype and shape for arrays and tensors, size for raw memory).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from mooncake._structured.bundles import _tensor_helpers
from mooncake._structured.layer import ndarray_destination
from mooncake._structured.model import (
    RawDestination,
    StructuredTypeError,
    TensorObjectBuffer,
    optional_module,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["rows_into"]

_torch: Any = optional_module("torch")


def rows_into(name: str, dest: Any, rows: Any) -> Any:
    """Write the gathered ``rows`` of field ``name`` (an ndarray or a tensor) into ``dest``.

    Returns what the read answers for the field: ``dest`` itself (an ndarray or tensor of the
    rows' shape and dtype, or a ``tensor_object_buffer``/``raw_destination``, which receives a
    tensor as a serialized tensor object: header then data), or for an ndarray into a
    ``raw_destination``, an ndarray view of that memory. Raises ``InvalidArgumentError``
    (a ``ValueError``) naming the field on a dtype, shape or size mismatch and
    ``StructuredTypeError`` for a destination kind the field cannot go to.
    """
    if isinstance(rows, np.ndarray):
        if not isinstance(dest, (np.ndarray, RawDestination)):
            raise StructuredTypeError(
                f"structured ndarray field {name} destination must be a numpy.ndarray "
                "or raw_destination"
            )
        out = ndarray_destination(name, dest, rows.dtype, tuple(rows.shape))
        out[...] = rows
        return out if isinstance(dest, RawDestination) else dest
    if isinstance(dest, (RawDestination, TensorObjectBuffer)):
        serialize, _ = _tensor_helpers()
        header, ptr, size, owner = serialize(rows)
        need = len(header) + int(size)
        if dest.size < need:
            raise InvalidArgumentError(
                f"tensor destination for {name} has {dest.size} bytes, expected at least {need}"
            )
        ctypes.memmove(dest.ptr, header, len(header))
        if size:
            ctypes.memmove(dest.ptr + len(header), ptr, int(size))
        del owner
        return dest
    if _torch is not None and isinstance(dest, _torch.Tensor):
        if dest.dtype != rows.dtype or tuple(dest.shape) != tuple(rows.shape):
            raise InvalidArgumentError(
                f"structured tensor field {name} destination shape mismatch: expected "
                f"{tuple(rows.shape)} {rows.dtype}, got {tuple(dest.shape)} {dest.dtype}"
            )
        dest.copy_(rows)
        return dest
    raise StructuredTypeError(
        f"structured tensor field {name} destination must be a torch.Tensor, "
        "tensor_object_buffer or raw_destination"
    )
