"""Codec inference for non-tensor columns and the recursive expansion of nested rows.

These are the published module's inference helpers (``_choose_leaf_codec``,
``infer_structure``, ``_escape_key``, ``MISSING`` and their records), with the same decisions,
fields and paths, so code written against the published names behaves the same here.

* :func:`choose_leaf_codec` looks at the non-null values of one column and returns a
  :class:`CodecDecision`: the codec the published writer would pick for it (``ragged_tensor``,
  ``media_list_ragged``, ``typed_ragged``, ``ndarray``, ``bytes_ragged``, ``media_bytes``,
  ``utf8_ragged``, ``msgpack_ragged``) and whether that codec accepts the column. It never
  raises for odd values: an unusable column is a decision with ``accepted=False`` and a reason.
  The column writer (:func:`mooncake._structured.codecs.encode_column`) starts from the same
  decision; it then differs only where this package stores differently: media lists are stored
  as ``msgpack_ragged``/``json_ragged`` (``media_list_ragged`` is not written here), dict and
  list rows go to ``json_ragged`` when they read back exactly from JSON and the compiled
  ``msgpack`` package is absent, and a refused column raises instead of returning.
* :func:`infer_structure` expands a column of nested rows (dicts with string keys, short lists
  of containers) into interior :class:`InferredNode` records and :class:`InferredLeaf` columns
  named by paths (``root.key``, ``root[0]``, keys escaped by :func:`escape_key`). A key absent
  from a row is :data:`MISSING` in the child column, distinct from a ``None`` value, and each
  node's ``row_mask`` records which rows held a real container. The column writer stores a
  column as this expansion (the published ``structured_recursive`` layout,
  :mod:`mooncake._structured.recursive`) when it has a node and a tensor, ndarray or bytes
  leaf, as the published writer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake._structured.model import optional_module
from mooncake.errors import InvalidArgumentError

_torch: Any = optional_module("torch")

__all__ = [
    "MAX_DEPTH",
    "MAX_LIST_LEN",
    "MAX_STRUCT_KEYS",
    "MISSING",
    "CodecDecision",
    "InferredLeaf",
    "InferredNode",
    "Missing",
    "choose_leaf_codec",
    "escape_key",
    "infer_structure",
    "is_bytes_like",
    "is_pil_image",
    "is_tensor",
    "path_tokens",
]

#: dict nodes with more distinct keys than this are leaves (one msgpack column), not expanded
MAX_STRUCT_KEYS = 64
#: list nodes longer than this in any row are leaves, not expanded
MAX_LIST_LEN = 8
#: nesting deeper than this raises (a cycle or an absurd row, not data worth expanding)
MAX_DEPTH = 32


class Missing:
    """The type of :data:`MISSING`: a dict key absent from a row (a value of ``None`` is
    ``None``). One instance exists; copies and pickles of it are that instance."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<MISSING>"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = Missing()


@dataclass
class CodecDecision:
    """What codec a column gets: ``accepted`` (whether ``codec`` can store it), ``codec``,
    a human ``reason``, the ``normalized_type`` of the rows and codec ``metadata`` (``dtype``
    for tensors, numeric sequences and scalars; ``recursive_source`` for ndarray rows)."""

    accepted: bool
    codec: str
    reason: str
    normalized_type: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferredLeaf:
    """One leaf column of an expansion: its ``path``, one value per row (``None`` where the
    parent was null, :data:`MISSING` where the key or index was absent) and its decision."""

    path: str
    values: list[Any]
    decision: CodecDecision


@dataclass
class InferredNode:
    """One interior node: ``node_type`` ``"dict"`` (``children`` are the sorted keys) or
    ``"list"`` (``children`` are ``0..max_len-1``, ``lengths`` the per-row length, 0 for a
    row without a list); ``row_mask[i]`` is whether row ``i`` held a real container."""

    path: str
    node_type: str
    children: list[Any]
    lengths: list[int] | None = None
    row_mask: list[bool] | None = None


