"""Bundles on the store: a JSON manifest naming the payload keys of a metadata blob and of
named members, and the structured-object layer that types those members.

Key layout (shared with the published module, so either side reads what the other wrote)::

    PREFIX/PARTITION/OBJECT_ID/manifest           JSON manifest
    PREFIX/PARTITION/OBJECT_ID/meta[/chunk/I]     JSON structured metadata
    PREFIX/PARTITION/OBJECT_ID/buffer/NAME[/chunk/I]

A payload larger than ``chunk_bytes`` is split over ``/chunk/I`` keys. A tensor member is one
key holding the 304-byte tensor header then the data (``"kind": "tensor"``: what
``put_tensor``/``get_tensor`` store). Every payload of a bundle is written with one batched
multi-buffer put straight from the caller's memory, and every member of a read with one batched
multi-buffer get straight into the arrays and tensors returned (:mod:`.io`).
"""

from __future__ import annotations

import ctypes
import io
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake._structured.codecs import BytesParts
from mooncake._structured.io import BatchIO, Part, buffer_address, grouped_config, remove_keys
from mooncake._structured.model import (
    STRUCTURED_FIELD_SPECS_KEY,
    RawDestination,
    RemoteBundleRef,
    StructuredKeyError,
    StructuredMemberSlice,
    StructuredObjectError,
    StructuredObjectPayload,
    StructuredObjectReadSpec,
    StructuredObjectResult,
    StructuredTypeError,
    TensorObjectBuffer,
    optional_module,
)
from mooncake._structured.nested import decode_nested, encode_nested, select_nested_rows
from mooncake.errors import InvalidArgumentError, NotSupportedError

_torch: Any = optional_module("torch")

__all__ = ["ManifestStore", "StructuredLayer", "normalize_key_prefix"]

_HEADER_BYTES = 304


def normalize_key_prefix(key_prefix: str) -> str:
    """``key_prefix`` without surrounding slashes; ValueError if empty or with control chars."""
    prefix = key_prefix.strip("/")
    if not prefix or any(ord(c) < 32 for c in prefix):
        raise InvalidArgumentError("key_prefix must be a non-empty key prefix")
    return prefix


def check_key_segment(value: Any, name: str) -> None:
    """A key segment is a non-empty string without ``/`` or control characters."""
    if not isinstance(value, str) or not value or "/" in value or any(ord(c) < 32 for c in value):
        raise InvalidArgumentError(f"invalid bundle {name}: {value!r}")


def check_chunk_bytes(chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise InvalidArgumentError("chunk_bytes must be positive")
    return chunk_bytes


def encode_json(value: Mapping[str, Any], label: str) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except TypeError as e:
        raise StructuredTypeError(f"{label} must be JSON-serializable") from e


def decode_json(payload: bytes, label: str) -> dict[str, Any]:
    try:
        value = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgumentError(f"{label} is not valid JSON ({len(payload)} bytes)") from e
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{label} must decode to a dict")
    return value


# -- payload sources: what one member writes -------------------------------------------------


class _Source:
    """A member's byte stream as parts, and the payload-spec extras it records."""

    def __init__(
        self, parts: list[Part], extra: dict[str, Any] | None = None, chunked: bool = True
    ) -> None:
        self.parts = parts
        self.extra = extra or {}
        self.chunked = chunked

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.parts)


def _bytes_source(value: Any, name: str) -> _Source:
    try:
        ptr, n, owner = buffer_address(value)
    except TypeError as e:
        raise StructuredTypeError(f"{name} must be bytes-like, got {type(value).__name__}") from e
    return _Source([Part(ptr, n, owner)] if n else [])


def _tensor_helpers() -> tuple[Any, Any]:
    from mooncake.store import _deserialize_tensor, _serialize_tensor

    return _serialize_tensor, _deserialize_tensor


