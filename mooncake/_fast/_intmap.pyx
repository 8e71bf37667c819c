# cython: language_level=3
"""IntMap: an int64 -> int64 hash map in C arrays (12 bytes a slot, no Python objects).

Open addressing with linear probing over a power-of-two table kept at load <= 0.75, keys mixed
by the splitmix64 finalizer, backward-shift deletion (no tombstones: a probe chain never holds
a dead slot, so lookups stay short after any mix of inserts and deletes). A slot whose key is 0
is empty; the key 0 itself lives outside the table (``_has_zero`` / ``_zero_val``). Keys are an
int64 array, values an int32 array beside it: a value outside (-2**31, 2**31) is kept in a side
dict and its slot marked (rare for what this holds: extent lengths, counts, ids), so a slot is
12 bytes and an entry 16-32 bytes at load 3/8..3/4.

Contracts (identical in the pure twin ``_intmap_pure``):

* keys and values are ints in [-2**63, 2**63): anything else raises ``TypeError`` (not an
  integer: objects with ``__index__`` count as integers) or ``OverflowError`` (out of range),
  for every operation that takes a key, lookups included;
* ``m[k]`` raises ``KeyError`` for a missing key; ``get``, ``pop``, ``clear``, ``len``, ``in``
  behave as a dict's;
* ``items_sorted()`` is ``(keys, values)`` as two ``array('q')``, ascending by key: the only
  way to enumerate (there is no iteration in hash order, so nothing can depend on it);
* ``total()`` is the sum of the values (exact, a Python int), kept as entries change;
* ``memory_bytes()`` is what the map holds in C memory plus its object header;
* like a dict, every operation runs under the GIL (none releases it while the table is in
  flux), so threads may share a map.
"""

