# cython: language_level=3
"""CRC32C on raw addresses and buffers: carry-less multiply folding (VPCLMULQDQ / PCLMULQDQ)
and the SSE4.2 / ARMv8 CRC instructions from C.

See ``csrc/mc_crc32c.h`` for the method. The kernel is chosen at import from what the CPU has
(``KERNEL``, one of ``KERNELS``); ``MOONCAKE_CRC_KERNEL`` (a name from ``KERNELS``) or
:func:`set_kernel` picks another, at most the best this CPU has (tests run every one). Every function takes the CRC so far (``crc``, 0 to
start) and returns it extended, so a value in parts checksums as the concatenation:
``crc32c(b, crc32c(a)) == crc32c(a + b)``. The GIL is released for 64 KiB and more.
The pure-Python twin is ``_crc32c_pure`` (same results, table driven, far slower).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import os

cdef extern from "mc_crc32c.h" nogil:
    void mc_crc32c_init()
    int mc_crc_hw
    int mc_crc_best
    int mc_crc_default
    int mc_crc32c_set_kernel(int want)
    int MC_CRC_HAVE_FOLD
    uint32_t mc_crc32c(uint32_t crc, const void *p, size_t n)
    uint32_t mc_copy_crc32c(void *dst, const void *src, size_t n, uint32_t crc)
    uint32_t mc_copy_crc32c_ex(void *dst, const void *src, size_t n, uint32_t crc, int stream)
    uint32_t mc_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)

mc_crc32c_init()

COMPILED = True
KERNELS = ("table", "sse42", "pclmul", "avx512") if MC_CRC_HAVE_FOLD else ("table", "armv8")
"""Every kernel, slowest first: slice-by-8 tables, the CRC instruction on three streams,
PCLMULQDQ folding of 128-bit lanes, VPCLMULQDQ (AVX-512) folding of 512-bit lanes (on
aarch64: tables and the ARMv8 CRC32C instructions)."""
AVAILABLE = KERNELS[: mc_crc_best + 1]
"""The kernels this CPU can run."""
ENV = "MOONCAKE_CRC_KERNEL"


def set_kernel(name):
    """Use kernel ``name`` (one of ``KERNELS``; the best available if this CPU lacks it) for
    every later checksum; returns the kernel in use. Not for use while checksums run."""
    global KERNEL, HARDWARE
    if name not in KERNELS:
        raise ValueError(f"crc32c kernel {name!r}: not one of {', '.join(KERNELS)}")
    KERNEL = KERNELS[mc_crc32c_set_kernel(KERNELS.index(name))]
    HARDWARE = bool(mc_crc_hw)
    return KERNEL


KERNEL = KERNELS[mc_crc_default]
"""The kernel in use."""
HARDWARE = bool(mc_crc_hw)
"""Whether a hardware kernel is used (else slice-by-8 tables in C)."""
if os.environ.get(ENV):
    if os.environ[ENV] not in KERNELS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: not one of {', '.join(KERNELS)}")
    set_kernel(os.environ[ENV])

DEF _NOGIL_AT = 65536


cdef inline uint32_t _crc_of(uintptr_t p, size_t n, uint32_t crc) noexcept:
    if n >= _NOGIL_AT:
        with nogil:
            crc = mc_crc32c(crc, <const void *>p, n)
        return crc
    return mc_crc32c(crc, <const void *>p, n)


def crc32c_at(uintptr_t addr, Py_ssize_t n, uint32_t crc=0):
    """The CRC32C of the ``n`` bytes at ``addr``, extending ``crc``."""
    if n < 0:
        raise ValueError(f"crc32c_at: negative length {n}")
    if n and not addr:
        raise ValueError("crc32c_at: null address")
    return _crc_of(addr, <size_t>n, crc)


def crc32c(object buf, uint32_t crc=0):
    """The CRC32C of a C-contiguous buffer (``bytes``, ``memoryview``...), extending ``crc``."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        return _crc_of(<uintptr_t>view.buf, <size_t>view.len, crc)
    finally:
        PyBuffer_Release(&view)


