# cython: language_level=3
"""Sync, non-blocking C primitives on raw addresses (see ``mooncake._fast``).

Every function works on plain integers (file descriptors, virtual addresses, lengths) and never
touches the event loop. Calls that may copy many bytes or enter the kernel release the GIL.
Errors come back as ``-errno`` (I/O) so the async driver decides what EAGAIN means; nothing here
raises except on bad Python arguments.
"""

from libc.errno cimport errno
from libc.string cimport memcpy as c_memcpy, memset
from libc.stdint cimport uint8_t, uintptr_t
from libc.stdlib cimport malloc, free

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t readv(int fd, const iovec *iov, int iovcnt)
    ssize_t writev(int fd, const iovec *iov, int iovcnt)

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT

cdef extern from "<unistd.h>" nogil:
    long sysconf(int name)
    int _SC_PAGESIZE

DEF IOV_MAX_BATCH = 1024

COMPILED = True


def send_at(int fd, uintptr_t addr, size_t n):
    """send(2) ``n`` bytes from ``addr``; returns bytes sent or ``-errno``."""
    cdef ssize_t r
    with nogil:
        r = send(fd, <const void *>addr, n, MSG_NOSIGNAL | MSG_DONTWAIT)
    if r < 0:
        return -errno
    return r


def recv_at(int fd, uintptr_t addr, size_t n):
    """recv(2) up to ``n`` bytes into ``addr``; returns bytes received (0 = EOF) or ``-errno``."""
    cdef ssize_t r
    with nogil:
        r = recv(fd, <void *>addr, n, MSG_DONTWAIT)
    if r < 0:
        return -errno
    return r


cdef ssize_t _vec(int fd, object addrs, object lens, Py_ssize_t start, Py_ssize_t skip,
                  bint write) except -2:
    cdef Py_ssize_t count = len(addrs) - start
    if count <= 0:
        return 0
    if count > IOV_MAX_BATCH:
        count = IOV_MAX_BATCH
    cdef iovec *iov = <iovec *>malloc(count * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    cdef Py_ssize_t i
    cdef ssize_t r
    try:
        for i in range(count):
            iov[i].iov_base = <void *><uintptr_t>addrs[start + i]
            iov[i].iov_len = <size_t>lens[start + i]
        iov[0].iov_base = <void *>(<uintptr_t>iov[0].iov_base + skip)
        iov[0].iov_len -= skip
        with nogil:
            if write:
                r = writev(fd, iov, <int>count)
            else:
                r = readv(fd, iov, <int>count)
        if r < 0:
            return -errno
        return r
    finally:
        free(iov)


def writev_at(int fd, addrs, lens, Py_ssize_t start=0, Py_ssize_t skip=0):
    """writev(2) of ``(addrs[i], lens[i])`` for i >= start, the first one advanced by ``skip``.

    Returns bytes written or ``-errno``. At most 1024 entries go in one call.
    """
    return _vec(fd, addrs, lens, start, skip, True)


def readv_at(int fd, addrs, lens, Py_ssize_t start=0, Py_ssize_t skip=0):
    """readv(2) into ``(addrs[i], lens[i])``; same conventions as :func:`writev_at`."""
    return _vec(fd, addrs, lens, start, skip, False)


def memcpy_at(uintptr_t dst, uintptr_t src, size_t n):
    """memcpy(3) ``n`` bytes from ``src`` to ``dst`` with the GIL released."""
    with nogil:
        c_memcpy(<void *>dst, <const void *>src, n)


def prefault(uintptr_t addr, size_t n, bint write=True):
    """Touch every page of ``[addr, addr+n)`` so later transfers do not pay first-touch faults.

    With ``write`` the first byte of each page is rewritten with its own value (safe on live
    data); without it the pages are only read.
    """
    cdef size_t page = <size_t>sysconf(_SC_PAGESIZE)
    cdef size_t off = 0
    cdef volatile uint8_t *p = <volatile uint8_t *>addr
    cdef uint8_t v
    with nogil:
        while off < n:
            v = p[off]
            if write:
                p[off] = v
            off += page
        if n:
            v = p[n - 1]
            if write:
                p[n - 1] = v
