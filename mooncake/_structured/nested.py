"""Nested (jagged) tensor members, in the published module's format.

A ``torch.jagged`` nested tensor is stored as one payload holding its ``values``, ``offsets``
and (when set) ``lengths`` tensors back to back, each a serialized tensor object (the 304-byte
header then the data); the field spec says so: ``{"encoding": "torch_tensor", "nested": true,
"format": "tensor_parts", "part_bytes": [...], "has_lengths": ..., "ragged_idx": ...}``. The
published module's other format, ``torch_save`` (one ``torch.save`` blob), is read too.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from mooncake._structured.model import optional_module
from mooncake.errors import InvalidArgumentError

__all__ = ["decode_nested", "encode_nested", "select_nested_rows"]

_torch: Any = optional_module("torch")


def _helpers() -> tuple[Any, Any]:
    from mooncake.store import _deserialize_tensor, _serialize_tensor

    return _serialize_tensor, _deserialize_tensor


def encode_nested(
    name: str, value: Any
) -> tuple[dict[str, Any], list[tuple[bytes, int, int, Any]]]:
    """The field spec of nested tensor member ``name`` and its parts: for each of ``values``,
    ``offsets`` (and ``lengths``), ``(header, data_ptr, data_size, owner)``. Only the jagged
    layout is stored (``InvalidArgumentError`` otherwise, as published)."""
    if value.layout != _torch.jagged:
        raise InvalidArgumentError(
            f"structured nested tensor fields require torch.jagged layout ({name})"
        )
    lengths = value.lengths()
    tensors = [value.values(), value.offsets()]
    if lengths is not None:
        tensors.append(lengths)
    serialize, _ = _helpers()
    parts = [serialize(t.detach().cpu().contiguous()) for t in tensors]
    spec = {
        "encoding": "torch_tensor",
        "dtype": str(value.dtype),
        "nested": True,
        "format": "tensor_parts",
        "part_bytes": [len(h) + int(n) for h, _p, n, _o in parts],
        "has_lengths": lengths is not None,
        "ragged_idx": int(getattr(value, "_ragged_idx", 1)),
    }
    return spec, parts


def decode_nested(payload: bytes, spec: dict[str, Any]) -> Any:
    """The nested tensor stored as ``payload`` under field spec ``spec``; a malformed payload
    raises ``InvalidArgumentError`` saying what is wrong."""
    fmt = spec.get("format", "torch_save")
    if fmt == "torch_save":
        value = _torch.load(io.BytesIO(payload), weights_only=True)
        return _from_parts(
            value.values(), value.offsets(), value.lengths(), int(getattr(value, "_ragged_idx", 1))
        )
    if fmt != "tensor_parts":
        raise InvalidArgumentError(f"unsupported nested tensor payload format: {fmt}")
    part_bytes = spec.get("part_bytes")
    expected = 3 if spec.get("has_lengths") else 2
    if not isinstance(part_bytes, list) or len(part_bytes) != expected:
        raise InvalidArgumentError("nested tensor payload has invalid part metadata")
    _, deserialize = _helpers()
    tensors = []
    offset = 0
    for size in part_bytes:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgumentError("nested tensor payload has invalid part size")
        end = offset + size
        if end > len(payload):
            raise InvalidArgumentError("nested tensor payload is truncated")
        tensors.append(deserialize(payload[offset:end]))
        offset = end
    if offset != len(payload):
        raise InvalidArgumentError("nested tensor payload has trailing bytes")
    return _from_parts(
        tensors[0],
        tensors[1],
        tensors[2] if expected == 3 else None,
        int(spec.get("ragged_idx", 1)),
    )


def _from_parts(values: Any, offsets: Any, lengths: Any, ragged_idx: int) -> Any:
    seq = lengths if lengths is not None else offsets.diff()
    lo, hi = (int(seq.min().item()), int(seq.max().item())) if seq.numel() else (0, 0)
    return _torch.nested.nested_tensor_from_jagged(
        values,
        offsets=offsets,
        lengths=lengths,
        jagged_dim=ragged_idx,
        min_seqlen=lo,
        max_seqlen=hi,
    )


def is_nested(value: Any) -> bool:
    return _torch is not None and isinstance(value, _torch.Tensor) and bool(value.is_nested)


def select_nested_rows(value: Any, indices: Sequence[int]) -> Any:
    """A jagged nested tensor of the rows ``indices`` of ``value`` (any order, repeats)."""
    rows = value.unbind()
    picked = [rows[int(i)] for i in indices]
    if picked:
        out = _torch.nested.as_nested_tensor(picked, layout=value.layout)
    else:
        offsets = _torch.zeros(1, dtype=value.offsets().dtype)
        out = _torch.nested.nested_tensor_from_jagged(value.values()[:0], offsets=offsets)
    if hasattr(value, "_ragged_idx"):
        out._ragged_idx = value._ragged_idx
    return out
