# cython: language_level=3
"""Mooncake TCP v2 data protocol state machines on raw addresses, run without the GIL.

Two resumable, non-blocking machines that the async driver steps until they need the socket to
become readable or writable (``WANT_READ``/``WANT_WRITE``), so a batch of many requests costs a
few system calls and no Python object per request:

* :class:`ServeConn` serves one connection: header -> bounds check against a
  :class:`RegionTable` -> READ: ``writev(status, data)``; WRITE: ``recv`` straight into the
  region, then the status. Refusals follow ``mooncake._engine.transports.tcp``: status 1 and keep
  the connection (a refused WRITE's payload up to ``drain_limit`` is read and dropped); v1
  requests, or a bigger refused payload, close it. A request on a range the table marks as
  device memory is not touched with the CPU: the machine sends the replies before it and
  returns ``STAGE``; the caller moves that request's bytes through its CUDA staging
  (:meth:`ServeConn.staged`, :meth:`ServeConn.take_input`) and resumes the machine with
  :meth:`ServeConn.staged_done`.
* :class:`ClientPipe` sends one group of same-opcode requests (headers and WRITE payloads in
  ``writev`` calls) and reads the replies in order (statuses, READ data straight into place).

:class:`RegionTable` is the server's view of registered memory: sorted, disjoint ranges with a
user count; ``remove`` refuses new users at once and blocks until the last one is gone (call it
in a worker thread). Both machines hold a region for the whole of a request.

Deadlines (:meth:`ServeConn.serve_blocking`): a connection in the middle of a request whose
socket makes no progress for ``progress_ms`` is dropped (``-ETIMEDOUT``), and so is one whose
request is not done within ``progress_ms`` + its size / ``min_rate`` (bytes per second) of its
start (the first byte after the previous request began; a peer trickling a byte at a time
cannot hold a connection); one idle between requests for ``idle_ms`` is closed (``CLOSE``). :meth:`RegionTable.close` marks a range closing;
:meth:`ServeConn.wake` then makes a serving thread drop its connection if it holds a closing
range (``-ECONNABORTED``), so a silent peer cannot hold memory that is being unregistered.
"""

from libc.errno cimport errno, EAGAIN, EINTR, ECONNRESET, ETIMEDOUT, ECONNABORTED
from libc.stdint cimport uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy, memmove, memset

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t writev(int fd, const iovec *iov, int iovcnt)
    ssize_t readv(int fd, const iovec *iov, int iovcnt)

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN
    short POLLOUT

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *ts)
    int CLOCK_MONOTONIC

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    int EFD_NONBLOCK
    int EFD_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t c_write "write" (int fd, const void *buf, size_t n)
    ssize_t c_read "read" (int fd, void *buf, size_t n)
    int c_close "close" (int fd)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_broadcast(pthread_cond_t *c)

COMPILED = True

cdef extern from *:
    """
    #define MC_STATUS_MAGIC 0x4D43545600000000ULL
    #define MC_STATUS_MASK 0xFFFFFFFF00000000ULL
    """
    uint64_t MC_STATUS_MAGIC
    uint64_t MC_STATUS_MASK

cdef enum:
    R_DONE = 0
    R_WANT_READ = 1
    R_WANT_WRITE = 2
    R_YIELD = 3
    R_CLOSE = 4
    R_PEER_CLOSED = 5
    R_STAGE = 6

STAGE_SIZE = 65536  # size of the staging buffer a ClientPipe wants (= STAGE_CAP)

# step() results
DONE = R_DONE
WANT_READ = R_WANT_READ
WANT_WRITE = R_WANT_WRITE
YIELD = R_YIELD
CLOSE = R_CLOSE  # server: close the connection (v1 refusal, oversized refused payload), all sent
PEER_CLOSED = R_PEER_CLOSED  # the peer closed: between requests (server), after a refusal (client)
STAGE = R_STAGE  # server: a request on a device range waits for the caller (ServeConn.staged)

DEF HEADER_SIZE = 24
DEF STATUS_SIZE = 8
DEF V2_FLAG = 0x80
DEF STEP_REQUESTS = 64
DEF STEP_BYTES = 16 << 20
DEF IOV_CHUNK = 512
DEF E_PROTO = 100000  # -E_PROTO: malformed header / status frame

cdef struct region_t:
    uintptr_t start
    size_t length
    long users
    int closing
    int device   # >= 0: device memory (CUDA ordinal), served through the caller's staging