def encode_member(name: str, value: Any) -> tuple[dict[str, Any], _Source]:
    """The field spec and payload source of one structured member."""
    if isinstance(value, TensorObjectBuffer):
        return {"encoding": "torch_tensor"}, _Source(
            [Part(value.ptr, value.size, value.owner)], chunked=False
        )
    if _torch is not None and isinstance(value, _torch.Tensor):
        if value.is_nested:
            nspec, tensor_parts = encode_nested(name, value)
            nparts: list[Part] = []
            for header, ptr, n, owner in tensor_parts:
                head = np.frombuffer(bytes(header), dtype=np.uint8)
                nparts.append(Part(int(head.ctypes.data), len(header), head))
                if n:
                    nparts.append(Part(int(ptr), int(n), owner))
            return nspec, _Source(nparts)
        spec = {
            "encoding": "torch_tensor",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "element_size": int(value.element_size()),
        }
        if value.dim() == 0:
            buf = io.BytesIO()
            _torch.save(value.detach().cpu(), buf)
            src = _bytes_source(buf.getvalue(), name)
            src.extra = {"format": "torch_save"}
            src.chunked = False
            return spec, src
        serialize, _ = _tensor_helpers()
        header, ptr, n, owner = serialize(value)
        head = np.frombuffer(bytes(header), dtype=np.uint8)
        parts = [Part(int(head.ctypes.data), len(header), head)]
        if n:
            parts.append(Part(int(ptr), int(n), owner))
        extra = {
            "kind": "tensor",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "metadata_bytes": len(header),
        }
        return spec, _Source(parts, extra, chunked=False)
    if isinstance(value, BytesParts):
        parts = []
        for p in value.parts:
            ptr, n, owner = buffer_address(p)
            if n:
                parts.append(Part(ptr, n, owner))
        if value.dtype is not None and value.shape is not None:
            return {
                "encoding": "ndarray",
                "dtype": value.dtype,
                "shape": list(value.shape),
            }, _Source(parts)
        return {"encoding": "bytes"}, _Source(parts)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise StructuredTypeError(f"{name} must be bytes-like, got an object ndarray")
        array = np.asarray(value, order="C")  # 0-d stays 0-d
        spec = {"encoding": "ndarray", "dtype": array.dtype.str, "shape": list(array.shape)}
        return spec, _Source(
            [Part(int(array.ctypes.data), int(array.nbytes), array)] if array.nbytes else []
        )
    return {"encoding": "bytes"}, _bytes_source(value, name)


def _split(parts: Sequence[Part], chunk_bytes: int) -> list[list[Part]]:
    """``parts`` regrouped into consecutive chunks of ``chunk_bytes`` (the last one shorter)."""
    groups: list[list[Part]] = []
    current: list[Part] = []
    room = chunk_bytes
    for p in parts:
        offset = 0
        while offset < p.size:
            n = min(room, p.size - offset)
            current.append(Part(p.ptr + offset, n, p.owner))
            offset += n
            room -= n
            if room == 0:
                groups.append(current)
                current, room = [], chunk_bytes
    if current:
        groups.append(current)
    return groups


def _scatter(
    chunks: Sequence[Mapping[str, Any]], parts: Sequence[Part]
) -> list[tuple[str, list[Part]]]:
    """The destination parts of each chunk key, cutting ``parts`` at the chunk boundaries."""
    sizes = [int(c["bytes"]) for c in chunks]
    out: list[tuple[str, list[Part]]] = []
    queue = list(parts)
    i = 0
    for chunk, size in zip(chunks, sizes, strict=True):
        mine: list[Part] = []
        need = size
        while need and i < len(queue):
            p = queue[i]
            n = min(need, p.size)
            mine.append(Part(p.ptr, n, p.owner))
            need -= n
            if n == p.size:
                i += 1
            else:
                queue[i] = Part(p.ptr + n, p.size - n, p.owner)
        if need:
            raise StructuredObjectError(f"destination too small for {chunk['key']}")
        out.append((str(chunk["key"]), mine))
    return out


def fragments(
    chunks: Sequence[Mapping[str, Any]], offset: int, length: int, dst_offset: int = 0
) -> list[tuple[str, int, int, int]]:
    """``(key, src_offset, dst_offset, size)`` pieces of the byte range ``[offset, +length)``."""
    out = []
    end = offset + length
    pos = 0
    for chunk in chunks:
        size = int(chunk["bytes"])
        lo, hi = max(offset, pos), min(end, pos + size)
        if lo < hi:
            out.append((str(chunk["key"]), lo - pos, dst_offset + lo - offset, hi - lo))
        pos += size
    return out


