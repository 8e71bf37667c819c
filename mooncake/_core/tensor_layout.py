"""The published store's tensor object layout, sans-I/O.

A tensor stored by ``put_tensor`` is one object: a 304-byte ``TensorMetadata`` header followed
by the tensor's bytes (C order). All integers are little-endian, with the C struct's natural
alignment:

```
TensorObjectHeader (40 B)   u32 magic 0x4d4f4f4e ("NOOM"), u16 version 1, u16 header_size 304,
                            i32 dtype, i32 ndim, u32 layout_kind (0 full, 1 shard),
                            u32 reserved_flags, u64 data_offset (304), u64 data_bytes
TensorLayoutMetadata (264 B) i64 global_shape[8], i64 local_shape[8] (unused dims = -1),
                            u32 axis_count, u32 reserved0,
                            LayoutAxis axes[4] (32 B each: i32 kind, axis_index, shard_rank,
                            shard_count, split_dim, reserved0; i64 reserved1)
```

Shards written for tensor parallelism carry ``layout_kind`` 1, the full tensor's shape as
``global_shape``, the shard's as ``local_shape`` and one axis per parallelism dimension
(``reserved0`` holds an EP axis's expert id or a PP axis's stage id, ``reserved1`` the shard's
extent along ``split_dim``). Writer-partitioned and parallelism writes also store a 96-byte
*manifest* (magic 0x574d414e, the full shape, split dim and shard count) under a side key.

:func:`parse_metadata` accepts exactly what the published ``ParseTensorMetadata`` accepts and
raises :class:`TensorLayoutError` on anything else. Key names (``key_tp_<rank>``,
``key__writer_<r>of<n>_sd<d>``, ``key__tp_0of2_sd0``, ...) are the published ones, so shards are
found under the same keys by either implementation.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake.errors import InvalidArgumentError

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
HEADER_SIZE = 40
AXIS_SIZE = 32
METADATA_SIZE = HEADER_SIZE + 2 * 8 * MAX_DIMS + 8 + AXIS_SIZE * MAX_AXES  # 304
MANIFEST_MAGIC = 0x574D414E
MANIFEST_VERSION = 1
MANIFEST_SIZE = 32 + 8 * MAX_DIMS  # 96: 28-byte header padded to 8, then the shape

_HEADER = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
_AXIS = struct.Struct("<iiiiiiq")
_COUNTS = struct.Struct("<II")
_MANIFEST_HEADER = struct.Struct("<IHHiiiii4x")
assert _HEADER.size == HEADER_SIZE and _AXIS.size == AXIS_SIZE
assert _MANIFEST_HEADER.size + _SHAPE.size == MANIFEST_SIZE


class TensorLayoutError(InvalidArgumentError):
    """Bytes that are not a valid Mooncake tensor object (or manifest)."""


class TensorDtype(enum.IntEnum):
    """The published dtype codes (``TensorDtype`` in the binding)."""

    FLOAT32 = 0
    FLOAT64 = 1
    INT8 = 2
    UINT8 = 3
    INT16 = 4
    UINT16 = 5
    INT32 = 6
    UINT32 = 7
    INT64 = 8
    UINT64 = 9
    BOOL = 10
    FLOAT16 = 11
    BFLOAT16 = 12
    FLOAT8_E4M3 = 13
    FLOAT8_E5M2 = 14

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_name(self) -> str:
        """The ``torch`` attribute naming this dtype (``float8_e4m3fn`` for FLOAT8_E4M3)."""
        return _TORCH_NAMES[self]


_ITEMSIZE = {
    TensorDtype.FLOAT32: 4,
    TensorDtype.FLOAT64: 8,
    TensorDtype.INT8: 1,
    TensorDtype.UINT8: 1,
    TensorDtype.INT16: 2,
    TensorDtype.UINT16: 2,
    TensorDtype.INT32: 4,
    TensorDtype.UINT32: 4,
    TensorDtype.INT64: 8,
    TensorDtype.UINT64: 8,
    TensorDtype.BOOL: 1,
    TensorDtype.FLOAT16: 2,
    TensorDtype.BFLOAT16: 2,
    TensorDtype.FLOAT8_E4M3: 1,
    TensorDtype.FLOAT8_E5M2: 1,
}
_TORCH_NAMES = {d: d.name.lower() for d in TensorDtype}
_TORCH_NAMES[TensorDtype.FLOAT8_E4M3] = "float8_e4m3fn"
DTYPE_BY_TORCH_NAME = {v: k for k, v in _TORCH_NAMES.items()}


class LayoutKind(enum.IntEnum):
    FULL = 0
    SHARD = 1


class AxisKind(enum.IntEnum):
    DP = 0
    TP = 1
    EP = 2
    PP = 3
    RESERVED = 4


def parse_axis_kind(kind: str) -> AxisKind:
    """``"tp"``/``"TP"`` etc. to the axis code; anything else is an error."""
    try:
        k = AxisKind[str(kind).upper()]
    except KeyError:
        raise InvalidArgumentError(f"unsupported parallel axis kind {kind!r}") from None
    if k is AxisKind.RESERVED:
        raise InvalidArgumentError(f"unsupported parallel axis kind {kind!r}")
    return k


@dataclass(frozen=True)
class LayoutAxis:
    """One packed axis of a shard's layout."""

    kind: int
    axis_index: int
    shard_rank: int
    shard_count: int
    split_dim: int = -1
    reserved0: int = 0
    reserved1: int = 0


