"""The published ``mooncake.shared_segment``: host memory allocated once and mapped by every
rank of a group on one host (one-writer/many-reader KV offload, e.g. MLA under TP).

::

    from mooncake.shared_segment import create_shared_segment

    seg = create_shared_segment(
        "vllm_sparse_kv",
        blocks={"k": dict(count=num_layers, shape=k_shape, dtype=torch.bfloat16)},
        world_size=tp_size, rank_id=tp_rank, comm_group=tp_group,
    )
    k_caches = seg.tensors("k")   # zero-copy CPU views, the same pages in every rank

Same names, arguments, layout and errors as the published module: blocks are laid out in
sorted name order, each entry ``_align_up(nbytes, 4096)`` apart inside a group stride, ``count``
groups; every rank must declare the same blocks (a disagreement raises
:class:`SharedSegmentError` in every rank); ``comm_group`` (a gloo process group or a vLLM
``GroupCoordinator``, its ``cpu_group`` then) exchanges the export blobs and may be omitted only
for ``world_size == 1``; ``tp_group`` is its deprecated alias.

How it is shared here: ``owner_rank`` creates a ``memfd`` of the segment's size and publishes
``(pid, fd, size, fingerprint)``; the other ranks open ``/proc/<pid>/fd/<fd>`` and map the
same pages (so the ranks must be processes of one host and user, as the published mmap
backend's POSIX shm also requires). Only the ``mmap=True``, ``host_register=False`` backend
exists: ``mmap=False`` (Ascend VMM) and ``host_register=True`` raise
:class:`SharedSegmentError`, and :func:`shared_segment_supported` answers False for them.
"""

from __future__ import annotations

import ctypes
import json
import mmap as _mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SharedSegment",
    "SharedSegmentError",
    "create_shared_segment",
    "shared_segment_supported",
]

_ALIGN = 4096


class SharedSegmentError(RuntimeError):
    """Raised when a shared segment cannot be created or addressed."""


@dataclass(frozen=True)
class _BlockSpec:
    count: int
    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype
    nbytes: int