cdef class RegionTable:
    """Registered ranges the TCP server may serve (sorted, disjoint), with user counts."""

    cdef region_t **regs
    cdef Py_ssize_t n, cap
    cdef pthread_mutex_t mu
    cdef pthread_cond_t cv

    def __cinit__(self):
        self.regs = NULL
        self.n = 0
        self.cap = 0
        pthread_mutex_init(&self.mu, NULL)
        pthread_cond_init(&self.cv, NULL)

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.n):
            free(self.regs[i])
        free(self.regs)
        pthread_cond_destroy(&self.cv)
        pthread_mutex_destroy(&self.mu)

    cdef Py_ssize_t _bisect(self, uintptr_t addr) noexcept nogil:
        # index of the last region whose start <= addr, or -1
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) // 2
            if self.regs[mid].start <= addr:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def add(self, uintptr_t start, size_t length, int device=-1):
        """Add ``[start, start+length)``; ``ValueError`` if empty or overlapping.

        ``device >= 0`` marks device memory: :class:`ServeConn` never touches it with the CPU,
        it hands such requests to its caller (``STAGE``).
        """
        if length == 0:
            raise ValueError("empty range")
        cdef Py_ssize_t i
        cdef region_t *r
        cdef region_t **grown
        pthread_mutex_lock(&self.mu)
        try:
            i = self._bisect(start)
            if i >= 0 and self.regs[i].start + self.regs[i].length > start:
                raise ValueError("overlaps a registered range")
            if i + 1 < self.n and self.regs[i + 1].start < start + length:
                raise ValueError("overlaps a registered range")
            if self.n == self.cap:
                grown = <region_t **>realloc(self.regs, (self.cap * 2 + 8) * sizeof(region_t *))
                if grown == NULL:
                    raise MemoryError()
                self.regs = grown
                self.cap = self.cap * 2 + 8
            r = <region_t *>malloc(sizeof(region_t))
            if r == NULL:
                raise MemoryError()
            r.start = start
            r.length = length
            r.users = 0
            r.closing = 0
            r.device = device if device >= 0 else -1
            for j in range(self.n, i + 1, -1):
                self.regs[j] = self.regs[j - 1]
            self.regs[i + 1] = r
            self.n += 1
        finally:
            pthread_mutex_unlock(&self.mu)

    def remove(self, uintptr_t start):
        """Remove the range starting at ``start``; blocks until no request uses it.

        New requests are refused from the moment this is called. Returns False if absent.
        """
        cdef Py_ssize_t i, j
        cdef region_t *r
        cdef bint found = False
        with nogil:
            pthread_mutex_lock(&self.mu)
            i = self._bisect(start)
            if i >= 0 and self.regs[i].start == start:
                found = True
                r = self.regs[i]
                r.closing = 1
                while r.users > 0:
                    pthread_cond_wait(&self.cv, &self.mu)
                i = self._bisect(start)  # the array may have changed while we waited
                for j in range(i, self.n - 1):
                    self.regs[j] = self.regs[j + 1]
                self.n -= 1
                free(r)
            pthread_mutex_unlock(&self.mu)
        return found

    def close(self, uintptr_t start):
        """Refuse new requests on the range starting at ``start`` (``remove`` still to come).

        Returns whether it has users right now (requests in progress that hold it).
        """
        cdef Py_ssize_t i
        cdef long users = 0
        with nogil:
            pthread_mutex_lock(&self.mu)
            i = self._bisect(start)
            if i >= 0 and self.regs[i].start == start:
                self.regs[i].closing = 1
                users = self.regs[i].users
            pthread_mutex_unlock(&self.mu)
        return users > 0

    def reopen(self, uintptr_t start):
        """Undo :meth:`close` (an unregistration that did not go through); False if absent."""
        cdef Py_ssize_t i
        cdef bint found = False
        with nogil:
            pthread_mutex_lock(&self.mu)
            i = self._bisect(start)
            if i >= 0 and self.regs[i].start == start:
                self.regs[i].closing = 0
                found = True
            pthread_mutex_unlock(&self.mu)
        return found

    def find(self, uintptr_t addr, size_t length):
        """Whether one open range holds all of ``[addr, addr+length)`` (for tests and logs)."""
        cdef region_t *r = self.acquire(addr, length)
        if r == NULL:
            return False
        self.release(r)
        return True

    def __len__(self):
        return self.n

    cdef region_t *acquire(self, uintptr_t addr, size_t length) noexcept nogil:
        cdef region_t *r = NULL
        cdef Py_ssize_t i
        if length == 0 or addr + length < addr:
            return NULL
        pthread_mutex_lock(&self.mu)
        i = self._bisect(addr)
        if i >= 0:
            r = self.regs[i]
            if r.closing or addr + length > r.start + r.length:
                r = NULL
            else:
                r.users += 1
        pthread_mutex_unlock(&self.mu)
        return r

    cdef void release(self, region_t *r) noexcept nogil:
        pthread_mutex_lock(&self.mu)
        r.users -= 1
        if r.users == 0 and r.closing:
            pthread_cond_broadcast(&self.cv)
        pthread_mutex_unlock(&self.mu)