@dataclass(frozen=True)
class TensorMetadata:
    """The decoded 304-byte header. Shapes hold ``ndim`` entries."""

    dtype: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layout_kind: int = LayoutKind.FULL
    axes: tuple[LayoutAxis, ...] = field(default=())
    data_bytes: int = 0
    data_offset: int = METADATA_SIZE
    reserved_flags: int = 0
    version: int = VERSION
    magic: int = MAGIC
    header_size: int = METADATA_SIZE

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    def pack(self) -> bytes:
        """The exact 304 bytes the published binding writes for this header."""
        if len(self.global_shape) > MAX_DIMS or len(self.local_shape) != len(self.global_shape):
            raise TensorLayoutError("shape rank must match and be at most 8")
        if len(self.axes) > MAX_AXES:
            raise TensorLayoutError("at most 4 layout axes")
        out = bytearray(METADATA_SIZE)
        _HEADER.pack_into(
            out,
            0,
            self.magic,
            self.version,
            self.header_size,
            self.dtype,
            self.ndim,
            self.layout_kind,
            self.reserved_flags,
            self.data_offset,
            self.data_bytes,
        )
        _SHAPE.pack_into(out, HEADER_SIZE, *_pad(self.global_shape))
        _SHAPE.pack_into(out, HEADER_SIZE + 64, *_pad(self.local_shape))
        _COUNTS.pack_into(out, HEADER_SIZE + 128, len(self.axes), 0)
        for i, a in enumerate(self.axes):
            _AXIS.pack_into(
                out,
                HEADER_SIZE + 136 + i * AXIS_SIZE,
                a.kind,
                a.axis_index,
                a.shard_rank,
                a.shard_count,
                a.split_dim,
                a.reserved0,
                a.reserved1,
            )
        return bytes(out)