class ManifestStore:
    """Manifests and payload keys of bundles under one key prefix."""

    def __init__(self, store: Any, key_prefix: str, default_chunk_bytes: int) -> None:
        self.store = store
        self.io = BatchIO(store)
        self.key_prefix = key_prefix
        self.default_chunk_bytes = default_chunk_bytes

    # -- writes --------------------------------------------------------------------------------

    def put_bundle(
        self,
        meta: Any,
        members: Mapping[str, _Source],
        *,
        partition: str,
        chunk_bytes: int | None,
        config: Any = None,
        reuse_buffers: Mapping[str, Any] | None = None,
        cleanup_keys: Sequence[str] | None = None,
    ) -> RemoteBundleRef:
        """Write ``meta`` and every member with one batched put, then the manifest. On failure
        nothing of this bundle is left behind. ``reuse_buffers`` adds payload specs of members
        already stored (a merged manifest); ``cleanup_keys`` are removed with the bundle."""
        check_key_segment(partition, "partition")
        chunk = check_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        object_id = f"{partition}/{uuid.uuid4().hex}"
        base = f"{self.key_prefix}/{object_id}"
        writes: list[tuple[str, list[Part]]] = []

        def add(key: str, src: _Source) -> dict[str, Any]:
            total = src.nbytes
            if total == 0:
                return {"key": key, "bytes": 0, "chunks": [], **src.extra}
            groups = _split(src.parts, chunk) if src.chunked else [list(src.parts)]
            keys = [key] if len(groups) == 1 else [f"{key}/chunk/{i}" for i in range(len(groups))]
            writes.extend(zip(keys, groups, strict=True))
            spec = {
                "key": key,
                "bytes": total,
                "chunks": [
                    {"key": k, "bytes": sum(p.size for p in g)}
                    for k, g in zip(keys, groups, strict=True)
                ],
            }
            spec.update(src.extra)
            return spec

        meta_spec = add(f"{base}/meta", _bytes_source(meta, "meta"))
        specs: dict[str, Any] = {}
        for name, src in members.items():
            check_key_segment(name, "buffer name")
            specs[name] = add(f"{base}/buffer/{name}", src)
        manifest: dict[str, Any] = {
            "version": 1,
            "layout": "bundle",
            "object_id": object_id,
            "meta": meta_spec,
            "buffers": specs,
        }
        if reuse_buffers is not None:
            merged = dict(reuse_buffers)
            collisions = sorted(set(merged) & set(specs))
            if collisions:
                raise InvalidArgumentError(f"structured members already exist: {collisions}")
            merged.update(specs)
            manifest["buffers"] = merged
            ids = {self.object_id_of(str(s["key"])) for s in merged.values()}
            ids.update(self.object_id_of(k) for k in cleanup_keys or [])
            ids.add(object_id)
            manifest["buffer_object_ids"] = sorted(i for i in ids if i)
            if cleanup_keys:
                manifest["cleanup_keys"] = list(dict.fromkeys(cleanup_keys))
        manifest_key = f"{base}/manifest"
        written = [k for k, _ in writes]
        self.io.put_many(writes, config)
        try:
            code = _put(self.store, manifest_key, encode_json(manifest, "bundle manifest"), config)
            if code not in (None, 0):
                raise StructuredObjectError(f"put failed for {manifest_key}: {code}")
        except BaseException:
            remove_keys(self.store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key=manifest_key, manifest=manifest)

    # -- manifests -----------------------------------------------------------------------------

    def resolve(self, ref: RemoteBundleRef | Mapping[str, Any]) -> dict[str, Any]:
        """The (validated) manifest of ``ref``, read from the store unless ``ref`` carries it."""
        manifest: Any
        if isinstance(ref, RemoteBundleRef):
            manifest = ref.manifest or self._read_manifest(ref.manifest_key)
        else:
            manifest = ref.get("manifest")
            if manifest is None:
                key = ref.get("manifest_key")
                if not isinstance(key, str):
                    raise InvalidArgumentError("bundle ref must include manifest_key")
                manifest = self._read_manifest(key)
        self.validate(manifest)
        return dict(manifest)

    def _read_manifest(self, key: str) -> dict[str, Any]:
        data = self.store.get(key)
        if not data:
            raise StructuredKeyError(f"bundle manifest {key!r} is not in the store")
        return decode_json(data, "bundle manifest")

    def object_id_of(self, key: str) -> str | None:
        """The object id a bundle key belongs to (None outside this prefix)."""
        prefix = f"{self.key_prefix}/"
        if not key.startswith(prefix):
            return None
        rest = key[len(prefix) :]
        for tail in ("/manifest", "/meta"):
            if rest.endswith(tail):
                return rest[: -len(tail)]
        for marker in ("/meta/", "/buffer/"):
            i = rest.find(marker)
            if i > 0:
                return rest[:i]
        return None

    def validate(self, manifest: Mapping[str, Any]) -> None:
        """ValueError unless ``manifest`` is a version-1 bundle manifest whose keys all lie in
        this prefix and its own (or its listed) object ids, with chunk sizes adding up."""
        if manifest.get("version") != 1 or manifest.get("layout") != "bundle":
            raise InvalidArgumentError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str):
            raise InvalidArgumentError("bundle manifest object_id must be a string")
        ids = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise InvalidArgumentError(
                "bundle manifest buffer_object_ids must be a list of strings"
            )
        bases = [f"{self.key_prefix}/{i}" for i in ids]
        self._validate_spec(manifest.get("meta"), [f"{self.key_prefix}/{object_id}"])
        cleanup = manifest.get("cleanup_keys", [])
        if not isinstance(cleanup, list) or not all(
            isinstance(k, str) and any(k == f"{b}/manifest" or k.startswith(f"{b}/") for b in bases)
            for k in cleanup
        ):
            raise InvalidArgumentError(
                "bundle manifest cleanup_keys are outside the bundle namespace"
            )
        buffers = manifest.get("buffers")
        if not isinstance(buffers, dict):
            raise InvalidArgumentError("bundle manifest buffers must be a dict")
        for name, spec in buffers.items():
            check_key_segment(name, "buffer name")
            self._validate_spec(spec, bases)

    @staticmethod
    def _validate_spec(spec: Any, bases: Sequence[str]) -> None:
        if not isinstance(spec, dict):
            raise InvalidArgumentError("bundle payload spec must be a dict")
        key = spec.get("key")
        if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
            raise InvalidArgumentError("bundle payload key is outside the bundle namespace")
        expected = int(spec.get("bytes", -1))
        if expected < 0:
            raise InvalidArgumentError("bundle payload bytes must be non-negative")
        chunks = spec.get("chunks")
        if not isinstance(chunks, list) or (expected and not chunks):
            raise InvalidArgumentError("bundle payload chunks are invalid")
        seen: set[str] = set()
        total = 0
        for c in chunks:
            if not isinstance(c, dict):
                raise InvalidArgumentError("bundle chunk must be a dict")
            ck, n = c.get("key"), int(c.get("bytes", -1))
            if not isinstance(ck, str) or (ck != key and not ck.startswith(f"{key}/")):
                raise InvalidArgumentError("bundle chunk key is outside the payload namespace")
            if ck in seen:
                raise InvalidArgumentError("bundle chunk keys must be unique")
            if n < 0:
                raise InvalidArgumentError("bundle chunk bytes must be non-negative")
            seen.add(ck)
            total += n
        if total != expected:
            raise InvalidArgumentError(
                f"bundle payload chunks total {total} bytes, expected {expected}"
            )

    def manifest_key(
        self, ref: RemoteBundleRef | Mapping[str, Any], manifest: Mapping[str, Any]
    ) -> str:
        expected = f"{self.key_prefix}/{manifest['object_id']}/manifest"
        key = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        if key is None:
            return expected
        if key != expected:
            raise InvalidArgumentError("bundle manifest_key does not match manifest object_id")
        return str(key)

    @staticmethod
    def payload_keys(manifest: Mapping[str, Any]) -> list[str]:
        return [
            c["key"]
            for spec in [manifest["meta"], *manifest["buffers"].values()]
            for c in spec["chunks"]
        ]

    def remove(self, ref: RemoteBundleRef | Mapping[str, Any]) -> None:
        """Remove the bundle's payloads, cleanup keys and manifest (a missing bundle is fine)."""
        key = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        embedded = ref.manifest if isinstance(ref, RemoteBundleRef) else ref.get("manifest")
        is_exist = getattr(self.store, "is_exist", None)
        if not embedded and isinstance(key, str) and callable(is_exist):
            status = is_exist(key)
            if status == 0:
                return
            if status != 1:
                raise StructuredObjectError(f"is_exist failed for {key}: {status}")
        manifest = self.resolve(ref)
        keys = self.payload_keys(manifest) + list(manifest.get("cleanup_keys", []))
        remove_keys(self.store, keys, strict=True)
        remove_keys(self.store, [self.manifest_key(ref, manifest)], strict=True)

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, spec: Mapping[str, Any]) -> bytes:
        total = int(spec["bytes"])
        if total == 0:
            return b""
        out = np.empty(total, dtype=np.uint8)
        self.io.get_many(_scatter(spec["chunks"], [Part(int(out.ctypes.data), total, out)]))
        return out.tobytes()