class _Mapping:
    """The shared pages of one rank (the owner also holds the memfd open)."""

    def __init__(self, fingerprint: str, size: int, owner: bool) -> None:
        self.fingerprint, self.size, self.owner = fingerprint, size, owner
        self.fd = -1
        self.map: _mmap.mmap | None = None
        if owner:
            self.fd = os.memfd_create("mooncake-shared-segment", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.map = _mmap.mmap(self.fd, size, _mmap.MAP_SHARED)

    def blob(self) -> bytes:
        doc: dict[str, Any] = {"fingerprint": self.fingerprint, "size": self.size}
        if self.owner:
            doc.update(pid=os.getpid(), fd=self.fd)
        return json.dumps(doc, sort_keys=True).encode()

    def complete(self, blobs: Sequence[bytes], owner_rank: int) -> None:
        docs = [json.loads(b.rstrip(b"\0")) for b in blobs]
        for rank, d in enumerate(docs):
            if d.get("fingerprint") != self.fingerprint or d.get("size") != self.size:
                raise SharedSegmentError(
                    f"rank {rank} declared a different shared segment layout "
                    f"({d.get('fingerprint')!r}, {d.get('size')} bytes) than this rank "
                    f"({self.fingerprint!r}, {self.size} bytes)"
                )
        if self.owner:
            return
        d = docs[owner_rank]
        path = f"/proc/{int(d['pid'])}/fd/{int(d['fd'])}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SharedSegmentError(
                f"cannot open the owner's segment {path}: {e.strerror} (the ranks must be "
                "processes of one host and user)"
            ) from None
        try:
            if os.fstat(fd).st_size != self.size:
                raise SharedSegmentError(f"the owner's segment {path} is not {self.size} bytes")
            self.map = _mmap.mmap(fd, self.size, _mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def base_addr(self) -> int:
        if self.map is None:
            raise SharedSegmentError("shared segment is not mapped")
        view = ctypes.c_char.from_buffer(self.map)
        try:
            return ctypes.addressof(view)
        finally:
            del view


def shared_segment_supported(mmap: bool = True, host_register: bool = False) -> bool:
    """Whether this build can create a shared segment with these options (memfd on Linux,
    ``mmap=True`` and ``host_register=False`` only)."""
    return bool(mmap) and not host_register and hasattr(os, "memfd_create")


def create_shared_segment(
    name: str,
    blocks: Mapping[str, Mapping[str, Any]],
    world_size: int,
    rank_id: int,
    owner_rank: int = 0,
    device_id: int | None = None,
    comm_group: Any = None,
    mmap: bool = True,
    host_register: bool = False,
    *,
    tp_group: Any = None,
) -> SharedSegment:
    """Create (``owner_rank``) or map (the others) the segment and return it ready to use.

    Every rank of the group calls this with the same declaration; ``device_id`` is kept for
    the published signature (the tensors are CPU views here)."""
    comm_group = _select_comm_group(comm_group, tp_group)
    if host_register and not mmap:
        raise SharedSegmentError("host_register requires mmap=True")
    if not shared_segment_supported(mmap=mmap, host_register=host_register):
        if not mmap:
            raise SharedSegmentError("This mooncake build has no VMM backend for shared segments")
        if host_register:
            raise SharedSegmentError("This mooncake build cannot HostRegister shared-segment pages")
        raise SharedSegmentError("This mooncake build has no mmap shared-segment backend")
    if not 0 <= owner_rank < world_size or not 0 <= rank_id < world_size:
        raise SharedSegmentError(
            f"rank_id {rank_id} and owner_rank {owner_rank} must be in [0, {world_size})"
        )
    names = sorted(blocks)
    specs = {n: _parse_block(n, blocks[n]) for n in names}
    offsets, stride, total = _build_layout(specs, names)
    tag = ";".join(_block_layout_tag(n, specs[n]) for n in names)
    seg: _Mapping | None = None
    error = ""
    try:
        seg = _Mapping(f"{name}|{tag}", total, rank_id == owner_rank)
    except OSError as e:
        error = f"cannot allocate {total} bytes of shared memory: {e.strerror or e}"
    _raise_if_any_rank_failed(error, world_size, rank_id, comm_group, "create")
    assert seg is not None
    error = ""
    try:
        blobs = (
            [seg.blob()]
            if world_size == 1
            else _all_gather_blob(seg.blob(), world_size, comm_group)
        )
        seg.complete(blobs, owner_rank)
    except (SharedSegmentError, ValueError, KeyError) as e:
        error = str(e)
    _raise_if_any_rank_failed(error, world_size, rank_id, comm_group, "complete")
    return SharedSegment(seg, specs, offsets, stride, device_id or 0)


class SharedSegment:
    """Handle to one shared host segment; alive as long as the mapping is needed (every
    tensor of :meth:`tensors` keeps it alive)."""

    def __init__(
        self,
        segment: Any,
        specs: dict[str, _BlockSpec],
        offsets: dict[str, int],
        stride: int,
        device_id: int,
    ) -> None:
        self._segment = segment
        self._specs = specs
        self._offsets = offsets
        self._stride = stride
        self._device_id = device_id

    def tensors(self, block: str) -> list[Any]:
        """Zero-copy CPU views of every entry of ``block``, in index order."""
        spec = self._specs.get(block)
        if spec is None:
            raise SharedSegmentError(f"Unknown shared segment block {block!r}")
        base = self.base_addr()
        return [
            _tensor_from_host_addr(
                base + self._offsets[block] + i * self._stride,
                spec.nbytes,
                spec.shape,
                spec.dtype,
                self,
            )
            for i in range(spec.count)
        ]

    def base_addr(self) -> int:
        return int(self._segment.base_addr())

    def total_size(self) -> int:
        return int(self._segment.size)


def _block_layout_tag(name: str, spec: _BlockSpec) -> str:
    shape = "x".join(str(dim) for dim in spec.shape)
    return f"{name}:{spec.count}:{shape}:{spec.dtype}:{spec.nbytes}"


def _align_up(value: int, alignment: int = _ALIGN) -> int:
    return (value + alignment - 1) // alignment * alignment


def _parse_block(name: str, spec: Mapping[str, Any]) -> _BlockSpec:
    import torch

    try:
        count = int(spec["count"])
        shape = tuple(int(dim) for dim in spec["shape"])
        dtype = spec["dtype"]
    except (KeyError, TypeError) as exc:
        raise SharedSegmentError(f"Block {name!r} needs count, shape and dtype") from exc
    if count <= 0:
        raise SharedSegmentError(f"Block {name!r} needs a positive count")
    if not shape or any(dim <= 0 for dim in shape):
        raise SharedSegmentError(f"Block {name!r} needs a positive shape")
    try:
        nbytes = int(torch.empty(0, dtype=dtype).element_size())
    except TypeError as exc:
        raise SharedSegmentError(f"Block {name!r}: dtype {dtype!r} is not a torch dtype") from exc
    for dim in shape:
        nbytes *= dim
    return _BlockSpec(count=count, shape=shape, dtype=dtype, nbytes=nbytes)


def _build_layout(
    specs: dict[str, _BlockSpec], names: Sequence[str]
) -> tuple[dict[str, int], int, int]:
    """(offsets by name, group stride, total size)."""
    stride = 0
    offsets: dict[str, int] = {}
    for name in names:
        offsets[name] = stride
        stride += _align_up(specs[name].nbytes)
    if stride == 0:
        raise SharedSegmentError("Shared segment needs at least one block")
    return offsets, stride, stride * max(spec.count for spec in specs.values())


def _select_comm_group(comm_group: Any, tp_group: Any) -> Any:
    if tp_group is None:
        return comm_group
    if comm_group is None or comm_group is tp_group:
        return tp_group
    raise SharedSegmentError("pass only comm_group; tp_group is a deprecated alias of comm_group")


def _resolve_cpu_group(comm_group: Any) -> Any:
    cpu_group = getattr(comm_group, "cpu_group", None)
    return cpu_group if cpu_group is not None else comm_group


def _raise_if_any_rank_failed(
    local_error: str, world_size: int, rank_id: int, comm_group: Any, phase: str
) -> None:
    """Every rank leaves a failed phase with the same error."""
    if world_size == 1:
        if local_error:
            raise SharedSegmentError(local_error)
        return
    if comm_group is None:
        raise SharedSegmentError("comm_group is required when world_size > 1")
    import torch.distributed as dist

    failures: list[tuple[int, str] | None] = [None] * world_size
    local = (rank_id, local_error) if local_error else None
    dist.all_gather_object(failures, local, group=_resolve_cpu_group(comm_group))
    errors = [f for f in failures if f is not None]
    if errors:
        detail = "; ".join(f"rank {r}: {m}" for r, m in errors)
        raise SharedSegmentError(f"Shared segment {phase} failed: {detail}")


def _all_gather_blob(blob: bytes, world_size: int, comm_group: Any) -> list[bytes]:
    import torch.distributed as dist

    blobs: list[bytes | None] = [None] * world_size
    dist.all_gather_object(blobs, blob, group=_resolve_cpu_group(comm_group))
    return [b if isinstance(b, bytes) else b"" for b in blobs]


def _tensor_from_host_addr(
    host_addr: int, nbytes: int, shape: tuple[int, ...], dtype: Any, holder: Any
) -> Any:
    import torch

    buffer = (ctypes.c_int8 * nbytes).from_address(host_addr)
    view = torch.frombuffer(buffer, dtype=dtype).view(shape)
    setattr(view, "_mooncake_segment", holder)  # noqa: B010 (the views keep the mapping alive)
    return view