def _pad(shape: Sequence[int]) -> list[int]:
    return [int(d) for d in shape] + [-1] * (MAX_DIMS - len(shape))


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def full_metadata(dtype: int, shape: Sequence[int]) -> TensorMetadata:
    """Header of a whole tensor (``layout_kind`` FULL)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_DIMS:
        raise TensorLayoutError(f"tensor has more than {MAX_DIMS} dimensions: {len(shape)}")
    return TensorMetadata(
        int(dtype), shape, shape, data_bytes=numel(shape) * TensorDtype(dtype).itemsize
    )


def parse_metadata(data: bytes | bytearray | memoryview, total_length: int) -> TensorMetadata:
    """Decode and validate a header; ``total_length`` is the whole object's size.

    Accepts what the published ``ValidateTensorMetadata`` accepts: magic, version and header
    size; a known dtype; 0..8 dims, unused dims -1, used dims >= 0; ``data_bytes`` equal to
    both ``total_length - data_offset`` and the element count times the item size; axes with
    a known kind, ``0 <= rank < count`` and ``-1 <= split_dim < ndim``.
    """
    mv = memoryview(data)
    if len(mv) < METADATA_SIZE or total_length < METADATA_SIZE:
        raise TensorLayoutError("insufficient data for tensor metadata")
    magic, version, hsize, dtype, ndim, kind, flags, off, nbytes = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or hsize != METADATA_SIZE:
        raise TensorLayoutError("bad tensor metadata magic, version or header size")
    if not 0 <= dtype < len(TensorDtype):
        raise TensorLayoutError(f"unknown tensor dtype code {dtype}")
    if not 0 <= ndim <= MAX_DIMS:
        raise TensorLayoutError(f"bad tensor ndim {ndim}")
    gshape = _SHAPE.unpack_from(mv, HEADER_SIZE)
    lshape = _SHAPE.unpack_from(mv, HEADER_SIZE + 64)
    axis_count, _ = _COUNTS.unpack_from(mv, HEADER_SIZE + 128)
    if axis_count > MAX_AXES:
        raise TensorLayoutError(f"bad layout axis count {axis_count}")
    if kind > LayoutKind.SHARD:
        raise TensorLayoutError(f"bad layout kind {kind}")
    if not METADATA_SIZE <= off <= total_length:
        raise TensorLayoutError("tensor data offset out of range")
    if nbytes != total_length - off:
        raise TensorLayoutError(
            f"tensor data size {nbytes} does not match the object ({total_length - off})"
        )
    if any(d < 0 for d in gshape[:ndim]) or any(d < 0 for d in lshape[:ndim]):
        raise TensorLayoutError("negative tensor dimension")
    if nbytes != numel(lshape[:ndim]) * TensorDtype(dtype).itemsize:
        raise TensorLayoutError("tensor data size does not match its shape and dtype")
    if any(d != -1 for d in gshape[ndim:]) or any(d != -1 for d in lshape[ndim:]):
        raise TensorLayoutError("unused tensor dimensions must be -1")
    axes = []
    for i in range(axis_count):
        a = LayoutAxis(*_AXIS.unpack_from(mv, HEADER_SIZE + 136 + i * AXIS_SIZE))
        if not AxisKind.DP <= a.kind <= AxisKind.RESERVED:
            raise TensorLayoutError(f"bad layout axis kind {a.kind}")
        if a.shard_count <= 0 or not 0 <= a.shard_rank < a.shard_count:
            raise TensorLayoutError("bad layout axis rank or count")
        if not -1 <= a.split_dim < ndim:
            raise TensorLayoutError("bad layout axis split_dim")
        axes.append(a)
    return TensorMetadata(
        dtype,
        tuple(gshape[:ndim]),
        tuple(lshape[:ndim]),
        kind,
        tuple(axes),
        nbytes,
        off,
        flags,
        version,
        magic,
        hsize,
    )


# -- parallelism requests -------------------------------------------------------------------


@dataclass(frozen=True)
class AxisSpec:
    """One axis of a parallelism request (``ParallelAxis`` in the published API)."""

    kind: str
    rank: int = 0
    size: int = 1
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None

    @property
    def code(self) -> AxisKind:
        return parse_axis_kind(self.kind)


def validate_axes(axes: Sequence[AxisSpec]) -> tuple[AxisSpec, ...]:
    """The published ``validate_parallelism_spec``: 1..4 axes, distinct kinds, TP needs
    ``split_dim``, DP/EP/PP must not have one, EP needs ``expert_id``, PP ``stage_id``."""
    if not axes:
        raise InvalidArgumentError("parallelism needs at least one axis")
    if len(axes) > MAX_AXES:
        raise InvalidArgumentError(f"parallelism has more than {MAX_AXES} axes")
    seen: set[AxisKind] = set()
    for a in axes:
        k = a.code
        if a.size <= 0 or not 0 <= a.rank < a.size:
            raise InvalidArgumentError(f"invalid rank/size {a.rank}/{a.size} for axis {a.kind}")
        if k in seen:
            raise InvalidArgumentError("duplicate axis kinds are not supported")
        seen.add(k)
        if k is AxisKind.TP and a.split_dim is None:
            raise InvalidArgumentError("TP axis requires split_dim")
        if k is not AxisKind.TP and a.split_dim is not None:
            raise InvalidArgumentError(f"{k.name} axis must not provide split_dim")
        if k is AxisKind.EP and a.expert_id is None:
            raise InvalidArgumentError("EP axis requires expert_id")
        if k is AxisKind.PP and a.stage_id is None:
            raise InvalidArgumentError("PP axis requires stage_id")
    return tuple(axes)


def tp_axis_index(axes: Sequence[AxisSpec]) -> int | None:
    for i, a in enumerate(axes):
        if a.code is AxisKind.TP:
            return i
    return None


def layout_axes(axes: Sequence[AxisSpec], local_shape: Sequence[int]) -> tuple[LayoutAxis, ...]:
    """Pack request axes as a shard header stores them."""
    out = []
    for i, a in enumerate(axes):
        extent = -1
        if a.split_dim is not None:
            if not 0 <= a.split_dim < len(local_shape):
                raise InvalidArgumentError(f"split_dim {a.split_dim} out of range")
            extent = int(local_shape[a.split_dim])
        r0 = 0
        if a.code is AxisKind.EP and a.expert_id is not None:
            r0 = a.expert_id
        if a.code is AxisKind.PP and a.stage_id is not None:
            r0 = a.stage_id
        out.append(
            LayoutAxis(
                int(a.code),
                i,
                a.rank,
                a.size,
                -1 if a.split_dim is None else a.split_dim,
                r0,
                extent if extent >= 0 else 0,
            )
        )
    return tuple(out)


def shard_metadata(
    dtype: int,
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    axes: Sequence[AxisSpec],
) -> TensorMetadata:
    """Header of one shard (``layout_kind`` SHARD)."""
    if not axes or len(axes) > MAX_AXES or len(global_shape) != len(local_shape):
        raise InvalidArgumentError("shard needs 1..4 axes and shapes of one rank")
    lshape = tuple(int(d) for d in local_shape)
    return TensorMetadata(
        int(dtype),
        tuple(int(d) for d in global_shape),
        lshape,
        LayoutKind.SHARD,
        layout_axes(axes, lshape),
        data_bytes=numel(lshape) * TensorDtype(dtype).itemsize,
    )


def axes_from_metadata(meta: TensorMetadata) -> tuple[AxisSpec, ...]:
    """The request a shard header was written for (inverse of :func:`layout_axes`)."""
    out = []
    for a in meta.axes:
        k = AxisKind(a.kind)
        out.append(
            AxisSpec(
                k.name.lower(),
                a.shard_rank,
                a.shard_count,
                None if a.split_dim < 0 else a.split_dim,
                a.reserved0 if k is AxisKind.EP else None,
                a.reserved0 if k is AxisKind.PP else None,
            )
        )
    return tuple(out)


def axes_match(request: Sequence[AxisSpec], stored: Sequence[AxisSpec]) -> bool:
    """Same axes by kind (order-free), each with equal rank, size and ids."""
    if len(request) != len(stored):
        return False
    by_kind = {a.code: a for a in stored}
    for a in request:
        b = by_kind.get(a.code)
        if b is None or (a.rank, a.size, a.split_dim, a.expert_id, a.stage_id) != (
            b.rank,
            b.size,
            b.split_dim,
            b.expert_id,
            b.stage_id,
        ):
            return False
    return True


def shard_range(dim: int, rank: int, count: int) -> tuple[int, int]:
    """``(start, length)`` of rank's slice of a dimension split uniformly in ``count``."""
    if count <= 0 or dim < 0 or dim % count:
        raise InvalidArgumentError(
            f"only uniform sharding is supported (dim {dim} over {count} shards)"
        )
    if not 0 <= rank < count:
        raise InvalidArgumentError(f"rank {rank} out of range for {count} shards")
    size = dim // count
    return rank * size, size


