"""The published ``mooncake.dataproto_catalog``: logical rows and fields of an RL pipeline
mapped onto immutable DataProto refs (:func:`mooncake.structured_object_store.export_dataproto_ref`).

A :class:`DataProtoCatalog` keeps, per ``partition`` and logical ``key``, a tag (a dict merged
on every update) and, per field, the location ``(fragment_id, row)`` that holds it: a
*fragment* is one single-stage DataProto handle (its id: the stage's ``manifest_key``), whose
``batch_size`` rows are the keys of the update, in order. :meth:`~DataProtoCatalog.resolve`
turns an ordered read ``(keys, fields)`` into ``field_groups`` (fields sharing the same
locations, in field order) and the ``handles`` to read them from. Errors are ``ValueError``
naming what is wrong (unknown keys, fields not ready, malformed handles, a fragment id reused
for another handle), raised before anything changes.

Lifetimes: each (key, field) pointing at a fragment is one reference; a fragment that loses its
last reference (replaced, removed) and has no pinned reader (``resolve(..., pin=True)`` until
:meth:`~DataProtoCatalog.release_read`) is forgotten, and if it was *managed* (published through
:meth:`~DataProtoCatalog.publish`, i.e. its store objects belong to the catalog) it is listed in
every result's ``retired_handles`` until :meth:`~DataProtoCatalog.ack_retired` confirms its
objects were removed. ``publish`` / ``publish_append`` are idempotent per ``operation_id``
(until :meth:`~DataProtoCatalog.ack_publication`). Calls to one catalog must be serialized by
its host, as published.

``DataProtoCatalogTransfer`` (the published wrapper that moves the bundles through a
``MooncakeBundleTransfer`` and a remote catalog) is not implemented here yet: it raises
:class:`~mooncake.errors.NotSupportedError` when constructed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake import _unsupported

__all__ = ["DataProtoCatalog", "DataProtoCatalogTransfer"]

Location = tuple[str, int]

DataProtoCatalogTransfer = _unsupported.cls(
    "mooncake.dataproto_catalog",
    "DataProtoCatalogTransfer",
    "a remote catalog and MooncakeBundleTransfer integration, not implemented here yet",
)


@dataclass
class _Entry:
    tag: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Location] = field(default_factory=dict)


@dataclass
class _Fragment:
    handle: dict[str, Any]
    refs: int = 0
    readers: int = 0
    managed: bool = False


class DataProtoCatalog:
    """Rows and fields of partitions, resolved to DataProto fragments (see the module doc)."""

    def __init__(self) -> None:
        self._partitions: dict[str, dict[str, _Entry]] = {}
        self._fragments: dict[str, _Fragment] = {}
        self._retired: dict[str, dict[str, Any]] = {}
        self._publications: dict[str, dict[str, Any]] = {}
        self._pins: dict[int, tuple[str, ...]] = {}
        self._next_token = 0
        self._drained = False

    # -- writes ----------------------------------------------------------------------------

    def update(
        self,
        partition: str,
        keys: Sequence[str],
        *,
        tags: Sequence[Mapping[str, Any]] | None = None,
        handle: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Merge ``tags`` (one per key) and/or point the keys' fields at ``handle``'s rows
        (row ``i`` is ``keys[i]``); ``{"keys", "tags", "fields", "retired_handles"}``."""
        return self._update(partition, keys, tags, handle, managed=False)

    def publish(
        self,
        operation_id: str,
        partition: str,
        keys: Sequence[str],
        *,
        tags: Sequence[Mapping[str, Any]] | None = None,
        handle: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """:meth:`update` with a fresh, catalog-managed fragment; once per ``operation_id``
        (a repeat answers the first result)."""
        op = _nonempty(operation_id, "operation_id")
        if op in self._publications:
            return copy.deepcopy(self._publications[op])
        result = self._update(partition, keys, tags, handle, managed=handle is not None)
        self._publications[op] = copy.deepcopy(result)
        return result

    def ack_publication(self, operation_id: str) -> None:
        """Forget the remembered result of ``operation_id``."""
        self._publications.pop(_nonempty(operation_id, "operation_id"), None)

    def publish_append(
        self,
        operation_id: str,
        fragment_id: str,
        partition: str,
        keys: Sequence[str],
        *,
        previous_handle: Mapping[str, Any],
        handle: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Replace managed fragment ``fragment_id`` (now ``previous_handle``) by ``handle``,
        the same rows with more fields; the new fields become the keys' locations. Refusals
        (stale handle, changed identity or fields, unknown keys, drained catalog) answer
        ``{"append_rejected": reason}``; once per ``operation_id``."""
        op = _nonempty(operation_id, "operation_id")
        if op in self._publications:
            return copy.deepcopy(self._publications[op])
        reason, result = self._append(fragment_id, partition, keys, previous_handle, handle)
        out = {"append_rejected": reason} if reason else result
        self._publications[op] = copy.deepcopy(out)
        return out

    def remove(self, partition: str, keys: Sequence[str]) -> dict[str, Any]:
        """Drop logical keys (unknown ones are ignored); ``{"retired_handles"}``."""
        partition = _nonempty(partition, "partition")
        names = _names(keys, "keys")
        entries = self._partitions.get(partition)
        if entries is not None:
            for key in names:
                entry = entries.pop(key, None)
                for fid, _row in entry.fields.values() if entry else ():
                    self._unref(fid)
            if not entries:
                del self._partitions[partition]
        return self._retired_result()

    def drain(self) -> dict[str, Any]:
        """Retire everything (no read may be pinned) and refuse further updates."""
        if self._pins:
            raise RuntimeError(
                f"cannot drain DataProto catalog with {len(self._pins)} active read(s)"
            )
        for fid, frag in self._fragments.items():
            if frag.managed:
                self._retired[fid] = frag.handle
        self._partitions.clear()
        self._fragments.clear()
        self._publications.clear()
        self._drained = True
        return self._retired_result()

    def ack_retired(self, handles: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Forget retired handles whose store objects are gone (``ValueError`` for a handle
        whose id is retired with different contents)."""
        for handle in handles:
            ref, normalized = _normalize(handle)
            fid = next((k for k, h in self._retired.items() if h == normalized), None)
            if fid is not None:
                del self._retired[fid]
            elif len(ref.stage_refs) == 1:
                fid = next(iter(ref.stage_refs.values())).manifest_key
                if fid in self._retired:
                    raise ValueError(f"retired DataProto fragment mismatch: {fid!r}")
        return self._retired_result()

    # -- reads -----------------------------------------------------------------------------

    def resolve(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        pin: bool = False,
    ) -> dict[str, Any]:
        """The ordered read of ``fields`` (default: every field of the keys) of ``keys``:
        ``{"keys", "tags", "fields", "field_groups": [{"fields", "locations"}], "handles",
        "meta_info"}`` plus ``read_token`` with ``pin=True`` (the fragments then stay until
        :meth:`release_read`)."""
        partition = _nonempty(partition, "partition")
        names = _names(keys, "keys")
        entries = self._partitions.get(partition, {})
        missing = [k for k in names if k not in entries]
        if missing:
            raise ValueError(f"keys were not found in partition {partition!r}: {missing}")
        selected = (
            list(_names(fields, "field names"))
            if fields is not None
            else _field_union(entries, names)
        )
        if not selected:
            raise ValueError("requested keys do not contain any fields")
        for key in names:
            absent = [f for f in selected if f not in entries[key].fields]
            if absent:
                raise ValueError(f"fields are not ready for key {key!r}: {absent}")
        groups: dict[tuple[Location, ...], list[str]] = {}
        for f in selected:
            groups.setdefault(tuple(entries[k].fields[f] for k in names), []).append(f)
        used = {fid for locs in groups for fid, _ in locs}
        handles = {fid: copy.deepcopy(self._fragments[fid].handle) for fid in used}
        meta: dict[str, Any] = {}
        for h in handles.values():
            for name, value in h.get("meta_info", {}).items():
                if name in meta and meta[name] != value:
                    raise ValueError(f"conflicting DataProto meta_info value for {name!r}")
                meta[name] = copy.deepcopy(value)
        out: dict[str, Any] = {
            "keys": list(names),
            "tags": [copy.deepcopy(entries[k].tag) for k in names],
            "fields": selected,
            "field_groups": [
                {"fields": fs, "locations": list(locs)} for locs, fs in groups.items()
            ],
            "handles": handles,
            "meta_info": meta,
        }
        if pin:
            self._next_token += 1
            self._pins[self._next_token] = tuple(used)
            for fid in used:
                self._fragments[fid].readers += 1
            out["read_token"] = self._next_token
        return out

    def release_read(self, token: int) -> dict[str, Any]:
        """Unpin a pinned :meth:`resolve` (idempotent); ``{"retired_handles"}``."""
        for fid in self._pins.pop(token, ()):
            frag = self._fragments[fid]
            frag.readers -= 1
            if frag.readers == 0 and frag.refs == 0:
                self._forget(fid)
        return self._retired_result()

    def list(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tag}}`` (one partition, or all)."""
        if partition is not None:
            partition = _nonempty(partition, "partition")
            parts = [partition] if partition in self._partitions else []
        else:
            parts = list(self._partitions)
        return {p: {k: copy.deepcopy(e.tag) for k, e in self._partitions[p].items()} for p in parts}

    # -- internals -------------------------------------------------------------------------

    def _update(
        self,
        partition: str,
        keys: Sequence[str],
        tags: Sequence[Mapping[str, Any]] | None,
        handle: Mapping[str, Any] | None,
        *,
        managed: bool,
    ) -> dict[str, Any]:
        if self._drained:
            raise RuntimeError("DataProto catalog is drained")
        partition = _nonempty(partition, "partition")
        names = _names(keys, "keys")
        new_tags = _tags(tags, len(names))
        frag = _fragment(handle, len(names)) if handle is not None else None
        if new_tags is None and frag is None:
            raise ValueError("catalog update requires tags or a DataProto handle")
        if frag is not None:  # every check before the first change
            fid, stored, _ = frag
            known = self._fragments.get(fid)
            if known is not None and known.handle != stored:
                raise ValueError(f"DataProto fragment id collision: {fid!r}")
            if known is not None and known.managed != managed:
                raise ValueError(f"DataProto fragment management mismatch: {fid!r}")
            if fid in self._retired:
                raise ValueError(f"DataProto fragment id is pending retirement: {fid!r}")
        entries = self._partitions.setdefault(partition, {})
        if frag is not None:
            fid, stored, frag_fields = frag
            target = self._fragments.setdefault(fid, _Fragment(stored, managed=managed))
        for row, key in enumerate(names):
            entry = entries.setdefault(key, _Entry())
            if new_tags is not None:
                entry.tag.update(new_tags[row])
            if frag is None:
                continue
            for f in frag_fields:
                old = entry.fields.get(f)
                entry.fields[f] = (fid, row)
                if old is not None and old[0] == fid:
                    continue  # the same fragment: the reference stays
                if old is not None:
                    self._unref(old[0])
                target.refs += 1
        return {
            "keys": list(names),
            "tags": [copy.deepcopy(entries[k].tag) for k in names],
            "fields": _field_union(entries, names),
            **self._retired_result(),
        }

    def _append(
        self,
        fragment_id: str,
        partition: str,
        keys: Sequence[str],
        previous_handle: Mapping[str, Any],
        handle: Mapping[str, Any],
    ) -> tuple[str, dict[str, Any]]:
        """(refusal reason or "", result) of :meth:`publish_append`."""
        if self._drained:
            return "DataProto catalog is drained", {}
        fid = _nonempty(fragment_id, "fragment_id")
        partition = _nonempty(partition, "partition")
        names = _names(keys, "keys")
        prev_ref, prev_norm = _normalize(previous_handle)
        ref, norm = _normalize(handle)
        frag = self._fragments.get(fid)
        if frag is None or not frag.managed or frag.handle != prev_norm:
            return f"stale DataProto append handle: {fid!r}", {}
        if (
            ref.batch_size != prev_ref.batch_size
            or ref.batch_size != len(names)
            or ref.partition != prev_ref.partition
            or ref.partition != partition
            or ref._storage_group_id != prev_ref._storage_group_id
        ):
            return "appended DataProto handle changed fragment identity", {}
        if any(ref.field_index.get(n) != loc for n, loc in prev_ref.field_index.items()):
            return "appended DataProto handle changed existing fields", {}
        entries = self._partitions.get(partition, {})
        missing = [k for k in names if k not in entries]
        if missing:
            return f"keys not found in partition {partition!r}: {missing}", {}
        added = [f for f in ref.field_index if f not in prev_ref.field_index]
        for row, key in enumerate(names):
            for f in added:
                old = entries[key].fields.get(f)
                if old is not None:
                    self._unref(old[0])
                entries[key].fields[f] = (fid, row)
                frag.refs += 1
        frag.handle = norm
        return "", {
            "keys": list(names),
            "tags": [copy.deepcopy(entries[k].tag) for k in names],
            "fields": _field_union(entries, names),
            **self._retired_result(),
        }

    def _unref(self, fid: str) -> None:
        frag = self._fragments[fid]
        frag.refs -= 1
        if frag.refs == 0 and frag.readers == 0:
            self._forget(fid)

    def _forget(self, fid: str) -> None:
        frag = self._fragments.pop(fid)
        if frag.managed:
            self._retired[fid] = frag.handle

    def _retired_result(self) -> dict[str, Any]:
        return {"retired_handles": [copy.deepcopy(h) for h in self._retired.values()]}


def _field_union(entries: Mapping[str, _Entry], keys: Sequence[str]) -> list[str]:
    """The keys' fields, first appearance first."""
    return list(dict.fromkeys(f for k in keys for f in entries[k].fields))


def _normalize(handle: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the ref, its canonical exported form) of a DataProto handle (``ValueError`` if bad)."""
    from mooncake.structured_object_store import export_dataproto_ref, import_dataproto_ref

    try:
        ref = import_dataproto_ref(handle)
    except (TypeError, KeyError) as e:
        raise ValueError(f"malformed DataProto handle: {e}") from None
    return ref, export_dataproto_ref(ref)


def _fragment(
    handle: Mapping[str, Any], batch_size: int
) -> tuple[str, dict[str, Any], tuple[str, ...]]:
    ref, stored = _normalize(handle)
    if len(ref.stage_refs) != 1:
        raise ValueError("catalog fragments must contain exactly one DataProto stage")
    fid = _nonempty(next(iter(ref.stage_refs.values())).manifest_key, "manifest_key")
    if ref.batch_size != batch_size:
        raise ValueError(
            f"DataProto batch size {ref.batch_size!r} does not match {batch_size} logical keys"
        )
    fields = _names(ref.field_index, "field names")
    return fid, stored, fields


def _names(values: Sequence[str] | Mapping[str, Any] | None, label: str) -> tuple[str, ...]:
    if isinstance(values, str) or values is None:
        raise ValueError(f"{label} must be a sequence of non-empty strings")
    out = tuple(values)
    if not out or any(not isinstance(v, str) or not v for v in out):
        raise ValueError(f"{label} must be non-empty strings")
    if len(out) != len(set(out)):
        raise ValueError(f"{label} must be unique")
    return out


def _tags(tags: Sequence[Mapping[str, Any]] | None, count: int) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    if len(tags) != count:
        raise ValueError("tags must have the same length as keys")
    if any(not isinstance(t, Mapping) for t in tags):
        raise TypeError("tags must be mappings")
    return [copy.deepcopy(dict(t)) for t in tags]


def _nonempty(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value