def _non_null(values: Sequence[Any]) -> list[Any]:
    return [v for v in values if v is not None and not isinstance(v, Missing)]


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (False when torch is not installed)."""
    return _torch is not None and isinstance(value, _torch.Tensor)


def is_bytes_like(value: Any) -> bool:
    """Whether ``value`` is ``bytes``, ``bytearray`` or ``memoryview``."""
    return isinstance(value, (bytes, bytearray, memoryview))


def is_pil_image(value: Any) -> bool:
    """Whether ``value`` looks like a PIL image (a ``PIL.*`` class with ``save``)."""
    module = getattr(value.__class__, "__module__", None) or ""
    return module.startswith("PIL.") and hasattr(value, "save")


def _is_media_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        is_pil_image(item) or is_bytes_like(item) for item in value
    )


def _reject(codec: str, reason: str, normalized_type: str) -> CodecDecision:
    return CodecDecision(False, codec, reason, normalized_type)


def choose_leaf_codec(values: Sequence[Any], *, media_lists: bool = True) -> CodecDecision:
    """The codec decision for one column (``None`` and :data:`MISSING` rows are skipped).

    The order of the checks is the published one: tensors (one dtype, any ndim), media lists
    (lists of images or bytes, empty lists included; skipped when ``media_lists`` is false),
    numeric ndarrays, numeric sequences, numeric scalars, bytes-like, PIL images, ``str``,
    then dicts/lists/tuples (``msgpack_ragged``, accepted without serialising them). Anything
    else, and a column with no non-null value, is ``msgpack_ragged`` not accepted.
    Numeric scalars that the common dtype cannot hold (ints beyond 64 bits) are ``ndarray`` not
    accepted, where the published function accepts them (and its writer then fails or stores
    an object array).
    """
    nn = _non_null(values)
    if not nn:
        return _reject("msgpack_ragged", "all rows are null", "msgpack")
    if all(is_tensor(v) for v in nn):
        dtypes = {v.dtype for v in nn}
        if len(dtypes) != 1:
            names = sorted(str(d) for d in dtypes)
            return _reject("ragged_tensor", f"mixed tensor dtype: {names}", "torch.Tensor")
        return CodecDecision(
            True,
            "ragged_tensor",
            "all non-null rows are Tensor",
            "torch.Tensor",
            {"dtype": str(nn[0].dtype)},
        )
    if media_lists and all(_is_media_list(v) for v in nn):
        return CodecDecision(True, "media_list_ragged", "all rows are media lists", "media list")
    if all(isinstance(v, np.ndarray) for v in nn):
        if all(np.issubdtype(v.dtype, np.number) for v in nn):
            return CodecDecision(
                True,
                "typed_ragged",
                "all rows are numeric ndarray",
                "numeric sequence",
                {"recursive_source": "ndarray"},
            )
        return _reject("msgpack_ragged", "object ndarray rows", "python object")
    if all(isinstance(v, (list, tuple)) for v in nn):
        dtype = _common_dtype([_asarray_dtype(v) for v in nn])
        if dtype is not None and np.issubdtype(dtype, np.number):
            return CodecDecision(
                True,
                "typed_ragged",
                "all rows are numeric sequences",
                "numeric sequence",
                {"dtype": str(dtype)},
            )
    if all(isinstance(v, (bool, int, float, np.number)) for v in nn):
        dtype = _common_dtype(nn)
        if dtype is None or not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            return _reject("ndarray", f"non-numeric dtype: {dtype}", "numeric scalar")
        if np.issubdtype(dtype, np.integer) and not _ints_fit(nn, dtype):
            return _reject("ndarray", f"integer out of {dtype} range", "numeric scalar")
        return CodecDecision(
            True, "ndarray", "all rows are numeric scalar", "numeric scalar", {"dtype": str(dtype)}
        )
    if all(is_bytes_like(v) for v in nn):
        return CodecDecision(True, "bytes_ragged", "all rows are bytes-like", "bytes-like")
    if all(is_pil_image(v) for v in nn):
        return CodecDecision(True, "media_bytes", "all rows are media", "media")
    if all(isinstance(v, str) for v in nn):
        return CodecDecision(True, "utf8_ragged", "all rows are str", "str")
    if all(isinstance(v, (dict, list, tuple)) for v in nn):
        return CodecDecision(True, "msgpack_ragged", "all rows are msgpack-like", "msgpack")
    return _reject("msgpack_ragged", "no codec matched", "python object")


def _asarray_dtype(value: Any) -> np.dtype[Any] | None:
    try:
        return np.asarray(value).dtype
    except (TypeError, ValueError, OverflowError):
        return None


def _ints_fit(values: Sequence[Any], dtype: np.dtype[Any]) -> bool:
    info = np.iinfo(dtype)
    return all(info.min <= v <= info.max for v in values if type(v) is int)


def _common_dtype(items: Sequence[Any]) -> np.dtype[Any] | None:
    if any(item is None for item in items):
        return None
    try:
        return np.result_type(*items)
    except (TypeError, ValueError, OverflowError):
        return None


def escape_key(key: str) -> str:
    """``key`` as one path segment: ``\\`` -> ``\\\\``, ``.`` -> ``\\.``, ``[`` -> ``\\[``."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def path_tokens(path: str) -> list[str | int]:
    """The segments of a path such as ``root.a[2].c\\.d``: keys (unescaped) and indexes.

    Every ``.`` starts a key, empty ones included, so ``path_tokens("r." + escape_key(k))``
    is ``["r", k]`` for every key ``k`` (the published parser drops empty keys, which the
    expansion of a row with key ``""`` produces); text before the first ``.``/``[`` is a key
    when non-empty. An index that is not a closed ``[digits]`` raises
    :class:`InvalidArgumentError` naming the path.
    """
    tokens: list[str | int] = []
    current: list[str] = []
    in_key = False  # a "." opened a key that has not been closed yet
    i = 0
    while i < len(path):
        char = path[i]
        if char == "\\" and i + 1 < len(path):
            current.append(path[i + 1])
            i += 2
            continue
        if char in ".[":
            if current or in_key:
                tokens.append("".join(current))
                current = []
            in_key = char == "."
            if char == "[":
                end = path.find("]", i)
                digits = path[i + 1 : end] if end >= 0 else ""
                if not (digits.isascii() and digits.isdigit()):
                    raise InvalidArgumentError(
                        f"bad index at offset {i} in structured path {path!r}"
                    )
                tokens.append(int(digits))
                i = end
        else:
            current.append(char)
        i += 1
    if current or in_key:
        tokens.append("".join(current))
    return tokens


def _dict_keys(values: Sequence[Any]) -> list[str] | None:
    nn = _non_null(values)
    if not nn or not all(isinstance(v, dict) for v in nn):
        return None
    keys = {k for v in nn for k in v}
    if not all(isinstance(k, str) for k in keys) or len(keys) > MAX_STRUCT_KEYS:
        return None
    return sorted(keys)


def _list_shape(values: Sequence[Any]) -> tuple[int, list[int]] | None:
    nn = _non_null(values)
    if not nn or not all(isinstance(v, (list, tuple)) for v in nn):
        return None
    max_len = max(len(v) for v in nn)
    if max_len > MAX_LIST_LEN:
        return None
    if not all(item is None or isinstance(item, (dict, list, tuple)) for v in nn for item in v):
        return None
    return max_len, [len(v) if isinstance(v, (list, tuple)) else 0 for v in values]


def infer_structure(
    path: str,
    values: list[Any],
    leaves: list[InferredLeaf],
    nodes: list[InferredNode],
    *,
    _depth: int = 0,
) -> None:
    """Expand the column ``values`` (one value per row) at ``path`` into ``nodes`` and
    ``leaves`` (output lists, appended to; nodes parent-first, in key/index order).

    A column whose non-null rows are all dicts with at most :data:`MAX_STRUCT_KEYS` distinct
    string keys becomes a ``dict`` node with one child column per key (``path.KEY``, the key
    escaped); one whose rows are all lists/tuples of at most :data:`MAX_LIST_LEN` items, each a
    container or ``None``, becomes a ``list`` node with one child per index (``path[I]``). Child
    values are ``None`` under a null row and :data:`MISSING` where the row lacks the key or
    index. Any other column is a leaf with :func:`choose_leaf_codec`'s decision. Nesting deeper
    than :data:`MAX_DEPTH` raises :class:`InvalidArgumentError` (a ``ValueError``).
    """
    if _depth > MAX_DEPTH:
        raise InvalidArgumentError(f"infer_structure exceeded max depth {MAX_DEPTH} at {path!r}")
    keys = _dict_keys(values)
    if keys is not None:
        nodes.append(
            InferredNode(path, "dict", list(keys), row_mask=[isinstance(v, dict) for v in values])
        )
        for key in keys:
            child = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            infer_structure(f"{path}.{escape_key(key)}", child, leaves, nodes, _depth=_depth + 1)
        return
    shape = _list_shape(values)
    if shape is not None:
        max_len, lengths = shape
        mask = [isinstance(v, (list, tuple)) for v in values]
        nodes.append(InferredNode(path, "list", list(range(max_len)), lengths, row_mask=mask))
        for index in range(max_len):
            child = [
                (v[index] if index < len(v) else MISSING) if isinstance(v, (list, tuple)) else None
                for v in values
            ]
            infer_structure(f"{path}[{index}]", child, leaves, nodes, _depth=_depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))
