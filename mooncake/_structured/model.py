"""Public records of the structured object store and the JSON transport handle of a DataProto.

Everything here is part of the published surface: names, fields, defaults and the handle format
(``{"type": "mooncake_dataproto_ref", "version": 1, "kind": "bundle_stages", ...}``), so a handle
exported by either implementation imports in the other.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mooncake.errors import InvalidArgumentError, MooncakeError, StoreError

__all__ = [
    "AUTO_PARALLEL_MIN_BYTES",
    "AUTO_PARALLEL_MIN_CHUNKS",
    "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION",
    "DEFAULT_BUNDLE_CHUNK_BYTES",
    "MISSING_OBJECT_ERROR",
    "STORAGE_GROUP_ID",
    "STRUCTURED_FIELD_SPECS_KEY",
    "BundleTransferPolicy",
    "DataProtoRefLike",
    "FieldSchema",
    "MooncakeDataProtoRef",
    "RawDestination",
    "RemoteBundleRef",
    "StructuredFieldLocation",
    "StructuredKeyError",
    "StructuredMemberSlice",
    "StructuredObjectError",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "StructuredTypeError",
    "StructuredValueTypeError",
    "TensorObjectBuffer",
    "export_dataproto_ref",
    "import_dataproto_ref",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
]

DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024**2
#: the published module's threshold for writing a payload's chunks in parallel; here every put
#: is one batched call whatever its size, so this is informational
AUTO_PARALLEL_MIN_BYTES = DEFAULT_BUNDLE_CHUNK_BYTES
#: the fewest chunks an ``auto`` put mode writes in parallel (staged writes, as published)
AUTO_PARALLEL_MIN_CHUNKS = 8
MISSING_OBJECT_ERROR = -704  # remove() of an object that is already gone
STRUCTURED_FIELD_SPECS_KEY = "__mooncake_structured_fields__"
DATAPROTO_REF_HANDLE_TYPE = "mooncake_dataproto_ref"
DATAPROTO_REF_HANDLE_VERSION = 1
STORAGE_GROUP_ID = "storage_group_id"


def optional_module(name: str) -> Any:
    """The module ``name`` if it can be imported, else None (torch and msgpack are optional)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class StructuredObjectError(StoreError, RuntimeError):
    """A store call made for a bundle failed (the message names the call, the key and the code)."""


class StructuredTypeError(MooncakeError, TypeError):
    """A value of the wrong type was handed to the structured object store."""


class StructuredValueTypeError(StructuredTypeError, AttributeError):
    """A column value its schema codec cannot encode (a ``utf8_ragged`` value that is not a
    ``str``): a ``TypeError``, and an ``AttributeError`` as the published module raises (from
    the value's missing ``encode``)."""


class StructuredKeyError(MooncakeError, KeyError):
    """A requested member or field is not in the stored object."""


@dataclass(frozen=True)
class BundleTransferPolicy:
    """Controls bundle transfer parallelism: ``max_inflight_put`` >= 1, ``put_mode`` one of
    ``auto``/``batch``/``parallel``, ``copy_mode`` one of ``auto``/``zero_copy``/``copy``."""

    max_inflight_put: int = 1
    put_mode: Literal["auto", "batch", "parallel"] = "auto"
    copy_mode: Literal["auto", "zero_copy", "copy"] = "auto"


@dataclass(frozen=True)
class FieldSchema:
    """Schema hint for a DataProto field: ``codec`` names the non-tensor codec (or ``auto``);
    ``metadata["section"]`` may pin the field to ``batch``, ``non_tensor_batch`` or ``meta_info``."""

    codec: str
    nullable: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RemoteBundleRef:
    """Reference to a named-buffer bundle: its manifest key and (when known) the manifest."""

    manifest_key: str
    manifest: dict[str, Any]


@dataclass(frozen=True, init=False)
class StructuredObjectPayload:
    """A structured object: JSON metadata plus named members (tensors, arrays or bytes)."""

    metadata: Mapping[str, Any]
    buffers: Mapping[str, Any]

    def __init__(
        self,
        metadata: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
    ) -> None:
        if buffers is None:
            raise StructuredTypeError("StructuredObjectPayload requires buffers")
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)
        object.__setattr__(self, "buffers", buffers)


@dataclass
class StructuredObjectResult:
    """A materialized structured object: its metadata and the members read."""

    metadata: dict[str, Any]
    objects: dict[str, Any]


