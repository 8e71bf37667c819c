# cython: language_level=3
"""IntMap: an int64 -> int64 hash map in one C array (16 bytes a slot, no Python objects).

Open addressing with linear probing over a power-of-two table kept at load <= 0.75, keys mixed
by the splitmix64 finalizer, backward-shift deletion (no tombstones: a probe chain never holds
a dead slot, so lookups stay short after any mix of inserts and deletes). A slot whose key is 0
is empty; the key 0 itself lives outside the table (``_has_zero`` / ``_zero_val``).

Contracts (identical in the pure twin ``_intmap_pure``):

* keys and values are ints in [-2**63, 2**63): anything else raises ``TypeError`` (not an
  integer: objects with ``__index__`` count as integers) or ``OverflowError`` (out of range),
  for every operation that takes a key, lookups included;
* ``m[k]`` raises ``KeyError`` for a missing key; ``get``, ``pop``, ``clear``, ``len``, ``in``
  behave as a dict's;
* ``items_sorted()`` is ``(keys, values)`` as two ``array('q')``, ascending by key: the only
  way to enumerate (there is no iteration in hash order, so nothing can depend on it);
* ``total()`` is the sum of the values (exact, a Python int), kept as entries change;
* ``memory_bytes()`` is what the map holds in C memory plus its object header.
"""

from cpython.array cimport array, clone
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.number cimport PyNumber_Index
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free

cdef extern from *:
    """
    typedef __int128 mc_i128;
    static inline int64_t mc_i128_hi(mc_i128 t) { return (int64_t)(t >> 64); }
    static inline uint64_t mc_i128_lo(mc_i128 t) { return (uint64_t)t; }
    """
    ctypedef long long mc_i128  # a signed 128-bit integer in C
    int64_t mc_i128_hi(mc_i128 t) nogil
    uint64_t mc_i128_lo(mc_i128 t) nogil

COMPILED = True

ctypedef struct Slot:
    int64_t key
    int64_t val

cdef size_t MIN_CAP = 8
cdef object _template = array("q")
cdef object _MISSING = object()


cdef inline int64_t _i64(object o) except? -1:
    """``o`` as int64: ``TypeError`` unless it is an integer, ``OverflowError`` if too big."""
    if type(o) is not int:
        o = PyNumber_Index(o)  # floats, strings, None: TypeError (no silent truncation)
    return <int64_t>o


cdef inline uint64_t _mix(int64_t k) noexcept nogil:
    cdef uint64_t x = <uint64_t>k
    x ^= x >> 30
    x *= <uint64_t>0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= <uint64_t>0x94D049BB133111EB
    x ^= x >> 31
    return x


