"""DataProto shapes: splitting a DataProto-like value into sections, flat dicts, field and row
selection, and building the result (a dict envelope or ``data_cls``)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from mooncake._structured.model import (
    FieldSchema,
    MooncakeDataProtoRef,
    StructuredKeyError,
    StructuredMemberSlice,
    StructuredTypeError,
    optional_module,
)
from mooncake.errors import InvalidArgumentError

_torch: Any = optional_module("torch")

SECTIONS = frozenset({"batch", "non_tensor_batch", "meta_info"})


@dataclass(frozen=True)
class RowSelection:
    """The rows a read returns: a slice, or explicit indices (each already in range)."""

    count: int
    member_slice: StructuredMemberSlice | None = None
    indices: tuple[int, ...] | None = None


def mapping_to_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise StructuredTypeError(f"expected mapping-like value, got {type(value).__name__}")


def _mapping_like(value: Any) -> bool:
    return value is None or isinstance(value, Mapping) or callable(getattr(value, "items", None))


def split_dataproto(data: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(batch, non_tensor_batch, meta_info)`` of a DataProto, an envelope dict or a mapping
    of tensors (all in ``batch``)."""
    if isinstance(data, Mapping):
        if data and set(data) <= SECTIONS and all(_mapping_like(v) for v in data.values()):
            return (
                mapping_to_dict(data.get("batch")),
                mapping_to_dict(data.get("non_tensor_batch")),
                mapping_to_dict(data.get("meta_info")),
            )
        return dict(data), {}, {}
    return (
        mapping_to_dict(getattr(data, "batch", None)),
        mapping_to_dict(getattr(data, "non_tensor_batch", None)),
        mapping_to_dict(getattr(data, "meta_info", None)),
    )


def batch_size(batch: Mapping[str, Any], non_tensor: Mapping[str, Any]) -> int:
    sizes = {len(v) for section in (batch, non_tensor) for v in section.values()}
    if not sizes:
        return 0
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}"
        )
    return sizes.pop()


def schema_section(name: str, schema: FieldSchema) -> str | None:
    section = schema.metadata.get("section")
    if section is None:
        return None
    if section not in SECTIONS:
        raise InvalidArgumentError(
            f"FieldSchema for {name!r} metadata['section'] must be one of {sorted(SECTIONS)}"
        )
    return str(section)


def schema_for(
    schemas: Mapping[str, FieldSchema] | None, name: str, section: str
) -> FieldSchema | None:
    if not schemas or name not in schemas:
        return None
    schema = schemas[name]
    declared = schema_section(name, schema)
    return schema if declared is None or declared == section else None


def check_schema_sections(
    batch: Mapping[str, Any],
    non_tensor: Mapping[str, Any],
    meta_info: Mapping[str, Any],
    schemas: Mapping[str, FieldSchema] | None,
) -> None:
    if not schemas:
        return
    actual: dict[str, set[str]] = {}
    for section, fields in (
        ("batch", batch),
        ("non_tensor_batch", non_tensor),
        ("meta_info", meta_info),
    ):
        for name in fields:
            actual.setdefault(name, set()).add(section)
    for name, schema in schemas.items():
        declared = schema_section(name, schema)
        where = actual.get(name)
        if declared is None or not where or declared in where:
            continue
        text = ", ".join(repr(s) for s in sorted(where))
        raise InvalidArgumentError(
            f"FieldSchema for {name!r} declares section {declared!r}, but data contains it in {text}"
        )


def _seq(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _dense(value: Any) -> bool:
    if _torch is not None and isinstance(value, _torch.Tensor):
        return bool(value.ndim > 0)
    return isinstance(value, np.ndarray) and value.dtype != object and value.ndim > 0


def _schema_dtype(schema: FieldSchema | None) -> np.dtype[Any] | None:
    name = None if schema is None else schema.metadata.get("dtype")
    if name is None:
        return None
    try:
        dtype: np.dtype[Any] = np.dtype(name)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"invalid FieldSchema metadata['dtype']: {name!r}") from e
    if dtype.kind not in "biufc":
        raise InvalidArgumentError(
            f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}"
        )
    return dtype


