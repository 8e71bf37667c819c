"""Pure-Python twins of the compiled primitives in ``_io.pyx`` (same names, same contracts).

Used when the extension is not built or ``MOONCAKE_NO_EXTENSIONS=1``. Slower, never different.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
from collections.abc import Sequence

COMPILED = False

_PAGE = mmap.PAGESIZE
_IOV_MAX_BATCH = 1024


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def send_at(fd: int, addr: int, n: int) -> int:
    """send(2) ``n`` bytes from ``addr``; returns bytes sent or ``-errno``."""
    try:
        return os.write(fd, _view(addr, n)) if n else 0
    except OSError as e:
        return -(e.errno or errno.EIO)


def recv_at(fd: int, addr: int, n: int) -> int:
    """recv(2) up to ``n`` bytes into ``addr``; returns bytes received (0 = EOF) or ``-errno``."""
    try:
        return os.readv(fd, [_view(addr, n)]) if n else 0
    except OSError as e:
        return -(e.errno or errno.EIO)


def _iov(addrs: Sequence[int], lens: Sequence[int], start: int, skip: int) -> list[memoryview]:
    end = min(len(addrs), start + _IOV_MAX_BATCH)
    views = [_view(addrs[i], lens[i]) for i in range(start, end)]
    if views:
        views[0] = views[0][skip:]
    return views


def writev_at(
    fd: int, addrs: Sequence[int], lens: Sequence[int], start: int = 0, skip: int = 0
) -> int:
    """writev(2) of ``(addrs[i], lens[i])`` for i >= start, the first advanced by ``skip``."""
    views = _iov(addrs, lens, start, skip)
    if not views:
        return 0
    try:
        return os.writev(fd, views)
    except OSError as e:
        return -(e.errno or errno.EIO)


def readv_at(
    fd: int, addrs: Sequence[int], lens: Sequence[int], start: int = 0, skip: int = 0
) -> int:
    """readv(2) into ``(addrs[i], lens[i])``; same conventions as :func:`writev_at`."""
    views = _iov(addrs, lens, start, skip)
    if not views:
        return 0
    try:
        return os.readv(fd, views)
    except OSError as e:
        return -(e.errno or errno.EIO)


def memcpy_at(dst: int, src: int, n: int) -> None:
    """memcpy(3) ``n`` bytes from ``src`` to ``dst``."""
    if n:
        ctypes.memmove(dst, src, n)


def prefault(addr: int, n: int, write: bool = True) -> None:
    """Touch every page of ``[addr, addr+n)`` (see the compiled twin)."""
    if not n:
        return
    view = _view(addr, n)
    for off in range(0, n, _PAGE):
        v = view[off]
        if write:
            view[off] = v
    v = view[n - 1]
    if write:
        view[n - 1] = v


# socket is imported so both twins expose the same module-level names users may rely on.
del socket


def memcpy_batch(
    dsts: Sequence[int], srcs: Sequence[int], lens: Sequence[int], stream: bool = False
) -> int:
    """memcpy(3) of every ``(dsts[i], srcs[i], lens[i])``; returns the bytes copied
    (``stream``, non-temporal stores in the compiled twin, changes nothing here)."""
    if not len(dsts) == len(srcs) == len(lens):
        raise ValueError("memcpy_batch: dsts, srcs and lens differ in length")
    total = 0
    for d, s, n in zip(dsts, srcs, lens, strict=True):
        if n:
            ctypes.memmove(d, s, n)
        total += n
    return total


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _vm(
    pid: int, laddrs: Sequence[int], raddrs: Sequence[int], lens: Sequence[int], write: bool
) -> int:
    n = len(laddrs)
    if not n == len(raddrs) == len(lens):
        raise ValueError("vm: laddrs, raddrs and lens differ in length")
    if n == 0:
        return 0
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    total = 0
    for i in range(n):  # one call per range: simple and exact about partial transfers
        done = 0
        while done < lens[i]:
            lv = _IoVec(laddrs[i] + done, lens[i] - done)
            rv = _IoVec(raddrs[i] + done, lens[i] - done)
            r = fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
            if r < 0:
                return -(ctypes.get_errno() or errno.EIO)
            if r == 0:
                return -errno.EIO
            done += r
        total += done
    return total


def vm_readv_at(pid: int, laddrs: Sequence[int], raddrs: Sequence[int], lens: Sequence[int]) -> int:
    """process_vm_readv(2) of ``pid``'s ``raddrs[i]`` into ``laddrs[i]``; bytes or ``-errno``."""
    return _vm(pid, laddrs, raddrs, lens, False)


def vm_writev_at(
    pid: int, laddrs: Sequence[int], raddrs: Sequence[int], lens: Sequence[int]
) -> int:
    """process_vm_writev(2): the mirror of :func:`vm_readv_at`."""
    return _vm(pid, laddrs, raddrs, lens, True)
