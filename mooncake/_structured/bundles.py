"""Bundles on the store: a JSON manifest naming the payload keys of a metadata blob and of
named members (the structured-object layer that types them is :mod:`.layer`).

Key layout (shared with the published module, so either side reads what the other wrote)::

    PREFIX/PARTITION/OBJECT_ID/manifest           JSON manifest
    PREFIX/PARTITION/OBJECT_ID/meta[/chunk/I]     JSON structured metadata
    PREFIX/PARTITION/OBJECT_ID/buffer/NAME[/chunk/I]

A payload larger than ``chunk_bytes`` is split over ``/chunk/I`` keys. A tensor member is one
key holding the 304-byte tensor header then the data (``"kind": "tensor"``: what
``put_tensor``/``get_tensor`` store). Every payload of a bundle is written with one batched
multi-buffer put straight from the caller's memory, and every member of a read with one batched
multi-buffer get straight into the arrays and tensors returned (:mod:`.io`). On a store without
the multi-buffer calls a tensor member is written by its ``put_tensor``/``pub_tensor`` (the
same object), or, without those either, as the same bytes by ``put`` recorded as a raw payload
(``metadata_bytes``, no ``kind``), as the published module does.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mooncake._structured.io import BatchIO, Part, buffer_address, grouped_config, remove_keys
from mooncake._structured.model import (
    BundleTransferPolicy,
    RemoteBundleRef,
    StructuredKeyError,
    StructuredObjectError,
    StructuredTypeError,
    TensorObjectBuffer,
    optional_module,
)
from mooncake._structured.nested import encode_nested
from mooncake._structured.payloads import parts_of
from mooncake.errors import InvalidArgumentError

_torch: Any = optional_module("torch")

__all__ = ["ManifestStore", "encode_member", "normalize_key_prefix"]

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
        #: the torch tensor this member encodes (a store without the multi-buffer calls but
        #: with ``put_tensor``/``pub_tensor`` is given it whole, as the published module does)
        self.tensor: Any = None
        #: a tensor-object buffer (header+data in caller memory): written whole by
        #: ``put_tensor_from``/``put_from`` on a store without the multi-buffer calls
        self.object_buffer = False

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


def has_tensor_codec_helpers() -> bool:
    """Whether ``mooncake.store`` offers the tensor header helpers (``_serialize_tensor``,
    ``_deserialize_tensor``); without them tensors are stored as ``torch_save`` blobs."""
    try:
        import mooncake.store as store
    except ImportError:  # pragma: no cover
        return False
    return all(
        callable(getattr(store, n, None)) for n in ("_serialize_tensor", "_deserialize_tensor")
    )


def encode_member(
    name: str, value: Any, tensor_codec: bool = True
) -> tuple[dict[str, Any], _Source]:
    """The field spec and payload source of one structured member. ``tensor_codec`` false
    stores a tensor as one ``torch_save`` blob (the published fallback without the tensor
    header helpers), else 0-d tensors only."""
    if isinstance(value, TensorObjectBuffer):
        src = _Source([Part(value.ptr, value.size, value.owner)], chunked=False)
        src.object_buffer = True
        return {"encoding": "torch_tensor"}, src
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
        if value.dim() == 0 or not tensor_codec:
            buf = io.BytesIO()
            _torch.save(value.detach().cpu(), buf)
            src = _bytes_source(buf.getvalue(), name)
            src.extra = {"format": "torch_save"}
            src.chunked = False
            src.tensor = value if tensor_codec else None
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
        src = _Source(parts, extra, chunked=False)
        src.tensor = value
        return spec, src
    multi = parts_of(value)
    if multi is not None:
        parts = []
        for p in multi:
            ptr, n, owner = buffer_address(p)
            if n:
                parts.append(Part(ptr, n, owner))
        if value.dtype is not None and value.shape is not None:
            want = int(np.prod(value.shape, dtype=np.int64)) * np.dtype(value.dtype).itemsize
            if sum(p.size for p in parts) != want:
                raise InvalidArgumentError(
                    f"{name} holds {sum(p.size for p in parts)} bytes, its dtype and shape {want}"
                )
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


def tensor_spec(key: str, tensor: Any) -> dict[str, Any]:
    """The payload spec of ``tensor`` stored whole at ``key`` by ``put_tensor``: one key of
    the tensor header then the data (``"kind": "tensor"``, the layout both packages read)."""
    serialize, _ = _tensor_helpers()
    header, _ptr, n, _owner = serialize(tensor)
    total = len(header) + int(n)
    return {
        "key": key,
        "bytes": total,
        "chunks": [{"key": key, "bytes": total}],
        "kind": "tensor",
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "metadata_bytes": len(header),
    }


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

    def __init__(
        self, store: Any, key_prefix: str, default_chunk_bytes: int, buffer_pool: Any = None
    ) -> None:
        self.store = store
        self.io = BatchIO(store, buffer_pool)
        #: whether tensors are stored by their header helpers (else as ``torch_save`` blobs)
        self.tensor_codec: Callable[[], bool] = has_tensor_codec_helpers
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
        policy: BundleTransferPolicy | None = None,
    ) -> RemoteBundleRef:
        """Write ``meta`` and every member with one batched put, then the manifest. On failure
        nothing of this bundle is left behind. ``reuse_buffers`` adds payload specs of members
        already stored (a merged manifest); ``cleanup_keys`` are removed with the bundle."""
        check_key_segment(partition, "partition")
        chunk = check_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        object_id = f"{partition}/{uuid.uuid4().hex}"
        base = f"{self.key_prefix}/{object_id}"
        writes: list[tuple[str, list[Part]]] = []
        direct: list[tuple[str, Any]] = []  # (key, a write answering the store's code)
        tensor_call = self.io.tensor_put_call(config)
        from_call = self.io.put_from_call(config)

        def add(key: str, src: _Source) -> dict[str, Any]:
            if tensor_call is not None and src.tensor is not None:
                direct.append((key, lambda t=src.tensor: tensor_call(key, t)))
                return tensor_spec(key, src.tensor)
            if from_call is not None and src.object_buffer and src.nbytes:
                (p,) = src.parts
                direct.append((key, lambda p=p: from_call(key, p.ptr, p.size)))
                return {"key": key, "bytes": p.size, "chunks": [{"key": key, "bytes": p.size}]}
            if src.tensor is not None and not self.io.zero_copy and "kind" in src.extra:
                # a store without tensor calls: the same header+data bytes written with
                # ``put`` are a raw payload, not a tensor object (the published spec)
                src.extra = {"metadata_bytes": src.extra["metadata_bytes"]}
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
            self.validate(manifest)
        manifest_key = f"{base}/manifest"
        written = [k for k, _ in writes]
        self.io.put_many(writes, config, policy)
        try:
            for key, write in direct:
                code = write()
                if code not in (None, 0):
                    raise StructuredObjectError(f"put failed for {key}: {code}")
                written.append(key)
            code = _put(self.store, manifest_key, encode_json(manifest, "bundle manifest"), config)
            if code not in (None, 0):
                raise StructuredObjectError(f"put failed for {manifest_key}: {code}")
        except BaseException:
            remove_keys(self.store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key=manifest_key, manifest=manifest)

    def put_payload(
        self,
        key: str,
        src: _Source,
        chunk_bytes: int | None,
        config: Any = None,
        policy: BundleTransferPolicy | None = None,
    ) -> tuple[dict[str, Any], list[str]]:
        """Write one payload (``src``) at ``key``, cut into chunks of ``chunk_bytes``, by one
        batched put: ``(payload spec, keys written)``. On failure nothing of it stays."""
        chunk = check_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        if src.nbytes == 0:
            return {"key": key, "bytes": 0, "chunks": []}, []
        groups = _split(src.parts, chunk)
        keys = [key] if len(groups) == 1 else [f"{key}/chunk/{i}" for i in range(len(groups))]
        self.io.put_many(list(zip(keys, groups, strict=True)), config, policy)
        spec = {
            "key": key,
            "bytes": src.nbytes,
            "chunks": [
                {"key": k, "bytes": sum(p.size for p in g)}
                for k, g in zip(keys, groups, strict=True)
            ],
        }
        return spec, keys

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
