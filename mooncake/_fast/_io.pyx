# cython: language_level=3
"""Sync, non-blocking C primitives on raw addresses (see ``mooncake._fast``).

Every function works on plain integers (file descriptors, virtual addresses, lengths) and never
touches the event loop. Calls that may copy many bytes or enter the kernel release the GIL.
Errors come back as ``-errno`` (I/O) so the async driver decides what EAGAIN means; nothing here
raises except on bad Python arguments.
"""

from libc.errno cimport errno
cdef extern from "mc_copy.h" nogil:
    void c_memcpy "mc_copy"(void *dst, const void *src, size_t n)
    void c_memcpy_stream "mc_copy_stream"(void *dst, const void *src, size_t n)
    void c_copy_fence "mc_copy_fence"()
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


cdef extern from "<sys/uio.h>" nogil:
    ssize_t process_vm_readv(int pid, const iovec *local_iov, unsigned long liovcnt,
                             const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec *local_iov, unsigned long liovcnt,
                              const iovec *remote_iov, unsigned long riovcnt, unsigned long flags)


def memcpy_batch(dsts, srcs, lens, bint stream=False):
    """memcpy(3) of ``(dsts[i], srcs[i], lens[i])`` for every i, all with the GIL released once.

    The three sequences are read into a C array first, so no Python object is touched while
    copying. With ``stream`` the destinations are written with non-temporal stores (for
    destinations not read again soon, such as a put into a store segment: less memory traffic
    on copies larger than the cache), fenced before returning. Returns the number of bytes
    copied.
    """
    cdef Py_ssize_t n = len(dsts), i
    if len(srcs) != n or len(lens) != n:
        raise ValueError("memcpy_batch: dsts, srcs and lens differ in length")
    if n == 0:
        return 0
    cdef uintptr_t *a = <uintptr_t *>malloc(3 * n * sizeof(uintptr_t))
    if a == NULL:
        raise MemoryError()
    cdef size_t total = 0
    try:
        for i in range(n):
            a[3 * i] = <uintptr_t>dsts[i]
            a[3 * i + 1] = <uintptr_t>srcs[i]
            a[3 * i + 2] = <uintptr_t>lens[i]
            total += a[3 * i + 2]
        with nogil:
            if stream:
                for i in range(n):
                    c_memcpy_stream(<void *>a[3 * i], <const void *>a[3 * i + 1], <size_t>a[3 * i + 2])
                c_copy_fence()
            else:
                for i in range(n):
                    c_memcpy(<void *>a[3 * i], <const void *>a[3 * i + 1], <size_t>a[3 * i + 2])
        return total
    finally:
        free(a)


cdef object _vm(int pid, object laddrs, object raddrs, object lens, bint write):
    cdef Py_ssize_t n = len(laddrs), i, done = 0, k
    if len(raddrs) != n or len(lens) != n:
        raise ValueError("vm: laddrs, raddrs and lens differ in length")
    if n == 0:
        return 0
    cdef iovec *lv = <iovec *>malloc(2 * n * sizeof(iovec))
    if lv == NULL:
        raise MemoryError()
    cdef iovec *rv = lv + n
    cdef ssize_t r = 0
    cdef size_t total = 0
    try:
        for i in range(n):
            lv[i].iov_base = <void *><uintptr_t>laddrs[i]
            lv[i].iov_len = <size_t>lens[i]
            rv[i].iov_base = <void *><uintptr_t>raddrs[i]
            rv[i].iov_len = lv[i].iov_len
        with nogil:
            # the kernel may stop early (partial transfer, IOV_MAX): continue from where it did
            while done < n:
                k = n - done
                if k > IOV_MAX_BATCH:
                    k = IOV_MAX_BATCH
                if write:
                    r = process_vm_writev(pid, lv + done, k, rv + done, k, 0)
                else:
                    r = process_vm_readv(pid, lv + done, k, rv + done, k, 0)
                if r < 0:
                    break
                if r == 0:
                    break
                total += r
                while r > 0 and done < n:
                    if <size_t>r >= lv[done].iov_len:
                        r -= lv[done].iov_len
                        done += 1
                    else:
                        lv[done].iov_base = <void *>(<uintptr_t>lv[done].iov_base + r)
                        lv[done].iov_len -= r
                        rv[done].iov_base = <void *>(<uintptr_t>rv[done].iov_base + r)
                        rv[done].iov_len -= r
                        r = 0
        if r < 0:
            return -errno
        if done < n:
            return -5  # EIO: the kernel moved nothing more (remote range unmapped)
        return total
    finally:
        free(lv)


def vm_readv_at(int pid, laddrs, raddrs, lens):
    """process_vm_readv(2): ``pid``'s ``raddrs[i]`` into local ``laddrs[i]``, ``lens[i]`` each.

    Returns the bytes copied or ``-errno`` (``-EPERM``: the kernel's ptrace policy refuses;
    ``-ESRCH``: no such process; ``-EFAULT``: a range is not mapped there).
    """
    return _vm(pid, laddrs, raddrs, lens, False)


def vm_writev_at(int pid, laddrs, raddrs, lens):
    """process_vm_writev(2): the mirror of :func:`vm_readv_at`."""
    return _vm(pid, laddrs, raddrs, lens, True)
