"""Pure-Python twin of ``_crc32c``: the same CRC32C (Castagnoli) results, table driven.

About 1000x slower than the compiled module (a few MB/s): good for tests and small values;
the store turns verification off by default when it runs on this twin (see ``docs/store.md``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

COMPILED = False
HARDWARE = False
KERNELS = ("pure",)
"""The one kernel of the twin (the compiled module's are ``table``, ``sse42``, ...)."""
AVAILABLE = KERNELS
KERNEL = "pure"
ENV = "MOONCAKE_CRC_KERNEL"


def set_kernel(name: str) -> str:
    """The compiled module's kernel switch: here every name selects the one pure kernel;
    returns ``"pure"``. A name that is no kernel of either module is a ``ValueError``."""
    if name not in ("pure", "table", "sse42", "pclmul", "avx512", "armv8"):
        raise ValueError(f"crc32c kernel {name!r}: not a kernel name")
    return KERNEL


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


def copy_crc32c(dst: int, src: int, n: int, crc: int = 0, stream: bool = False) -> int:
    """memcpy ``n`` bytes from ``src`` to ``dst``; the CRC32C of what landed at ``dst``.
    ``stream`` (non-temporal stores in the compiled module) changes nothing here."""
    _check(n, "copy_crc32c")
    if not n:
        return crc
    if not dst or not src:
        raise ValueError("copy_crc32c: null address")
    ctypes.memmove(dst, src, n)
    return crc32c_at(dst, n, crc)


def bytes_crc32c(src: int, n: int, crc: int = 0) -> tuple[bytes, int]:
    """``(data, crc)``: a new ``bytes`` of the ``n`` bytes at ``src`` and its CRC32C."""
    _check(n, "bytes_crc32c")
    if not n:
        return b"", crc
    if not src:
        raise ValueError("bytes_crc32c: null address")
    data = ctypes.string_at(src, n)
    return data, _update(crc, data)


def _times(mat: list[int], vec: int) -> int:
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _pow2() -> list[list[int]]:
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    op = _square(_square(_square(odd)))  # eight zero bits: one byte
    out = [op]
    for _ in range(47):
        out.append(_square(out[-1]))
    return out


_POW2: list[list[int]] = []


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len(B)``."""
    if not 0 <= len2 < 1 << 48:
        raise ValueError(f"crc32c_combine: length {len2} out of range")
    if not _POW2:
        _POW2.extend(_pow2())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_POW2[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def copy_crc32c_batch(
    dsts: Sequence[int],
    srcs: Sequence[int],
    lens: Sequence[int],
    sums: Sequence[bool],
    stream: bool = False,
) -> list[int]:
    """Copy each range; the CRC32C of each as it landed where ``sums[i]`` (else ``-1``)."""
    if not (len(dsts) == len(srcs) == len(lens) == len(sums)):
        raise ValueError("copy_crc32c_batch: sequences of different lengths")
    out = []
    for d, s, n, want in zip(dsts, srcs, lens, sums, strict=True):
        if want:
            out.append(copy_crc32c(d, s, n))
        else:
            _check(n, "copy_crc32c_batch")
            if n:
                ctypes.memmove(d, s, n)
            out.append(-1)
    return out
