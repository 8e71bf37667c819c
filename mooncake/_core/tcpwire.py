"""Mooncake's TCP data protocol (version 2), as the published ``tcp`` transport speaks it.

Request header: the raw C struct ``{u64 size; u64 addr; u8 opcode}`` on x86-64, 24 bytes with
7 pad bytes, little-endian. ``addr`` is the peer's virtual address. Opcode READ=0, WRITE=1; bit
0x80 marks protocol v2.

v2 status frame: 8 bytes, the u64 ``0x4D435456_00000000 | code`` little-endian ("MCTV"), code 0
= OK, 1 = address rejected. WRITE: the client streams ``size`` bytes after the header and the
write is complete only when the server's status arrives. READ: the server sends the status first,
then ``size`` bytes (only if OK). The published server closes the connection after a rejection.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from mooncake._core.transfer import Opcode
from mooncake.errors import ProtocolError

HEADER = struct.Struct("<QQB7x")
HEADER_SIZE = HEADER.size  # 24
STATUS = struct.Struct("<Q")
STATUS_SIZE = STATUS.size  # 8
STATUS_MAGIC = 0x4D435456_00000000
STATUS_MAGIC_MASK = 0xFFFFFFFF_00000000
V2_FLAG = 0x80
PROTO_VERSION = 2


class Status(enum.IntEnum):
    OK = 0
    REJECTED = 1


@dataclass(frozen=True, slots=True)
class Header:
    size: int
    addr: int
    opcode: Opcode
    v2: bool


def encode_header(opcode: Opcode, addr: int, size: int, v2: bool = True) -> bytes:
    return HEADER.pack(size, addr, int(opcode) | (V2_FLAG if v2 else 0))


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse a 24-byte request header (:class:`ProtocolError` on an unknown opcode)."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"TCP request header must be {HEADER_SIZE} bytes, got {len(data)}")
    size, addr, op = HEADER.unpack(data)
    v2 = bool(op & V2_FLAG)
    base = op & ~V2_FLAG
    if base not in (0, 1):
        raise ProtocolError(f"unknown TCP opcode {op:#x}")
    return Header(size, addr, Opcode(base), v2)


def encode_status(status: Status | int) -> bytes:
    return STATUS.pack(STATUS_MAGIC | int(status))


def decode_status(data: bytes | bytearray | memoryview) -> int:
    """Parse a v2 status frame; returns the code (:class:`ProtocolError` if the magic is wrong)."""
    if len(data) != STATUS_SIZE:
        raise ProtocolError(f"TCP status frame must be {STATUS_SIZE} bytes, got {len(data)}")
    (value,) = STATUS.unpack(data)
    if value & STATUS_MAGIC_MASK != STATUS_MAGIC:
        raise ProtocolError(f"bad TCP status frame {value:#018x} (no MCTV magic)")
    return int(value & 0xFFFFFFFF)