def crc32c_parts(object parts, uint32_t crc=0):
    """The CRC32C of the concatenation of ``(address, length)`` ranges, extending ``crc``."""
    cdef uintptr_t a
    cdef Py_ssize_t n
    for a, n in parts:
        if n < 0:
            raise ValueError(f"crc32c_parts: negative length {n}")
        if n:
            if not a:
                raise ValueError("crc32c_parts: null address")
            crc = _crc_of(a, <size_t>n, crc)
    return crc


def copy_crc32c(uintptr_t dst, uintptr_t src, Py_ssize_t n, uint32_t crc=0, bint stream=False):
    """memcpy ``n`` bytes from ``src`` to ``dst`` and return the CRC32C of what landed at
    ``dst`` (extending ``crc``), in one pass: each byte loaded once, stored and checksummed
    (the table kernel: cache-sized chunks copied, then checksummed). With ``stream`` (a
    destination not read again soon) the folding kernels write 4 KiB and more with
    non-temporal stores."""
    if n < 0:
        raise ValueError(f"copy_crc32c: negative length {n}")
    if n and (not dst or not src):
        raise ValueError("copy_crc32c: null address")
    if n >= _NOGIL_AT:
        with nogil:
            crc = mc_copy_crc32c_ex(<void *>dst, <const void *>src, <size_t>n, crc, stream)
        return crc
    return mc_copy_crc32c_ex(<void *>dst, <const void *>src, <size_t>n, crc, stream)


def bytes_crc32c(uintptr_t src, Py_ssize_t n, uint32_t crc=0):
    """``(data, crc)``: a new ``bytes`` of the ``n`` bytes at ``src`` and the CRC32C of what
    landed in it (extending ``crc``), copied and checksummed in one pass."""
    if n < 0:
        raise ValueError(f"bytes_crc32c: negative length {n}")
    if n and not src:
        raise ValueError("bytes_crc32c: null address")
    out = PyBytes_FromStringAndSize(NULL, n)
    cdef char *d = PyBytes_AS_STRING(out)
    if n >= _NOGIL_AT:
        with nogil:
            crc = mc_copy_crc32c(<void *>d, <const void *>src, <size_t>n, crc)
    elif n:
        crc = mc_copy_crc32c(<void *>d, <const void *>src, <size_t>n, crc)
    return out, crc


def crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2):
    """The CRC32C of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len(B)``."""
    if len2 >= (<uint64_t>1) << 48:
        raise ValueError(f"crc32c_combine: length {len2} too large")
    return mc_crc32c_combine(crc1, crc2, len2)


def copy_crc32c_batch(dsts, srcs, lens, sums, bint stream=False):
    """Copy ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every ``i`` (GIL released for
    the whole batch), each in one pass with its CRC32C where ``sums[i]`` is true; the CRC of
    each range as it landed (``-1`` where not asked). ``stream``: as :func:`copy_crc32c`,
    for the summed ranges."""
    cdef Py_ssize_t n = len(dsts), i
    if not (len(srcs) == n and len(lens) == n and len(sums) == n):
        raise ValueError("copy_crc32c_batch: sequences of different lengths")
    cdef uintptr_t *t = <uintptr_t *>malloc(sizeof(uintptr_t) * 4 * (n if n else 1))
    if t == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            t[4 * i] = dsts[i]
            t[4 * i + 1] = srcs[i]
            ln = lens[i]
            if ln < 0:
                raise ValueError(f"copy_crc32c_batch: negative length {ln}")
            if ln and (not t[4 * i] or not t[4 * i + 1]):
                raise ValueError("copy_crc32c_batch: null address")
            t[4 * i + 2] = <uintptr_t>ln
            t[4 * i + 3] = 1 if sums[i] else 0
        with nogil:
            for i in range(n):
                if t[4 * i + 3]:
                    t[4 * i + 3] = 2 + mc_copy_crc32c_ex(
                        <void *>t[4 * i], <const void *>t[4 * i + 1], t[4 * i + 2], 0, stream
                    )
                elif t[4 * i + 2]:
                    memcpy(<void *>t[4 * i], <const void *>t[4 * i + 1], t[4 * i + 2])
        return [<long long>t[4 * i + 3] - 2 if t[4 * i + 3] else -1 for i in range(n)]
    finally:
        free(t)
