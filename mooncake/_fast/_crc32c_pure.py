"""Pure-Python twin of ``_crc32c``: the same CRC32C (Castagnoli) results, table driven.

About 1000x slower than the compiled module (a few MB/s): good for tests and small values;
the store turns verification off by default when it runs on this twin (see ``docs/store.md``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

COMPILED = False
HARDWARE = False

_POLY = 0x82F63B78


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return out


_T = _table()


def _update(crc: int, data: bytes | memoryview) -> int:
    c = crc ^ 0xFFFFFFFF
    t = _T
    for b in bytes(data):
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _check(n: int, what: str) -> None:
    if n < 0:
        raise ValueError(f"{what}: negative length {n}")


def crc32c_at(addr: int, n: int, crc: int = 0) -> int:
    """The CRC32C of the ``n`` bytes at ``addr``, extending ``crc``."""
    _check(n, "crc32c_at")
    if not n:
        return crc
    if not addr:
        raise ValueError("crc32c_at: null address")
    return _update(crc, ctypes.string_at(addr, n))


def crc32c(buf: Any, crc: int = 0) -> int:
    """The CRC32C of a C-contiguous buffer, extending ``crc``."""
    return _update(crc, memoryview(buf).cast("B"))


def crc32c_parts(parts: Iterable[tuple[int, int]], crc: int = 0) -> int:
    """The CRC32C of the concatenation of ``(address, length)`` ranges, extending ``crc``."""
    for a, n in parts:
        crc = crc32c_at(a, n, crc)
    return crc


def copy_crc32c(dst: int, src: int, n: int, crc: int = 0) -> int:
    """memcpy ``n`` bytes from ``src`` to ``dst``; the CRC32C of what landed at ``dst``."""
    _check(n, "copy_crc32c")
    if not n:
        return crc
    if not dst or not src:
        raise ValueError("copy_crc32c: null address")
    ctypes.memmove(dst, src, n)
    return crc32c_at(dst, n, crc)