@dataclass(frozen=True)
class StructuredFieldLocation:
    """Where a DataProto field lives: its stage, member name and section."""

    stage: str
    member: str
    section: Literal["batch", "non_tensor_batch"]


@dataclass
class MooncakeDataProtoRef:
    """Lightweight DataProto handle: one structured object per stage plus a field index."""

    batch_size: int
    stage_refs: dict[str, RemoteBundleRef]
    field_index: dict[str, StructuredFieldLocation]
    meta_info: dict[str, Any]
    namespace: str = "default"
    partition: str = "default"
    global_indexes: list[int] | None = None
    encoded_non_tensor: dict[str, Any] = field(default_factory=dict)
    _storage_group_id: str | None = field(default=None, repr=False)


DataProtoRefLike = MooncakeDataProtoRef | Mapping[str, Any]


@dataclass(frozen=True)
class StructuredMemberSlice:
    """A slice ``[start:end:step]`` of one member along ``axis`` (only axis 0 is read)."""

    axis: int
    start: int
    end: int
    step: int = 1


@dataclass(frozen=True)
class StructuredObjectReadSpec:
    """Lazy read plan: which members to read and which slices to apply."""

    ref: RemoteBundleRef | Mapping[str, Any]
    member_names: tuple[str, ...] | None = None
    member_slices: tuple[tuple[str, StructuredMemberSlice], ...] = ()

    def select_members(self, names: Sequence[str] | None) -> StructuredObjectReadSpec:
        """A new spec that materializes only ``names`` (None: every member)."""
        return StructuredObjectReadSpec(
            ref=self.ref,
            member_names=None if names is None else tuple(names),
            member_slices=self.member_slices,
        )

    def slice_member(
        self, name: str, axis: int, start: int, end: int, step: int = 1
    ) -> StructuredObjectReadSpec:
        """A new spec with ``[start:end:step]`` along ``axis`` applied to member ``name``."""
        slices = dict(self.member_slices)
        slices[name] = StructuredMemberSlice(axis=axis, start=start, end=end, step=step)
        return StructuredObjectReadSpec(
            ref=self.ref, member_names=self.member_names, member_slices=tuple(slices.items())
        )

    def member_slice(self, name: str) -> StructuredMemberSlice | None:
        """The slice configured for ``name``, if any."""
        return dict(self.member_slices).get(name)


@dataclass(frozen=True)
class TensorObjectBuffer:
    """Caller memory holding (or receiving) a serialized tensor object: header then data."""

    ptr: int
    size: int
    owner: Any
    batch_size: int | None = None

    def __len__(self) -> int:
        if self.batch_size is None:
            raise StructuredTypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass(frozen=True)
class RawDestination:
    """Caller memory to read a member into (``pre_registered``: already registered)."""

    ptr: int
    size: int
    owner: Any
    pre_registered: bool = False


def tensor_object_buffer(
    ptr: int, size: int, owner: Any = None, batch_size: int | None = None
) -> TensorObjectBuffer:
    """Wrap caller memory that holds a serialized tensor object (see ``TensorObjectBuffer``)."""
    return TensorObjectBuffer(ptr=int(ptr), size=int(size), owner=owner, batch_size=batch_size)


def raw_destination(
    ptr: int, size: int, owner: Any = None, *, pre_registered: bool = False
) -> RawDestination:
    """Wrap caller memory as a read destination (see ``RawDestination``)."""
    return RawDestination(ptr=int(ptr), size=int(size), owner=owner, pre_registered=pre_registered)


# -- the transport handle ------------------------------------------------------------------------


def is_dataproto_ref_handle(value: Any) -> bool:
    """Whether ``value`` is an exported DataProto handle (a mapping of the handle type)."""
    return isinstance(value, Mapping) and value.get("type") == DATAPROTO_REF_HANDLE_TYPE


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    raise StructuredTypeError(
        f"DataProto ref handles support only JSON-safe values, got {type(value).__name__}"
    )


