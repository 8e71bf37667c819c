"""Multi-part payload members and the published module's typed-ragged helpers.

A payload member may be written from several buffers without joining them first. Besides the
codecs' :class:`~mooncake._structured.codecs.BytesParts`, the published module's two such
members are accepted by ``put_structured_object`` under their published names and fields:

* :class:`MultiBufferPayload` (``_MultiBufferPayload``): ``buffers`` (bytes-like views) stored
  back to back, ``owners`` kept alive with them, and ``dtype``/``shape`` (an ndarray member when
  both are set, else a bytes member);
* :class:`DirectCopyPayload` (``_DirectCopyPayload``): C-contiguous ``arrays`` stored back to
  back (``total_bytes`` in all), always with ``dtype``/``shape``.

Both are written by the same batched call as every other member (their buffers are parts of
the one write; nothing is concatenated in Python).

The helpers below are the published ``_encode_typed_ragged_values``,
``_encode_typed_ragged_regular_ndarray_rows`` and ``_decode_typed_ragged_values`` with their
arguments and results, built on this package's ``typed_ragged`` codec
(:mod:`mooncake._structured.codecs`): the same ``offsets``/``shapes``/``ndims``/``nulls``
members and metadata (``physical_layout: "contiguous_flat"`` where the rows are ndarrays laid
back to back), ``data`` as one of the payload members above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake._structured import codecs
from mooncake.errors import InvalidArgumentError

__all__ = [
    "TYPED_RAGGED_DEFAULT_DTYPE",
    "DirectCopyPayload",
    "MultiBufferPayload",
    "decode_typed_ragged_values",
    "encode_typed_ragged_regular_ndarray_rows",
    "encode_typed_ragged_values",
    "parts_of",
]

#: the element type of a ``typed_ragged`` column with no value to take one from
TYPED_RAGGED_DEFAULT_DTYPE = "int64"


@dataclass(frozen=True)
class MultiBufferPayload:
    """A payload member stored as its ``buffers`` back to back (see the module docstring)."""

    buffers: tuple[Any, ...]
    owners: tuple[Any, ...] = ()
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the member holds (every buffer's ``nbytes``)."""
        return sum(memoryview(b).nbytes for b in self.buffers)

    @property
    def parts(self) -> tuple[Any, ...]:
        """The buffers in storage order."""
        return tuple(self.buffers)


@dataclass(frozen=True)
class DirectCopyPayload:
    """A payload member stored as the bytes of ``arrays`` back to back (module docstring)."""

    arrays: list[np.ndarray]
    total_bytes: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """``total_bytes``."""
        return self.total_bytes

    @property
    def parts(self) -> tuple[Any, ...]:
        """The arrays in storage order; ``InvalidArgumentError`` when they do not hold
        ``total_bytes`` or one is not a C-contiguous ndarray."""
        arrays = tuple(self.arrays)
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise InvalidArgumentError(
                    f"direct-copy payload array {i} must be a C-contiguous numpy.ndarray"
                )
        held = sum(int(a.nbytes) for a in arrays)
        if held != self.total_bytes:
            raise InvalidArgumentError(
                f"direct-copy payload arrays hold {held} bytes, expected {self.total_bytes}"
            )
        return arrays

    @staticmethod
    def from_flat_arrays(
        flat_arrays: list[np.ndarray], dtype: Any, total_elems: int
    ) -> DirectCopyPayload:
        """The payload of ``flat_arrays`` (1-D, of ``dtype``): ``shape`` is ``(total_elems,)``."""
        return DirectCopyPayload(
            arrays=flat_arrays,
            total_bytes=sum(int(a.nbytes) for a in flat_arrays),
            dtype=np.dtype(dtype).str,
            shape=(int(total_elems),),
        )


PART_TYPES = (codecs.BytesParts, MultiBufferPayload, DirectCopyPayload)


def parts_of(value: Any) -> tuple[Any, ...] | None:
    """The buffers of a multi-part payload member in storage order, ``None`` for any other
    value."""
    if isinstance(value, PART_TYPES):
        return value.parts
    return None


