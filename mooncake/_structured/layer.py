"""The structured-object layer: typed members (tensors, ndarrays, bytes, nested tensors) over
the bundles of :mod:`.bundles`, and how each member is read back (whole, sliced, or into caller
memory).

Reads land in numpy-allocated host memory (:func:`host_buffer`) or in the caller's
destinations; every full read of a materialize is one batched get (:mod:`.io`), slices are
range reads.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake._structured.bundles import (
    _HEADER_BYTES,
    ManifestStore,
    _scatter,
    _Source,
    _tensor_helpers,
    check_key_segment,
    decode_json,
    encode_json,
    encode_member,
    fragments,
)
from mooncake._structured.io import Part
from mooncake._structured.model import (
    STRUCTURED_FIELD_SPECS_KEY,
    BundleTransferPolicy,
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
from mooncake._structured.nested import decode_nested, select_nested_rows
from mooncake.errors import InvalidArgumentError, NotSupportedError

__all__ = ["StructuredLayer", "host_buffer", "ndarray_destination"]

_torch: Any = optional_module("torch")


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
        policy: BundleTransferPolicy | None = None,
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
        tensor_codec = self.bundles.tensor_codec()
        for name, value in payload.buffers.items():
            check_key_segment(name, "buffer name")
            specs[name], sources[name] = encode_member(name, value, tensor_codec)
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
            policy=policy,
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
        if mslice is None and pspec.get("kind") == "tensor":
            get_tensor = self.bundles.io.tensor_get_call()
            if get_tensor is not None:
                key = str(pspec["key"])
                return lambda: get_tensor(key)
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
            if total and self.bundles.io.range_reads:  # the published destination read
                self.bundles.io.get_ranges(
                    fragments(chunks, 0, total), Part(dest.ptr, total, dest.owner)
                )
            elif total:
                reads.extend(_scatter(chunks, [Part(dest.ptr, total, dest.owner)]))
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
            out = ndarray_destination(name, dest, dtype, full)
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
        out = ndarray_destination(name, dest, dtype, (count, *full[1:]))
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


def ndarray_destination(
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
