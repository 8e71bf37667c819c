"""MessagePack for the ``msgpack_ragged`` codec: the ``msgpack`` package when installed, else a
small pure-Python twin of the subset that codec uses.

``packb(value)`` packs like ``msgpack.packb(value, use_bin_type=True, strict_types=True)``
(``None``, ``bool``, ``int``, ``float`` as float64, ``str``, ``bytes``, ``list``, ``dict``;
anything else, tuples and subclasses included, raises ``TypeError``); ``unpack_all(data)`` reads
every packed value in ``data`` like ``msgpack.Unpacker(raw=False)``.
"""

from __future__ import annotations

import struct
from typing import Any

from mooncake._structured.model import optional_module

__all__ = ["NATIVE", "packb", "unpack_all"]

_msgpack: Any = optional_module("msgpack")
NATIVE: Any = _msgpack  # the compiled package, when installed


def _pack(value: Any, out: bytearray) -> None:
    t = type(value)
    if value is None:
        out.append(0xC0)
    elif t is bool:
        out.append(0xC3 if value else 0xC2)
    elif t is int:
        if 0 <= value < 0x80:
            out.append(value)
        elif -32 <= value < 0:
            out.append(value & 0xFF)
        elif 0 <= value <= 0xFF:
            out += b"\xcc" + struct.pack(">B", value)
        elif 0 <= value <= 0xFFFF:
            out += b"\xcd" + struct.pack(">H", value)
        elif 0 <= value <= 0xFFFFFFFF:
            out += b"\xce" + struct.pack(">I", value)
        elif 0 <= value <= 0xFFFFFFFFFFFFFFFF:
            out += b"\xcf" + struct.pack(">Q", value)
        elif -0x80 <= value < 0:
            out += b"\xd0" + struct.pack(">b", value)
        elif -0x8000 <= value < 0:
            out += b"\xd1" + struct.pack(">h", value)
        elif -0x80000000 <= value < 0:
            out += b"\xd2" + struct.pack(">i", value)
        elif -0x8000000000000000 <= value < 0:
            out += b"\xd3" + struct.pack(">q", value)
        else:
            raise OverflowError("Integer value out of range")
    elif t is float:
        out += b"\xcb" + struct.pack(">d", value)
    elif t is str:
        data = value.encode("utf-8")
        n = len(data)
        if n < 32:
            out.append(0xA0 | n)
        elif n <= 0xFF:
            out += b"\xd9" + struct.pack(">B", n)
        elif n <= 0xFFFF:
            out += b"\xda" + struct.pack(">H", n)
        else:
            out += b"\xdb" + struct.pack(">I", n)
        out += data
    elif t is bytes or t is bytearray:
        n = len(value)
        if n <= 0xFF:
            out += b"\xc4" + struct.pack(">B", n)
        elif n <= 0xFFFF:
            out += b"\xc5" + struct.pack(">H", n)
        else:
            out += b"\xc6" + struct.pack(">I", n)
        out += value
    elif t is list:
        n = len(value)
        if n < 16:
            out.append(0x90 | n)
        elif n <= 0xFFFF:
            out += b"\xdc" + struct.pack(">H", n)
        else:
            out += b"\xdd" + struct.pack(">I", n)
        for item in value:
            _pack(item, out)
    elif t is dict:
        n = len(value)
        if n < 16:
            out.append(0x80 | n)
        elif n <= 0xFFFF:
            out += b"\xde" + struct.pack(">H", n)
        else:
            out += b"\xdf" + struct.pack(">I", n)
        for k, v in value.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(f"can not serialize {t.__name__!r} object")


def packb(value: Any) -> bytes:
    """``value`` packed (see the module docstring)."""
    if _msgpack is not None:
        return bytes(_msgpack.packb(value, use_bin_type=True, strict_types=True))
    out = bytearray()
    _pack(value, out)
    return bytes(out)


_FIXED = {
    0xCC: ">B",
    0xCD: ">H",
    0xCE: ">I",
    0xCF: ">Q",
    0xD0: ">b",
    0xD1: ">h",
    0xD2: ">i",
    0xD3: ">q",
}
_FLOAT = {0xCA: ">f", 0xCB: ">d"}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ValueError("truncated msgpack data")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def num(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def value(self) -> Any:
        b = self.take(1)[0]
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return [self.value() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xC4, 0xC5, 0xC6):
            return bytes(self.take(self.num({0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}[b])))
        if b in _FLOAT:
            return self.num(_FLOAT[b])
        if b in _FIXED:
            return self.num(_FIXED[b])
        if b in (0xD9, 0xDA, 0xDB):
            return self.take(self.num({0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}[b])).decode("utf-8")
        if b in (0xDC, 0xDD):
            return [self.value() for _ in range(self.num(">H" if b == 0xDC else ">I"))]
        if b in (0xDE, 0xDF):
            return self.map(self.num(">H" if b == 0xDE else ">I"))
        raise ValueError(f"unsupported msgpack type byte 0x{b:02x}")

    def map(self, n: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for _ in range(n):
            k = self.value()
            out[k] = self.value()
        return out


def unpack_all(data: bytes) -> list[Any]:
    """Every value packed back to back in ``data`` (strings as ``str``, bin as ``bytes``)."""
    if _msgpack is not None:
        unpacker = _msgpack.Unpacker(raw=False)
        unpacker.feed(data)
        return list(unpacker)
    reader = _Reader(data)
    values = []
    while reader.pos < len(data):
        values.append(reader.value())
    return values
