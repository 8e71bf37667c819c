"""The published ``structured_recursive`` column layout: nested rows stored as leaf columns.

A column of nested rows (dicts and short lists, see :func:`inference.infer_structure`) whose
leaves include tensors, numeric ndarrays or bytes is stored as its expansion: per interior
node ``node.I.missing`` / ``node.I.row_mask`` (bool per row) and, for lists,
``node.I.lengths`` (int64 per row); per leaf its own column codec's payload under
``leaf.J.NAME`` plus ``leaf.J.missing``. The metadata names the nodes and leaves
(``{"schema_source", "structure_version": 1, "root_path", "nodes", "leaves"}``), as the
published writer lays it out, so either side reads the other's columns.

The leaf codecs are the caller's (:mod:`.codecs` passes its encoder and decoder in), so this
module depends on nothing but the inference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mooncake._structured.inference import (
    MISSING,
    CodecDecision,
    InferredLeaf,
    InferredNode,
    Missing,
    escape_key,
    infer_structure,
    path_tokens,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["decode_recursive", "encode_recursive"]

#: (codec, values, hint) -> (payload, metadata)
LeafEncoder = Callable[[str, list[Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]
#: (codec, payload, rows, metadata) -> values
LeafDecoder = Callable[[str, Mapping[str, Any], int, Mapping[str, Any]], list[Any]]

_RECURSIVE_LEAF_CODECS = frozenset(
    {"ragged_tensor", "bytes_ragged", "media_bytes", "media_list_ragged"}
)


def _wants_recursive(leaves: Sequence[InferredLeaf]) -> bool:
    return any(
        leaf.decision.codec in _RECURSIVE_LEAF_CODECS
        or (
            leaf.decision.codec == "typed_ragged"
            and leaf.decision.metadata.get("recursive_source") == "ndarray"
        )
        for leaf in leaves
    )


def _lookup(value: Any, root: str, target: str) -> Any:
    """The value at ``target`` (a node path under ``root``) in one row; MISSING if absent."""
    suffix = target[len(root) :]
    current = value
    for token in path_tokens(suffix):
        if isinstance(current, Missing):
            return MISSING
        if isinstance(token, str):
            if not isinstance(current, dict) or token not in current:
                return MISSING
        elif not isinstance(current, (list, tuple)) or token >= len(current):
            return MISSING
        current = current[token]
    return current


def encode_recursive(
    path: str, values: list[Any], encode_leaf: LeafEncoder
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The ``structured_recursive`` payload and metadata of the column, or None when the
    published writer would not use that layout (no interior node, or no tensor, ndarray or
    bytes leaf). A leaf no codec accepts raises :class:`InvalidArgumentError`; errors of the
    leaf encoder propagate (the caller falls back to a flat codec)."""
    leaves: list[InferredLeaf] = []
    nodes: list[InferredNode] = []
    infer_structure(path, values, leaves, nodes)
    if not nodes or not _wants_recursive(leaves):
        return None
    payload: dict[str, Any] = {}
    node_specs: list[dict[str, Any]] = []
    for node_id, node in enumerate(nodes):
        spec: dict[str, Any] = {
            "id": node_id,
            "path": node.path,
            "node_type": node.node_type,
            "children": list(node.children),
        }
        name = f"node.{node_id}.missing"
        payload[name] = np.asarray([_lookup(v, path, node.path) is MISSING for v in values], bool)
        spec["missing_payload"] = name
        if node.row_mask is not None:
            name = f"node.{node_id}.row_mask"
            payload[name] = np.asarray(node.row_mask, dtype=np.bool_)
            spec["row_mask_payload"] = name
        if node.lengths is not None:
            name = f"node.{node_id}.lengths"
            payload[name] = np.asarray(node.lengths, dtype=np.int64)
            spec["lengths_payload"] = name
        node_specs.append(spec)
    leaf_specs: list[dict[str, Any]] = []
    for leaf_id, leaf in enumerate(leaves):
        missing = [isinstance(v, Missing) for v in leaf.values]
        codec_values = [None if m else v for m, v in zip(missing, leaf.values, strict=True)]
        decision = leaf.decision
        if not decision.accepted:
            if any(v is not None for v in codec_values):
                raise InvalidArgumentError(
                    f"unsupported structured non-tensor leaf {leaf.path!r}: {decision.reason}"
                )
            decision = CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
        leaf_payload, leaf_meta = encode_leaf(decision.codec, codec_values, dict(decision.metadata))
        members: dict[str, str] = {}
        for pname, pvalue in leaf_payload.items():
            payload[f"leaf.{leaf_id}.{pname}"] = pvalue
            members[pname] = f"leaf.{leaf_id}.{pname}"
        payload[f"leaf.{leaf_id}.missing"] = np.asarray(missing, dtype=np.bool_)
        members["missing"] = f"leaf.{leaf_id}.missing"
        leaf_specs.append(
            {
                "id": leaf_id,
                "path": leaf.path,
                "codec": decision.codec,
                "rows": len(values),
                "metadata": leaf_meta,
                "payload_members": members,
            }
        )
    metadata = {
        "schema_source": "inferred_from_runtime_values",
        "structure_version": 1,
        "root_path": path,
        "nodes": node_specs,
        "leaves": leaf_specs,
    }
    return payload, metadata


