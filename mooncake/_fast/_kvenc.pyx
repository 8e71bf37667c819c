# cython: language_level=3, boundscheck=False, wraparound=False
"""The KV event batch body from pre-encoded pieces, in C: one buffer per batch, no Python
object per event (the pure encoder builds seven to nine ``bytes`` per event).

Contracts: identical to the pure twin ``_kvenc_pure`` (its docstring states them); the
encodings are msgspec's (the smallest msgpack form of each int and string), byte for byte.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

COMPILED = True

cdef struct Buf:
    char* p
    Py_ssize_t n
    Py_ssize_t cap


cdef int _grow(Buf* b, Py_ssize_t need) except -1:
    cdef Py_ssize_t cap = b.cap * 2 if b.cap else 8192
    while cap < b.n + need:
        cap *= 2
    cdef char* p = <char*>PyMem_Realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int _put(Buf* b, const char* s, Py_ssize_t k) except -1:
    if b.n + k > b.cap:
        _grow(b, k)
    memcpy(b.p + b.n, s, k)
    b.n += k
    return 0


cdef inline int _put_bytes(Buf* b, bytes s) except -1:
    return _put(b, PyBytes_AS_STRING(s), PyBytes_GET_SIZE(s))


cdef inline void _be(unsigned char* t, uint64_t v, int k) noexcept:
    cdef int i
    for i in range(k):
        t[k - 1 - i] = <unsigned char>(v & 0xFF)
        v >>= 8


cdef int _put_uint(Buf* b, uint64_t v) except -1:
    cdef unsigned char t[9]
    if v < 128:
        t[0] = <unsigned char>v
        return _put(b, <char*>t, 1)
    if v < 256:
        t[0] = 0xCC
        _be(t + 1, v, 1)
        return _put(b, <char*>t, 2)
    if v < 65536:
        t[0] = 0xCD
        _be(t + 1, v, 2)
        return _put(b, <char*>t, 3)
    if v < 4294967296:
        t[0] = 0xCE
        _be(t + 1, v, 4)
        return _put(b, <char*>t, 5)
    t[0] = 0xCF
    _be(t + 1, v, 8)
    return _put(b, <char*>t, 9)


cdef int _put_int(Buf* b, int64_t v) except -1:
    cdef unsigned char t[9]
    if v >= 0:
        return _put_uint(b, <uint64_t>v)
    if v >= -32:
        t[0] = <unsigned char>(v & 0xFF)
        return _put(b, <char*>t, 1)
    if v >= -128:
        t[0] = 0xD0
        _be(t + 1, <uint64_t>v, 1)
        return _put(b, <char*>t, 2)
    if v >= -32768:
        t[0] = 0xD1
        _be(t + 1, <uint64_t>v, 2)
        return _put(b, <char*>t, 3)
    if v >= -2147483648:
        t[0] = 0xD2
        _be(t + 1, <uint64_t>v, 4)
        return _put(b, <char*>t, 5)
    t[0] = 0xD3
    _be(t + 1, <uint64_t>v, 8)
    return _put(b, <char*>t, 9)


cdef int _put_str(Buf* b, const char* s, Py_ssize_t k) except -1:
    cdef unsigned char t[5]
    if k < 32:
        t[0] = <unsigned char>(0xA0 | k)
        _put(b, <char*>t, 1)
    elif k < 256:
        t[0] = 0xD9
        _be(t + 1, <uint64_t>k, 1)
        _put(b, <char*>t, 2)
    elif k < 65536:
        t[0] = 0xDA
        _be(t + 1, <uint64_t>k, 2)
        _put(b, <char*>t, 3)
    else:
        t[0] = 0xDB
        _be(t + 1, <uint64_t>k, 4)
        _put(b, <char*>t, 5)
    return _put(b, s, k)


cdef int _hex(char c) noexcept:
    if b"0"[0] <= c <= b"9"[0]:
        return c - b"0"[0]
    if b"a"[0] <= c <= b"f"[0]:
        return c - b"a"[0] + 10
    if b"A"[0] <= c <= b"F"[0]:
        return c - b"A"[0] + 10
    return -1


cdef bint _parse(const char* s, Py_ssize_t k, uint64_t* out) noexcept:
    """``s[:k]`` (UTF-8) as a decimal or ``0x``-hex u64; false if it is neither or too big."""
    cdef uint64_t v = 0
    cdef Py_ssize_t i
    cdef int d
    if k == 0:
        return False
    if k >= 2 and s[0] == b"0"[0] and (s[1] == b"x"[0] or s[1] == b"X"[0]):
        if k == 2:
            return False
        for i in range(2, k):
            d = _hex(s[i])
            if d < 0 or (v >> 60) != 0:
                return False
            v = (v << 4) | <uint64_t>d
        out[0] = v
        return True
    for i in range(k):
        d = s[i] - b"0"[0]
        if d < 0 or d > 9:
            return False
        if v > (<uint64_t>0xFFFFFFFFFFFFFFFF - <uint64_t>d) // 10:
            return False
        v = v * 10 + <uint64_t>d
    out[0] = v
    return True


def parse_seq_hash(str key):
    """The u64 ``key`` encodes in decimal or ``0x`` hex, else ``None``."""
    cdef Py_ssize_t k
    cdef const char* s = PyUnicode_AsUTF8AndSize(key, &k)
    cdef uint64_t v
    if _parse(s, k, &v):
        return v
    return None


def encode_events(
    list events,
    first_event_id,
    bytes ts_entry,
    tuple heads,
    tuple tails,
    dict mids,
    middle_of,
    str prefix,
    split,
    okey,
    bytes seq_key,
    block_key,
    bytes empty,
):
    """The batch body of ``events`` (see ``_kvenc_pure``)."""
    cdef Buf b
    b.p = NULL
    b.n = 0
    b.cap = 0
    cdef uint64_t eid0 = first_event_id
    cdef uint64_t eid = eid0
    cdef Py_ssize_t unparsed = 0
    cdef Py_ssize_t pk, k
    cdef const char* pfx = PyUnicode_AsUTF8AndSize(prefix, &pk)
    cdef const char* s
    cdef bint has_okey = okey is not None
    cdef bint legacy = block_key is not None
    cdef bytes okey_b = okey if has_okey else b""
    cdef bytes block_b = block_key if legacy else b""
    cdef bytes head0 = heads[0]
    cdef bytes head1 = heads[1]
    cdef bytes tail0 = tails[0]
    cdef bytes tail1 = tails[1]
    cdef bytes m
    cdef bytes last_mid = None
    cdef object last_medium = None
    cdef int last_kind = -1
    cdef int kind
    cdef uint64_t h
    cdef bint is_hash
    cdef str key, tenant
    cdef object medium
    cdef tuple ev
    try:
        for ev in events:
            kind = ev[0]
            key = ev[1]
            medium = ev[2]
            if kind != 0 and kind != 1:
                raise ValueError(f"kv event kind must be 0 or 1, got {kind}")
            s = PyUnicode_AsUTF8AndSize(key, &k)
            tenant = ""
            if pk > 0 and k >= pk and memcmp(s, pfx, pk) == 0:
                key, tenant = split(key)
                s = PyUnicode_AsUTF8AndSize(key, &k)
            is_hash = k > 0 and b"0"[0] <= s[0] <= b"9"[0] and _parse(s, k, &h)
            if not is_hash and (not has_okey or k == 0):
                continue
            if tenant == "" and kind == last_kind and medium is last_medium:
                m = last_mid
            else:
                m = mids.get((kind, medium, tenant)) or middle_of(kind, medium, tenant)
                if tenant == "":
                    last_kind, last_medium, last_mid = kind, medium, m
            _put_bytes(&b, head0 if kind == 0 else head1)
            _put_uint(&b, eid)
            _put_bytes(&b, ts_entry)
            _put_bytes(&b, m)
            if has_okey:
                _put_bytes(&b, okey_b)
                _put_str(&b, s, k)
            if not is_hash:
                unparsed += 1
                _put_bytes(&b, empty)
            else:
                _put_bytes(&b, seq_key)
                _put(&b, b"\x91", 1)
                _put_uint(&b, h)
                if legacy:
                    _put_bytes(&b, block_b)
                    _put(&b, b"\x91", 1)
                    _put_int(&b, <int64_t>h)
            _put_bytes(&b, tail0 if kind == 0 else tail1)
            eid += 1
        out = PyBytes_FromStringAndSize(b.p, b.n) if b.n else b""
    finally:
        PyMem_Free(b.p)
    return out, <Py_ssize_t>(eid - eid0), unparsed
