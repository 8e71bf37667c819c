"""Column codecs for ``non_tensor_batch`` fields (numpy object arrays, one value per row).

A codec turns a column into named payload members plus JSON metadata; the DataProto layer
stores each payload member as its own bundle member (``non_tensor_batch.NAME.PAYLOAD``) and
records ``{"codec", "rows", "metadata", "payload_members"}`` in the handle, so the reader needs
nothing but the handle. Payload values are numpy arrays (``ndarray`` members) or
:class:`BytesParts` (a ``bytes`` member written from several buffers without joining them).

Codecs (the published names and layouts): ``ndarray`` (numeric scalars: ``data``, ``nulls``),
``utf8_ragged`` / ``bytes_ragged`` / ``json_ragged`` / ``media_bytes`` (``data``, ``offsets``
int64, ``nulls``), ``msgpack_ragged`` (same members, values packed back to back, nulls
skipped; chosen for dict and list rows when the compiled ``msgpack`` package is installed, else
``json_ragged`` is chosen for rows that JSON holds exactly), ``typed_ragged`` (numeric sequences: ``data``, ``offsets``, ``shapes``, ``ndims``,
``nulls``) and ``ragged_tensor`` (a ``typed_ragged`` of tensors) and, by schema only,
``ragged_tensor_dict`` (rows that map names to tensors: ``null_mask`` plus one
``ragged_tensor`` per name, ``NAME.data`` ...). Reading also understands what the published
writer produces for these. ``structured_recursive`` (columns of nested dicts and lists holding
tensors, arrays or bytes: :mod:`.recursive`) is chosen as the published writer chooses it, its
leaves stored with the codecs above, ``media_list_ragged`` (lists of bytes: ``data``,
``row_offsets``, ``byte_offsets``, ``nulls``) among them. A flat column of media lists is still
written as ``msgpack_ragged``/``json_ragged``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake._structured import inference, msgpack_lite, recursive
from mooncake._structured.model import (
    FieldSchema,
    StructuredTypeError,
    StructuredValueTypeError,
    optional_module,
)
from mooncake.errors import InvalidArgumentError, NotSupportedError

_torch: Any = optional_module("torch")

__all__ = ["BytesParts", "EncodedColumn", "decode_column", "encode_column", "encode_with_schema"]

_MAX_SAMPLE_BYTES = 1 << 20
_MAX_SAMPLE_ROWS = 128


@dataclass(frozen=True)
class BytesParts:
    """A bytes payload member made of several buffers, stored as their concatenation."""

    parts: tuple[Any, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


@dataclass
class EncodedColumn:
    """One encoded column: codec, row count, payload members and metadata."""

    codec: str
    rows: int
    payload: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


def _non_null(values: Sequence[Any]) -> list[Any]:
    return [v for v in values if v is not None]


_is_bytes_like = inference.is_bytes_like
_is_tensor = inference.is_tensor
_is_pil = inference.is_pil_image


def _choose(values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """The codec for a column: :func:`inference.choose_leaf_codec`'s decision (media lists
    not recognised), kept where this package writes that codec; dict/list rows and anything
    the decision refuses or stores otherwise go to ``msgpack_ragged`` or ``json_ragged``."""
    nn = _non_null(values)
    if not nn:
        return "json_ragged", {"decision_reason": "all rows are null or missing"}
    decision = inference.choose_leaf_codec(values, media_lists=False)
    if decision.codec == "ragged_tensor":
        if not decision.accepted:
            raise InvalidArgumentError(
                "unsupported structured non-tensor field: mixed tensor dtype"
            )
        return "ragged_tensor", dict(decision.metadata)
    if decision.reason == "object ndarray rows":
        raise InvalidArgumentError("unsupported structured non-tensor field: object ndarray rows")
    if decision.accepted and decision.codec in ("typed_ragged", "ndarray"):
        return decision.codec, dict(decision.metadata)
    if decision.accepted and decision.codec in ("bytes_ragged", "utf8_ragged"):
        return decision.codec, {}
    if decision.accepted and decision.codec == "msgpack_ragged":
        if msgpack_lite.NATIVE is None and _json_exact(nn):
            # without the compiled msgpack package, JSON (compiled) reads back far faster
            return "json_ragged", {}
        try:
            for v in nn:
                msgpack_lite.packb(v)
            return "msgpack_ragged", {}
        except (TypeError, ValueError, OverflowError):
            pass
    try:
        sampled = sum(len(_json_bytes(v)) for v in nn[:_MAX_SAMPLE_ROWS])
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise InvalidArgumentError(f"unsupported structured non-tensor field: {e}") from e
    if sampled > _MAX_SAMPLE_BYTES:
        raise InvalidArgumentError(
            "unsupported structured non-tensor field: sampled payload too large"
        )
    return "json_ragged", {}


def _json_exact(values: Sequence[Any]) -> bool:
    """Whether every value reads back from JSON equal and of the same types (no tuples,
    non-string keys, bytes, NaN or numpy scalars)."""
    try:
        text = json.dumps(values, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False
    # equality also tells tuples from lists and int keys from str keys; bool, int and float
    # keep their JSON spellings
    return bool(json.loads(text) == list(values))


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _json_bytes(value: Any) -> bytes:
    return _JSON.encode(value).encode("utf-8")


_JOIN_BELOW = 256 * 1024  # rows smaller than this on average are joined into one buffer


def _bytes_columns(values: Sequence[bytes | None]) -> dict[str, Any]:
    lengths = np.fromiter(
        (0 if v is None else len(v) for v in values), dtype=np.int64, count=len(values)
    )
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = [v for v in values if v]
    if len(parts) > 1 and int(offsets[-1]) < _JOIN_BELOW * len(parts):
        parts = [b"".join(parts)]
    return {
        "data": BytesParts(tuple(parts)),
        "offsets": offsets,
        "nulls": np.asarray([v is None for v in values], dtype=np.bool_),
    }


def _encode_numeric(values: Sequence[Any], dtype: np.dtype[Any]) -> dict[str, Any]:
    fill = False if dtype == np.dtype(np.bool_) else 0
    data = np.asarray([fill if v is None else v for v in values], dtype=dtype)
    return {"data": data, "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}


def _encode_typed_ragged(
    values: Sequence[Any], dtype_hint: np.dtype[Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    if dtype_hint is None:
        arrays_nn = [np.asarray(v) for v in values if v is not None]
        dtype = np.result_type(*arrays_nn) if arrays_nn else np.dtype(np.int64)
    else:
        dtype = np.dtype(dtype_hint)
    if dtype.hasobject:
        raise InvalidArgumentError("typed_ragged codec requires non-object dtype")
    arrays = [
        np.empty(0, dtype=dtype) if v is None else np.asarray(v, dtype=dtype, order="C")
        for v in values
    ]
    max_ndim = max((a.ndim for a in arrays), default=0)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    ndims = np.zeros(len(arrays), dtype=np.int16)
    shapes = np.zeros((len(arrays), max(max_ndim, 1)), dtype=np.int64)
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    for row, a in enumerate(arrays):
        offsets[row + 1] = offsets[row] + a.size
        ndims[row] = a.ndim
        if a.ndim:
            shapes[row, : a.ndim] = a.shape
    flats = [a.reshape(-1) for a in arrays if a.size]
    if len(flats) > 1 and int(offsets[-1]) * dtype.itemsize < _JOIN_BELOW * len(flats):
        flats = [np.concatenate(flats)]
    data = BytesParts(tuple(flats), dtype=dtype.str, shape=(int(offsets[-1]),))
    is_array = [v is not None and isinstance(v, np.ndarray) for v in values]
    if all(v is None or a for v, a in zip(values, is_array, strict=True)):
        row_format = "ndarray"
    elif any(is_array):
        row_format = "mixed"
    else:
        row_format = "list"
    metadata: dict[str, Any] = {
        "dtype": str(dtype),
        "max_ndim": int(max_ndim),
        "shape_policy": "ragged",
        "row_format": row_format,
        "ndarray_rows": is_array if row_format == "mixed" else None,
    }
    return (
        {"data": data, "offsets": offsets, "shapes": shapes, "ndims": ndims, "nulls": nulls},
        metadata,
    )


def _view_decodable(payload: Mapping[str, Any], metadata: Mapping[str, Any]) -> bool:
    """Whether the published module's view decoder (taken for ``contiguous_flat`` columns)
    reads these rows back exactly: with ``max_ndim`` 1 it makes every row 1-D, so a 0-d row
    among them must keep the general layout; with more dimensions it checks for itself."""
    if int(metadata["max_ndim"]) != 1:
        return True
    ndims, nulls = payload["ndims"], payload["nulls"]
    return bool(np.all(ndims[~nulls] == 1))


def _encode_ragged_tensor(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert _torch is not None
    tdtype = None
    arrays: list[Any] = []
    for v in values:
        if v is None:
            arrays.append(None)
            continue
        t = (
            _torch.as_tensor(v.copy() if isinstance(v, np.ndarray) else v)
            .detach()
            .cpu()
            .contiguous()
        )
        if t.dtype == _torch.bfloat16:
            raise InvalidArgumentError("ragged tensor codec does not support torch.bfloat16")
        if tdtype is not None and t.dtype != tdtype:
            raise InvalidArgumentError(f"mixed tensor dtype: {tdtype} vs {t.dtype}")
        tdtype = t.dtype
        arrays.append(t.numpy())
    tdtype = tdtype or _torch.float32
    np_dtype = _torch.empty(0, dtype=tdtype).numpy().dtype
    payload, meta = _encode_typed_ragged(arrays, np_dtype)
    meta["dtype"] = str(tdtype)
    return payload, meta


def _dict_keys(keys: Any) -> list[str]:
    out: list[str] = []
    for key in keys.keys() if isinstance(keys, Mapping) else keys:
        if not isinstance(key, str):
            raise StructuredTypeError("ragged_tensor_dict keys must be strings")
        if not key:
            raise InvalidArgumentError("ragged_tensor_dict keys must not be empty")
        if any(sep in key for sep in (".", "/", "\\")):
            raise InvalidArgumentError("ragged_tensor_dict keys must not contain '.', '/', or '\\'")
        if key in out:
            raise InvalidArgumentError(f"ragged_tensor_dict keys contain duplicate key {key!r}")
        out.append(key)
    return out


def _encode_ragged_tensor_dict(
    values: list[Any], declared: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = None if declared is None else _dict_keys(declared)
    seen: set[str] = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise StructuredTypeError(
                f"ragged_tensor_dict rows must be mappings or None; row {row} is {type(item).__name__}"
            )
        nulls = sorted(k for k, v in item.items() if v is None)
        if nulls:
            raise StructuredTypeError(
                "ragged_tensor_dict rows cannot contain explicit None tensor values; "
                f"row {row} has explicit None for {nulls}"
            )
        row_keys = _dict_keys(item.keys())
        if keys is not None and set(row_keys) - set(keys):
            extra = sorted(set(row_keys) - set(keys))
            raise InvalidArgumentError(
                "ragged_tensor_dict rows contain keys not declared in FieldSchema "
                f"metadata['keys']; row {row} has keys not declared: {extra}"
            )
        seen.update(row_keys)
    keys = keys if keys is not None else _dict_keys(sorted(seen))
    if keys and _torch is None:
        raise NotSupportedError("torch is required to encode ragged_tensor_dict fields")
    payload: dict[str, Any] = {"null_mask": np.asarray([v is None for v in values], dtype=np.bool_)}
    key_codecs: dict[str, Any] = {}
    for key in keys:
        try:
            sub, sub_meta = _encode_ragged_tensor(
                [None if v is None else v.get(key) for v in values]
            )
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(
                f"failed to encode ragged_tensor_dict key {key!r}: {e}"
            ) from e
        payload.update({f"{key}.{name}": value for name, value in sub.items()})
        key_codecs[key] = sub_meta
    return payload, {"keys": keys, "key_codecs": key_codecs}


def _decode_ragged_tensor_dict(
    payload: Mapping[str, Any], rows: int, metadata: Mapping[str, Any]
) -> list[Any]:
    null_mask = np.asarray(payload["null_mask"]).astype(bool).tolist()
    keys = list(metadata.get("keys", []))
    columns = {}
    for key in keys:
        prefix = f"{key}."
        sub = {n[len(prefix) :]: v for n, v in payload.items() if n.startswith(prefix)}
        columns[key] = _decode_ragged_tensor(
            sub, rows, metadata.get("key_codecs", {}).get(key) or {}
        )
    return [
        None if null_mask[r] else {k: columns[k][r] for k in keys if columns[k][r] is not None}
        for r in range(rows)
    ]


def _encode(codec: str, values: list[Any], hint: dict[str, Any]) -> EncodedColumn:
    metadata: dict[str, Any]
    if codec == "ragged_tensor_dict":
        payload, metadata = _encode_ragged_tensor_dict(values, hint.get("keys"))
    elif codec == "ndarray":
        payload = _encode_numeric(values, np.dtype(hint["dtype"]))
        metadata = {"dtype": str(payload["data"].dtype), "shape": list(payload["data"].shape)}
    elif codec == "typed_ragged":
        dt = hint.get("dtype")
        payload, metadata = _encode_typed_ragged(values, None if dt is None else np.dtype(dt))
        if metadata["row_format"] == "ndarray" and _view_decodable(payload, metadata):
            # ndarray rows lie back to back in ``data``: the published module marks such a
            # column so (its readers then return the rows as views; the layout is the same)
            metadata["physical_layout"] = "contiguous_flat"
    elif codec == "ragged_tensor":
        payload, metadata = _encode_ragged_tensor(values)
    elif codec in ("bytes_ragged", "media_bytes"):
        if any(v is not None and not _is_bytes_like(v) for v in values):
            raise StructuredTypeError(f"{codec} codec requires bytes-like values")
        payload, metadata = _bytes_columns([None if v is None else bytes(v) for v in values]), {}
    elif codec == "utf8_ragged":
        payload = _bytes_columns([None if v is None else v.encode("utf-8") for v in values])
        metadata = {}
    elif codec == "json_ragged":
        payload = _bytes_columns([None if v is None else _json_bytes(v) for v in values])
        metadata = {}
    elif codec == "media_list_ragged":
        payload, metadata = _encode_media_lists(values)
    elif codec == "msgpack_ragged":
        try:
            packed = [None if v is None else msgpack_lite.packb(v) for v in values]
        except TypeError as e:
            raise InvalidArgumentError(
                "unsupported structured non-tensor field: msgpack codec cannot encode value"
            ) from e
        payload, metadata = _bytes_columns(packed), {}
    else:
        raise InvalidArgumentError(f"unsupported schema codec: {codec!r}")
    return EncodedColumn(codec=codec, rows=len(values), payload=payload, metadata=metadata)


def encode_typed_ragged_column(values: Sequence[Any], dtype: Any) -> EncodedColumn:
    """The ``typed_ragged`` column of ``values`` with element type ``dtype`` (``data`` as
    :class:`BytesParts`; ``physical_layout`` set where the published writer sets it)."""
    return _encode("typed_ragged", list(values), {"dtype": str(np.dtype(dtype))})


def encode_msgpack_ragged_values(
    path: str, values: Sequence[Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The published ``msgpack_ragged`` encoder: ``({"data": bytearray, "offsets": int64,
    "nulls": bool}, {})``, the non-null values packed back to back; a value msgpack cannot
    pack raises ``InvalidArgumentError`` (a ``ValueError``) naming ``path``."""
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    nulls = np.zeros(len(values), dtype=np.bool_)
    data = bytearray()
    try:
        for i, value in enumerate(values):
            if value is None:
                nulls[i] = True
            else:
                data += msgpack_lite.packb(value)
            offsets[i + 1] = len(data)
    except (TypeError, OverflowError) as e:
        raise InvalidArgumentError(
            f"unsupported structured non-tensor field {path}: msgpack codec cannot encode value"
        ) from e
    return {"data": data, "offsets": offsets, "nulls": nulls}, {}


