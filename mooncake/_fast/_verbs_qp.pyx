# cython: language_level=3
"""Reliable-connected queue pair: state transitions and batched RDMA WRITE/READ posting.

Transitions use Mooncake's attributes (RdmaEndPoint::doSetupConnection): INIT (port, pkey
index, access LOCAL_WRITE|REMOTE_READ|REMOTE_WRITE), RTR (path MTU, dest QPN, rq_psn 0,
max_dest_rd_atomic 16, min_rnr_timer 12, address vector with the peer's LID and, when the
peer has a GID, a GRH with its GID, sgid index and hop limit), RTS (timeout 14, retry_cnt 7,
rnr_retry 7, sq_psn 0, max_rd_atomic 16).

Posting: one SGE per WR, every WR signaled, ``wr_id`` a slab index of the send CQ (see
``_verbs_cq``). A WR's slot holds its local MR until the completion is reaped, so the
registered buffer outlives every WR that can touch it. ``post`` releases the GIL around
``ibv_post_send``.
"""

import warnings

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_pd cimport PD
from mooncake._fast._verbs_cq cimport CQ
from mooncake._fast._verbs_mr cimport MR
from mooncake._fast._verbs_lib cimport Resource, check_rc, ibv, live_add, raise_errno, LIVE_QP
from mooncake.errors import ClosedError, InvalidArgumentError, NotRegisteredError, VerbsError

OP_WRITE = 0  # IBV_WR_RDMA_WRITE
OP_READ = 4   # IBV_WR_RDMA_READ

QPS_RESET = 0
QPS_INIT = 1
QPS_RTR = 2
QPS_RTS = 3
QPS_ERR = 6

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
MTU_ENUM = {v: k for k, v in MTU_BYTES.items()}