cdef class IntMap:
    """A dict of int64 keys to int64 values in C memory (see the module docstring)."""

    cdef Slot *_slots
    cdef size_t _cap  # power of two
    cdef size_t _used  # occupied table slots (key 0 not counted)
    cdef bint _has_zero
    cdef int64_t _zero_val
    cdef mc_i128 _total

    def __cinit__(self) -> None:
        self._slots = <Slot *>calloc(MIN_CAP, sizeof(Slot))
        if self._slots == NULL:
            raise MemoryError()
        self._cap = MIN_CAP
        self._used = 0
        self._has_zero = False
        self._zero_val = 0
        self._total = 0

    def __dealloc__(self) -> None:
        free(self._slots)

    # -- C internals -------------------------------------------------------------------------

    cdef inline Py_ssize_t _find(self, int64_t k) noexcept nogil:
        """Slot index holding ``k`` (k != 0), or -1."""
        cdef size_t mask = self._cap - 1
        cdef size_t i = <size_t>_mix(k) & mask
        cdef int64_t s
        while True:
            s = self._slots[i].key
            if s == k:
                return <Py_ssize_t>i
            if s == 0:
                return -1
            i = (i + 1) & mask

    cdef int _grow(self) except -1:
        cdef size_t new_cap = self._cap * 2
        cdef Slot *new = <Slot *>calloc(new_cap, sizeof(Slot))
        if new == NULL:
            raise MemoryError()
        cdef size_t mask = new_cap - 1
        cdef size_t j, i
        cdef Slot *old = self._slots
        with nogil:
            for j in range(self._cap):
                if old[j].key != 0:
                    i = <size_t>_mix(old[j].key) & mask
                    while new[i].key != 0:
                        i = (i + 1) & mask
                    new[i] = old[j]
        free(old)
        self._slots = new
        self._cap = new_cap
        return 0

    cdef int _set(self, int64_t k, int64_t v) except -1:
        cdef size_t mask, i
        cdef int64_t s
        if k == 0:
            if self._has_zero:
                self._total -= self._zero_val
            self._has_zero = True
            self._zero_val = v
            self._total += v
            return 0
        mask = self._cap - 1
        i = <size_t>_mix(k) & mask
        while True:
            s = self._slots[i].key
            if s == k:
                self._total += <mc_i128>v - <mc_i128>self._slots[i].val
                self._slots[i].val = v
                return 0
            if s == 0:
                break
            i = (i + 1) & mask
        if (self._used + 1) * 4 > self._cap * 3:
            self._grow()
            mask = self._cap - 1
            i = <size_t>_mix(k) & mask
            while self._slots[i].key != 0:
                i = (i + 1) & mask
        self._slots[i].key = k
        self._slots[i].val = v
        self._used += 1
        self._total += v
        return 0

    cdef void _delete_at(self, size_t i) noexcept nogil:
        """Empty slot ``i`` and shift later entries of its probe chain back (no tombstone)."""
        cdef size_t mask = self._cap - 1
        cdef size_t j = i
        cdef size_t home
        cdef int64_t s
        self._total -= self._slots[i].val
        while True:
            j = (j + 1) & mask
            s = self._slots[j].key
            if s == 0:
                break
            home = <size_t>_mix(s) & mask
            # the entry at j may fill the hole at i when i lies on its probe path home..j
            if ((j - home) & mask) >= ((j - i) & mask):
                self._slots[i] = self._slots[j]
                i = j
        self._slots[i].key = 0
        self._slots[i].val = 0
        self._used -= 1

    # -- the dict-like API -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._used + self._has_zero

    def __contains__(self, key_obj: object) -> bool:
        cdef int64_t key = _i64(key_obj)
        if key == 0:
            return self._has_zero
        return self._find(key) >= 0

    def __getitem__(self, key_obj: object) -> int:
        cdef Py_ssize_t i
        cdef int64_t key = _i64(key_obj)
        if key == 0:
            if self._has_zero:
                return self._zero_val
            raise KeyError(key)
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return self._slots[i].val

    def __setitem__(self, key: object, value: object) -> None:
        self._set(_i64(key), _i64(value))

    def __delitem__(self, key_obj: object) -> None:
        cdef Py_ssize_t i
        cdef int64_t key = _i64(key_obj)
        if key == 0:
            if not self._has_zero:
                raise KeyError(key)
            self._total -= self._zero_val
            self._has_zero = False
            self._zero_val = 0
            return
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        self._delete_at(<size_t>i)

    def __iter__(self) -> None:
        raise TypeError("IntMap is not iterable in hash order; use items_sorted()")

    def get(self, key_obj: object, default: object = None) -> object:
        """``m[key]`` if present, else ``default``."""
        cdef Py_ssize_t i
        cdef int64_t key = _i64(key_obj)
        if key == 0:
            return self._zero_val if self._has_zero else default
        i = self._find(key)
        if i < 0:
            return default
        return self._slots[i].val

    def pop(self, key_obj: object, default: object = _MISSING) -> object:
        """Remove ``key`` and return its value; ``default`` if absent (``KeyError`` if none)."""
        cdef Py_ssize_t i
        cdef int64_t v
        cdef int64_t key = _i64(key_obj)
        if key == 0:
            if not self._has_zero:
                if default is _MISSING:
                    raise KeyError(key)
                return default
            v = self._zero_val
            self._total -= v
            self._has_zero = False
            self._zero_val = 0
            return v
        i = self._find(key)
        if i < 0:
            if default is _MISSING:
                raise KeyError(key)
            return default
        v = self._slots[i].val
        self._delete_at(<size_t>i)
        return v

    def update(self, pairs: object) -> None:
        """Set every ``(key, value)`` of the iterable ``pairs``, in order."""
        for k, v in pairs:
            self._set(_i64(k), _i64(v))

    def clear(self) -> None:
        """Remove everything and give the table's memory back (down to the minimum)."""
        cdef Slot *new = <Slot *>calloc(MIN_CAP, sizeof(Slot))
        if new == NULL:
            raise MemoryError()
        free(self._slots)
        self._slots = new
        self._cap = MIN_CAP
        self._used = 0
        self._has_zero = False
        self._zero_val = 0
        self._total = 0

    def total(self) -> int:
        """Sum of all values (exact)."""
        return (<object>mc_i128_hi(self._total) << 64) + <object>mc_i128_lo(self._total)

    def memory_bytes(self) -> int:
        """Bytes held: the C table plus the object itself."""
        return self._cap * sizeof(Slot) + self.__sizeof__()

    def items_sorted(self) -> tuple[array, array]:
        """``(keys, values)`` as ``array('q')``, ascending by key."""
        cdef size_t n = self._used + self._has_zero
        cdef size_t j, m = 0
        cdef array keys = clone(_template, n, False)
        cdef array vals = clone(_template, n, False)
        if n == 0:
            return keys, vals
        cdef Slot *a = <Slot *>PyMem_Malloc(n * sizeof(Slot))
        cdef Slot *b = <Slot *>PyMem_Malloc(n * sizeof(Slot))
        cdef Slot *res
        cdef long long *ko = keys.data.as_longlongs
        cdef long long *vo = vals.data.as_longlongs
        if a == NULL or b == NULL:
            PyMem_Free(a)
            PyMem_Free(b)
            raise MemoryError()
        with nogil:
            if self._has_zero:
                a[0].key = 0
                a[0].val = self._zero_val
                m = 1
            for j in range(self._cap):
                if self._slots[j].key != 0:
                    a[m] = self._slots[j]
                    m += 1
            res = _radix_sort(a, b, n)
            for j in range(n):
                ko[j] = res[j].key
                vo[j] = res[j].val
        PyMem_Free(a)
        PyMem_Free(b)
        return keys, vals

    def __canon__(self) -> tuple[list[int], list[int]]:
        """Content in key order (fingerprints of state; independent of insertion history)."""
        k, v = self.items_sorted()
        return k.tolist(), v.tolist()

    def __reduce__(self) -> tuple[object, ...]:
        k, v = self.items_sorted()
        return (_rebuild, (k.tobytes(), v.tobytes()))

    def __repr__(self) -> str:
        return f"<IntMap len={len(self)} capacity={self._cap}>"