# -- key names -------------------------------------------------------------------------------


def tp_key(base: str, rank: int) -> str:
    return f"{base}_tp_{rank}"


def writer_shard_key(base: str, rank: int, size: int, split_dim: int) -> str:
    return f"{base}__writer_{rank}of{size}_sd{split_dim}"


def writer_manifest_key(base: str) -> str:
    return f"{base}__writer_manifest"


def parallelism_manifest_key(base: str) -> str:
    return f"{base}__parallelism_manifest"


def _axis_suffix(a: AxisSpec) -> str:
    s = f"{a.code.name.lower()}_{a.rank}of{a.size}"
    if a.split_dim is not None:
        s += f"_sd{a.split_dim}"
    if a.expert_id is not None:
        s += f"_eid{a.expert_id}"
    if a.stage_id is not None:
        s += f"_sid{a.stage_id}"
    return s


def parallelism_key(base: str, axes: Sequence[AxisSpec]) -> str:
    """Where a shard of ``base`` for this request lives: ``base_tp_<r>`` for a lone TP axis,
    else ``base__<axis>...`` with the axes in DP, TP, EP, PP order."""
    if len(axes) == 1 and axes[0].code is AxisKind.TP:
        return tp_key(base, axes[0].rank)
    ordered = sorted(axes, key=lambda a: int(a.code))
    return base + "".join("__" + _axis_suffix(a) for a in ordered)