def _put(store: Any, key: str, value: bytes, config: Any) -> Any:
    cfg = grouped_config(config, 1)
    return store.put(key, value) if cfg is None else store.put(key, value, config=cfg)


def _torch_dtype(name: str) -> Any:
    if _torch is None:
        raise NotSupportedError("torch is required to read structured tensor members")
    dtype = getattr(_torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, _torch.dtype):
        raise InvalidArgumentError(f"unknown torch dtype: {name}")
    return dtype


def host_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of uninitialized, writable host memory (uint8) for a read to land in.

    numpy's allocator is used on purpose: it advises transparent huge pages for large
    buffers and reuses freed, already-faulted memory, so filling the buffer runs near memcpy
    speed, where a fresh ``torch.empty`` takes one fault per 4 KiB page during the copy."""
    return np.empty(nbytes, dtype=np.uint8)


def _empty_tensor(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialized CPU tensor over :func:`host_buffer` memory."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return _torch.empty(shape, dtype=dtype)
    item = _torch.empty(0, dtype=dtype).element_size()
    return _torch.from_numpy(host_buffer(numel * item)).view(dtype).reshape(shape)


def _tensor_view(ptr: int, shape: tuple[int, ...], dtype: Any) -> Any:
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * _torch.empty(0, dtype=dtype).element_size()
    if not nbytes:
        return _torch.empty(shape, dtype=dtype)
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return _torch.frombuffer(raw, dtype=_torch.uint8).view(dtype).reshape(shape)


def _norm_slice(s: StructuredMemberSlice, rows: int) -> tuple[int, int, int]:
    if s.step <= 0:
        raise InvalidArgumentError("structured ndarray slicing step must be positive")
    return slice(s.start, s.end, s.step).indices(rows)


def _patched_header(header: bytes, shape: Sequence[int], data_bytes: int) -> bytes:
    patched = bytearray(header)
    ctypes.c_uint64.from_buffer(patched, 32).value = int(data_bytes)
    for i, dim in enumerate(shape):
        ctypes.c_int64.from_buffer(patched, 40 + i * 8).value = int(dim)
        ctypes.c_int64.from_buffer(patched, 40 + 64 + i * 8).value = int(dim)
    return bytes(patched)


class StructuredLayer:
    """Structured objects: typed members over bundles (see the module docstring)."""

    def __init__(self, bundles: ManifestStore) -> None:
        self.bundles = bundles

    def put(
        self,
        payload: StructuredObjectPayload,
        *,
        partition: str,
        chunk_bytes: int | None,
        config: Any = None,
        merge_into: RemoteBundleRef | None = None,
    ) -> RemoteBundleRef:
        """Store ``payload`` as a new bundle. With ``merge_into`` (a stage bundle), the new
        bundle is one manifest over the old members and the new ones (the old bundle stays
        readable; its manifest and metadata keys are listed as cleanup keys of the new one)."""
        metadata = dict(payload.metadata) if isinstance(payload.metadata, Mapping) else None
        if metadata is None:
            raise StructuredTypeError("structured metadata must be a mapping")
        if STRUCTURED_FIELD_SPECS_KEY in metadata:
            raise InvalidArgumentError(
                f"structured metadata key {STRUCTURED_FIELD_SPECS_KEY!r} is reserved"
            )
        if not isinstance(metadata.get("layout", "structured"), str):
            raise InvalidArgumentError("structured metadata layout must be a string")
        metadata.setdefault("layout", "structured")
        specs: dict[str, Any] = {}
        sources: dict[str, _Source] = {}
        for name, value in payload.buffers.items():
            check_key_segment(name, "buffer name")
            specs[name], sources[name] = encode_member(name, value)
        reuse: dict[str, Any] | None = None
        cleanup: list[str] | None = None
        if merge_into is not None:
            old_manifest = self.bundles.resolve(merge_into)
            old_meta = self.metadata(old_manifest)
            if old_meta.get("dataproto") != metadata.get("dataproto"):
                raise InvalidArgumentError(
                    "DataProto stage metadata mismatch during manifest merge"
                )
            old_specs = dict(old_meta.get(STRUCTURED_FIELD_SPECS_KEY, {}))
            collisions = sorted(set(old_specs) & set(specs))
            if collisions:
                raise InvalidArgumentError(f"structured members already exist: {collisions}")
            old_specs.update(specs)
            metadata = {**old_meta}
            specs = old_specs
            reuse = dict(old_manifest["buffers"])
            cleanup = [
                *old_manifest.get("cleanup_keys", []),
                self.bundles.manifest_key(merge_into, old_manifest),
                *[c["key"] for c in old_manifest["meta"]["chunks"]],
            ]
        if specs:
            metadata[STRUCTURED_FIELD_SPECS_KEY] = specs
        meta = encode_json(metadata, "structured metadata")
        return self.bundles.put_bundle(
            meta,
            sources,
            partition=partition,
            chunk_bytes=chunk_bytes,
            config=config,
            reuse_buffers=reuse,
            cleanup_keys=cleanup,
        )

    def metadata(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return decode_json(self.bundles.read_bytes(manifest["meta"]), "structured metadata")

    def materialize(
        self,
        spec: StructuredObjectReadSpec,
        destinations: Mapping[str, Any] | None = None,
        *,
        bytes_as_array: bool = False,
    ) -> StructuredObjectResult:
        """Read the selected members: every full read in one batched get, slices by range.

        A bytes member comes back as ``bytes`` (as it was given); with ``bytes_as_array``, as
        the uint8 array it was read into (no copy; the column decoders read it so)."""
        if spec.member_names is not None and not spec.member_names:
            raise InvalidArgumentError("structured read spec selected no members")
        manifest = self.bundles.resolve(spec.ref)
        metadata = self.metadata(manifest)
        buffers = manifest["buffers"]
        selected = list(buffers) if spec.member_names is None else list(spec.member_names)
        missing = [n for n in selected if n not in buffers]
        if missing:
            raise StructuredKeyError(f"unknown bundle buffers: {missing}")
        field_specs = metadata.get(STRUCTURED_FIELD_SPECS_KEY, {})
        if not isinstance(field_specs, dict):
            raise InvalidArgumentError("structured field specs must be a dict")
        dests = destinations or {}
        slices = dict(spec.member_slices)
        reads: list[tuple[str, list[Part]]] = []
        finish: dict[str, Any] = {}
        for name in selected:
            finish[name] = self._plan(
                name,
                buffers[name],
                field_specs.get(name, {"encoding": "bytes"}),
                slices.get(name),
                dests.get(name),
                reads,
                bytes_as_array,
            )
        self.bundles.io.get_many(reads)
        objects = {name: (f() if callable(f) else f) for name, f in finish.items()}
        return StructuredObjectResult(metadata=dict(metadata), objects=objects)

    # One member: queue its full reads in ``reads`` and answer a callable giving the value
    # once they are done (range reads happen right here).
    def _plan(
        self,
        name: str,
        pspec: Mapping[str, Any],
        fspec: Mapping[str, Any],
        mslice: StructuredMemberSlice | None,
        dest: Any,
        reads: list[tuple[str, list[Part]]],
        bytes_as_array: bool,
    ) -> Any:
        encoding = fspec.get("encoding", "bytes")
        total = int(pspec["bytes"])
        chunks = pspec["chunks"]
        if encoding == "bytes":
            if mslice is not None:
                raise InvalidArgumentError(
                    f"structured bytes member {name} does not support slicing"
                )
            if dest is not None:
                raise InvalidArgumentError(
                    f"structured bytes member {name} does not support materialize_into"
                )
            out = host_buffer(total)
            reads.extend(
                _scatter(chunks, [Part(int(out.ctypes.data), total, out)] if total else [])
            )
            return (lambda: out) if bytes_as_array else out.tobytes
        if encoding == "ndarray":
            return self._plan_ndarray(name, pspec, fspec, mslice, dest, reads)
        if encoding != "torch_tensor":
            raise InvalidArgumentError(f"unsupported structured field encoding: {encoding}")
        if fspec.get("nested"):
            if dest is not None:
                raise InvalidArgumentError(
                    f"structured nested tensor member {name} does not support destinations"
                )
            nested = decode_nested(self.bundles.read_bytes(pspec), dict(fspec))
            if mslice is None:
                return nested
            if mslice.axis != 0:
                raise InvalidArgumentError(
                    "structured nested tensor slicing currently supports axis=0 only"
                )
            return select_nested_rows(nested, range(*_norm_slice(mslice, len(nested))))
        if pspec.get("format") == "torch_save":
            if dest is not None:
                raise InvalidArgumentError(
                    f"structured torch_save tensor member {name} does not support destinations"
                )
            value = _torch.load(io.BytesIO(self.bundles.read_bytes(pspec)), weights_only=True)
            if mslice is None:
                return value
            if mslice.axis != 0:
                raise InvalidArgumentError(
                    "structured tensor slicing currently supports axis=0 only"
                )
            start, end, step = _norm_slice(mslice, len(value))
            return value[start:end:step]
        header = int(
            pspec.get("metadata_bytes", _HEADER_BYTES if pspec.get("kind") == "tensor" else -1)
        )
        shape = fspec.get("shape")
        dtype_name = fspec.get("dtype")
        if dest is not None:
            return self._plan_tensor_into(name, pspec, fspec, mslice, dest, header, reads)
        if header < 0 or not isinstance(shape, list) or not isinstance(dtype_name, str):
            if mslice is not None:
                raise InvalidArgumentError(
                    f"structured tensor field {name} is missing slice metadata"
                )
            _, deserialize = _tensor_helpers()
            raw = self.bundles.read_bytes(pspec)
            return deserialize(raw)
        dtype = _torch_dtype(dtype_name)
        shape_t = tuple(int(d) for d in shape)
        if mslice is None:
            tensor = _empty_tensor(shape_t, dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if total != header + nbytes:
                raise StructuredObjectError(
                    f"structured tensor member {name}: {total} bytes stored, expected {header + nbytes}"
                )
            scratch = np.empty(max(header, 1), dtype=np.uint8)
            parts = [Part(int(scratch.ctypes.data), header, scratch)] if header else []
            if nbytes:
                parts.append(Part(int(tensor.data_ptr()), nbytes, tensor))
            reads.extend(_scatter(chunks, parts))
            return lambda: tensor
        if mslice.axis != 0:
            raise InvalidArgumentError("structured tensor slicing currently supports axis=0 only")
        if not shape_t:
            raise InvalidArgumentError("structured tensor slicing requires at least one dimension")
        start, end, step = _norm_slice(mslice, shape_t[0])
        count = len(range(start, end, step))
        row = (
            int(np.prod(shape_t[1:], dtype=np.int64)) * _torch.empty(0, dtype=dtype).element_size()
        )
        cover = 0 if count == 0 else (count - 1) * step + 1
        tensor = _empty_tensor((cover, *shape_t[1:]), dtype)
        if cover and row:
            self.bundles.io.get_ranges(
                fragments(chunks, header + start * row, cover * row),
                Part(int(tensor.data_ptr()), cover * row, tensor),
            )
        return tensor if step == 1 else tensor[::step].contiguous()

    def _plan_tensor_into(
        self,
        name: str,
        pspec: Mapping[str, Any],
        fspec: Mapping[str, Any],
        mslice: StructuredMemberSlice | None,
        dest: Any,
        header: int,
        reads: list[tuple[str, list[Part]]],
    ) -> Any:
        if not isinstance(dest, (TensorObjectBuffer, RawDestination)):
            raise InvalidArgumentError(
                f"structured tensor member {name} only supports tensor_object_buffer or raw_destination destinations"
            )
        total = int(pspec["bytes"])
        chunks = pspec["chunks"]
        if mslice is None:
            if dest.size < total:
                raise InvalidArgumentError(
                    f"tensor destination has {dest.size} bytes, expected at least {total}"
                )
            reads.extend(_scatter(chunks, [Part(dest.ptr, total, dest.owner)] if total else []))
            shape, dtype = fspec.get("shape"), fspec.get("dtype")
            if pspec.get("kind") != "tensor" or not isinstance(shape, list) or header < 0:
                return dest
            # a tensor object read into caller memory answers the tensor viewing that memory
            # (as ``get_tensor_into`` does); the caller keeps the memory alive
            return lambda: _tensor_view(dest.ptr + header, tuple(shape), _torch_dtype(str(dtype)))
        shape = fspec.get("shape")
        element_size = int(fspec.get("element_size", 0))
        if header < 0 or not isinstance(shape, list) or element_size <= 0:
            raise InvalidArgumentError(f"structured tensor field {name} is missing slice metadata")
        if mslice.axis != 0:
            raise InvalidArgumentError("structured tensor slicing currently supports axis=0 only")
        start, end, step = _norm_slice(mslice, int(shape[0]))
        if step != 1:
            raise InvalidArgumentError("structured tensor slicing currently requires step=1")
        row = element_size * int(np.prod(shape[1:], dtype=np.int64))
        length = max(end - start, 0) * row
        if dest.size < header + length:
            raise InvalidArgumentError(
                f"tensor destination has {dest.size} bytes, expected at least {header + length}"
            )
        head = np.empty(header, dtype=np.uint8)
        self.bundles.io.get_ranges(
            fragments(chunks, 0, header), Part(int(head.ctypes.data), header, head)
        )
        patched = _patched_header(head.tobytes(), (max(end - start, 0), *shape[1:]), length)
        ctypes.memmove(dest.ptr, patched, header)
        self.bundles.io.get_ranges(
            fragments(chunks, header + start * row, length, header),
            Part(dest.ptr, header + length, dest.owner),
        )
        return dest

    def _plan_ndarray(
        self,
        name: str,
        pspec: Mapping[str, Any],
        fspec: Mapping[str, Any],
        mslice: StructuredMemberSlice | None,
        dest: Any,
        reads: list[tuple[str, list[Part]]],
    ) -> Any:
        dtype_s, shape = fspec.get("dtype"), fspec.get("shape")
        if not isinstance(dtype_s, str) or not isinstance(shape, list):
            raise InvalidArgumentError(f"structured ndarray field {name} is missing dtype or shape")
        dtype = np.dtype(dtype_s)
        full = tuple(int(d) for d in shape)
        chunks = pspec["chunks"]
        if mslice is None:
            out = _ndarray_destination(name, dest, dtype, full)
            if out.nbytes:
                reads.extend(_scatter(chunks, [Part(int(out.ctypes.data), int(out.nbytes), out)]))
            return lambda: out
        if mslice.axis != 0:
            raise InvalidArgumentError("structured ndarray slicing currently supports axis=0 only")
        if not full:
            raise InvalidArgumentError("structured ndarray slicing requires at least one dimension")
        start, end, step = _norm_slice(mslice, full[0])
        count = len(range(start, end, step))
        row = dtype.itemsize * int(np.prod(full[1:], dtype=np.int64))
        out = _ndarray_destination(name, dest, dtype, (count, *full[1:]))
        if not count or not row:
            return out
        cover = (count - 1) * step + 1
        target = out if step == 1 else np.empty((cover, *full[1:]), dtype=dtype)
        self.bundles.io.get_ranges(
            fragments(chunks, start * row, cover * row),
            Part(int(target.ctypes.data), cover * row, target),
        )
        if step != 1:
            out[...] = target[::step]
        return out


def _ndarray_destination(
    name: str, dest: Any, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray:
    if dest is None:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return host_buffer(n).view(dtype).reshape(shape) if n else np.empty(shape, dtype=dtype)
    if isinstance(dest, RawDestination):
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if dest.size < n:
            raise InvalidArgumentError(
                f"raw destination has {dest.size} bytes, expected at least {n}"
            )
        return (
            np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(dest.ptr))
            .view(dtype)
            .reshape(shape)
        )
    if not isinstance(dest, np.ndarray):
        raise StructuredTypeError(
            f"structured ndarray field {name} destination must be a numpy.ndarray or raw_destination"
        )
    if dest.dtype != dtype:
        raise InvalidArgumentError(
            f"structured ndarray field {name} destination dtype mismatch: expected {dtype.str}, got {dest.dtype.str}"
        )
    if tuple(dest.shape) != shape:
        raise InvalidArgumentError(
            f"structured ndarray field {name} destination shape mismatch: expected {shape}, got {tuple(dest.shape)}"
        )
    if not dest.flags["C_CONTIGUOUS"] or not dest.flags["WRITEABLE"]:
        raise InvalidArgumentError(
            f"structured ndarray field {name} destination must be C-contiguous and writeable"
        )
    return dest
