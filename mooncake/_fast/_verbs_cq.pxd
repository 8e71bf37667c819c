# cython: language_level=3
from libc.stdint cimport int32_t, uint32_t, uint64_t
from mooncake._fast._ibv cimport mcv_comp_channel, mcv_cq, mcv_wc
from mooncake._fast._verbs_device cimport Context
from mooncake._fast._verbs_lib cimport Resource

cdef class CompChannel(Resource):
    cdef mcv_comp_channel *ch
    cdef readonly Context context

cdef class WcBatch:
    cdef mcv_wc *wc
    cdef readonly int capacity
    cdef readonly object cookies
    cdef readonly object status
    cdef readonly object opcode
    cdef readonly object byte_len
    cdef readonly object qp_num
    cdef readonly object vendor_err
    cdef uint64_t[::1] _cookies
    cdef int32_t[::1] _status
    cdef int32_t[::1] _opcode
    cdef uint32_t[::1] _byte_len
    cdef uint32_t[::1] _qp_num
    cdef uint32_t[::1] _vendor_err

cdef class CQ(Resource):
    cdef mcv_cq *cq
    cdef readonly Context context
    cdef readonly CompChannel channel
    cdef readonly int cqe
    cdef int slab_size
    cdef uint32_t *gen
    cdef int32_t *free_stack
    cdef int free_top
    cdef uint64_t *cookies
    cdef list owners
    cdef list slot_qp
    cdef readonly unsigned long long stray
    cdef uint64_t slab_take(self, Resource qp, Resource owner, uint64_t cookie) except 0
    cdef void slab_put(self, uint32_t slot) noexcept
    cdef int slab_release_qp(self, Resource qp) except -1
