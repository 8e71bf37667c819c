# cython: language_level=3
from cpython.buffer cimport Py_buffer
from mooncake._fast._ibv cimport mcv_mr
from mooncake._fast._verbs_pd cimport PD
from mooncake._fast._verbs_lib cimport Resource

cdef class MR(Resource):
    cdef mcv_mr *mr
    cdef readonly PD pd
    cdef Py_buffer view
    cdef bint has_view
    cdef object owner
    cdef readonly size_t addr
    cdef readonly size_t length
    cdef readonly unsigned int lkey
    cdef readonly unsigned int rkey
    cdef readonly int access
    cdef _release_view(self)
