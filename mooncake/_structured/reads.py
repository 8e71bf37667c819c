"""Reading the fields of a DataProto ref: per stage, one materialize of the members the fields
need (sliced to the selected rows, or to the span covering picked rows), then the rows picked,
the encoded columns decoded and the caller's destinations filled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake._structured import codecs
from mooncake._structured.dataproto import RowSelection
from mooncake._structured.destinations import rows_into
from mooncake._structured.layer import StructuredLayer
from mooncake._structured.model import MooncakeDataProtoRef, StructuredObjectReadSpec
from mooncake._structured.nested import is_nested, select_nested_rows
from mooncake.errors import InvalidArgumentError

__all__ = ["read_fields", "take_rows"]


def take_rows(value: Any, indices: Sequence[int], offset: int) -> Any:
    """Rows ``indices`` of ``value`` (an ndarray, tensor or jagged nested tensor holding the
    rows from ``offset`` on), in that order, repeats allowed."""
    picks = [i - offset for i in indices]
    if is_nested(value):
        return select_nested_rows(value, picks)
    if isinstance(value, np.ndarray):
        return value[np.asarray(picks, dtype=np.int64)]
    import torch

    return value[torch.as_tensor(picks, dtype=torch.long)]


def read_fields(
    layer: StructuredLayer,
    ref: MooncakeDataProtoRef,
    sel: RowSelection | None,
    batch_names: Sequence[str],
    nt_names: Sequence[str],
    destinations: Mapping[str, Any],
    *,
    flat: bool,
) -> dict[str, Any]:
    """The value of each named field of ``ref`` for the row selection ``sel`` (None: all
    rows); a field with an entry in ``destinations`` is read into it. ``flat``: encoded columns
    as lists (else object ndarrays)."""
    dests = dict(destinations)
    # with explicit row indices, the covering span is read and the picked rows are
    # written into the caller's destination afterwards
    gathered = sel is not None and sel.indices is not None
    by_stage: dict[str, list[str]] = {}
    for name in [*batch_names, *nt_names]:
        by_stage.setdefault(ref.field_index[name].stage, []).append(name)
    values: dict[str, Any] = {}
    for stage, names in by_stage.items():
        spec = StructuredObjectReadSpec(ref=ref.stage_refs[stage])
        members: list[str] = []
        stage_dests: dict[str, Any] = {}
        lo = 0
        if sel is not None and sel.indices:
            lo = min(sel.indices)
        for name in names:
            loc = ref.field_index[name]
            enc = ref.encoded_non_tensor.get(name)
            if enc is not None and loc.section == "non_tensor_batch":
                members.extend(enc["payload_members"].values())
                continue
            members.append(loc.member)
            if name in dests and gathered:
                # refused before any read, as a destination given without row indices is
                pspec = layer.bundles.resolve(ref.stage_refs[stage])["buffers"].get(loc.member)
                if isinstance(pspec, dict) and pspec.get("format") == "torch_save":
                    raise InvalidArgumentError(
                        f"structured torch_save tensor member {loc.member} does not support "
                        "destinations"
                    )
            if name in dests and not gathered:
                stage_dests[loc.member] = dests[name]
            if sel is not None and sel.member_slice is not None:
                s = sel.member_slice
                spec = spec.slice_member(loc.member, s.axis, s.start, s.end, s.step)
            elif sel is not None and sel.indices is not None:
                hi = max(sel.indices) + 1 if sel.indices else 0
                spec = spec.slice_member(loc.member, 0, lo, hi)
        result = layer.materialize(
            spec.select_members(list(dict.fromkeys(members))), stage_dests, bytes_as_array=True
        )
        for name in names:
            loc = ref.field_index[name]
            enc = ref.encoded_non_tensor.get(name)
            if enc is None or loc.section != "non_tensor_batch":
                value = result.objects[loc.member]
                if sel is not None and sel.indices is not None:
                    value = take_rows(value, sel.indices, lo)
                    if name in dests:
                        value = rows_into(name, dests[name], value)
                values[name] = value
                continue
            payload = {p: result.objects[m] for p, m in enc["payload_members"].items()}
            column = codecs.decode_column(enc, payload, ref.batch_size)
            if sel is not None and sel.member_slice is not None:
                s = sel.member_slice
                column = column[slice(*slice(s.start, s.end, s.step).indices(ref.batch_size))]
            elif sel is not None and sel.indices is not None:
                column = [column[i] for i in sel.indices]
            values[name] = column if flat else codecs.object_column(column)
    return values
