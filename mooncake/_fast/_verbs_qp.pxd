# cython: language_level=3
from libc.stdint cimport uint32_t
from mooncake._fast._ibv cimport mcv_qp, mcv_qp_attr, mcv_send_wr, mcv_sge
from mooncake._fast._verbs_pd cimport PD
from mooncake._fast._verbs_cq cimport CQ
from mooncake._fast._verbs_lib cimport Resource

cdef class QP(Resource):
    cdef mcv_qp *qp
    cdef readonly PD pd
    cdef readonly CQ send_cq
    cdef readonly CQ recv_cq
    cdef readonly int max_send_wr
    cdef readonly int max_send_sge
    cdef readonly int max_inline
    cdef readonly int state
    cdef readonly unsigned int qp_num
    cdef mcv_send_wr *wrs
    cdef mcv_sge *sges
    # slab slots of WRs posted by the batch engine, in posting order (selective signaling)
    cdef uint32_t *fifo
    cdef int fifo_head
    cdef int fifo_count
    cdef int _modify(self, mcv_qp_attr *a, int mask, int new_state, str what) except -1