# -- server ----------------------------------------------------------------------------------

DEF S_HDR = 0
DEF S_PAYLOAD = 1     # WRITE payload into the region
DEF S_DRAIN = 2       # refused WRITE payload, dropped
DEF S_CLOSED = 3
DEF S_STAGE = 4       # a request on a device range, waiting for the caller (staged_done)
DEF IN_CAP = 65536    # input staging: many small requests arrive in one recv
DEF OUT_SLOTS = 128   # replies coalesced into one writev
DEF DIRECT_MIN = 16384  # payloads at least this big go straight from the socket into place
DEF STAGE_CAP = 65536  # client: statuses and small READ data staged per recv

cdef class ServeConn:
    """The server side of one connection (see the module docstring).

    Input is staged: one ``recv`` brings in many headers and small WRITE payloads, which are
    copied into place from there; bigger payloads are received in place. Replies (statuses, READ
    data straight from the region) are coalesced and sent with one ``writev`` whenever the input
    runs dry or the reply slots fill. A READ's region stays held until its data is sent.
    """

    cdef int fd
    cdef RegionTable table
    cdef size_t drain_limit
    cdef int state
    cdef uint8_t *inbuf
    cdef size_t in_pos, in_len
    cdef region_t *held            # region of the WRITE payload being received
    cdef uintptr_t addr
    cdef size_t left
    cdef bint v2
    cdef bint close_after
    cdef iovec out[2 * OUT_SLOTS]
    cdef Py_ssize_t nout, out_pos
    cdef uint64_t stat[OUT_SLOTS]
    cdef Py_ssize_t nstat
    cdef region_t *out_held[OUT_SLOTS]
    cdef Py_ssize_t nheld
    cdef readonly long served
    cdef readonly long refused
    cdef int stop_fd
    cdef volatile int stopping
    cdef volatile int evicting
    cdef uint8_t st_op
    cdef bint st_v2
    cdef uintptr_t st_addr
    cdef size_t st_len
    cdef long long req_start       # ms (CLOCK_MONOTONIC) the current request began; -1 idle
    cdef long req_mark             # served + refused when it began
    cdef uint64_t req_size         # its size (payload or reply bytes), from its header

    def __cinit__(self, int fd, RegionTable table not None, size_t drain_limit,
                  size_t scratch_size=65536):
        self.stop_fd = -1
        self.stopping = 0
        self.evicting = 0
        self.fd = fd
        self.table = table
        self.drain_limit = drain_limit
        self.state = S_HDR
        self.in_pos = 0
        self.in_len = 0
        self.held = NULL
        self.nout = 0
        self.out_pos = 0
        self.nstat = 0
        self.nheld = 0
        self.close_after = False
        self.inbuf = <uint8_t *>malloc(IN_CAP)
        if self.inbuf == NULL:
            raise MemoryError()
        self.served = 0
        self.refused = 0
        self.req_start = -1
        self.req_mark = 0
        self.req_size = 0

    def __dealloc__(self):
        self._release_all()
        free(self.inbuf)
        if self.stop_fd >= 0:
            c_close(self.stop_fd)

    def serve_blocking(self, long progress_ms=-1, long idle_ms=-1, double min_rate=0):
        """Serve the connection on the calling thread until it ends or :meth:`stop` is called.

        Runs without the GIL, waiting in ``poll`` (the socket and a private eventfd) instead of
        returning WANT_READ/WANT_WRITE: no Python, and no event loop, per request. Returns the
        final :meth:`step` result, PEER_CLOSED after ``stop``, ``-ETIMEDOUT`` when a request
        made no progress for ``progress_ms`` or was not done within its bound
        (:meth:`frame_wait`), CLOSE after ``idle_ms`` idle between requests (or
        an :meth:`evict` while idle), ``-ECONNABORTED`` when woken (:meth:`wake`) while holding a
        range that is closing, STAGE for a request on a device range (stage it, call
        :meth:`staged_done`, then call this again). Negative times wait forever. Call :meth:`prepare_blocking` first
        (from the thread that will call ``stop``).
        """
        cdef long r
        cdef pollfd p[2]
        cdef int n
        cdef bint busy
        cdef long wait
        cdef uint64_t junk
        if self.stop_fd < 0:
            raise ValueError("call prepare_blocking() first")
        with nogil:
            while True:
                r = self._step()
                if r == R_YIELD:
                    continue
                if r != R_WANT_READ and r != R_WANT_WRITE:
                    break
                busy = not self._idle()
                wait = self._wait(progress_ms, idle_ms, min_rate)
                if busy and wait == 0:
                    r = -ETIMEDOUT
                    break
                p[0].fd = self.fd
                p[0].events = POLLIN if r == R_WANT_READ else POLLOUT
                p[0].revents = 0
                p[1].fd = self.stop_fd
                p[1].events = POLLIN
                p[1].revents = 0
                n = poll(p, 2, <int>wait)
                if n < 0 and errno != EINTR:
                    r = -errno
                    break
                if n == 0:
                    r = -ETIMEDOUT if busy else R_CLOSE
                    break
                if p[1].revents:
                    c_read(self.stop_fd, &junk, 8)
                    if self.stopping:
                        r = R_PEER_CLOSED
                        break
                    if self._holds_closing():
                        r = -ECONNABORTED
                        break
                    if self.evicting:
                        self.evicting = 0
                        if self._idle():
                            r = R_CLOSE
                            break
        return r

    cdef long _wait(self, long progress_ms, long idle_ms, double min_rate) noexcept nogil:
        # what frame_wait answers (see there)
        cdef timespec ts
        cdef long long now, end
        cdef long mark
        if self._idle():
            self.req_start = -1
            return idle_ms
        clock_gettime(CLOCK_MONOTONIC, &ts)
        now = <long long>ts.tv_sec * 1000 + ts.tv_nsec // 1000000
        mark = self.served + self.refused
        if self.req_start < 0 or mark != self.req_mark:
            self.req_start = now
            self.req_mark = mark
        if progress_ms < 0:
            return -1
        end = self.req_start + progress_ms
        if min_rate > 0:
            end += <long long>(<double>self.req_size * 1000.0 / min_rate)
        if end <= now:
            return 0
        if end - now < progress_ms:
            return <long>(end - now)
        return progress_ms

    def frame_wait(self, long progress_ms=-1, long idle_ms=-1, double min_rate=0):
        """Milliseconds to wait for the socket now (-1: forever): ``idle_ms`` between requests;
        inside one, the smaller of ``progress_ms`` and what is left of its whole bound,
        ``progress_ms`` + its size / ``min_rate`` from its start (the first wait after the
        previous request began, or after idle); 0 once that bound has passed (drop it)."""
        return self._wait(progress_ms, idle_ms, min_rate)

    cdef bint _idle(self) noexcept nogil:
        # between requests: no partial header, no payload, no reply pending
        return (self.state == S_HDR and self.in_pos == self.in_len and
                self.out_pos == self.nout and not self.close_after and self.held == NULL)

    cdef bint _holds_closing(self) noexcept nogil:
        cdef Py_ssize_t i
        cdef bint hit = False
        pthread_mutex_lock(&self.table.mu)
        if self.held != NULL and self.held.closing:
            hit = True
        for i in range(self.nheld):
            if self.out_held[i].closing:
                hit = True
        pthread_mutex_unlock(&self.table.mu)
        return hit

    @property
    def idle(self):
        """Between requests (no partial request, no reply pending): safe to close."""
        return self._idle()

    def holds_closing(self):
        """Whether an unfinished request holds a range that is closing (call from the thread
        that steps this connection)."""
        return self._holds_closing()

    def wake(self):
        """Make a running ``serve_blocking`` re-check its held ranges (from any thread)."""
        cdef uint64_t one = 1
        if self.stop_fd >= 0:
            c_write(self.stop_fd, &one, 8)

    def evict(self):
        """Ask a running ``serve_blocking`` to close the connection if it is idle."""
        cdef uint64_t one = 1
        self.evicting = 1
        if self.stop_fd >= 0:
            c_write(self.stop_fd, &one, 8)

    def staged(self):
        """The request a ``STAGE`` result waits on: ``(opcode, addr, size, v2, device)``.

        Its range stays held (``unregister`` waits for it; :meth:`holds_closing` sees it) until
        :meth:`staged_done`. Every reply before it has been sent. The caller moves the bytes:
        READ: the v2 OK status (if ``v2``) then ``size`` bytes of data; WRITE: the ``size``
        payload bytes (the first of them through :meth:`take_input`), then the status.
        """
        if self.state != S_STAGE:
            raise ValueError("no request is waiting for staging")
        return (self.st_op, self.st_addr, self.st_len, bool(self.st_v2),
                self.held.device if self.held != NULL else -1)

    def take_input(self, uintptr_t addr, size_t n):
        """Copy up to ``n`` bytes already received (past the staged header) to ``addr``.

        Returns how many; the rest of a staged WRITE's payload is still in the socket.
        """
        cdef size_t k = self.in_len - self.in_pos
        if self.state != S_STAGE:
            raise ValueError("no request is waiting for staging")
        if k > n:
            k = n
        memcpy(<void *>addr, self.inbuf + self.in_pos, k)
        self.in_pos += k
        return k

    def staged_done(self):
        """The caller finished the staged request (its bytes and status are out): release
        its range and go on with the next request."""
        if self.state != S_STAGE:
            raise ValueError("no request is waiting for staging")
        if self.held != NULL:
            self.table.release(self.held)
            self.held = NULL
        self.state = S_HDR

    def prepare_blocking(self):
        """Create the eventfd :meth:`stop` signals (once, before ``serve_blocking``)."""
        if self.stop_fd < 0:
            self.stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
            if self.stop_fd < 0:
                raise OSError(errno, "eventfd failed")

    def stop(self):
        """Make a running ``serve_blocking`` return (from any thread)."""
        cdef uint64_t one = 1
        self.stopping = 1
        if self.stop_fd >= 0:
            c_write(self.stop_fd, &one, 8)

    cdef void _release_all(self) noexcept nogil:
        cdef Py_ssize_t i
        if self.held != NULL:
            self.table.release(self.held)
            self.held = NULL
        for i in range(self.nheld):
            self.table.release(self.out_held[i])
        self.nheld = 0
        self.nout = 0
        self.out_pos = 0
        self.nstat = 0

    def close(self):
        """Release every region held by unfinished requests (the connection is being dropped)."""
        self._release_all()
        self.state = S_CLOSED

    cdef bint _room(self) noexcept nogil:
        return self.nstat < OUT_SLOTS and self.nheld < OUT_SLOTS and self.nout + 2 <= 2 * OUT_SLOTS

    cdef void _queue_status(self, uint64_t code) noexcept nogil:
        self.stat[self.nstat] = MC_STATUS_MAGIC | code
        self.out[self.nout].iov_base = &self.stat[self.nstat]
        self.out[self.nout].iov_len = STATUS_SIZE
        self.nstat += 1
        self.nout += 1

    cdef long _flush(self) noexcept nogil:
        """writev the queued replies; 0 when all are out, else R_WANT_WRITE or -errno."""
        cdef ssize_t r
        cdef int cnt
        cdef Py_ssize_t i
        while self.out_pos < self.nout:
            cnt = <int>(self.nout - self.out_pos)
            r = writev(self.fd, self.out + self.out_pos, cnt)
            if r < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    return R_WANT_WRITE
                return -errno
            while r > 0 and self.out_pos < self.nout:
                if <size_t>r >= self.out[self.out_pos].iov_len:
                    r -= self.out[self.out_pos].iov_len
                    self.out_pos += 1
                else:
                    self.out[self.out_pos].iov_base = <void *>(
                        <uintptr_t>self.out[self.out_pos].iov_base + r)
                    self.out[self.out_pos].iov_len -= r
                    r = 0
        for i in range(self.nheld):
            self.table.release(self.out_held[i])
        self.nheld = 0
        self.nout = 0
        self.out_pos = 0
        self.nstat = 0
        return 0

    def step(self):
        """Serve until the socket would block; returns WANT_READ/WANT_WRITE/YIELD, CLOSE,
        PEER_CLOSED (clean end between requests) or ``-errno`` (``-100000``: bad header)."""
        cdef long r
        with nogil:
            r = self._step()
        return r

    cdef long _step(self) noexcept nogil:
        cdef ssize_t r
        cdef long f
        cdef uint64_t size, addr
        cdef uint8_t op
        cdef int nreq = 0
        cdef size_t nbytes = 0, k, avail
        while True:
            if self.state == S_CLOSED:
                return R_PEER_CLOSED
            avail = self.in_len - self.in_pos
            if nreq >= STEP_REQUESTS or nbytes >= STEP_BYTES:
                f = self._flush()
                return f if f != 0 else R_YIELD
            if self.state == S_STAGE:
                f = self._flush()
                return f if f != 0 else R_STAGE
            if self.state == S_HDR:
                if self.close_after:
                    f = self._flush()
                    if f != 0:
                        return f
                    self.state = S_CLOSED
                    return R_CLOSE
                if avail >= HEADER_SIZE:
                    if not self._room():
                        f = self._flush()
                        if f != 0:
                            return f
                    memcpy(&size, self.inbuf + self.in_pos, 8)
                    memcpy(&addr, self.inbuf + self.in_pos + 8, 8)
                    op = self.inbuf[self.in_pos + 16]
                    self.in_pos += HEADER_SIZE
                    self.req_size = size
                    self.v2 = (op & V2_FLAG) != 0
                    op = op & ~V2_FLAG
                    if op > 1:
                        return -E_PROTO
                    nreq += 1
                    self.held = self.table.acquire(<uintptr_t>addr, <size_t>size)
                    if self.held == NULL:
                        self.refused += 1
                        if not self.v2:
                            self.close_after = True
                            continue
                        if op == 1 and size > self.drain_limit:
                            self._queue_status(1)
                            self.close_after = True
                        elif op == 1 and size > 0:
                            self.left = size
                            self.state = S_DRAIN
                        else:
                            self._queue_status(1)
                        continue
                    self.served += 1
                    if self.held.device >= 0:
                        # device memory: the caller stages it (replies queued so far go first)
                        self.st_op = op
                        self.st_v2 = self.v2
                        self.st_addr = <uintptr_t>addr
                        self.st_len = <size_t>size
                        self.state = S_STAGE
                        continue
                    if op == 1:
                        self.addr = <uintptr_t>addr
                        self.left = size
                        self.state = S_PAYLOAD
                    else:
                        if self.v2:
                            self._queue_status(0)
                        self.out[self.nout].iov_base = <void *><uintptr_t>addr
                        self.out[self.nout].iov_len = size
                        self.nout += 1
                        self.out_held[self.nheld] = self.held
                        self.nheld += 1
                        self.held = NULL
                        nbytes += size
                    continue
            elif self.state == S_PAYLOAD or self.state == S_DRAIN:
                if avail > 0:
                    k = avail if avail < self.left else self.left
                    if self.state == S_PAYLOAD:
                        memcpy(<void *>self.addr, self.inbuf + self.in_pos, k)
                        self.addr += k
                    self.in_pos += k
                    self.left -= k
                    nbytes += k
                elif self.state == S_PAYLOAD and self.left >= DIRECT_MIN:
                    r = recv(self.fd, <void *>self.addr, self.left, MSG_DONTWAIT)
                    if r < 0:
                        if errno == EINTR:
                            continue
                        if errno == EAGAIN:
                            f = self._flush()
                            return f if f != 0 else R_WANT_READ
                        return -errno
                    if r == 0:
                        return -ECONNRESET
                    self.addr += r
                    self.left -= r
                    nbytes += r
                else:
                    avail = 0  # fall through to refill the input below
                if self.left == 0:
                    # room for this status was made before the header was taken in
                    if self.state == S_PAYLOAD:
                        self.table.release(self.held)
                        self.held = NULL
                        if self.v2:
                            self._queue_status(0)
                    else:
                        self._queue_status(1)
                    self.state = S_HDR
                    continue
                if avail > 0:
                    continue
            # need input: send what is queued first, so the client is never kept waiting
            f = self._flush()
            if f != 0:
                return f
            if self.in_pos > 0:
                if self.in_pos < self.in_len:
                    memmove(self.inbuf, self.inbuf + self.in_pos, self.in_len - self.in_pos)
                self.in_len -= self.in_pos
                self.in_pos = 0
            r = recv(self.fd, self.inbuf + self.in_len, IN_CAP - self.in_len, MSG_DONTWAIT)
            if r < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    return R_WANT_READ
                return -errno
            if r == 0:
                if self.state == S_HDR and self.in_len == 0:
                    self.state = S_CLOSED
                    return R_PEER_CLOSED
                return -ECONNRESET
            self.in_len += r

