# cython: language_level=3
"""A copy queue: scatter-gather memcpy jobs run by C worker threads, completions on an eventfd.

``submit(job_id, dsts, srcs, lens)`` copies the three sequences into a C array and queues the
job; a worker thread (no GIL, no Python object touched) copies every range, appends the id to
the done list and adds 1 to the eventfd. The event loop waits for the eventfd to become readable
and calls ``drain()``, which resets it and returns every id completed since, so one wake-up
delivers a whole burst of completions. Nothing here knows about the event loop.

``close()`` lets the workers finish every queued job, then joins them; ids still not drained
are returned by a last ``drain()``. The eventfd is closed when the queue is freed.
"""

from libc.errno cimport errno
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    int EFD_NONBLOCK
    int EFD_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void *buf, size_t n)
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t *t, void *attr, void *(*fn)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t t, void **ret)
    int pthread_mutex_init(pthread_mutex_t *m, void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_signal(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)

COMPILED = True

DEF MAX_WORKERS = 16

cdef struct job_t:
    uint64_t id
    Py_ssize_t n
    uintptr_t *t      # dst, src, len triples
    job_t *next

cdef struct shared_t:
    pthread_mutex_t mu
    pthread_cond_t cv
    job_t *head
    job_t *tail
    uint64_t *done
    Py_ssize_t ndone, cap
    int stop
    int efd


cdef void *_worker(void *arg) noexcept nogil:
    cdef shared_t *s = <shared_t *>arg
    cdef job_t *j
    cdef Py_ssize_t i
    cdef uint64_t one = 1
    cdef uint64_t *grown
    while True:
        pthread_mutex_lock(&s.mu)
        while s.head == NULL and not s.stop:
            pthread_cond_wait(&s.cv, &s.mu)
        j = s.head
        if j == NULL:  # stopping and nothing left
            pthread_mutex_unlock(&s.mu)
            return NULL
        s.head = j.next
        if s.head == NULL:
            s.tail = NULL
        pthread_mutex_unlock(&s.mu)
        for i in range(j.n):
            memcpy(<void *>j.t[3 * i], <const void *>j.t[3 * i + 1], <size_t>j.t[3 * i + 2])
        pthread_mutex_lock(&s.mu)
        if s.ndone == s.cap:
            grown = <uint64_t *>realloc(s.done, (s.cap * 2 + 64) * sizeof(uint64_t))
            if grown != NULL:
                s.done = grown
                s.cap = s.cap * 2 + 64
        if s.ndone < s.cap:
            s.done[s.ndone] = j.id
            s.ndone += 1
        pthread_mutex_unlock(&s.mu)
        free(j.t)
        free(j)
        write(s.efd, &one, 8)


cdef class CopyQueue:
    """Worker threads copying scatter-gather jobs; completions via an eventfd (``fileno``)."""

    cdef shared_t s
    cdef pthread_t threads[MAX_WORKERS]
    cdef int nthreads
    cdef bint closed

    def __cinit__(self, int workers=1):
        if workers < 1 or workers > MAX_WORKERS:
            raise ValueError(f"workers must be in 1..{MAX_WORKERS}")
        self.s.head = NULL
        self.s.tail = NULL
        self.s.done = NULL
        self.s.ndone = 0
        self.s.cap = 0
        self.s.stop = 0
        self.nthreads = 0
        self.closed = True
        self.s.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.s.efd < 0:
            raise OSError(errno, "eventfd failed")
        pthread_mutex_init(&self.s.mu, NULL)
        pthread_cond_init(&self.s.cv, NULL)
        self.closed = False
        cdef int i
        for i in range(workers):
            if pthread_create(&self.threads[i], NULL, _worker, &self.s) != 0:
                self.close()
                raise OSError("pthread_create failed")
            self.nthreads += 1

    def fileno(self):
        """The eventfd: readable when at least one job completed since the last drain."""
        return self.s.efd

    def submit(self, uint64_t job_id, dsts, srcs, lens):
        """Queue one job copying ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i.

        The caller keeps all ranges valid (and untouched by others) until ``job_id`` is drained.
        """
        if self.closed:
            raise ValueError("CopyQueue is closed")
        cdef Py_ssize_t n = len(dsts), i
        if len(srcs) != n or len(lens) != n:
            raise ValueError("submit: dsts, srcs and lens differ in length")
        cdef job_t *j = <job_t *>malloc(sizeof(job_t))
        if j == NULL:
            raise MemoryError()
        j.t = <uintptr_t *>malloc(3 * n * sizeof(uintptr_t) + 1)
        if j.t == NULL:
            free(j)
            raise MemoryError()
        try:
            for i in range(n):
                j.t[3 * i] = <uintptr_t>dsts[i]
                j.t[3 * i + 1] = <uintptr_t>srcs[i]
                j.t[3 * i + 2] = <uintptr_t>lens[i]
        except BaseException:
            free(j.t)
            free(j)
            raise
        j.id = job_id
        j.n = n
        j.next = NULL
        with nogil:
            pthread_mutex_lock(&self.s.mu)
            if self.s.tail == NULL:
                self.s.head = j
            else:
                self.s.tail.next = j
            self.s.tail = j
            pthread_cond_signal(&self.s.cv)
            pthread_mutex_unlock(&self.s.mu)

    def drain(self):
        """Reset the eventfd and return the ids of every job completed since the last drain."""
        cdef uint64_t v
        cdef Py_ssize_t i, n
        cdef uint64_t *ids
        read(self.s.efd, &v, 8)  # EAGAIN when nothing new: fine
        with nogil:
            pthread_mutex_lock(&self.s.mu)
            ids = self.s.done
            n = self.s.ndone
            self.s.done = NULL
            self.s.ndone = 0
            self.s.cap = 0
            pthread_mutex_unlock(&self.s.mu)
        try:
            return [ids[i] for i in range(n)]
        finally:
            free(ids)

    def close(self):
        """Finish every queued job and stop the workers (idempotent; blocks until done)."""
        cdef int i
        if self.closed:
            return
        self.closed = True
        with nogil:
            pthread_mutex_lock(&self.s.mu)
            self.s.stop = 1
            pthread_cond_broadcast(&self.s.cv)
            pthread_mutex_unlock(&self.s.mu)
            for i in range(self.nthreads):
                pthread_join(self.threads[i], NULL)
        self.nthreads = 0

    def __dealloc__(self):
        self.close()
        free(self.s.done)
        if self.s.efd >= 0:
            close(self.s.efd)
        pthread_cond_destroy(&self.s.cv)
        pthread_mutex_destroy(&self.s.mu)