def _column(name: str, value: Any, rows: int, schema: FieldSchema | None) -> Any:
    if isinstance(value, np.ndarray):
        if len(value) != rows:
            raise InvalidArgumentError(
                f"flat dict non_tensor_batch field {name!r} has batch size {len(value)}, expected {rows}"
            )
        dtype = _schema_dtype(schema)
        if (
            schema is not None
            and schema.codec == "ndarray"
            and dtype is not None
            and (value.dtype != object or all(v is not None for v in value))
        ):
            return np.asarray(value, dtype=dtype)
        return value
    if _seq(value):
        if len(value) != rows:
            raise InvalidArgumentError(
                f"flat dict non_tensor_batch field {name!r} has batch size {len(value)}, expected {rows}"
            )
        out = np.empty(rows, dtype=object)
        out[:] = list(value)
        return out
    raise StructuredTypeError(
        f"flat dict non_tensor_batch field {name!r} must be an ndarray or non-string sequence"
    )


def _len(name: str, value: Any) -> int:
    try:
        return len(value)
    except TypeError as e:
        raise InvalidArgumentError(f"flat dict row-aligned field {name!r} must be sized") from e


def _auto_rows(data: Mapping[str, Any], exclude: set[str]) -> int:
    dense = {len(v) for k, v in data.items() if k not in exclude and _dense(v)}
    if len(dense) > 1:
        raise InvalidArgumentError(
            f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}"
        )
    if dense:
        return dense.pop()
    sizes = {
        len(v)
        for k, v in data.items()
        if k not in exclude and ((isinstance(v, np.ndarray) and v.ndim > 0) or _seq(v))
    }
    if not sizes:
        return 0
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"flat dict fields have ambiguous batch sizes: {sorted(sizes)}; "
            "pass FieldSchema metadata['section'] for list-valued metadata fields"
        )
    return sizes.pop()


def flat_dict_to_envelope(data: Any, schemas: Mapping[str, FieldSchema] | None) -> dict[str, Any]:
    """Sort a flat dict into sections: row-aligned tensors/arrays into ``batch``, row-aligned
    sequences into ``non_tensor_batch``, the rest into ``meta_info`` (schemas may pin one)."""
    if not isinstance(data, Mapping):
        raise StructuredTypeError("flat dict payload must be a mapping")
    schemas = schemas or {}
    pinned = {
        _len(n, data[n])
        for n, s in schemas.items()
        if n in data and schema_section(n, s) in ("batch", "non_tensor_batch")
    }
    if len(pinned) > 1:
        raise InvalidArgumentError(
            f"flat dict fields have inconsistent batch sizes: {sorted(pinned)}"
        )
    schema_rows = pinned.pop() if pinned else 0
    rows = schema_rows
    if rows == 0:
        meta = {n for n, s in schemas.items() if n in data and schema_section(n, s) == "meta_info"}
        rows = _auto_rows(data, meta)
    out: dict[str, dict[str, Any]] = {"batch": {}, "non_tensor_batch": {}, "meta_info": {}}
    for key, value in data.items():
        schema = schemas.get(key)
        section = None if schema is None else schema_section(key, schema)
        if section is None:
            if rows and _dense(value) and tuple(value.shape[:1]) == (rows,):
                out["batch"][key] = value
            elif schema_rows == 0 and _seq(value) and len(value) == rows:
                out["non_tensor_batch"][key] = _column(key, value, rows, schema)
            else:
                out["meta_info"][key] = value
        elif section == "non_tensor_batch":
            out["non_tensor_batch"][key] = _column(key, value, rows, schema)
        else:
            out[section][key] = value
    return out


def envelope_to_flat_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    meta, batch, non_tensor = (
        mapping_to_dict(data.get(s)) for s in ("meta_info", "batch", "non_tensor_batch")
    )
    overlap = (
        (set(meta) & set(batch)) | (set(meta) & set(non_tensor)) | (set(batch) & set(non_tensor))
    )
    if overlap:
        raise InvalidArgumentError(
            f"Duplicate keys found across DataProto sections: {sorted(overlap)}"
        )
    result = dict(meta)
    result.update(batch)
    for name, value in non_tensor.items():
        result[name] = (
            value.tolist() if isinstance(value, np.ndarray) and value.dtype == object else value
        )
    return result


def build_result(
    batch: dict[str, Any], non_tensor: dict[str, Any], meta_info: dict[str, Any], data_cls: Any
) -> Any:
    """The envelope dict, or ``data_cls.from_dict(...)`` / ``data_cls(batch=..., ...)``."""
    if data_cls is None or data_cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}
    from_dict = getattr(data_cls, "from_dict", None)
    try:
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta_info)
        return data_cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)
    except TypeError as e:
        raise StructuredTypeError(
            f"{getattr(data_cls, '__name__', data_cls)!r} cannot be constructed from "
            "batch, non_tensor_batch, and meta_info"
        ) from e