# -- client ----------------------------------------------------------------------------------

cdef class ClientPipe:
    """One pipelined group of same-opcode requests on one connection (see module docstring).

    ``statuses[i]`` after completion: 0 OK, 1 refused, -1 no reply (connection ended first).
    ``done`` counts requests with a definite result, in order.
    """

    cdef int fd
    cdef bint write_op
    cdef bint v2
    cdef Py_ssize_t n
    cdef uint8_t *hdrs
    cdef uintptr_t *laddr
    cdef size_t *lens
    cdef iovec *iov
    cdef Py_ssize_t niov, iov_pos
    cdef Py_ssize_t rx      # request whose reply is being read
    cdef int rx_phase       # 0 status, 1 data
    cdef size_t rx_got
    cdef uint64_t st
    cdef signed char *stat
    cdef bint last_refused
    cdef uint8_t *stage
    cdef size_t st_pos, st_len
    cdef readonly Py_ssize_t done

    cdef bint own_stage
    cdef object stage_owner

    def __cinit__(self, int fd, bint write, bint v2, laddrs, raddrs, lens,
                  uintptr_t stage_addr=0, size_t stage_size=0, object stage_owner=None):
        cdef Py_ssize_t n = len(laddrs), i
        if len(raddrs) != n or len(lens) != n:
            raise ValueError("ClientPipe: laddrs, raddrs and lens differ in length")
        self.fd = fd
        self.write_op = write
        self.v2 = v2
        self.n = n
        self.hdrs = <uint8_t *>malloc(n * HEADER_SIZE + 1)
        self.laddr = <uintptr_t *>malloc(n * sizeof(uintptr_t) + 1)
        self.lens = <size_t *>malloc(n * sizeof(size_t) + 1)
        self.iov = <iovec *>malloc(2 * n * sizeof(iovec) + 1)
        self.stat = <signed char *>malloc(n + 1)
        # A fresh staging buffer per call would pay first-touch page faults every time (tens of
        # microseconds on a VM): callers pass a long-lived, pre-faulted one (``stage_*``).
        if stage_addr != 0 and stage_size >= STAGE_CAP:
            self.stage = <uint8_t *>stage_addr
            self.own_stage = False
            self.stage_owner = stage_owner
        else:
            self.stage = <uint8_t *>malloc(STAGE_CAP)
            self.own_stage = True
        self.st_pos = 0
        self.st_len = 0
        if not (self.hdrs and self.laddr and self.lens and self.iov and self.stat and self.stage):
            raise MemoryError()
        memset(self.hdrs, 0, n * HEADER_SIZE)
        cdef uint64_t sz, ra
        cdef uint8_t op = (1 if write else 0) | (V2_FLAG if v2 else 0)
        self.niov = 0
        for i in range(n):
            sz = <uint64_t>lens[i]
            ra = <uint64_t>raddrs[i]
            self.laddr[i] = <uintptr_t>laddrs[i]
            self.lens[i] = sz
            memcpy(self.hdrs + i * HEADER_SIZE, &sz, 8)
            memcpy(self.hdrs + i * HEADER_SIZE + 8, &ra, 8)
            self.hdrs[i * HEADER_SIZE + 16] = op
            self.stat[i] = -1
            self.iov[self.niov].iov_base = self.hdrs + i * HEADER_SIZE
            self.iov[self.niov].iov_len = HEADER_SIZE
            self.niov += 1
            if write and sz:
                self.iov[self.niov].iov_base = <void *>self.laddr[i]
                self.iov[self.niov].iov_len = sz
                self.niov += 1
        self.iov_pos = 0
        self.rx = 0
        self.rx_phase = 0
        self.rx_got = 0
        self.done = 0
        self.last_refused = False

    def __dealloc__(self):
        free(self.hdrs)
        free(self.laddr)
        free(self.lens)
        free(self.iov)
        free(self.stat)
        if self.own_stage:
            free(self.stage)

    @property
    def statuses(self):
        return [self.stat[i] for i in range(self.n)]

    def run_blocking(self, long timeout_ms, long spin_us=0):
        """Run to the end on the calling thread without the GIL, waiting in ``poll``.

        For a caller that owns the connection (no event loop): steps until DONE, PEER_CLOSED or
        an error (as :meth:`step`), or ``-ETIMEDOUT`` once ``timeout_ms`` have passed (a
        negative ``timeout_ms`` waits without limit). The first wait for a reply spins for up
        to ``spin_us`` microseconds before sleeping in ``poll``. After a timeout or an error
        the connection is in an unknown state and must be closed.
        """
        cdef long r
        cdef pollfd p
        cdef timespec ts
        cdef long long deadline = 0, now, left, spin_end
        cdef int n
        with nogil:
            if timeout_ms >= 0:
                clock_gettime(CLOCK_MONOTONIC, &ts)
                deadline = <long long>ts.tv_sec * 1000 + ts.tv_nsec // 1000000 + timeout_ms
            while True:
                r = self._step()
                if r != R_WANT_READ and r != R_WANT_WRITE:
                    break
                left = -1
                if timeout_ms >= 0:
                    clock_gettime(CLOCK_MONOTONIC, &ts)
                    now = <long long>ts.tv_sec * 1000 + ts.tv_nsec // 1000000
                    if now >= deadline:
                        r = -ETIMEDOUT
                        break
                    left = deadline - now
                    if left > 2147483647:
                        left = 2147483647
                if spin_us > 0 and r == R_WANT_READ:
                    # a small request's reply usually comes within microseconds: look again
                    # for a short while before sleeping (a sleep costs a scheduler wake-up)
                    clock_gettime(CLOCK_MONOTONIC, &ts)
                    spin_end = <long long>ts.tv_sec * 1000000 + ts.tv_nsec // 1000 + spin_us
                    while True:
                        r = self._step()
                        if r != R_WANT_READ:
                            break
                        clock_gettime(CLOCK_MONOTONIC, &ts)
                        if <long long>ts.tv_sec * 1000000 + ts.tv_nsec // 1000 >= spin_end:
                            break
                    spin_us = 0
                    if r != R_WANT_READ:
                        continue
                p.fd = self.fd
                p.events = POLLIN if r == R_WANT_READ else POLLOUT
                p.revents = 0
                n = poll(&p, 1, <int>left)
                if n < 0 and errno != EINTR:
                    r = -errno
                    break
        return r

    def step(self):
        """Advance; DONE when every reply is in, WANT_READ/WANT_WRITE, PEER_CLOSED (the peer
        closed right after a refusal, as the published server does), or ``-errno``
        (``-100000``: bad status frame)."""
        cdef long r
        with nogil:
            r = self._step()
        return r

    cdef long _step(self) noexcept nogil:
        cdef ssize_t r
        cdef int cnt
        cdef uint64_t v
        while self.iov_pos < self.niov:
            cnt = <int>(self.niov - self.iov_pos)
            if cnt > IOV_CHUNK:
                cnt = IOV_CHUNK
            r = writev(self.fd, self.iov + self.iov_pos, cnt)
            if r < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    return R_WANT_WRITE
                return -errno
            while r > 0 and self.iov_pos < self.niov:
                if <size_t>r >= self.iov[self.iov_pos].iov_len:
                    r -= self.iov[self.iov_pos].iov_len
                    self.iov_pos += 1
                else:
                    self.iov[self.iov_pos].iov_base = <void *>(
                        <uintptr_t>self.iov[self.iov_pos].iov_base + r)
                    self.iov[self.iov_pos].iov_len -= r
                    r = 0
        if not self.v2:
            # v1: no status frames; READ data follows directly, WRITE has no reply at all
            if self.write_op:
                while self.done < self.n:
                    self.stat[self.done] = 0
                    self.done += 1
                return R_DONE
            while self.rx < self.n:
                if self.rx_got < self.lens[self.rx]:
                    r = recv(self.fd, <void *>(self.laddr[self.rx] + self.rx_got),
                             self.lens[self.rx] - self.rx_got, MSG_DONTWAIT)
                    if r < 0:
                        if errno == EINTR:
                            continue
                        if errno == EAGAIN:
                            return R_WANT_READ
                        return -errno
                    if r == 0:
                        return -ECONNRESET
                    self.rx_got += r
                    continue
                self.stat[self.rx] = 0
                self.rx += 1
                self.done = self.rx
                self.rx_got = 0
            return R_DONE
        cdef size_t avail, k, need
        while self.rx < self.n:
            avail = self.st_len - self.st_pos
            if avail == 0:
                # refill: big READ data goes straight into place, everything else is staged so
                # that one recv brings in many statuses and small payloads
                need = self.lens[self.rx] - self.rx_got if self.rx_phase == 1 else 0
                if self.rx_phase == 1 and need >= DIRECT_MIN:
                    r = recv(self.fd, <void *>(self.laddr[self.rx] + self.rx_got), need,
                             MSG_DONTWAIT)
                elif (self.rx_phase == 0 and not self.write_op
                        and self.lens[self.rx] >= DIRECT_MIN):
                    r = recv(self.fd, (<uint8_t *>&self.st) + self.rx_got,
                             STATUS_SIZE - self.rx_got, MSG_DONTWAIT)
                else:
                    r = recv(self.fd, self.stage, STAGE_CAP, MSG_DONTWAIT)
                    if r > 0:
                        self.st_pos = 0
                        self.st_len = r
                        continue
                if r < 0:
                    if errno == EINTR:
                        continue
                    if errno == EAGAIN:
                        return R_WANT_READ
                    return -errno
                if r == 0:
                    if self.rx_phase == 0 and self.rx_got == 0 and self.last_refused:
                        return R_PEER_CLOSED
                    return -ECONNRESET
                self.rx_got += r
            elif self.rx_phase == 0:
                k = STATUS_SIZE - self.rx_got
                if k > avail:
                    k = avail
                memcpy((<uint8_t *>&self.st) + self.rx_got, self.stage + self.st_pos, k)
                self.st_pos += k
                self.rx_got += k
            else:
                k = self.lens[self.rx] - self.rx_got
                if k > avail:
                    k = avail
                memcpy(<void *>(self.laddr[self.rx] + self.rx_got), self.stage + self.st_pos, k)
                self.st_pos += k
                self.rx_got += k
            if self.rx_phase == 0:
                if self.rx_got < STATUS_SIZE:
                    continue
                self.rx_got = 0
                v = self.st
                if (v & MC_STATUS_MASK) != MC_STATUS_MAGIC:
                    return -E_PROTO
                v = v & <uint64_t>0xFFFFFFFFU
                if v > 1:
                    return -E_PROTO
                self.last_refused = v != 0
                if v == 0 and not self.write_op and self.lens[self.rx] > 0:
                    self.rx_phase = 1
                    continue
                self.stat[self.rx] = <signed char>v
                self.rx += 1
                self.done = self.rx
            elif self.rx_got == self.lens[self.rx]:
                self.rx_got = 0
                self.rx_phase = 0
                self.stat[self.rx] = 0
                self.rx += 1
                self.done = self.rx
        return R_DONE
