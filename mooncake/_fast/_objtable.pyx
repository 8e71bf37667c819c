# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The master's object table in C arrays; compiled twin of ``_objtable_pure.py`` (same names,
contracts, errors and ``state`` layout: see that module's docstring).

Storage, all owned by the table and grown by ``realloc`` (about 1.5x), never one Python
object per key:

* a key arena: the UTF-8 (``surrogatepass``) bytes of every key, one after another; per
  handle an ``int64`` offset (``-1``: the handle is free) and a ``uint32`` length, beside
  the ``uint32`` hash of the key (one 16-byte record, so a lookup touches one cache line of
  it besides its slot and the key's bytes). A removed key's bytes stay as garbage until the garbage outweighs the live bytes (and 16 bytes per
  handle), when :meth:`remove` compacts the arena (amortized: the garbage pays for it);
* a hash index: open addressing with linear probing over ``int32`` slots holding handle + 1
  (``0`` empty, so a new index is ``calloc``'d memory, no fill pass), a power of two of them
  at load <= 0.7, deletion by backward shift. It grows incrementally: past the load limit a
  twice larger index takes every insertion while the old one is moved into it 8 slots per
  insertion (a lookup meanwhile probes both), so no insertion waits for a whole rehash. The
  hash is a keyed wyhash-style 64-bit hash of the key's bytes with a per-process random key,
  so a client cannot choose keys that collide; 32 bits of it are kept per handle so
  probing and growing compare and move numbers, not keys. Nothing observable (handles,
  orders, states) depends on the hash;
* per handle columns: ``seq`` (``int64``); the cold row (``seg`` ``int32``, ``-1`` when the
  handle has none, ``addr``/``size``/``vid`` ``int64``, ``lease``/``read`` ``double``,
  ``writer`` ``int32``), zero while not cold; the recency list's ``prev``/``next``
  (``int32``, ``-1`` ends the list, ``prev == -2``: not listed) and size (``int64``);
* a stack of free handles (``int32``), the most recently freed on top.

No method releases the GIL, so threads cannot see the buffers half-changed (the table is for
one event loop; it takes no lock of its own). A table pickles as its :meth:`state`.
"""

import os

from cpython.array cimport array, clone
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from array import array as _pyarray

from mooncake._fast._objtable_pure import normalize_state

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size)
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)
    bint PyLong_CheckExact(object o)
    bint PyUnicode_CheckExact(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1
    object PyNumber_Float(object o)
    double PyFloat_AS_DOUBLE(object o)
    bint PyFloat_CheckExact(object o)
    void PyErr_Clear()
    object PyLong_FromUnsignedLongLong(unsigned long long v)

cdef extern from "mc_objtable.h" nogil:
    uint64_t mc_hash(const void *key, size_t len, uint64_t seed)
    int mc_utf8_valid(const unsigned char *s, size_t n)
    ctypedef struct mc_seqpair:
        int64_t seq
        int64_t h
    void mc_sort_seqpairs(mc_seqpair *p, size_t n)
    void mc_prefetch(const void *p)
    ctypedef struct mc_keyref:
        int64_t off
        uint32_t len
        uint32_t hash

COMPILED = True


def _from_state(st):
    return ObjectTable.from_state(st)

cdef uint64_t _SEED = int.from_bytes(os.urandom(8), "little")
cdef int64_t _I31 = 2147483647  # one less than 2**31: handles, seg, writer are < 2**31
cdef object _PY_I31 = 2**31
cdef object _PY_I63 = 2**63
cdef int32_t _NOT_LISTED = -2
cdef Py_ssize_t _MAX_HANDLES = 2147483647
cdef Py_ssize_t _MIGRATE_STEPS = 8  # old index slots moved per insertion while the index grows


cdef int _grow(void **p, size_t elem, Py_ssize_t cap) except -1:
    cdef void *q = realloc(p[0], elem * <size_t>cap)
    if q == NULL:
        raise MemoryError()
    p[0] = q
    return 0


cdef inline double _as_double(object x) except? -1.0:
    if PyFloat_CheckExact(x):
        return PyFloat_AS_DOUBLE(x)
    return PyFloat_AS_DOUBLE(PyNumber_Float(x))


cdef int64_t _as_num(str name, object v, int64_t hi_incl) except -1:
    """``v`` (an exact int in ``[0, hi_incl]``) as a C integer (the pure twin's checks)."""
    cdef int overflow = 0
    cdef long long x
    if not PyLong_CheckExact(v):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < 0 or x > hi_incl:
        raise OverflowError(f"{name} {v} out of range [0, {_PY_I31 if hi_incl <= _I31 else _PY_I63})")
    return x


cdef class _Columns:
    """The storage of an :class:`ObjectTable`: its C buffers and the primitives over them
    (growing, the index, the arena, the recency links). No Python-facing methods."""


    # handles: n ever handed out, hcap allocated, count live
    cdef Py_ssize_t n, hcap, count, nfree, free_cap, ncold, lru_n, nslots
    cdef int64_t next_seq_
    cdef mc_keyref *km  # per handle: the key's offset, length and hash, side by side
    cdef int64_t *seq_
    cdef int32_t *seg_
    cdef int64_t *addr_
    cdef int64_t *size_
    cdef int64_t *vid_
    cdef double *lease_
    cdef double *read_
    cdef int32_t *writer_
    cdef int32_t *prev_
    cdef int32_t *next_
    cdef int64_t *lsize
    cdef int32_t *free_
    cdef int32_t *slots
    cdef int32_t *old_slots  # while the index grows: the previous index, moved over by steps
    cdef Py_ssize_t old_nslots, mig  # its size, and how many of its slots were moved
    cdef char *arena
    cdef Py_ssize_t aused, acap, alive
    cdef int32_t head, tail
    cdef object kbuf  # the UTF-8 copy of the last key with a lone surrogate (see _utf8)
    cdef uint64_t lb_lo  # lru_bytes = lb_hi * 2**64 + lb_lo
    cdef int64_t lb_hi

    def __cinit__(self):
        self.nslots = 16
        self.slots = <int32_t *>calloc(16, sizeof(int32_t))
        if self.slots == NULL:
            raise MemoryError()
        self.head = -1
        self.tail = -1

    def __dealloc__(self):
        free(self.km)
        free(self.seq_)
        free(self.seg_)
        free(self.addr_)
        free(self.size_)
        free(self.vid_)
        free(self.lease_)
        free(self.read_)
        free(self.writer_)
        free(self.prev_)
        free(self.next_)
        free(self.lsize)
        free(self.free_)
        free(self.slots)
        free(self.old_slots)
        free(self.arena)

    # -- storage -----------------------------------------------------------------------------

    cdef int _reserve_handles(self, Py_ssize_t want) except -1:
        cdef Py_ssize_t cap
        if want <= self.hcap:
            return 0
        cap = self.hcap + (self.hcap >> 1)
        if cap < want:
            cap = want
        if cap < 16:
            cap = 16
        if cap > _MAX_HANDLES:
            cap = _MAX_HANDLES
        _grow(<void **>&self.km, sizeof(mc_keyref), cap)
        _grow(<void **>&self.seq_, sizeof(int64_t), cap)
        _grow(<void **>&self.seg_, sizeof(int32_t), cap)
        _grow(<void **>&self.addr_, sizeof(int64_t), cap)
        _grow(<void **>&self.size_, sizeof(int64_t), cap)
        _grow(<void **>&self.vid_, sizeof(int64_t), cap)
        _grow(<void **>&self.lease_, sizeof(double), cap)
        _grow(<void **>&self.read_, sizeof(double), cap)
        _grow(<void **>&self.writer_, sizeof(int32_t), cap)
        _grow(<void **>&self.prev_, sizeof(int32_t), cap)
        _grow(<void **>&self.next_, sizeof(int32_t), cap)
        _grow(<void **>&self.lsize, sizeof(int64_t), cap)
        self.hcap = cap
        return 0

    cdef int _reserve_arena(self, Py_ssize_t extra) except -1:
        cdef Py_ssize_t cap
        if self.aused + extra <= self.acap:
            return 0
        cap = self.acap + (self.acap >> 1)
        if cap < self.aused + extra:
            cap = self.aused + extra
        if cap < 4096:
            cap = 4096
        _grow(<void **>&self.arena, 1, cap)
        self.acap = cap
        return 0

    cdef int _set_slots(self, Py_ssize_t nslots) except -1:
        """A fresh index of ``nslots`` (a power of two) slots holding every live handle."""
        cdef int32_t *s = <int32_t *>calloc(nslots, sizeof(int32_t))
        cdef Py_ssize_t h
        cdef uint64_t mask = nslots - 1, i
        if s == NULL:
            raise MemoryError()
        for h in range(self.n):
            if self.km[h].off >= 0:
                i = self.km[h].hash & mask
                while s[i] != 0:
                    i = (i + 1) & mask
                s[i] = <int32_t>h + 1
        free(self.slots)
        self.slots = s
        self.nslots = nslots
        return 0

    cdef const char *_utf8(self, object key, Py_ssize_t *ln) except NULL:
        """The UTF-8 bytes of ``key`` (a lone surrogate as ``surrogatepass``, as the pure
        twin encodes it); ``TypeError`` for anything but a ``str``. Valid until the next call."""
        cdef const char *p
        if not PyUnicode_CheckExact(key):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        p = PyUnicode_AsUTF8AndSize(key, ln)
        if p == NULL:  # a lone surrogate
            PyErr_Clear()
            self.kbuf = (<str>key).encode("utf-8", "surrogatepass")
            p = PyBytes_AS_STRING(self.kbuf)
            ln[0] = PyBytes_GET_SIZE(self.kbuf)
        return p

    cdef inline int32_t _probe_in(self, int32_t *slots, Py_ssize_t nslots, const char *p,
                                  Py_ssize_t ln, uint32_t hv, uint64_t *slot) noexcept nogil:
        """The handle of key ``p[:ln]`` (hash ``hv``) in index ``slots``, or -1 and the empty
        slot it would take there."""
        cdef uint64_t mask = nslots - 1
        cdef uint64_t i = hv & mask
        cdef int32_t h
        while True:
            h = slots[i] - 1  # a slot holds handle + 1; 0 is empty (calloc'd: no fill pass)
            if h < 0:
                slot[0] = i
                return -1
            if (self.km[h].hash == hv and self.km[h].len == <uint32_t>ln
                    and memcmp(self.arena + self.km[h].off, p, ln) == 0):
                slot[0] = i
                return h
            i = (i + 1) & mask

    cdef inline int32_t _probe(self, const char *p, Py_ssize_t ln, uint32_t hv,
                               uint64_t *slot) noexcept nogil:
        """The handle of key ``p[:ln]`` (hash ``hv``), or -1 and the empty slot of the
        current index it would take. While the index grows a key is in the new index or, not
        moved yet, in the old one."""
        cdef uint64_t other
        cdef int32_t h = self._probe_in(self.slots, self.nslots, p, ln, hv, slot)
        if h < 0 and self.old_slots != NULL:
            h = self._probe_in(self.old_slots, self.old_nslots, p, ln, hv, &other)
        return h

    cdef void _put_new(self, int32_t g) noexcept nogil:
        """Index ``g`` in the current index unless it is there already."""
        cdef uint64_t mask = self.nslots - 1
        cdef uint64_t i = self.km[g].hash & mask
        while self.slots[i] != 0:
            if self.slots[i] == g + 1:
                return
            i = (i + 1) & mask
        self.slots[i] = g + 1

    cdef bint _unindex_in(self, int32_t *slots, Py_ssize_t nslots, int32_t h,
                          bint old) noexcept nogil:
        """Take ``h`` out of index ``slots`` if it is there, shifting the run after it back (no
        tombstones); 0 if it was not there. In the old index, a handle shifted back below the
        move cursor is moved to the new index at once (the cursor will not pass it again)."""
        cdef uint64_t mask = nslots - 1
        cdef uint64_t i = self.km[h].hash & mask, j, k
        cdef int32_t g
        while slots[i] != h + 1:
            if slots[i] == 0:
                return 0
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            g = slots[j] - 1
            if g < 0:
                break
            k = self.km[g].hash & mask
            # g stays where it is if its home k lies cyclically in (i, j]
            if i <= j:
                if i < k and k <= j:
                    continue
            elif i < k or k <= j:
                continue
            slots[i] = g + 1
            if old and <Py_ssize_t>i < self.mig:
                self._put_new(g)
            i = j
        slots[i] = 0
        return 1

    cdef void _unindex(self, int32_t h) noexcept nogil:
        """Take ``h`` out of the index (both, while it grows)."""
        self._unindex_in(self.slots, self.nslots, h, 0)
        if self.old_slots != NULL:
            self._unindex_in(self.old_slots, self.old_nslots, h, 1)

    cdef void _migrate(self, Py_ssize_t steps) noexcept nogil:
        """Move up to ``steps`` slots of the old index into the current one; free the old one
        once every slot has been moved."""
        cdef int32_t g
        while self.old_slots != NULL:
            if self.mig >= self.old_nslots:
                free(self.old_slots)
                self.old_slots = NULL
                self.old_nslots = 0
                self.mig = 0
                return
            if steps <= 0:
                return
            g = self.old_slots[self.mig] - 1
            if g >= 0:
                self._put_new(g)
            self.mig += 1
            steps -= 1

    cdef int _grow_index(self) except -1:
        """Start moving to an index twice the size: the current one becomes the old one,
        moved over :data:`_MIGRATE_STEPS` slots per insertion (so no insertion waits for a
        whole rehash; a lookup meanwhile probes both)."""
        cdef Py_ssize_t nslots = self.nslots * 2
        cdef int32_t *s = <int32_t *>calloc(nslots, sizeof(int32_t))
        if s == NULL:
            raise MemoryError()
        self._migrate(self.old_nslots)  # (finished long before: 8 slots per insertion)
        self.old_slots = self.slots
        self.old_nslots = self.nslots
        self.mig = 0
        self.slots = s
        self.nslots = nslots
        return 0

    cdef void _compact(self) noexcept:
        """Rewrite the arena with only the live keys (in handle order); left as it is when no
        memory is to be had (compacting is only ever a saving)."""
        cdef Py_ssize_t cap = self.alive + (self.alive >> 2) + 4096, pos = 0, h
        cdef char *a = <char *>malloc(cap)
        if a == NULL:
            return
        for h in range(self.n):
            if self.km[h].off >= 0:
                memcpy(a + pos, self.arena + self.km[h].off, self.km[h].len)
                self.km[h].off = pos
                pos += self.km[h].len
        free(self.arena)
        self.arena = a
        self.acap = cap
        self.aused = pos

    cdef int32_t _live(self, object h) except -1:
        cdef int overflow = 0
        cdef long long x
        if not PyLong_CheckExact(h):
            raise TypeError(f"handle must be an int, got {type(h).__name__}")
        x = PyLong_AsLongLongAndOverflow(h, &overflow)
        if overflow or x < 0 or x >= self.n or self.km[x].off < 0:
            raise KeyError(h)
        return <int32_t>x

    cdef inline bint _listed(self, int32_t h) noexcept:
        return self.prev_[h] != _NOT_LISTED

    cdef void _zero_cold(self, int32_t h) noexcept:
        self.seg_[h] = -1
        self.addr_[h] = 0
        self.size_[h] = 0
        self.vid_[h] = 0
        self.lease_[h] = 0.0
        self.read_[h] = 0.0
        self.writer_[h] = 0

    cdef void _unlink(self, int32_t h) noexcept:
        cdef int32_t p = self.prev_[h], q = self.next_[h]
        cdef uint64_t s = <uint64_t>self.lsize[h]
        if p >= 0:
            self.next_[p] = q
        else:
            self.head = q
        if q >= 0:
            self.prev_[q] = p
        else:
            self.tail = p
        self.prev_[h] = _NOT_LISTED
        self.next_[h] = -1
        self.lsize[h] = 0
        self.lru_n -= 1
        if self.lb_lo < s:
            self.lb_hi -= 1
        self.lb_lo -= s

    cdef void _append(self, int32_t h, int64_t size) noexcept:
        self.prev_[h] = self.tail
        self.next_[h] = -1
        if self.tail >= 0:
            self.next_[self.tail] = h
        else:
            self.head = h
        self.tail = h
        self.lsize[h] = size
        self.lru_n += 1
        self.lb_lo += <uint64_t>size
        if self.lb_lo < <uint64_t>size:
            self.lb_hi += 1

    cdef bint _index_all(self) noexcept nogil:
        """Put every live handle in the (empty) index; 0 if two have the same key."""
        cdef uint64_t mask = self.nslots - 1, slot
        cdef Py_ssize_t h, ahead = 16
        for h in range(self.n):
            if h + ahead < self.n:
                mc_prefetch(&self.slots[self.km[h + ahead].hash & mask])
            if self.km[h].off < 0:
                continue
            if self._probe(self.arena + self.km[h].off, self.km[h].len, self.km[h].hash,
                           &slot) >= 0:
                return 0
            self.slots[slot] = <int32_t>h + 1
            self.count += 1
        return 1

    cdef int _copy_columns(self, dict c, Py_ssize_t n) except -1:
        memcpy(self.seq_, (<array>c["seq"]).data.as_voidptr, n * 8)
        memcpy(self.seg_, (<array>c["seg"]).data.as_voidptr, n * 4)
        memcpy(self.addr_, (<array>c["addr"]).data.as_voidptr, n * 8)
        memcpy(self.size_, (<array>c["size"]).data.as_voidptr, n * 8)
        memcpy(self.vid_, (<array>c["vid"]).data.as_voidptr, n * 8)
        memcpy(self.lease_, (<array>c["lease"]).data.as_voidptr, n * 8)
        memcpy(self.read_, (<array>c["read"]).data.as_voidptr, n * 8)
        memcpy(self.writer_, (<array>c["writer"]).data.as_voidptr, n * 4)
        return 0


cdef class ObjectTable(_Columns):
    """Keys to handles, with cold rows and one recency list (see the module docstring)."""

    def __init__(self):
        pass

    def __reduce__(self):
        return (_from_state, (self.state(),))

    # -- keys and handles ----------------------------------------------------------------------

    def __len__(self):
        return self.count

    @property
    def capacity(self):
        """One past the largest handle ever handed out."""
        return self.n

    @property
    def next_seq(self):
        """The sequence number the next :meth:`add` gets."""
        return self.next_seq_

    def find(self, key):
        """The handle of ``key``, or ``-1``."""
        cdef Py_ssize_t ln
        cdef const char *p
        cdef uint64_t slot
        p = self._utf8(key, &ln)
        return self._probe(p, ln, <uint32_t>mc_hash(p, ln, _SEED), &slot)

    def lease_keys(self, keys, deadline):
        """For each key of the list ``keys``: ``-1`` if absent, ``-2`` if cold (its lease
        raised to at least ``deadline``), else its handle (a hot object: the caller's)."""
        cdef Py_ssize_t ln, i, n
        cdef const char *p
        cdef uint64_t slot
        cdef int32_t h
        cdef object key
        cdef double d = _as_double(deadline)
        cdef list out = []
        if type(keys) is not list:
            raise TypeError(f"keys must be a list, got {type(keys).__name__}")
        n = len(<list>keys)
        for i in range(n):
            key = (<list>keys)[i]
            p = self._utf8(key, &ln)
            h = self._probe(p, ln, <uint32_t>mc_hash(p, ln, _SEED), &slot)
            if h >= 0 and self.seg_[h] >= 0:
                if self.lease_[h] < d:
                    self.lease_[h] = d
                h = -2
            out.append(h)
        return out

    def add(self, key):
        """A new handle for ``key`` (``ValueError`` if ``key`` is already in the table)."""
        cdef Py_ssize_t ln
        cdef const char *p
        cdef uint64_t slot
        cdef uint32_t hv
        cdef int32_t h
        p = self._utf8(key, &ln)
        if ln > 0xFFFFFFFF:
            raise OverflowError(f"key of {ln} bytes: at most 2**32 - 1")
        hv = <uint32_t>mc_hash(p, ln, _SEED)
        if self._probe(p, ln, hv, &slot) >= 0:
            raise ValueError(f"key {key!r} is already in the table")
        if self.nfree == 0 and self.n >= _MAX_HANDLES:
            raise OverflowError("object table full: 2**31 - 1 handles")
        # reserve everything first: nothing below fails
        self._reserve_arena(ln)
        if self.nfree == 0:
            self._reserve_handles(self.n + 1)
        if (self.count + 1) * 10 > self.nslots * 7:
            self._grow_index()
        if self.old_slots != NULL:
            self._migrate(_MIGRATE_STEPS)
            self._probe_in(self.slots, self.nslots, p, ln, hv, &slot)
        if self.nfree > 0:
            self.nfree -= 1
            h = self.free_[self.nfree]
        else:
            h = <int32_t>self.n
            self.n += 1
            self._zero_cold(h)
            self.prev_[h] = _NOT_LISTED
            self.next_[h] = -1
            self.lsize[h] = 0
        memcpy(self.arena + self.aused, p, ln)
        self.km[h].off = self.aused
        self.km[h].len = <uint32_t>ln
        self.km[h].hash = hv
        self.aused += ln
        self.alive += ln
        self.seq_[h] = self.next_seq_
        self.next_seq_ += 1
        self.slots[slot] = h + 1
        self.count += 1
        return h

    def remove(self, h):
        """Forget handle ``h``: its key, cold row and place in the recency list."""
        cdef int32_t x = self._live(h)
        cdef Py_ssize_t garbage, cap
        if self.nfree >= self.free_cap:
            cap = self.free_cap + (self.free_cap >> 1)
            if cap < 16:
                cap = 16
            _grow(<void **>&self.free_, sizeof(int32_t), cap)
            self.free_cap = cap
        if self._listed(x):
            self._unlink(x)
        if self.seg_[x] >= 0:
            self.ncold -= 1
            self._zero_cold(x)
        self._unindex(x)
        self.alive -= self.km[x].len
        self.km[x].off = -1
        self.km[x].len = 0
        self.free_[self.nfree] = x
        self.nfree += 1
        self.count -= 1
        garbage = self.aused - self.alive
        if garbage > self.alive and garbage > 16 * self.n + 4096:
            self._compact()

    def key(self, h):
        cdef int32_t x = self._live(h)
        return PyUnicode_DecodeUTF8(self.arena + self.km[x].off, self.km[x].len, "surrogatepass")

    def seq(self, h):
        return self.seq_[self._live(h)]

    cdef list _sorted(self, mc_seqpair *pairs, Py_ssize_t m):
        cdef list out
        cdef Py_ssize_t i
        mc_sort_seqpairs(pairs, m)
        out = [None] * m
        for i in range(m):
            out[i] = pairs[i].h
        return out

    def handles(self):
        """Every live handle, in ``seq`` order (the order their keys were added in)."""
        cdef mc_seqpair *pairs = <mc_seqpair *>malloc((self.count + 1) * sizeof(mc_seqpair))
        cdef Py_ssize_t h, m = 0
        if pairs == NULL:
            raise MemoryError()
        try:
            for h in range(self.n):
                if self.km[h].off >= 0:
                    pairs[m].seq = self.seq_[h]
                    pairs[m].h = h
                    m += 1
            return self._sorted(pairs, m)
        finally:
            free(pairs)

    def sort_by_seq(self, handles):
        """``handles`` (live, distinct) in ``seq`` order."""
        cdef list hs = list(handles)
        cdef Py_ssize_t i, m = len(hs)
        cdef int32_t x
        cdef mc_seqpair *pairs = <mc_seqpair *>malloc((m + 1) * sizeof(mc_seqpair))
        if pairs == NULL:
            raise MemoryError()
        try:
            for i in range(m):
                x = self._live(hs[i])
                pairs[i].seq = self.seq_[x]
                pairs[i].h = x
            return self._sorted(pairs, m)
        finally:
            free(pairs)

    # -- cold rows -------------------------------------------------------------------------------

    @property
    def cold_count(self):
        return self.ncold

    def is_cold(self, h):
        return self.seg_[self._live(h)] >= 0

    def set_cold(self, h, seg, addr, size, vid, lease, read, writer):
        """Give ``h`` a cold row (replacing any it has)."""
        cdef int32_t x = self._live(h)
        cdef int64_t s = _as_num("seg", seg, _I31)
        cdef int64_t a = _as_num("addr", addr, 0x7FFFFFFFFFFFFFFF)
        cdef int64_t z = _as_num("size", size, 0x7FFFFFFFFFFFFFFF)
        cdef int64_t v = _as_num("vid", vid, 0x7FFFFFFFFFFFFFFF)
        cdef int64_t w = _as_num("writer", writer, _I31)
        cdef double ls = _as_double(lease)
        cdef double rd = _as_double(read)
        if self.seg_[x] < 0:
            self.ncold += 1
        self.seg_[x] = <int32_t>s
        self.addr_[x] = a
        self.size_[x] = z
        self.vid_[x] = v
        self.lease_[x] = ls
        self.read_[x] = rd
        self.writer_[x] = <int32_t>w

    cdef int32_t _cold(self, object h) except -1:
        cdef int32_t x = self._live(h)
        if self.seg_[x] < 0:
            raise KeyError(h)
        return x

    def cold_row(self, h):
        """``(seg, addr, size, vid, lease, read, writer)``; ``KeyError`` if ``h`` is not cold."""
        cdef int32_t x = self._cold(h)
        return (self.seg_[x], self.addr_[x], self.size_[x], self.vid_[x], self.lease_[x],
                self.read_[x], self.writer_[x])

    def clear_cold(self, h):
        """Drop the cold row of ``h`` (``KeyError`` if it has none)."""
        cdef int32_t x = self._cold(h)
        self._zero_cold(x)
        self.ncold -= 1

    def set_deadlines(self, h, lease, read):
        """Set the lease and read-window deadlines of cold ``h``."""
        cdef int32_t x = self._cold(h)
        cdef double ls = _as_double(lease)
        cdef double rd = _as_double(read)
        self.lease_[x] = ls
        self.read_[x] = rd

    def extend_deadlines(self, at_least):
        """Raise every cold row's lease and read deadlines to at least ``at_least``."""
        cdef double t = _as_double(at_least)
        cdef Py_ssize_t h
        for h in range(self.n):
            if self.seg_[h] >= 0:
                if t > self.lease_[h]:
                    self.lease_[h] = t
                if t > self.read_[h]:
                    self.read_[h] = t

    def cold_on_segment(self, seg):
        """Cold handles whose replica is on segment ``seg``, in ``seq`` order."""
        cdef int overflow = 0
        cdef long long s
        cdef Py_ssize_t h, m = 0
        cdef mc_seqpair *pairs
        if not PyLong_CheckExact(seg):
            raise TypeError(f"seg must be an int, got {type(seg).__name__}")
        s = PyLong_AsLongLongAndOverflow(seg, &overflow)
        if overflow or s < 0 or s > _I31:
            return []
        for h in range(self.n):
            if self.seg_[h] == s:
                m += 1
        pairs = <mc_seqpair *>malloc((m + 1) * sizeof(mc_seqpair))
        if pairs == NULL:
            raise MemoryError()
        try:
            m = 0
            for h in range(self.n):
                if self.seg_[h] == s:
                    pairs[m].seq = self.seq_[h]
                    pairs[m].h = h
                    m += 1
            return self._sorted(pairs, m)
        finally:
            free(pairs)

    # -- the recency list ------------------------------------------------------------------------

    def lru_push(self, h, size):
        """Append ``h`` (``size`` bytes) at the most recent end (``ValueError`` if listed)."""
        cdef int32_t x = self._live(h)
        cdef int64_t z = _as_num("size", size, 0x7FFFFFFFFFFFFFFF)
        if self._listed(x):
            raise ValueError(f"handle {h} is already in the recency list")
        self._append(x, z)

    cdef int32_t _in_list(self, object h) except -1:
        cdef int32_t x = self._live(h)
        if not self._listed(x):
            raise KeyError(h)
        return x

    def lru_unlink(self, h):
        """Take ``h`` out of the recency list (``KeyError`` if it is not in it)."""
        self._unlink(self._in_list(h))

    def lru_touch(self, h):
        """Move ``h`` to the most recent end (``KeyError`` if it is not listed)."""
        cdef int32_t x = self._in_list(h)
        cdef int64_t z
        if self.tail != x:
            z = self.lsize[x]
            self._unlink(x)
            self._append(x, z)

    def lru_contains(self, h):
        cdef int overflow = 0
        cdef long long x
        if not PyLong_CheckExact(h):
            return False
        x = PyLong_AsLongLongAndOverflow(h, &overflow)
        if overflow or x < 0 or x >= self.n or self.km[x].off < 0:
            return False
        return self._listed(<int32_t>x)

    def lru_size(self, h):
        return self.lsize[self._in_list(h)]

    def lru_first(self):
        """The least recent handle, or ``-1``."""
        return self.head

    cdef list _walk(self, int32_t start, object limit):
        cdef Py_ssize_t m, i
        cdef int32_t x = start
        cdef list out
        if not PyLong_CheckExact(limit):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        if limit < 0 or limit > self.lru_n:
            m = self.lru_n
        else:
            m = limit
        out = []
        i = 0
        while i < m and x >= 0:
            out.append(x)
            x = self.next_[x]
            i += 1
        return out

    def lru_order(self, limit=-1):
        """Listed handles, least recent first (at most ``limit`` of them when ``>= 0``)."""
        return self._walk(self.head, limit)

    def lru_after(self, h, limit):
        """Up to ``limit`` listed handles that follow ``h``, in order (``KeyError`` if ``h``
        is not listed)."""
        cdef int32_t x
        if not PyLong_CheckExact(limit):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        x = self._in_list(h)
        if limit <= 0:
            return []
        return self._walk(self.next_[x], limit)

    @property
    def lru_len(self):
        return self.lru_n

    @property
    def lru_bytes(self):
        return ((<object>self.lb_hi) << 64) + PyLong_FromUnsignedLongLong(self.lb_lo)

    # -- whole-table moves -----------------------------------------------------------------------

    cdef array _col(self, str tc, void *src, Py_ssize_t m, size_t elem):
        cdef array a = clone(_pyarray(tc), m, False)
        if m:
            memcpy(a.data.as_voidptr, src, m * elem)
        return a

    def state(self):
        """The table as columns indexed by handle (see the module docstring)."""
        cdef Py_ssize_t n = self.n, h, pos = 0, i
        cdef object live = PyBytes_FromStringAndSize(NULL, n)
        cdef object blob = PyBytes_FromStringAndSize(NULL, self.alive)
        cdef char *lv = PyBytes_AS_STRING(live)
        cdef char *bl = PyBytes_AS_STRING(blob)
        cdef array key_len = clone(_pyarray("Q"), n, False)
        cdef array lru = clone(_pyarray("q"), self.lru_n, False)
        cdef array lru_size = clone(_pyarray("q"), self.lru_n, False)
        cdef unsigned long long *kl = key_len.data.as_ulonglongs
        cdef long long *lo = lru.data.as_longlongs
        cdef long long *ls = lru_size.data.as_longlongs
        cdef int32_t x
        for h in range(n):
            if self.km[h].off >= 0:
                lv[h] = 1
                memcpy(bl + pos, self.arena + self.km[h].off, self.km[h].len)
                pos += self.km[h].len
            else:
                lv[h] = 0
            kl[h] = self.km[h].len
        x = self.head
        i = 0
        while x >= 0:
            lo[i] = x
            ls[i] = self.lsize[x]
            x = self.next_[x]
            i += 1
        cdef array fr = clone(_pyarray("q"), self.nfree, False)
        for i in range(self.nfree):
            fr.data.as_longlongs[i] = self.free_[i]
        return {
            "n": n,
            "next_seq": self.next_seq_,
            "live": live,
            "key_blob": blob,
            "key_len": key_len,
            "seq": self._col("q", self.seq_, n, 8),
            "free": fr,
            "seg": self._col("i", self.seg_, n, 4),
            "addr": self._col("q", self.addr_, n, 8),
            "size": self._col("q", self.size_, n, 8),
            "vid": self._col("q", self.vid_, n, 8),
            "lease": self._col("d", self.lease_, n, 8),
            "read": self._col("d", self.read_, n, 8),
            "writer": self._col("i", self.writer_, n, 4),
            "lru": lru,
            "lru_size": lru_size,
        }

    @classmethod
    def from_state(cls, st):
        """The table :meth:`state` described (``ValueError`` if the state is malformed, as the
        pure twin's ``from_state`` says)."""
        n_, next_seq, live_, blob_, c = normalize_state(st)
        cdef ObjectTable t = cls()
        cdef Py_ssize_t n = n_, h, pos = 0, nlive = 0, nslots, i, m
        cdef bytes live = live_, blob = blob_
        cdef const unsigned char *lv = <const unsigned char *>PyBytes_AS_STRING(live)
        cdef const unsigned char *bl = <const unsigned char *>PyBytes_AS_STRING(blob)
        cdef Py_ssize_t nblob = PyBytes_GET_SIZE(blob)
        cdef array kla = c["key_len"], fra = c["free"], lra = c["lru"], lsa = c["lru_size"]
        cdef unsigned long long *kl = kla.data.as_ulonglongs
        cdef unsigned long long total = 0, ln
        cdef int64_t ns = next_seq, s
        cdef int32_t x, seg
        cdef uint64_t slot
        cdef long long f, z
        cdef char *mark
        for h in range(n):
            if kl[h] > 0xFFFFFFFF:
                raise ValueError(f"object table key of handle {h} too long")
            total += kl[h]
        if total != <unsigned long long>nblob:
            raise ValueError("object table key_len does not add up to key_blob")
        t._reserve_handles(n)
        t.n = n
        t.next_seq_ = ns
        if n:
            t._copy_columns(c, n)
        for h in range(n):
            t.prev_[h] = _NOT_LISTED
            t.next_[h] = -1
            t.lsize[h] = 0
            t.km[h].off = -1
            t.km[h].len = 0
            if lv[h]:
                nlive += 1
        # keys and rows, handle by handle: check them, copy the live keys, hash them
        nslots = 16
        while nlive * 10 > nslots * 7:
            nslots *= 2
        t._reserve_arena(nblob)
        t._set_slots(nslots)
        pos = 0
        for h in range(n):
            ln = kl[h]
            if not mc_utf8_valid(bl + pos, ln):
                raise ValueError(f"object table key of handle {h} is not UTF-8")
            if lv[h]:
                s = t.seq_[h]
                if s < 0 or s >= ns:
                    raise ValueError(f"object table seq {s} of handle {h} not in [0, {ns})")
                t.km[h].hash = <uint32_t>mc_hash(bl + pos, ln, _SEED)
                memcpy(t.arena + t.aused, bl + pos, ln)
                t.km[h].off = t.aused
                t.km[h].len = <uint32_t>ln
                t.aused += ln
                seg = t.seg_[h]
                if seg >= 0:
                    if t.addr_[h] < 0 or t.size_[h] < 0 or t.vid_[h] < 0 or t.writer_[h] < 0:
                        row = (seg, t.addr_[h], t.size_[h], t.vid_[h], t.writer_[h])
                        raise ValueError(
                            f"object table cold row of handle {h} out of range: {row}")
                    t.ncold += 1
                else:
                    t._zero_cold(<int32_t>h)
            else:
                t.km[h].hash = 0
                t._zero_cold(<int32_t>h)
            pos += ln
        # the index, fetching each slot a few keys ahead (the slots are many cache misses)
        if not t._index_all():
            raise ValueError("object table with a key twice")
        t.alive = t.aused
        # the free list: exactly the dead handles, each once
        m = len(fra)
        if m != n - nlive:
            raise ValueError("object table free list is not the dead handles")
        mark = <char *>malloc(n + 1)
        if mark == NULL:
            raise MemoryError()
        try:
            memset(mark, 0, n + 1)
            for i in range(m):
                f = fra.data.as_longlongs[i]
                if f < 0 or f >= n or lv[f] or mark[f]:
                    raise ValueError("object table free list is not the dead handles")
                mark[f] = 1
        finally:
            free(mark)
        if m:
            _grow(<void **>&t.free_, sizeof(int32_t), m)
            t.free_cap = m
            for i in range(m):
                t.free_[i] = <int32_t>fra.data.as_longlongs[i]
            t.nfree = m
        for i in range(len(lra)):
            f = lra.data.as_longlongs[i]
            z = lsa.data.as_longlongs[i]
            if f < 0 or f >= n or not lv[f] or t.prev_[f] != _NOT_LISTED or z < 0:
                raise ValueError(f"object table recency entry ({f}, {z}) is bad")
            t._append(<int32_t>f, z)
        return t

    def self_check(self):
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests)."""
        cdef Py_ssize_t h, live = 0, cold = 0, nidx = 0, i, alive = 0
        cdef uint64_t slot
        cdef int32_t x, p
        assert self.n <= self.hcap or self.n == 0
        for h in range(self.n):
            if self.km[h].off >= 0:
                live += 1
                alive += self.km[h].len
                assert self.km[h].off + self.km[h].len <= self.aused
                assert self.km[h].hash == <uint32_t>mc_hash(
                    self.arena + self.km[h].off, self.km[h].len, _SEED)
                assert self._probe(self.arena + self.km[h].off, self.km[h].len, self.km[h].hash,
                                   &slot) == h
                if self.seg_[h] >= 0:
                    cold += 1
            else:
                assert self.km[h].len == 0
                assert self.prev_[h] == _NOT_LISTED
            if self.seg_[h] < 0:
                assert self.seg_[h] == -1 and self.addr_[h] == 0 and self.size_[h] == 0
                assert self.vid_[h] == 0 and self.writer_[h] == 0
                assert self.lease_[h] == 0.0 and self.read_[h] == 0.0
        assert live == self.count and live + self.nfree == self.n
        assert cold == self.ncold and alive == self.alive
        seen = set()
        for i in range(self.nslots):
            if self.slots[i] != 0:
                nidx += 1
                assert self.km[self.slots[i] - 1].off >= 0
                assert self.slots[i] not in seen
                seen.add(self.slots[i])
        if self.old_slots != NULL:  # growing: every live handle is in one index or the other
            assert 0 <= self.mig <= self.old_nslots
            for i in range(self.old_nslots):
                if self.old_slots[i] != 0:
                    assert self.km[self.old_slots[i] - 1].off >= 0
                    assert i >= self.mig or self.old_slots[i] in seen, "unmoved below cursor"
                    seen.add(self.old_slots[i])
            nidx = len(seen)
        assert nidx == self.count and self.count * 10 <= self.nslots * 7
        for i in range(self.nfree):
            assert self.km[self.free_[i]].off < 0
        total = 0
        x = self.head
        p = -1
        i = 0
        while x >= 0:
            assert self.km[x].off >= 0 and self.prev_[x] == p
            total += self.lsize[x]
            p = x
            x = self.next_[x]
            i += 1
            assert i <= self.lru_n
        assert p == self.tail and i == self.lru_n and total == self.lru_bytes

    def memory_bytes(self):
        """Bytes the table's own buffers take (allocated sizes)."""
        return (self.hcap * (sizeof(mc_keyref) + 8 + 4 + 8 + 8 + 8 + 8 + 8 + 4 + 4 + 4 + 8)
                + self.free_cap * 4 + (self.nslots + self.old_nslots) * 4 + self.acap)