cdef class QP(Resource):
    """``QP(pd, send_cq, recv_cq=None, max_send_wr=256, max_send_sge=4, max_inline=64)``."""

    def __cinit__(self, PD pd not None, CQ send_cq not None, CQ recv_cq=None, *,
                  int max_send_wr=256, int max_send_sge=4, int max_inline=64):
        pd._check_open()
        send_cq._check_open()
        if recv_cq is None:
            recv_cq = send_cq
        recv_cq._check_open()
        self.qp = NULL
        self.wrs = NULL
        self.sges = NULL
        self.fifo = NULL
        self._closed = True
        self._close_rank = 0
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        if max_send_wr < 1 or max_send_sge < 1 or max_inline < 0:
            raise InvalidArgumentError(
                f"QP caps max_send_wr={max_send_wr} max_send_sge={max_send_sge} "
                f"max_inline={max_inline} must be positive"
            )
        cdef mcv_qp_init_attr a
        memset(&a, 0, sizeof(a))
        a.send_cq = send_cq.cq
        a.recv_cq = recv_cq.cq
        a.qp_type = MCV_QPT_RC
        a.sq_sig_all = 0
        a.cap.max_send_wr = max_send_wr
        a.cap.max_recv_wr = 1
        a.cap.max_send_sge = max_send_sge
        a.cap.max_recv_sge = 1
        a.cap.max_inline_data = max_inline
        self.qp = ibv().create_qp(pd.pd, &a)
        if self.qp == NULL:
            raise_errno(f"ibv_create_qp(max_send_wr={max_send_wr})")
        self.max_send_wr = max_send_wr
        self.max_send_sge = max_send_sge
        self.max_inline = max_inline
        self.qp_num = self.qp.qp_num
        self.state = QPS_RESET
        self.wrs = <mcv_send_wr *>PyMem_Calloc(max_send_wr, sizeof(mcv_send_wr))
        self.sges = <mcv_sge *>PyMem_Calloc(max_send_wr, sizeof(mcv_sge))
        self.fifo = <uint32_t *>PyMem_Calloc(max_send_wr + 1, sizeof(uint32_t))
        if self.wrs == NULL or self.sges == NULL or self.fifo == NULL:
            ibv().destroy_qp(self.qp)
            self.qp = NULL
            raise MemoryError()
        pd._adopt(self)
        send_cq._adopt(self)
        if recv_cq is not send_cq:
            recv_cq._adopt(self)
        live_add(LIVE_QP, 1)
        self._closed = False

    cdef int _modify(self, mcv_qp_attr *a, int mask, int new_state, str what) except -1:
        self._check_open()
        rc = ibv().modify_qp(self.qp, a, mask)
        check_rc(rc, f"ibv_modify_qp(qpn {self.qp_num} -> {what})")
        self.state = new_state
        return 0

    def to_init(self, int port=1, int pkey_index=0,
                int access=MCV_ACCESS_LOCAL_WRITE | MCV_ACCESS_REMOTE_READ | MCV_ACCESS_REMOTE_WRITE):
        """RESET -> INIT."""
        cdef mcv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = MCV_QPS_INIT
        a.port_num = <uint8_t>port
        a.pkey_index = <uint16_t>pkey_index
        a.qp_access_flags = access
        self._modify(&a, MCV_QP_STATE | MCV_QP_PKEY_INDEX | MCV_QP_PORT | MCV_QP_ACCESS_FLAGS,
                     QPS_INIT, "INIT")

    def to_rtr(self, unsigned int dest_qpn, int dlid=0, bytes dgid=None, *, int port=1,
               int sgid_index=0, int mtu=4096, int hop_limit=16, int traffic_class=0,
               int sl=0, unsigned int rq_psn=0, int max_dest_rd_atomic=16,
               int min_rnr_timer=12):
        """INIT -> RTR towards ``dest_qpn`` at ``dlid`` and (if non-zero) ``dgid``."""
        if mtu not in MTU_ENUM:
            raise InvalidArgumentError(f"path MTU {mtu} not one of {sorted(MTU_ENUM)}")
        cdef mcv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = MCV_QPS_RTR
        a.path_mtu = MTU_ENUM[mtu]
        a.dest_qp_num = dest_qpn
        a.rq_psn = rq_psn
        a.max_dest_rd_atomic = <uint8_t>max_dest_rd_atomic
        a.min_rnr_timer = <uint8_t>min_rnr_timer
        a.ah_attr.dlid = <uint16_t>dlid
        a.ah_attr.sl = <uint8_t>sl
        a.ah_attr.port_num = <uint8_t>port
        if dgid is not None and any(dgid):
            if len(dgid) != 16:
                raise InvalidArgumentError(f"GID must be 16 bytes, got {len(dgid)}")
            a.ah_attr.is_global = 1
            for i in range(16):
                a.ah_attr.grh.dgid.raw[i] = dgid[i]
            a.ah_attr.grh.sgid_index = <uint8_t>sgid_index
            a.ah_attr.grh.hop_limit = <uint8_t>hop_limit
            a.ah_attr.grh.traffic_class = <uint8_t>traffic_class
        self._modify(&a, MCV_QP_STATE | MCV_QP_AV | MCV_QP_PATH_MTU | MCV_QP_DEST_QPN |
                     MCV_QP_RQ_PSN | MCV_QP_MAX_DEST_RD_ATOMIC | MCV_QP_MIN_RNR_TIMER,
                     QPS_RTR, "RTR")

    def to_rts(self, unsigned int sq_psn=0, int timeout=14, int retry_cnt=7, int rnr_retry=7,
               int max_rd_atomic=16):
        """RTR -> RTS."""
        cdef mcv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = MCV_QPS_RTS
        a.timeout = <uint8_t>timeout
        a.retry_cnt = <uint8_t>retry_cnt
        a.rnr_retry = <uint8_t>rnr_retry
        a.sq_psn = sq_psn
        a.max_rd_atomic = <uint8_t>max_rd_atomic
        self._modify(&a, MCV_QP_STATE | MCV_QP_TIMEOUT | MCV_QP_RETRY_CNT | MCV_QP_RNR_RETRY |
                     MCV_QP_SQ_PSN | MCV_QP_MAX_QP_RD_ATOMIC, QPS_RTS, "RTS")

    def to_error(self):
        """Any state -> ERR: outstanding WRs complete with IBV_WC_WR_FLUSH_ERR."""
        cdef mcv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = MCV_QPS_ERR
        self._modify(&a, MCV_QP_STATE, QPS_ERR, "ERR")

    def reset(self):
        """Any state -> RESET (outstanding WRs are dropped by the device, not completed)."""
        cdef mcv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = MCV_QPS_RESET
        self._modify(&a, MCV_QP_STATE, QPS_RESET, "RESET")

    @property
    def slots_free(self):
        """WRs that may be posted now: send-queue room, bounded by the send CQ's slab."""
        return min(self.max_send_wr - self.inflight, self.send_cq.free_top)

    def post(self, int opcode, list mrs not None, list local_addrs not None,
             list lengths not None, list remote_addrs not None, list rkeys not None,
             list cookies not None):
        """Post one WR per index: RDMA ``opcode`` (OP_WRITE/OP_READ) of ``lengths[i]`` bytes
        between ``local_addrs[i]`` (inside ``mrs[i]``) and ``remote_addrs[i]`` under ``rkeys[i]``.

        Returns the number posted (all of them). At most :attr:`slots_free` WRs per call. If the
        device refuses WR ``k``, WRs ``0..k-1`` stay posted (their completions will come) and
        :class:`VerbsError` is raised with ``posted = k``.
        """
        self._check_open()
        if opcode != OP_WRITE and opcode != OP_READ:
            raise InvalidArgumentError(f"opcode {opcode} is neither OP_WRITE nor OP_READ")
        cdef Py_ssize_t n = len(mrs)
        if not (len(local_addrs) == len(lengths) == len(remote_addrs) == len(rkeys)
                == len(cookies) == n):
            raise InvalidArgumentError("post: argument lists differ in length")
        if n == 0:
            return 0
        if n > self.slots_free:
            raise InvalidArgumentError(
                f"post of {n} WRs exceeds the {self.slots_free} free send-queue slots"
            )
        cdef Py_ssize_t i
        cdef MR mr
        cdef uint64_t laddr, length
        for i in range(n):
            mr = <MR?>mrs[i]
            laddr = local_addrs[i]
            length = lengths[i]
            if mr._closed:
                raise ClosedError(f"WR {i}: its MR is closed")
            if mr.pd is not self.pd:
                raise InvalidArgumentError(f"WR {i}: its MR belongs to another PD than the QP")
            if length == 0 or length > 0x80000000 or laddr < mr.addr or laddr + length > mr.addr + mr.length:
                raise NotRegisteredError(
                    f"WR {i}: local [{laddr:#x}, +{length}) not inside MR "
                    f"[{mr.addr:#x}, +{mr.length})"
                )
        cdef mcv_send_wr *w
        for i in range(n):
            mr = <MR>mrs[i]
            w = &self.wrs[i]
            w.wr_id = self.send_cq.slab_take(self, mr, <uint64_t>cookies[i])
            w.next = &self.wrs[i + 1] if i + 1 < n else NULL
            w.sg_list = &self.sges[i]
            w.num_sge = 1
            w.opcode = opcode
            w.send_flags = MCV_SEND_SIGNALED
            w.wr.rdma.remote_addr = <uint64_t>remote_addrs[i]
            w.wr.rdma.rkey = <uint32_t>rkeys[i]
            self.sges[i].addr = <uint64_t>local_addrs[i]
            self.sges[i].length = <uint32_t>lengths[i]
            self.sges[i].lkey = mr.lkey
        cdef mcv_send_wr *bad = NULL
        cdef int rc
        with nogil:
            rc = self.qp.context.ops.post_send(self.qp, self.wrs, &bad)
        if rc == 0:
            return n
        cdef Py_ssize_t posted = n
        if bad != NULL:
            posted = bad - self.wrs
        for i in range(posted, n):
            self.send_cq.slab_put(<uint32_t>(self.wrs[i].wr_id & 0xffffffffu))
        raise VerbsError(rc if rc > 0 else -rc, f"ibv_post_send(qpn {self.qp_num})", posted)

    def close(self):
        """Destroy the QP; its unreaped WRs' slots are freed (the device is done with them)."""
        if self._closed:
            return
        self._closed = True
        rc = ibv().destroy_qp(self.qp)
        self.qp = NULL
        self.send_cq.slab_release_qp(self)
        if self.recv_cq is not self.send_cq:
            self.recv_cq.slab_release_qp(self)
        live_add(LIVE_QP, -1)
        check_rc(rc, f"ibv_destroy_qp(qpn {self.qp_num})")

    def __dealloc__(self):
        if self.qp != NULL:
            ibv().destroy_qp(self.qp)
            live_add(LIVE_QP, -1)
        PyMem_Free(self.wrs)
        PyMem_Free(self.sges)
        PyMem_Free(self.fifo)

    def __del__(self):
        if not self._closed:
            warnings.warn(f"unclosed verbs QP {self.qp_num}", ResourceWarning, source=self)
