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