from cpython.array cimport array, clone
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.number cimport PyNumber_Index
from libc.stdint cimport INT32_MAX, INT32_MIN, int32_t, int64_t, uint64_t
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
cdef int32_t BIG = INT32_MIN  # value slot marker: the value is in the ``_big`` dict
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

    cdef int64_t *_keys  # 0: empty slot
    cdef int32_t *_vals  # BIG: the value is _big[key]
    cdef dict _big  # values outside int32 (rare: None until one comes)
    cdef size_t _cap  # power of two
    cdef size_t _used  # occupied table slots (key 0 not counted)
    cdef bint _has_zero
    cdef int64_t _zero_val
    cdef mc_i128 _total

    def __cinit__(self) -> None:
        self._keys = NULL
        self._vals = NULL
        self._reset()

    def __dealloc__(self) -> None:
        free(self._keys)
        free(self._vals)

    # -- C internals -------------------------------------------------------------------------

    cdef int _alloc_table(self, size_t cap) except -1:
        """Replace the table by an empty one of ``cap`` slots (the old one is freed)."""
        cdef int64_t *k = <int64_t *>calloc(cap, sizeof(int64_t))
        cdef int32_t *v = <int32_t *>calloc(cap, sizeof(int32_t))
        if k == NULL or v == NULL:
            free(k)
            free(v)
            raise MemoryError()
        free(self._keys)
        free(self._vals)
        self._keys = k
        self._vals = v
        self._cap = cap
        return 0

    cdef int _reset(self) except -1:
        """Empty, at the minimum size."""
        self._alloc_table(MIN_CAP)
        self._big = None
        self._used = 0
        self._has_zero = False
        self._zero_val = 0
        self._total = 0
        return 0

    cdef inline Py_ssize_t _find(self, int64_t k) noexcept nogil:
        """Slot index holding ``k`` (k != 0), or -1."""
        cdef size_t mask = self._cap - 1
        cdef size_t i = <size_t>_mix(k) & mask
        cdef int64_t s
        while True:
            s = self._keys[i]
            if s == k:
                return <Py_ssize_t>i
            if s == 0:
                return -1
            i = (i + 1) & mask

    cdef inline int64_t _val_at(self, size_t i) except? -1:
        cdef int32_t v = self._vals[i]
        if v != BIG:
            return v
        return <int64_t>self._big[self._keys[i]]

    cdef inline int _put_val(self, size_t i, int64_t v) except -1:
        """Store ``v`` for the key in slot ``i`` (whose old value, if any, is already gone)."""
        if INT32_MIN < v <= INT32_MAX:
            self._vals[i] = <int32_t>v
        else:
            if self._big is None:
                self._big = {}
            self._big[self._keys[i]] = v
            self._vals[i] = BIG
        return 0

    cdef int _grow(self) except -1:
        cdef size_t new_cap = self._cap * 2
        cdef int64_t *nk = <int64_t *>calloc(new_cap, sizeof(int64_t))
        cdef int32_t *nv = <int32_t *>calloc(new_cap, sizeof(int32_t))
        if nk == NULL or nv == NULL:
            free(nk)
            free(nv)
            raise MemoryError()
        cdef size_t mask = new_cap - 1
        cdef size_t j, i
        cdef int64_t *ok = self._keys
        cdef int32_t *ov = self._vals
        # the GIL stays held here and below: no other thread may see a half-moved table
        for j in range(self._cap):
            if ok[j] != 0:
                i = <size_t>_mix(ok[j]) & mask
                while nk[i] != 0:
                    i = (i + 1) & mask
                nk[i] = ok[j]
                nv[i] = ov[j]
        free(ok)
        free(ov)
        self._keys = nk
        self._vals = nv
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
            s = self._keys[i]
            if s == k:
                self._total -= self._val_at(i)
                if self._vals[i] == BIG:
                    del self._big[k]
                self._put_val(i, v)
                self._total += v
                return 0
            if s == 0:
                break
            i = (i + 1) & mask
        if (self._used + 1) * 4 > self._cap * 3:
            self._grow()
            mask = self._cap - 1
            i = <size_t>_mix(k) & mask
            while self._keys[i] != 0:
                i = (i + 1) & mask
        self._keys[i] = k
        self._put_val(i, v)
        self._used += 1
        self._total += v
        return 0

    cdef int64_t _delete_at(self, size_t i) except? -1:
        """Empty slot ``i``, shift later entries of its probe chain back (no tombstone) and
        return the value it held."""
        cdef size_t mask = self._cap - 1
        cdef size_t j = i
        cdef size_t home
        cdef int64_t s
        cdef int64_t v = self._val_at(i)
        if self._vals[i] == BIG:
            del self._big[self._keys[i]]
        self._total -= v
        while True:
            j = (j + 1) & mask
            s = self._keys[j]
            if s == 0:
                break
            home = <size_t>_mix(s) & mask
            # the entry at j may fill the hole at i when i lies on its probe path home..j
            if ((j - home) & mask) >= ((j - i) & mask):
                self._keys[i] = s
                self._vals[i] = self._vals[j]
                i = j
        self._keys[i] = 0
        self._vals[i] = 0
        self._used -= 1
        return v

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
        return self._val_at(<size_t>i)

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
        return self._val_at(<size_t>i)

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
        return self._delete_at(<size_t>i)

    def update(self, pairs: object) -> None:
        """Set every ``(key, value)`` of the iterable ``pairs``, in order."""
        for k, v in pairs:
            self._set(_i64(k), _i64(v))

    def update_columns(self, keys: array, values: array) -> None:
        """Set ``keys[j] -> values[j]`` for every ``j`` (two ``array('q')`` of one length), in
        order: :meth:`update` without a Python pair per entry."""
        cdef Py_ssize_t j, n
        if type(keys) is not array or type(values) is not array:
            raise TypeError("update_columns takes two array('q')")
        if keys.typecode != "q" or values.typecode != "q":
            raise TypeError(f"update_columns takes array('q'), got {keys.typecode!r}, {values.typecode!r}")
        n = len(keys)
        if len(values) != n:
            raise ValueError(f"{n} keys but {len(values)} values")
        for j in range(n):
            self._set(keys.data.as_longlongs[j], values.data.as_longlongs[j])

    def clear(self) -> None:
        """Remove everything and give the table's memory back (down to the minimum)."""
        self._reset()

    def total(self) -> int:
        """Sum of all values (exact)."""
        return (<object>mc_i128_hi(self._total) << 64) + <object>mc_i128_lo(self._total)

    def memory_bytes(self) -> int:
        """Bytes held: the C table plus the object itself."""
        cdef size_t n = self._cap * (sizeof(int64_t) + sizeof(int32_t)) + self.__sizeof__()
        if self._big:  # the dict and, per entry, a key and a value int
            n += self._big.__sizeof__() + 64 * len(self._big)
        return n

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
        if self._has_zero:
            a[0].key = 0
            a[0].val = self._zero_val
            m = 1
        for j in range(self._cap):
            if self._keys[j] != 0:
                a[m].key = self._keys[j]
                a[m].val = self._val_at(j)
                m += 1
        with nogil:  # private buffers only: the table is not touched without the GIL
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