def _path_depth(path: str) -> int:
    return path.count(".") + path.count("[")


def _child_path(node: Mapping[str, Any], child: Any) -> str:
    if node["node_type"] == "dict":
        return f"{node['path']}.{escape_key(str(child))}"
    return f"{node['path']}[{int(child)}]"


def _member(payload: Mapping[str, Any], name: Any, what: str) -> np.ndarray:
    if name is None:
        raise InvalidArgumentError(f"structured_recursive metadata lacks {what}")
    try:
        return np.asarray(payload[name])
    except KeyError:
        raise InvalidArgumentError(f"structured_recursive payload lacks member {name!r}") from None


def decode_recursive(
    metadata: Mapping[str, Any], payload: Mapping[str, Any], rows: int, decode_leaf: LeafDecoder
) -> list[Any]:
    """The rows of a ``structured_recursive`` column (dicts lose the keys their row lacked,
    lists get back their lengths, ``None`` stays ``None``). A malformed layout raises
    :class:`InvalidArgumentError` naming what is missing."""
    values: dict[str, list[Any]] = {}
    for leaf in metadata.get("leaves", []):
        members = leaf["payload_members"]
        leaf_payload = {n: payload[g] for n, g in members.items() if n != "missing"}
        decoded = decode_leaf(leaf["codec"], leaf_payload, rows, leaf.get("metadata") or {})
        missing = _member(payload, members.get("missing"), f"the missing mask of {leaf['path']!r}")
        values[leaf["path"]] = [MISSING if missing[r] else decoded[r] for r in range(rows)]
    nodes = sorted(metadata.get("nodes", []), key=lambda n: _path_depth(n["path"]), reverse=True)
    for node in nodes:
        missing = _member(payload, node.get("missing_payload"), f"{node['path']!r} missing mask")
        mask_name = node.get("row_mask_payload")
        mask = None if mask_name is None else _member(payload, mask_name, "row mask")
        len_name = node.get("lengths_payload")
        lengths = None if len_name is None else _member(payload, len_name, "lengths")
        children = [(c, values.get(_child_path(node, c))) for c in node["children"]]
        for c, col in children:
            if col is None:
                raise InvalidArgumentError(
                    f"structured_recursive node {node['path']!r} has no column for child {c!r}"
                )
        out: list[Any] = []
        for r in range(rows):
            if missing[r]:
                out.append(MISSING)
            elif mask is not None and not mask[r]:
                out.append(None)
            elif node["node_type"] == "dict":
                out.append(
                    {c: col[r] for c, col in children if col is not None and col[r] is not MISSING}
                )
            else:
                n = int(lengths[r]) if lengths is not None else len(children)
                item: list[Any] = [None] * n
                for c, col in children:
                    if col is not None and int(c) < n and col[r] is not MISSING:
                        item[int(c)] = col[r]
                out.append(item)
        values[node["path"]] = out
    root = metadata.get("root_path")
    if root not in values:
        raise InvalidArgumentError("structured_recursive metadata has no root node")
    return values[root]