def export_dataproto_ref(ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """Export ``ref`` as a JSON-safe handle (``json.dumps`` works on the result)."""
    if not isinstance(ref, MooncakeDataProtoRef):
        raise StructuredTypeError(f"expected MooncakeDataProtoRef, got {type(ref).__name__}")
    handle: dict[str, Any] = {
        "type": DATAPROTO_REF_HANDLE_TYPE,
        "version": DATAPROTO_REF_HANDLE_VERSION,
        "kind": "bundle_stages",
        "batch_size": int(ref.batch_size),
        "namespace": ref.namespace,
        "partition": ref.partition,
        "global_indexes": _json_safe(ref.global_indexes),
        "stage_refs": {s: {"manifest_key": r.manifest_key} for s, r in ref.stage_refs.items()},
        "field_index": {
            name: {"stage": loc.stage, "member": loc.member, "section": loc.section}
            for name, loc in ref.field_index.items()
        },
        "meta_info": _json_safe(ref.meta_info),
        "encoded_non_tensor": _json_safe(ref.encoded_non_tensor),
    }
    if ref._storage_group_id is not None:
        handle[STORAGE_GROUP_ID] = ref._storage_group_id
    json.dumps(handle, ensure_ascii=False)
    return handle


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"DataProto ref handle {name} must be a mapping")
    return value


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _global_indexes(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidArgumentError("DataProto ref handle global_indexes must be a list or null")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise InvalidArgumentError("DataProto ref handle global_indexes must contain integers")
    return list(value)


def import_dataproto_ref(handle: Mapping[str, Any]) -> MooncakeDataProtoRef:
    """Import an exported handle (versions 1 and 2) into a lazy ref; ValueError if malformed."""
    if not is_dataproto_ref_handle(handle):
        raise InvalidArgumentError("not a Mooncake DataProto ref handle")
    version = int(handle.get("version", -1))
    if version not in (DATAPROTO_REF_HANDLE_VERSION, 2):
        raise InvalidArgumentError(
            f"unsupported DataProto ref handle version: {handle.get('version')!r}"
        )
    if handle.get("kind") != "bundle_stages":
        raise InvalidArgumentError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    stage_refs: dict[str, RemoteBundleRef] = {}
    for stage_name, raw in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(raw, f"stage_refs[{stage_name!r}]").get("manifest_key")
        if not _nonempty_str(stage_name) or not _nonempty_str(key):
            raise InvalidArgumentError(
                "DataProto ref handle stage refs must contain non-empty string names and "
                "manifest_key values"
            )
        stage_refs[stage_name] = RemoteBundleRef(manifest_key=str(key), manifest={})
    field_index: dict[str, StructuredFieldLocation] = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        loc = _mapping(raw, f"field_index[{name!r}]")
        section = loc.get("section")
        if section not in ("batch", "non_tensor_batch"):
            raise InvalidArgumentError(f"invalid DataProto field section: {section!r}")
        stage: Any = loc.get("stage")
        member: Any = loc.get("member")
        if not (_nonempty_str(name) and _nonempty_str(stage) and _nonempty_str(member)):
            raise InvalidArgumentError(
                "DataProto ref handle field locations must be non-empty strings"
            )
        if stage not in stage_refs:
            raise InvalidArgumentError(
                f"DataProto ref handle field {name!r} references unknown stage {stage!r}"
            )
        field_index[name] = StructuredFieldLocation(
            stage=str(stage), member=str(member), section=section
        )
    group_id = handle.get(STORAGE_GROUP_ID)
    if (version == 2 and group_id is None) or (
        group_id is not None and not _nonempty_str(group_id)
    ):
        raise InvalidArgumentError("DataProto ref handle has invalid storage_group_id")
    return MooncakeDataProtoRef(
        batch_size=int(handle["batch_size"]),
        stage_refs=stage_refs,
        field_index=field_index,
        meta_info=dict(_mapping(handle.get("meta_info", {}), "meta_info")),
        namespace=str(handle.get("namespace", "default")),
        partition=str(handle.get("partition", "default")),
        global_indexes=_global_indexes(handle.get("global_indexes")),
        encoded_non_tensor=dict(
            _mapping(handle.get("encoded_non_tensor", {}), "encoded_non_tensor")
        ),
        _storage_group_id=group_id,
    )


def resolve_dataproto_ref(ref: DataProtoRefLike) -> MooncakeDataProtoRef:
    """``ref`` itself, or the ref an exported handle describes."""
    if isinstance(ref, MooncakeDataProtoRef):
        return ref
    if is_dataproto_ref_handle(ref):
        return import_dataproto_ref(ref)
    raise StructuredTypeError(
        f"expected MooncakeDataProtoRef or DataProto handle, got {type(ref).__name__}"
    )
