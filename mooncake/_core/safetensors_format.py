"""The safetensors file format, sans-I/O (what ``save_tensor_to_safetensor`` writes).

A file is ``u64 LE header_len``, a JSON header of that many bytes (padded with spaces to a
multiple of 8) mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header), then the tensors' bytes. :func:`decode` checks
every offset against the data it was given and raises
:class:`~mooncake.errors.InvalidArgumentError` on anything malformed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

from mooncake._core.tensor_layout import TensorDtype
from mooncake.errors import InvalidArgumentError

_CODES = {
    TensorDtype.FLOAT32: "F32",
    TensorDtype.FLOAT64: "F64",
    TensorDtype.INT8: "I8",
    TensorDtype.UINT8: "U8",
    TensorDtype.INT16: "I16",
    TensorDtype.UINT16: "U16",
    TensorDtype.INT32: "I32",
    TensorDtype.UINT32: "U32",
    TensorDtype.INT64: "I64",
    TensorDtype.UINT64: "U64",
    TensorDtype.BOOL: "BOOL",
    TensorDtype.FLOAT16: "F16",
    TensorDtype.BFLOAT16: "BF16",
    TensorDtype.FLOAT8_E4M3: "F8_E4M3",
    TensorDtype.FLOAT8_E5M2: "F8_E5M2",
}
_BY_CODE = {v: k for k, v in _CODES.items()}
MAX_HEADER = 100 << 20

Entry = tuple[TensorDtype, tuple[int, ...], int, int]  # dtype, shape, begin, end (absolute)


def encode_header(tensors: Mapping[str, tuple[TensorDtype, tuple[int, ...], int]]) -> bytes:
    """The length prefix and JSON header for tensors ``name -> (dtype, shape, nbytes)``,
    laid out one after another in the given order."""
    header: dict[str, object] = {}
    off = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [off, off + nbytes],
        }
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def decode(data: bytes | bytearray | memoryview) -> dict[str, Entry]:
    """Tensors of a whole file: ``name -> (dtype, shape, begin, end)`` with absolute offsets."""
    mv = memoryview(data)
    if len(mv) < 8:
        raise InvalidArgumentError("safetensors file too short")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if n > MAX_HEADER or 8 + n > len(mv):
        raise InvalidArgumentError("safetensors header length out of range")
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
    except ValueError as e:
        raise InvalidArgumentError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise InvalidArgumentError("safetensors header is not an object")
    base = 8 + n
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_CODE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgumentError(f"bad safetensors entry {name!r}") from None
        count = 1
        for d in shape:
            if d < 0:
                raise InvalidArgumentError(f"bad shape for {name!r}")
            count *= d
        if not 0 <= begin <= end or base + end > len(mv) or end - begin != count * dtype.itemsize:
            raise InvalidArgumentError(f"bad data offsets for {name!r}")
        out[name] = (dtype, shape, base + begin, base + end)
    return out