# -- manifests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """Where a full tensor's shards are: its dtype, shape, split dim and shard count."""

    dtype: int
    global_shape: tuple[int, ...]
    split_dim: int
    shard_count: int

    def pack(self) -> bytes:
        out = bytearray(MANIFEST_SIZE)
        _MANIFEST_HEADER.pack_into(
            out,
            0,
            MANIFEST_MAGIC,
            MANIFEST_VERSION,
            MANIFEST_SIZE,
            self.dtype,
            len(self.global_shape),
            self.split_dim,
            self.shard_count,
            0,
        )
        _SHAPE.pack_into(out, _MANIFEST_HEADER.size, *_pad(self.global_shape))
        return bytes(out)


def parse_manifest(data: bytes | bytearray | memoryview) -> Manifest:
    mv = memoryview(data)
    if len(mv) < MANIFEST_SIZE:
        raise TensorLayoutError("manifest too short")
    magic, version, hsize, dtype, ndim, split_dim, count, _ = _MANIFEST_HEADER.unpack_from(mv, 0)
    if (
        magic != MANIFEST_MAGIC
        or version != MANIFEST_VERSION
        or hsize != MANIFEST_SIZE
        or not 0 <= ndim <= MAX_DIMS
        or count <= 0
        or not 0 <= split_dim < ndim
    ):
        raise TensorLayoutError("invalid tensor shard manifest")
    shape = _SHAPE.unpack_from(mv, _MANIFEST_HEADER.size)[:ndim]
    if any(d < 0 for d in shape):
        raise TensorLayoutError("invalid tensor shard manifest shape")
    return Manifest(dtype, tuple(shape), split_dim, count)
