"""The published ``mooncake.structured_object_store``: DataProto-like bundles over a store.

``MooncakeBundleTransfer(store, key_prefix="bundle", default_chunk_bytes=64 MiB,
buffer_pool=None)`` stores structured objects (JSON metadata plus named tensor, array and bytes
members) and DataProto-like values (``batch`` tensors, ``non_tensor_batch`` columns,
``meta_info``) in a ``MooncakeDistributedStore``, and hands back refs that export to JSON
(``export_ref``/``import_ref``) so another process can read them lazily: selected fields,
slices or rows.

The keys, manifests, tensor objects and column codecs are the published module's, so a
published client reads what this one wrote and the other way round. Every payload of a put is
written by one batched multi-buffer call straight from the tensors and arrays given; every
member of a read lands by one batched call straight in the tensors and arrays returned.

Nested (jagged) tensor members are stored in the published ``tensor_parts`` format
(:mod:`mooncake._structured.nested`). What is not here (raises ``NotSupportedError`` by name):
PIL images in media lists (``media_list_ragged`` is written only for bytes items inside nested
columns; a flat column of media lists gets ``msgpack_ragged``/``json_ragged``).
``BundleTransferPolicy`` is validated; on a store with the multi-buffer calls a put is one batch
(``max_inflight_put`` and ``put_mode`` matter only to the pooled writes below; ``copy_mode="zero_copy"`` admits tensor-object buffers only,
see :mod:`mooncake._structured.policy`); ``buffer_pool`` stages the writes of a store without
the multi-buffer calls (one ``batch_put_from`` per key from a lease, as published) and is
otherwise unused.

The published codec-inference helpers are here under their published names (``MISSING``,
``infer_structure``, ``_choose_leaf_codec``, ``_escape_key``, ``_CodecDecision``,
``_InferredLeaf``, ``_InferredNode``, ``_Missing``, ``_structured_path_tokens``); see
:mod:`mooncake._structured.inference` for how they relate to the column writer. So are the
published payload members and codec helpers (``_MultiBufferPayload``, ``_DirectCopyPayload``,
``_encode_typed_ragged_values`` ... :mod:`mooncake._structured.payloads`), ``_bundle_store``
(:mod:`mooncake._structured.bundle_store`) and ``_has_tensor_codec_helpers`` (replaced by a
function answering False, tensors are stored as ``torch_save`` blobs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from mooncake._fast_copy import concat_arrays_into
from mooncake._structured import codecs
from mooncake._structured.bundle_store import BundleManifestStore
from mooncake._structured.bundles import (
    ManifestStore,
    _bytes_source,
    check_chunk_bytes,
    decode_json,
    has_tensor_codec_helpers,
    normalize_key_prefix,
)
from mooncake._structured.dataproto import (
    build_result,
    check_schema_sections,
    config_with_group,
    envelope_to_flat_dict,
    flat_dict_to_envelope,
    new_group_id,
    schema_for,
    select_fields,
    select_rows,
    split_dataproto,
)
from mooncake._structured.inference import (
    MISSING,
    CodecDecision,
    InferredLeaf,
    InferredNode,
    Missing,
    choose_leaf_codec,
    escape_key,
    infer_structure,
    path_tokens,
)
from mooncake._structured.io import Part, grouped_config, remove_keys
from mooncake._structured.layer import StructuredLayer
from mooncake._structured.model import (
    AUTO_PARALLEL_MIN_BYTES,
    DATAPROTO_REF_HANDLE_TYPE,
    DATAPROTO_REF_HANDLE_VERSION,
    DEFAULT_BUNDLE_CHUNK_BYTES,
    MISSING_OBJECT_ERROR,
    STORAGE_GROUP_ID,
    STRUCTURED_FIELD_SPECS_KEY,
    BundleTransferPolicy,
    DataProtoRefLike,
    FieldSchema,
    MooncakeDataProtoRef,
    RemoteBundleRef,
    StructuredFieldLocation,
    StructuredMemberSlice,
    StructuredObjectPayload,
    StructuredObjectReadSpec,
    StructuredObjectResult,
    TensorObjectBuffer,
    export_dataproto_ref,
    import_dataproto_ref,
    is_dataproto_ref_handle,
    raw_destination,
    resolve_dataproto_ref,
    tensor_object_buffer,
)
from mooncake._structured.payloads import (
    DirectCopyPayload,
    MultiBufferPayload,
    decode_typed_ragged_values,
    encode_typed_ragged_regular_ndarray_rows,
    encode_typed_ragged_values,
)
from mooncake._structured.policy import check_policy, check_zero_copy
from mooncake._structured.reads import read_fields
from mooncake.errors import InvalidArgumentError, NotSupportedError

__all__ = [
    "AUTO_PARALLEL_MIN_BYTES",
    "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION",
    "DEFAULT_BUNDLE_CHUNK_BYTES",
    "MISSING",
    "MISSING_OBJECT_ERROR",
    "STORAGE_GROUP_ID",
    "STRUCTURED_FIELD_SPECS_KEY",
    "BundleStore",
    "BundleTransferPolicy",
    "DataProtoRefLike",
    "FieldSchema",
    "MooncakeBundleTransfer",
    "MooncakeDataProtoRef",
    "RemoteBundleRef",
    "StructuredFieldLocation",
    "StructuredMemberSlice",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "export_dataproto_ref",
    "export_ref",
    "import_dataproto_ref",
    "import_ref",
    "infer_structure",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
]

export_ref = export_dataproto_ref
import_ref = import_dataproto_ref

# the published module's codec-inference names (mooncake._structured.inference)
_CodecDecision = CodecDecision
_InferredLeaf = InferredLeaf
_InferredNode = InferredNode
_Missing = Missing
_choose_leaf_codec = choose_leaf_codec
_escape_key = escape_key
_structured_path_tokens = path_tokens
# the published module's payload members and codec helpers (mooncake._structured.payloads,
# mooncake._structured.codecs): same arguments and results, on this package's codecs
_MultiBufferPayload = MultiBufferPayload
_DirectCopyPayload = DirectCopyPayload
_encode_typed_ragged_values = encode_typed_ragged_values
_encode_typed_ragged_regular_ndarray_rows = encode_typed_ragged_regular_ndarray_rows
_decode_typed_ragged_values = decode_typed_ragged_values
_encode_msgpack_ragged_values = codecs.encode_msgpack_ragged_values
_decode_msgpack_ragged_values = codecs.decode_msgpack_ragged_values
_encode_with_schema = codecs.encode_schema_leaf
_config_for_grouped_keys = grouped_config
_concat_arrays_into = concat_arrays_into
_has_tensor_codec_helpers = has_tensor_codec_helpers


def _decode_manifest(payload: bytes) -> dict[str, Any]:
    """A stored bundle manifest's JSON (the published module's name); ``ValueError`` for
    bytes that are not a JSON object."""
    return decode_json(payload, "bundle manifest")


class BundleStore(Protocol):
    """What a store must offer (``MooncakeDistributedStore`` offers it and the batch calls)."""

    def put(self, key: str, value: Any, config: Any = None) -> int: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, key: str, force: bool = False) -> int: ...

    def is_exist(self, key: str) -> int: ...


class MooncakeBundleTransfer:
    """Structured objects and DataProto-like bundles through Mooncake (see the module doc)."""

    def __init__(
        self,
        store: BundleStore,
        key_prefix: str = "bundle",
        default_chunk_bytes: int = DEFAULT_BUNDLE_CHUNK_BYTES,
        buffer_pool: Any = None,
    ) -> None:
        self.store = store
        self.key_prefix = normalize_key_prefix(key_prefix)
        self.default_chunk_bytes = check_chunk_bytes(default_chunk_bytes)
        self.buffer_pool = buffer_pool
        self._bundles = ManifestStore(store, self.key_prefix, self.default_chunk_bytes, buffer_pool)
        self._structured = StructuredLayer(self._bundles)
        # the published module-level switch, read at each put
        self._bundles.tensor_codec = lambda: _has_tensor_codec_helpers()
        #: the published ``_bundle_store`` calls (mooncake._structured.bundle_store)
        self._bundle_store = BundleManifestStore(self._bundles)
        #: the published ``_transport``'s put-mode choice (``_resolve_buffer_group_put_mode``)
        self._transport = self._bundles.io

    # -- bundles and structured objects ----------------------------------------------------------

    def put_bundle(
        self,
        meta: bytes | bytearray | memoryview,
        buffers: Mapping[str, Any],
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store raw ``meta`` bytes plus named bytes-like buffers as a low-level bundle."""
        policy = check_policy(policy, max_inflight_put)
        check_zero_copy(policy, buffers)
        sources = {}
        for name, value in buffers.items():
            if isinstance(value, TensorObjectBuffer):
                sources[name] = _bytes_source(b"", name)
                sources[name].parts = [Part(value.ptr, value.size, value.owner)]
                sources[name].chunked = False
            else:
                sources[name] = _bytes_source(value, name)
        return self._bundles.put_bundle(
            meta,
            sources,
            partition=partition,
            chunk_bytes=chunk_bytes,
            config=config,
            policy=policy,
        )

    def remove_bundle(self, ref: RemoteBundleRef | Mapping[str, Any]) -> None:
        """Remove every Mooncake object of a stored bundle (a missing bundle is fine)."""
        self._bundles.remove(ref)

    def put_structured_object(
        self,
        payload: StructuredObjectPayload,
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store JSON metadata plus named members (tensors, ndarrays, bytes-like)."""
        policy = check_policy(policy, max_inflight_put)
        check_zero_copy(policy, payload.buffers)
        return self._structured.put(
            payload, partition=partition, chunk_bytes=chunk_bytes, config=config, policy=policy
        )

    def put_object(
        self,
        obj: Any,
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store a mapping of members, or one tensor/array value (read back by get_object)."""
        if isinstance(obj, Mapping):
            payload = StructuredObjectPayload(metadata={}, buffers=obj)
        else:
            payload = StructuredObjectPayload(
                metadata={"__mooncake_wrapped_object__": True}, buffers={"value": obj}
            )
        return self.put_structured_object(
            payload, partition, chunk_bytes, policy, max_inflight_put, config
        )

    def get_object(self, ref: RemoteBundleRef | Mapping[str, Any]) -> Any:
        """The object stored by put_object: the mapping of members, or the single value."""
        result = self.materialize(self.read_spec(ref))
        if result.metadata.get("__mooncake_wrapped_object__"):
            return result.objects["value"]
        return result.objects

    def read_spec(self, ref: RemoteBundleRef | Mapping[str, Any]) -> StructuredObjectReadSpec:
        """A lazy read spec over every member of ``ref``."""
        return StructuredObjectReadSpec(ref=ref)

    def materialize(self, spec: StructuredObjectReadSpec) -> StructuredObjectResult:
        """Read the members ``spec`` selects (with its slices)."""
        return self._structured.materialize(spec)

    def materialize_into(
        self, spec: StructuredObjectReadSpec, destinations: Mapping[str, Any] | None
    ) -> StructuredObjectResult:
        """As materialize, reading members into caller destinations (ndarrays,
        ``raw_destination`` or ``tensor_object_buffer``) where given."""
        return self._structured.materialize(spec, destinations)

    @staticmethod
    def release_result(result: Any) -> None:
        """Release pool-backed buffers in a result. Results here own plain memory (numpy
        arrays and tensors), so this only releases objects carrying a pool owner."""
        seen: set[int] = set()

        def visit(value: Any) -> None:
            owner = getattr(value, "_mooncake_pool_owner", None)
            if owner is not None:
                if id(owner) not in seen:
                    seen.add(id(owner))
                    owner.release()
                return
            if id(value) in seen:
                return
            if isinstance(value, Mapping):
                items: Any = value.values()
            elif hasattr(value, "batch") and hasattr(value, "non_tensor_batch"):
                items = (value.batch, value.non_tensor_batch, getattr(value, "meta_info", None))
            elif isinstance(value, (list, tuple)) or (
                isinstance(value, np.ndarray) and value.dtype == object
            ):
                items = value.flat if isinstance(value, np.ndarray) else value
            else:
                return
            seen.add(id(value))
            for item in items:
                visit(item)

        visit(result)

    # -- DataProto -------------------------------------------------------------------------------

    def put(
        self,
        data: Any,
        *,
        type: Literal["dataproto", "dict"] = "dataproto",
        namespace: str = "default",
        partition: str = "default",
        stage: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        config: Any = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
    ) -> MooncakeDataProtoRef:
        """Store a DataProto-like value (``type="dataproto"``) or a flat dict as one stage."""
        if type == "dataproto":
            stage_data = data
        elif type == "dict":
            stage_data = flat_dict_to_envelope(data, field_schemas)
        else:
            raise InvalidArgumentError(f"unsupported Mooncake payload type: {type!r}")
        return self._put_stage(
            None,
            stage_data,
            namespace=namespace,
            partition=partition,
            stage=stage,
            chunk_bytes=chunk_bytes,
            policy=policy,
            overwrite=False,
            config=config,
            field_schemas=field_schemas,
        )

    def get(
        self,
        ref: DataProtoRefLike,
        *,
        type: Literal["dataproto", "dict"] = "dataproto",
        fields: Sequence[str] | None = None,
        batch_fields: Sequence[str] | None = None,
        non_tensor_fields: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        data_cls: Any = None,
        destinations: Mapping[str, Any] | None = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """Read a DataProto-like value (an envelope dict, or ``data_cls``) or a flat dict."""
        if type not in ("dataproto", "dict"):
            raise InvalidArgumentError(f"unsupported Mooncake payload type: {type!r}")
        flat = type == "dict"
        result = self._get(
            ref,
            fields,
            batch_fields,
            non_tensor_fields,
            meta_info_keys,
            dict if flat else data_cls,
            destinations,
            rows,
            flat,
        )
        return envelope_to_flat_dict(result) if flat else result

    def put_dataproto(
        self,
        data: Any,
        *,
        namespace: str = "default",
        partition: str = "default",
        stage: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
        config: Any = None,
    ) -> MooncakeDataProtoRef:
        """Store a DataProto-like value as one stage (see put)."""
        return self.put(
            data,
            type="dataproto",
            namespace=namespace,
            partition=partition,
            stage=stage,
            chunk_bytes=chunk_bytes,
            policy=policy,
            field_schemas=field_schemas,
            config=config,
        )

    def append_dataproto_fields(
        self,
        ref: DataProtoRefLike,
        data: Any,
        *,
        stage: str,
        overwrite: bool = False,
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
        config: Any = None,
    ) -> MooncakeDataProtoRef:
        """A new ref with ``data``'s fields added in ``stage`` (the old ref stays readable).
        Existing fields are refused unless ``overwrite``, which replaces the whole stage."""
        old = resolve_dataproto_ref(ref)
        return self._put_stage(
            old,
            data,
            namespace=old.namespace,
            partition=old.partition,
            stage=stage,
            chunk_bytes=chunk_bytes,
            policy=policy,
            overwrite=overwrite,
            field_schemas=field_schemas,
            config=config,
        )

    def dataproto_manifest_view(self, ref: DataProtoRefLike) -> dict[str, Any]:
        """Fields, sections, member specs and stages of a DataProto ref, from its manifests."""
        ref = resolve_dataproto_ref(ref)
        metas = {
            stage: self._structured.metadata(self._bundles.resolve(sref))
            for stage, sref in ref.stage_refs.items()
        }
        fields: dict[str, dict[str, Any]] = {}
        for name, loc in ref.field_index.items():
            specs = metas[loc.stage].get(STRUCTURED_FIELD_SPECS_KEY, {})
            spec = dict(specs.get(loc.member, {"encoding": "bytes"}))
            enc = ref.encoded_non_tensor.get(name)
            if enc is not None:
                spec = {
                    "encoding": "structured_non_tensor",
                    "codec": enc["codec"],
                    "metadata": enc.get("metadata"),
                    "payload_members": dict(enc["payload_members"]),
                    "payload_specs": {
                        p: dict(specs.get(m, {"encoding": "bytes"}))
                        for p, m in enc["payload_members"].items()
                    },
                }
            fields[name] = {
                "section": loc.section,
                "stage": loc.stage,
                "member": loc.member,
                "spec": spec,
            }
        return {
            "namespace": ref.namespace,
            "partition": ref.partition,
            "batch_size": ref.batch_size,
            "batch_fields": {n: i for n, i in fields.items() if i["section"] == "batch"},
            "non_tensor_fields": {
                n: i for n, i in fields.items() if i["section"] == "non_tensor_batch"
            },
            "meta_info_keys": list(ref.meta_info),
            "stages": {
                stage: {
                    "manifest_key": sref.manifest_key,
                    "dataproto": metas[stage].get("dataproto", {}),
                }
                for stage, sref in ref.stage_refs.items()
            },
        }

    def get_dataproto(
        self,
        ref: DataProtoRefLike,
        *,
        fields: Sequence[str] | None = None,
        batch_fields: Sequence[str] | None = None,
        non_tensor_fields: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        data_cls: Any = None,
        destinations: Mapping[str, Any] | None = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """Read selected DataProto fields (see get)."""
        return self._get(
            ref,
            fields,
            batch_fields,
            non_tensor_fields,
            meta_info_keys,
            data_cls,
            destinations,
            rows,
            False,
        )

    def cleanup_dataproto(self, ref: DataProtoRefLike) -> None:
        """Remove every stage object a DataProto ref points at."""
        ref = resolve_dataproto_ref(ref)
        seen: set[str] = set()
        for sref in ref.stage_refs.values():
            if sref.manifest_key not in seen:
                seen.add(sref.manifest_key)
                self.remove_bundle(sref)

    def cleanup_dataproto_append(
        self, previous: DataProtoRefLike, appended: DataProtoRefLike
    ) -> None:
        """Remove what an unpublished append added, leaving ``previous`` readable."""
        prev = resolve_dataproto_ref(previous)
        new = resolve_dataproto_ref(appended)
        for stage, sref in new.stage_refs.items():
            old = prev.stage_refs.get(stage)
            if old is None:
                self.remove_bundle(sref)
                continue
            if sref.manifest_key == old.manifest_key:
                continue
            is_exist = getattr(self.store, "is_exist", None)
            if callable(is_exist) and is_exist(sref.manifest_key) == 0:
                continue
            manifest = self._bundles.resolve(sref)
            old_names = {loc.member for loc in prev.field_index.values() if loc.stage == stage}
            for name, enc in prev.encoded_non_tensor.items():
                if prev.field_index[name].stage == stage:
                    old_names.update(enc["payload_members"].values())
            added = [spec for name, spec in manifest["buffers"].items() if name not in old_names]
            ids = {self._bundles.object_id_of(spec["key"]) for spec in added}
            keys = [c["key"] for c in manifest["meta"]["chunks"]]
            keys += [c["key"] for spec in added for c in spec["chunks"]]
            keys += [
                k for k in manifest.get("cleanup_keys", []) if self._bundles.object_id_of(k) in ids
            ]
            remove_keys(self.store, keys, strict=True)
            remove_keys(self.store, [sref.manifest_key], strict=True)

    # -- DataProto internals -----------------------------------------------------------------------

    def _put_stage(
        self,
        ref: MooncakeDataProtoRef | None,
        data: Any,
        *,
        namespace: str,
        partition: str,
        stage: str,
        chunk_bytes: int | None,
        policy: BundleTransferPolicy | None,
        overwrite: bool,
        field_schemas: Mapping[str, FieldSchema] | None = None,
        config: Any = None,
    ) -> MooncakeDataProtoRef:
        effective_policy = check_policy(policy)
        batch, non_tensor, meta_info = split_dataproto(data)
        check_schema_sections(batch, non_tensor, meta_info, field_schemas)
        from mooncake._structured.dataproto import batch_size as _batch_size

        size = _batch_size(batch, non_tensor)
        if ref is not None and size != ref.batch_size:
            raise InvalidArgumentError(
                f"DataProto append batch size {size} does not match ref batch size {ref.batch_size}"
            )
        overlap = sorted(set(batch) & set(non_tensor))
        if overlap:
            raise InvalidArgumentError(
                f"DataProto batch and non_tensor_batch fields overlap: {overlap}"
            )
        buffers: dict[str, Any] = {}
        updates: dict[str, StructuredFieldLocation] = {}
        encoded_updates: dict[str, Any] = {}
        for name, value in batch.items():
            buffers[f"batch.{name}"] = value
            updates[name] = StructuredFieldLocation(stage, f"batch.{name}", "batch")
        for name, value in non_tensor.items():
            member = f"non_tensor_batch.{name}"
            schema = schema_for(field_schemas, name, "non_tensor_batch")
            col: codecs.EncodedColumn | None = None
            if schema is not None:
                try:
                    col = codecs.encode_with_schema(member, value, schema)
                except (
                    TypeError,
                    ValueError,
                    RuntimeError,
                    AttributeError,
                    NotSupportedError,
                ) as e:
                    raise type(e)(
                        f"failed to encode non_tensor_batch field {name!r} with FieldSchema codec "
                        f"{schema.codec!r}: {e}"
                    ) from e
            elif isinstance(value, np.ndarray) and value.dtype == object:
                col = codecs.encode_column(member, value)
            updates[name] = StructuredFieldLocation(stage, member, "non_tensor_batch")
            if col is None:
                buffers[member] = value
                continue
            members: dict[str, str] = {}
            for pname, pvalue in col.payload.items():
                buffers[f"{member}.{pname}"] = pvalue
                members[pname] = f"{member}.{pname}"
            encoded_updates[name] = {
                "codec": col.codec,
                "rows": col.rows,
                "metadata": col.metadata,
                "payload_members": members,
            }
        if not buffers:
            if ref is not None:
                return MooncakeDataProtoRef(
                    batch_size=ref.batch_size,
                    stage_refs=dict(ref.stage_refs),
                    field_index=dict(ref.field_index),
                    meta_info={**ref.meta_info, **meta_info},
                    namespace=ref.namespace,
                    partition=ref.partition,
                    global_indexes=ref.global_indexes,
                    encoded_non_tensor=dict(ref.encoded_non_tensor),
                    _storage_group_id=ref._storage_group_id,
                )
            return MooncakeDataProtoRef(
                batch_size=size,
                stage_refs={},
                field_index={},
                meta_info=dict(meta_info),
                namespace=namespace,
                partition=partition,
                encoded_non_tensor={},
                _storage_group_id=new_group_id(config),
            )
        if ref is not None:
            dup = sorted(set(ref.field_index) & set(updates))
            if dup and not overwrite:
                raise InvalidArgumentError(f"DataProto fields already exist: {dup}")
            if overwrite:
                dangling = sorted(
                    n
                    for n, loc in ref.field_index.items()
                    if loc.stage == stage and n not in updates
                )
                if dangling:
                    raise InvalidArgumentError(
                        f"DataProto overwrite for stage {stage!r} must include existing fields: {dangling}"
                    )
        group = new_group_id(config) if ref is None else ref._storage_group_id
        effective = config if group is None else config_with_group(config, group)
        payload = StructuredObjectPayload(
            metadata={
                "layout": "dataproto_stage",
                "dataproto": {
                    "version": 1,
                    "namespace": namespace,
                    "partition": partition,
                    "stage": stage,
                    "batch_size": size,
                },
            },
            buffers=buffers,
        )
        check_zero_copy(effective_policy, buffers)
        existing = ref.stage_refs.get(stage) if ref is not None else None
        stage_ref = self._structured.put(
            payload,
            partition=partition,
            chunk_bytes=chunk_bytes,
            config=effective,
            merge_into=existing if existing is not None and not overwrite else None,
            policy=effective_policy,
        )
        if existing is not None and overwrite and existing.manifest_key != stage_ref.manifest_key:
            self.remove_bundle(existing)
        if ref is None:
            return MooncakeDataProtoRef(
                batch_size=size,
                stage_refs={stage: stage_ref},
                field_index=dict(updates),
                meta_info=dict(meta_info),
                namespace=namespace,
                partition=partition,
                global_indexes=None,
                encoded_non_tensor=dict(encoded_updates),
                _storage_group_id=group,
            )
        encoded = {n: e for n, e in ref.encoded_non_tensor.items() if n not in updates}
        encoded.update(encoded_updates)
        return MooncakeDataProtoRef(
            batch_size=size,
            stage_refs={**ref.stage_refs, stage: stage_ref},
            field_index={**ref.field_index, **updates},
            meta_info={**ref.meta_info, **meta_info},
            namespace=namespace,
            partition=partition,
            global_indexes=ref.global_indexes,
            encoded_non_tensor=encoded,
            _storage_group_id=group,
        )

    def _get(
        self,
        ref_like: DataProtoRefLike,
        fields: Sequence[str] | None,
        batch_fields: Sequence[str] | None,
        non_tensor_fields: Sequence[str] | None,
        meta_info_keys: Sequence[str] | None,
        data_cls: Any,
        destinations: Mapping[str, Any] | None,
        rows: Any,
        flat: bool,
    ) -> Any:
        ref = resolve_dataproto_ref(ref_like)
        sel = select_rows(rows, ref.batch_size)
        batch_names, nt_names = select_fields(ref, fields, batch_fields, non_tensor_fields)
        values = read_fields(
            self._structured, ref, sel, batch_names, nt_names, destinations or {}, flat=flat
        )
        meta = (
            dict(ref.meta_info)
            if meta_info_keys is None
            else {k: ref.meta_info[k] for k in meta_info_keys if k in ref.meta_info}
        )
        return build_result(
            {n: values[n] for n in batch_names}, {n: values[n] for n in nt_names}, meta, data_cls
        )