def _data_member(flats: list[np.ndarray], dtype: np.dtype[Any], ndarray_rows: bool) -> Any:
    """``data`` as the published encoder builds it: one ndarray row is a one-buffer
    :class:`MultiBufferPayload`, several rows a :class:`DirectCopyPayload`, none an empty
    :class:`MultiBufferPayload`."""
    total = sum(int(a.size) for a in flats)
    if not flats or (ndarray_rows and len(flats) == 1):
        flat = flats[0] if flats else np.empty(0, dtype=dtype)
        return MultiBufferPayload(
            buffers=(memoryview(flat.data).cast("B"),),
            owners=(flat,),
            dtype=dtype.str,
            shape=(total,),
        )
    return DirectCopyPayload.from_flat_arrays(flats, dtype, total)


def encode_typed_ragged_regular_ndarray_rows(
    values: Sequence[Any], dtype: Any
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The ``typed_ragged`` payload and metadata of at least two rows that are all
    C-contiguous ndarrays of ``dtype`` and one shape (no null); ``None`` for anything else."""
    dtype = np.dtype(dtype)
    rows = list(values)
    if len(rows) < 2:
        return None
    first = rows[0]
    if not isinstance(first, np.ndarray):
        return None
    for v in rows:
        if (
            not isinstance(v, np.ndarray)
            or v.dtype != dtype
            or not v.flags.c_contiguous
            or v.shape != first.shape
        ):
            return None
    row_elems = int(first.size)
    total = row_elems * len(rows)
    data: Any
    if row_elems:
        data = DirectCopyPayload.from_flat_arrays([v.reshape(-1) for v in rows], dtype, total)
    else:
        data = np.asarray(rows, dtype=dtype).reshape(-1)
    ndim = int(first.ndim)
    if ndim == 0:
        shapes = np.zeros((len(rows), 1), dtype=np.int64)
    else:
        shapes = np.empty((len(rows), ndim), dtype=np.int64)
        shapes[:] = first.shape
    payload = {
        "data": data,
        "offsets": np.arange(len(rows) + 1, dtype=np.int64) * row_elems,
        "shapes": shapes,
        "ndims": np.full(len(rows), ndim, dtype=np.int16),
        "nulls": np.zeros(len(rows), dtype=np.bool_),
    }
    metadata = {
        "dtype": str(dtype),
        "max_ndim": ndim,
        "shape_policy": "ragged",
        "row_format": "ndarray",
        "ndarray_rows": None,
        "physical_layout": "contiguous_flat",
    }
    return payload, metadata


def encode_typed_ragged_values(
    values: Sequence[Any], dtype_hint: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``typed_ragged`` column of numeric rows (``None`` rows allowed): ``(payload,
    metadata)``. The element type is ``dtype_hint``, else the rows' common type
    (:data:`TYPED_RAGGED_DEFAULT_DTYPE` with no row); an object type raises
    ``InvalidArgumentError`` (a ``ValueError``)."""
    rows = list(values)
    if dtype_hint is None:
        present = [np.asarray(v) for v in rows if v is not None]
        dtype = np.result_type(*present) if present else np.dtype(TYPED_RAGGED_DEFAULT_DTYPE)
    else:
        dtype = np.dtype(dtype_hint)
    if dtype.hasobject:
        raise InvalidArgumentError("typed_ragged codec requires non-object dtype")
    regular = encode_typed_ragged_regular_ndarray_rows(rows, dtype)
    if regular is not None:
        return regular
    col = codecs.encode_typed_ragged_column(rows, dtype)
    flats = [
        np.ascontiguousarray(np.asarray(v, dtype=dtype)).reshape(-1) for v in rows if v is not None
    ]
    flats = [a for a in flats if a.size]
    payload = dict(col.payload)
    payload["data"] = _data_member(flats, dtype, col.metadata["row_format"] == "ndarray")
    return payload, dict(col.metadata)


def decode_typed_ragged_values(
    payload: Mapping[str, Any], rows: int, metadata: Mapping[str, Any] | None = None
) -> list[Any]:
    """The rows of a ``typed_ragged`` column (``data`` as an ndarray, bytes or tensor): ndarray
    rows are views of ``data``, list rows lists, null rows ``None``."""
    return codecs.decode_column(
        {"codec": "typed_ragged", "metadata": metadata or {}}, payload, rows
    )
