# cython: language_level=3
from mooncake._fast._ibv cimport IbvApi

cdef enum LiveKind:
    LIVE_CONTEXT = 0
    LIVE_PD = 1
    LIVE_MR = 2
    LIVE_CQ = 3
    LIVE_QP = 4
    LIVE_CHANNEL = 5
    LIVE_KINDS = 6

cdef IbvApi *ibv() except NULL
cdef int check_rc(int rc, str what) except -1
cdef int raise_errno(str what) except -1
cdef void live_add(int kind, int delta) noexcept


cdef class Resource:
    """Base of every verbs object: closed flag, in-flight count, the children to close first."""
    cdef bint _closed
    cdef public int inflight
    cdef int _close_rank
    cdef object _children
    cdef object __weakref__
    cdef int _adopt(self, Resource child) except -1
    cdef int _close_children(self) except -1
    cdef int _check_open(self) except -1