def decode_msgpack_ragged_values(payload: Mapping[str, Any], rows: int) -> list[Any]:
    """The rows of a ``msgpack_ragged`` column. ``InvalidArgumentError`` (a ``ValueError``)
    when ``offsets``/``nulls`` do not match ``rows`` or the data holds another number of
    values than the non-null rows."""
    offsets = np.asarray(payload["offsets"])
    nulls = np.asarray(payload["nulls"]).astype(bool)
    if len(offsets) != rows + 1:
        raise InvalidArgumentError(
            f"msgpack_ragged offsets length {len(offsets)} does not match rows {rows}"
        )
    if len(nulls) != rows:
        raise InvalidArgumentError(
            f"msgpack_ragged nulls length {len(nulls)} does not match rows {rows}"
        )
    try:
        values = msgpack_lite.unpack_all(_as_bytes(payload["data"]))
    except ValueError as e:
        raise InvalidArgumentError(f"msgpack_ragged payload is invalid: {e}") from e
    present = rows - int(nulls.sum())
    if len(values) != present:
        raise InvalidArgumentError(f"msgpack_ragged decoded {len(values)} rows, expected {present}")
    it = iter(values)
    return [None if nulls[r] else next(it) for r in range(rows)]


def _encode_media_lists(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``media_list_ragged``: rows that are lists of bytes-like items (``None`` rows allowed);
    all item bytes back to back, ``row_offsets`` (items) and ``byte_offsets`` (bytes)."""
    row_offsets, byte_offsets, parts = [0], [0], []
    for value in values:
        items = [] if value is None else list(value)
        for item in items:
            if not _is_bytes_like(item):
                raise NotSupportedError(
                    f"media_list_ragged is written for bytes items only, not {type(item).__name__}"
                )
            parts.append(bytes(item))
            byte_offsets.append(byte_offsets[-1] + len(parts[-1]))
        row_offsets.append(row_offsets[-1] + len(items))
    payload = {
        "data": BytesParts((b"".join(parts),)),
        "row_offsets": np.asarray(row_offsets, dtype=np.int64),
        "byte_offsets": np.asarray(byte_offsets, dtype=np.int64),
        "nulls": np.asarray([v is None for v in values], dtype=np.bool_),
    }
    metadata = {
        "encode_source": "raw_pixels_from_object",
        "media_encodings": [{"kind": "bytes"}] * len(parts),
    }
    return payload, metadata


def _decode_media_lists(payload: Mapping[str, Any], rows: int) -> list[Any]:
    """Rows of a ``media_list_ragged`` column; every item as bytes (a PIL image the published
    writer stored reads back as its raw pixel bytes)."""
    data = _as_bytes(payload["data"])
    row_off = np.asarray(payload["row_offsets"]).tolist()
    byte_off = np.asarray(payload["byte_offsets"]).tolist()
    nulls = np.asarray(payload["nulls"]).tolist()
    return [
        None
        if nulls[r]
        else [data[byte_off[i] : byte_off[i + 1]] for i in range(row_off[r], row_off[r + 1])]
        for r in range(rows)
    ]


def _encode_leaf(
    codec: str, values: list[Any], hint: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    col = _encode(codec, values, hint)
    return col.payload, col.metadata


def _decode_leaf(
    codec: str, payload: Mapping[str, Any], rows: int, metadata: Mapping[str, Any]
) -> list[Any]:
    return decode_column({"codec": codec, "metadata": metadata}, payload, rows)


def encode_column(path: str, value: np.ndarray) -> EncodedColumn:
    """Encode an object-dtype column with the codec inferred from its values."""
    values = list(value)
    try:
        nested = recursive.encode_recursive(path, values, _encode_leaf)
    except (InvalidArgumentError, NotSupportedError, TypeError, ValueError, OverflowError):
        nested = None  # as published: a column the layout cannot take gets a flat codec
    if nested is not None:
        return EncodedColumn("structured_recursive", len(values), nested[0], nested[1])
    codec, hint = _choose(values)
    col = _encode(codec, values, hint)
    col.metadata.update(
        {
            "schema_source": "inferred_from_runtime_values",
            "normalized_type": codec,
            **{k: v for k, v in hint.items() if k != "dtype" or codec == "ndarray"},
        }
    )
    return col


def encode_with_schema(path: str, value: Any, schema: FieldSchema) -> EncodedColumn | None:
    """Encode a column with ``schema.codec`` (None for ``auto`` on a non-object column: the
    caller stores it as a plain member). Refuses nulls when ``schema.nullable`` is false."""
    if isinstance(value, np.ndarray):
        column = value
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        column = np.empty(len(value), dtype=object)
        column[:] = list(value)
    else:
        raise StructuredTypeError(
            f"non_tensor_batch field {path!r} with FieldSchema must be an ndarray or non-string sequence"
        )
    values = list(column)
    if not schema.nullable and any(v is None for v in values):
        raise InvalidArgumentError(f"FieldSchema for {path!r} is not nullable")
    if schema.codec == "auto":
        if column.dtype != object:
            return None
        try:
            return encode_column(path, column)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"unable to infer a safe codec for structured non-tensor field {path!r}: {e}"
            ) from e
    hint: dict[str, Any] = {"keys": schema.metadata.get("keys")}
    dtype = schema.metadata.get("dtype")
    if schema.codec == "ndarray":
        if dtype is None:
            return encode_column(path, column)
        hint["dtype"] = str(np.dtype(str(dtype).removeprefix("torch.")))
    elif schema.codec == "typed_ragged" and dtype is not None:
        hint["dtype"] = str(np.dtype(str(dtype).removeprefix("torch.")))
    elif schema.codec == "utf8_ragged" and any(
        v is not None and not isinstance(v, str) for v in values
    ):
        raise StructuredValueTypeError("utf8_ragged codec requires str values")
    return _encode(schema.codec, values, hint)


def encode_schema_leaf(path: str, value: Any, schema: FieldSchema) -> EncodedColumn:
    """The published ``_encode_with_schema``: as :func:`encode_with_schema`, but an ``auto``
    schema on a non-object column encodes it too (by the codec inferred from its values)."""
    col = encode_with_schema(path, value, schema)
    if col is None:
        col = encode_column(path, object_column(list(value)))
    return col


# -- decoding --------------------------------------------------------------------------------


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        return data.tobytes()
    return bytes(data)


def _decode_bytes(payload: Mapping[str, Any], rows: int) -> list[bytes | None]:
    data = _as_bytes(payload["data"])
    offsets = np.asarray(payload["offsets"]).tolist()
    nulls = np.asarray(payload["nulls"]).tolist()
    return [None if nulls[r] else data[offsets[r] : offsets[r + 1]] for r in range(rows)]


def _decode_typed_ragged(
    payload: Mapping[str, Any], rows: int, metadata: Mapping[str, Any]
) -> list[Any]:
    dtype = np.dtype(metadata.get("dtype", "int64"))
    raw = payload["data"]
    if _is_tensor(raw):
        data = raw.numpy()
    elif isinstance(raw, np.ndarray):
        data = raw if raw.dtype == dtype else raw.reshape(-1).view(np.uint8).view(dtype)
    else:
        data = np.frombuffer(_as_bytes(raw), dtype=dtype)
    data = data.reshape(-1)
    offsets = np.asarray(payload["offsets"]).tolist()
    shapes = np.asarray(payload["shapes"])
    ndims = np.asarray(payload["ndims"]).tolist()
    nulls = np.asarray(payload["nulls"]).tolist()
    row_format = metadata.get("row_format")
    ndarray_rows = metadata.get("ndarray_rows") or []
    out: list[Any] = []
    for r in range(rows):
        if nulls[r]:
            out.append(None)
            continue
        shape = tuple(int(v) for v in shapes[r, : ndims[r]].tolist())
        array = data[offsets[r] : offsets[r + 1]].reshape(shape)
        as_array = row_format == "ndarray" or (row_format == "mixed" and bool(ndarray_rows[r]))
        out.append(array if as_array else array.tolist())
    return out


def _decode_numeric(payload: Mapping[str, Any]) -> list[Any]:
    data = np.asarray(payload["data"])
    nulls = np.asarray(payload["nulls"])
    if not bool(nulls.any()):
        return list(data.tolist())
    values = data.astype(object)
    values[nulls] = None
    return list(values.tolist())


def _decode_ragged_tensor(
    payload: Mapping[str, Any], rows: int, metadata: Mapping[str, Any]
) -> list[Any]:
    if _torch is None:
        raise NotSupportedError("torch is required to decode ragged tensor fields")
    name = str(metadata.get("dtype", "torch.float32")).removeprefix("torch.")
    tdtype = getattr(_torch, name, None)
    if not isinstance(tdtype, _torch.dtype):
        raise InvalidArgumentError(f"unknown torch dtype: {metadata.get('dtype')}")
    np_meta = dict(metadata)
    np_meta["dtype"] = str(_torch.empty(0, dtype=tdtype).numpy().dtype)
    return [
        None
        if v is None
        else (
            _torch.from_numpy(np.asarray(v, order="C"))
            if isinstance(v, np.ndarray)
            else _torch.as_tensor(v, dtype=tdtype)
        ).to(tdtype)
        for v in _decode_typed_ragged(payload, rows, np_meta)
    ]


def decode_column(encoded: Mapping[str, Any], payload: Mapping[str, Any], rows: int) -> list[Any]:
    """The row values of an encoded column, from its handle entry and payload members."""
    codec = encoded.get("codec")
    metadata = encoded.get("metadata") or {}
    if codec == "structured_recursive":
        return recursive.decode_recursive(metadata, payload, rows, _decode_leaf)
    if codec == "media_list_ragged":
        return _decode_media_lists(payload, rows)
    if codec == "ndarray":
        return _decode_numeric(payload)
    if codec == "ragged_tensor_dict":
        return _decode_ragged_tensor_dict(payload, rows, metadata)
    if codec == "typed_ragged":
        return _decode_typed_ragged(payload, rows, metadata)
    if codec == "ragged_tensor":
        return _decode_ragged_tensor(payload, rows, metadata)
    if codec in ("bytes_ragged", "media_bytes"):
        return list(_decode_bytes(payload, rows))
    if codec == "utf8_ragged":
        return [None if v is None else v.decode("utf-8") for v in _decode_bytes(payload, rows)]
    if codec == "json_ragged":
        return [None if v is None else json.loads(v) for v in _decode_bytes(payload, rows)]
    if codec == "msgpack_ragged":
        return decode_msgpack_ragged_values(payload, rows)
    raise InvalidArgumentError(f"unknown structured non-tensor codec: {codec}")


def object_column(values: list[Any]) -> np.ndarray:
    """``values`` as a 1-D object array (rows that are lists stay lists)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