cdef Slot *_radix_sort(Slot *a, Slot *b, size_t n) noexcept nogil:
    """LSD radix sort of ``a`` by signed key, bytes where all keys agree skipped; ``b`` is
    scratch of the same size; returns the buffer holding the result."""
    cdef size_t counts[8][256]
    cdef size_t j, pos, c
    cdef int p, d
    cdef uint64_t u
    cdef Slot *t
    for p in range(8):
        for d in range(256):
            counts[p][d] = 0
    for j in range(n):
        u = <uint64_t>a[j].key ^ (<uint64_t>1 << 63)
        for p in range(8):
            counts[p][(u >> (8 * p)) & 0xFF] += 1
    for p in range(8):
        u = (<uint64_t>a[0].key ^ (<uint64_t>1 << 63)) >> (8 * p) & 0xFF
        if counts[p][u] == n:
            continue  # every key has this byte: the pass would not move anything
        pos = 0
        for d in range(256):
            c = counts[p][d]
            counts[p][d] = pos
            pos += c
        for j in range(n):
            u = <uint64_t>a[j].key ^ (<uint64_t>1 << 63)
            d = <int>((u >> (8 * p)) & 0xFF)
            b[counts[p][d]] = a[j]
            counts[p][d] += 1
        t = a
        a = b
        b = t
    return a


def _rebuild(kb: bytes, vb: bytes) -> IntMap:
    """An IntMap from the ``items_sorted()`` columns as bytes (unpickling)."""
    cdef array k = array("q")
    cdef array v = array("q")
    k.frombytes(kb)
    v.frombytes(vb)
    if len(k) != len(v):
        raise ValueError("IntMap pickle: key and value columns differ in length")
    cdef IntMap m = IntMap()
    cdef Py_ssize_t j
    for j in range(len(k)):
        m._set(k.data.as_longlongs[j], v.data.as_longlongs[j])
    return m