def select_fields(
    ref: MooncakeDataProtoRef,
    fields: Sequence[str] | None,
    batch_fields: Sequence[str] | None,
    non_tensor_fields: Sequence[str] | None,
) -> tuple[list[str], list[str]]:
    """The batch and non-tensor field names a read returns (KeyError for unknown ones)."""
    if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
        raise InvalidArgumentError(
            "fields cannot be combined with batch_fields or non_tensor_fields"
        )
    index = ref.field_index
    if fields is not None:
        names = list(fields)
        _check_exist(ref, names)
        return (
            [n for n in names if index[n].section == "batch"],
            [n for n in names if index[n].section == "non_tensor_batch"],
        )
    if batch_fields is None and non_tensor_fields is None:
        return (
            [n for n, loc in index.items() if loc.section == "batch"],
            [n for n, loc in index.items() if loc.section == "non_tensor_batch"],
        )
    b = [] if batch_fields is None else list(batch_fields)
    nt = [] if non_tensor_fields is None else list(non_tensor_fields)
    _check_exist(ref, [*b, *nt])
    return b, nt


def _check_exist(ref: MooncakeDataProtoRef, names: Sequence[str]) -> None:
    missing = [n for n in names if n not in ref.field_index]
    if missing:
        raise StructuredKeyError(f"unknown DataProto fields: {missing}")


def _slice_len(s: StructuredMemberSlice, rows: int) -> int:
    if s.step <= 0:
        raise InvalidArgumentError("structured ndarray slicing step must be positive")
    return len(range(*slice(s.start, s.end, s.step).indices(rows)))


def select_rows(rows: Any, total: int) -> RowSelection | None:
    """The row selection for ``rows`` (None, a slice, a StructuredMemberSlice or indices)."""
    if rows is None:
        return None
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise InvalidArgumentError("DataProto row slicing currently supports axis=0 only")
        return RowSelection(count=_slice_len(rows, total), member_slice=rows)
    if isinstance(rows, slice):
        start, end, step = rows.indices(total)
        if step <= 0:
            raise InvalidArgumentError("DataProto row slicing step must be positive")
        s = StructuredMemberSlice(axis=0, start=start, end=end, step=step)
        return RowSelection(count=_slice_len(s, total), member_slice=s)
    if _seq(rows) or isinstance(rows, np.ndarray):
        out = []
        for i in rows:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise StructuredTypeError("DataProto row indices must be integers")
            j = int(i) + (total if int(i) < 0 else 0)
            if not 0 <= j < total:
                raise IndexError(f"DataProto row index {i} out of range for {total} rows")
            out.append(j)
        return RowSelection(count=len(out), indices=tuple(out))
    raise StructuredTypeError(
        "DataProto rows must be a slice, StructuredMemberSlice, or row index sequence"
    )


# -- storage groups ---------------------------------------------------------------------------


def _replicate_config() -> Any:
    try:
        from mooncake.store import ReplicateConfig

        return ReplicateConfig()
    except ImportError:  # pragma: no cover
        return SimpleNamespace()


def config_with_group(config: Any, group_id: str) -> Any:
    """``config`` (or a default ``ReplicateConfig``) whose ``group_ids`` is ``[group_id]``."""
    ids = getattr(config, "group_ids", None) if config is not None else None
    if isinstance(ids, str):
        ids = [ids]
    if ids and ids[0] and ids[0] != group_id:
        raise InvalidArgumentError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        out = _replicate_config()
    else:
        from mooncake._structured.io import _copy_config

        out = _copy_config(config)
    out.group_ids = [group_id]
    return out


def new_group_id(config: Any) -> str | None:
    """The storage group of a new DataProto: the one ``config.group_ids`` names, a fresh
    ``structured-<uuid>`` when it names none, ``None`` for an empty name (ungrouped)."""
    raw = getattr(config, "group_ids", None)
    if raw is None:
        group = None
    elif isinstance(raw, str):
        group = raw
    else:
        try:
            ids = list(raw)
        except TypeError as e:
            raise InvalidArgumentError(
                "structured object store config.group_ids must contain strings"
            ) from e
        if len(ids) > 1:
            raise InvalidArgumentError(
                "structured object store config.group_ids must contain exactly one logical group "
                "id; it is expanded across internal Mooncake keys"
            )
        group = ids[0] if ids else None
    if group is None:
        return f"structured-{uuid.uuid4().hex}"
    if not isinstance(group, str):
        raise InvalidArgumentError("structured object store config.group_ids must contain strings")
    return group or None
