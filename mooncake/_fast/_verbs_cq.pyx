# cython: language_level=3
"""Completion channel, completion queue, batched polling and the work-request slab.

Completions reach an event loop through :attr:`CompChannel.fd` (non-blocking): arm with
:meth:`CQ.req_notify`, drain with :meth:`CQ.poll`, wait for the fd to be readable, consume with
:meth:`CompChannel.get_events`, re-arm, drain again (arm-then-drain closes the race with a
completion that lands between the last poll and the arm).

The slab: every posted WR takes a slot of its send CQ; ``wr_id`` is ``generation << 32 | slot``,
never a Python pointer. The slot holds the QP and the local MR (so the MR, and through it the
registered buffer, stays alive) plus the caller's 64-bit cookie, until the completion is reaped
by :meth:`CQ.poll` or the QP is destroyed (after which the NIC no longer touches the buffers).
"""

import array
import warnings

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.errno cimport errno, EAGAIN
from libc.stdint cimport int32_t, uint32_t, uint64_t

from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_device cimport Context
from mooncake._fast._verbs_lib cimport (
    Resource, check_rc, ibv, live_add, raise_errno, LIVE_CQ, LIVE_CHANNEL,
)
from mooncake.errors import InvalidArgumentError, VerbsError

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    int F_GETFL
    int F_SETFL
    int O_NONBLOCK

WC_STATUS_NAMES = {
    0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR",
    17: "INV_EECN_ERR", 18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR",
    21: "GENERAL_ERR",
}


cdef class CompChannel(Resource):
    """``ibv_create_comp_channel``; :attr:`fd` is non-blocking, for ``wait_readable``."""

    def __cinit__(self, Context context not None):
        context._check_open()
        self.ch = NULL
        self.context = context
        self._closed = True
        self._close_rank = 3
        self.ch = ibv().create_comp_channel(context.ctx)
        if self.ch == NULL:
            raise_errno("ibv_create_comp_channel")
        cdef int fl = fcntl(self.ch.fd, F_GETFL)
        fcntl(self.ch.fd, F_SETFL, fl | O_NONBLOCK)
        context._adopt(self)
        live_add(LIVE_CHANNEL, 1)
        self._closed = False

    @property
    def fd(self):
        self._check_open()
        return self.ch.fd

    def get_events(self):
        """Consume and acknowledge every pending CQ event; returns how many there were."""
        self._check_open()
        cdef IbvApi *api = ibv()
        cdef mcv_cq *cq
        cdef void *cq_ctx
        cdef int n = 0
        cdef int rc
        while True:
            with nogil:
                rc = api.get_cq_event(self.ch, &cq, &cq_ctx)
            if rc != 0:
                if errno == EAGAIN or n > 0 or errno == 0:
                    break
                raise VerbsError(errno, "ibv_get_cq_event")
            api.ack_cq_events(cq, 1)
            n += 1
        return n

    def close(self):
        if self._closed:
            return
        self._close_children()
        self._closed = True
        rc = ibv().destroy_comp_channel(self.ch)
        self.ch = NULL
        live_add(LIVE_CHANNEL, -1)
        check_rc(rc, "ibv_destroy_comp_channel")

    def __dealloc__(self):
        if self.ch != NULL:
            ibv().destroy_comp_channel(self.ch)
            live_add(LIVE_CHANNEL, -1)

    def __del__(self):
        if not self._closed:
            warnings.warn("unclosed verbs CompChannel", ResourceWarning, source=self)


cdef class WcBatch:
    """Preallocated output of :meth:`CQ.poll`: parallel arrays indexed ``0..n-1``.

    ``cookies`` (the caller's cookie of each reaped WR), ``status`` (``ibv_wc_status``),
    ``opcode``, ``byte_len``, ``qp_num``, ``vendor_err``. Reused across polls: read before the
    next poll.
    """

    def __cinit__(self, int capacity=64):
        if capacity < 1 or capacity > 65536:
            raise InvalidArgumentError(f"WcBatch capacity {capacity} outside [1, 65536]")
        self.capacity = capacity
        self.wc = <mcv_wc *>PyMem_Calloc(capacity, sizeof(mcv_wc))
        if self.wc == NULL:
            raise MemoryError()
        self.cookies = array.array("Q", bytes(8 * capacity))
        self.status = array.array("i", bytes(4 * capacity))
        self.opcode = array.array("i", bytes(4 * capacity))
        self.byte_len = array.array("I", bytes(4 * capacity))
        self.qp_num = array.array("I", bytes(4 * capacity))
        self.vendor_err = array.array("I", bytes(4 * capacity))
        self._cookies = self.cookies
        self._status = self.status
        self._opcode = self.opcode
        self._byte_len = self.byte_len
        self._qp_num = self.qp_num
        self._vendor_err = self.vendor_err

    def __dealloc__(self):
        PyMem_Free(self.wc)


cdef class CQ(Resource):
    """``CQ(context, cqe, channel=None)``: a CQ of ``cqe`` entries with a slab of as many slots.

    Every WR is signaled, so the slab bounds the WRs in flight on all QPs using this CQ as their
    send CQ and the CQ can never overrun.
    """

    def __cinit__(self, Context context not None, int cqe=4096, CompChannel channel=None):
        context._check_open()
        self.cq = NULL
        self.gen = NULL
        self.free_stack = NULL
        self.cookies = NULL
        self._closed = True
        self.context = context
        self.channel = channel
        self._close_rank = 2
        if cqe < 1:
            raise InvalidArgumentError(f"CQ size {cqe} must be positive")
        if channel is not None:
            channel._check_open()
        self.cq = ibv().create_cq(context.ctx, cqe, NULL,
                                  channel.ch if channel is not None else NULL, 0)
        if self.cq == NULL:
            raise_errno(f"ibv_create_cq({cqe})")
        self.cqe = cqe
        self.slab_size = cqe
        self.gen = <uint32_t *>PyMem_Calloc(cqe, sizeof(uint32_t))
        self.free_stack = <int32_t *>PyMem_Calloc(cqe, sizeof(int32_t))
        self.cookies = <uint64_t *>PyMem_Calloc(cqe, sizeof(uint64_t))
        if self.gen == NULL or self.free_stack == NULL or self.cookies == NULL:
            raise MemoryError()
        for i in range(cqe):
            self.free_stack[i] = cqe - 1 - i
            self.gen[i] = 1
        self.free_top = cqe
        self.owners = [None] * cqe
        self.slot_qp = [None] * cqe
        context._adopt(self)
        if channel is not None:
            channel._adopt(self)
        live_add(LIVE_CQ, 1)
        self._closed = False

    @property
    def slots_free(self):
        """Slab slots left: how many more WRs may be posted against this CQ."""
        return self.free_top

    cdef uint64_t slab_take(self, Resource qp, Resource owner, uint64_t cookie) except 0:
        if self.free_top == 0:
            raise VerbsError(12, "CQ slab full")  # ENOMEM; callers check slots_free first
        self.free_top -= 1
        cdef uint32_t slot = <uint32_t>self.free_stack[self.free_top]
        self.owners[slot] = owner
        self.slot_qp[slot] = qp
        self.cookies[slot] = cookie
        owner.inflight += 1
        qp.inflight += 1
        self.inflight += 1
        return (<uint64_t>self.gen[slot] << 32) | slot

    cdef void slab_put(self, uint32_t slot) noexcept:
        cdef Resource owner = <Resource>self.owners[slot]
        cdef Resource qp = <Resource>self.slot_qp[slot]
        owner.inflight -= 1
        qp.inflight -= 1
        self.inflight -= 1
        self.owners[slot] = None
        self.slot_qp[slot] = None
        self.gen[slot] += 1
        if self.gen[slot] == 0:
            self.gen[slot] = 1
        self.free_stack[self.free_top] = <int32_t>slot
        self.free_top += 1

    cdef int slab_release_qp(self, Resource qp) except -1:
        """Free every slot of ``qp`` (called once the QP is destroyed: no more DMA)."""
        cdef uint32_t slot
        for slot in range(<uint32_t>self.slab_size):
            if self.slot_qp[slot] is qp:
                self.slab_put(slot)
        return 0

    def req_notify(self, bint solicited_only=False):
        """Arm the CQ: the next completion writes one event to the channel."""
        self._check_open()
        check_rc(self.cq.context.ops.req_notify_cq(self.cq, solicited_only), "ibv_req_notify_cq")

    def poll(self, WcBatch out not None):
        """Reap up to ``out.capacity`` completions into ``out``; returns how many.

        Each reaped WR's slab slot is freed (its MR and QP lose one in-flight reference).
        Raises :class:`VerbsError` if the CQ is in error (overrun).
        """
        self._check_open()
        cdef int n
        cdef int i, k = 0
        cdef uint64_t wr_id
        cdef uint32_t slot, g
        cdef mcv_wc *w
        with nogil:
            n = self.cq.context.ops.poll_cq(self.cq, out.capacity, out.wc)
        if n < 0:
            raise VerbsError(-n if n < -1 else 5, "ibv_poll_cq")
        for i in range(n):
            w = &out.wc[i]
            wr_id = w.wr_id
            slot = <uint32_t>(wr_id & 0xffffffffu)
            g = <uint32_t>(wr_id >> 32)
            if slot >= <uint32_t>self.slab_size or self.gen[slot] != g or self.owners[slot] is None:
                self.stray += 1  # a completion for a WR we do not own: never hand it out
                continue
            out._cookies[k] = self.cookies[slot]
            out._status[k] = w.status
            out._opcode[k] = w.opcode
            out._byte_len[k] = w.byte_len
            out._qp_num[k] = w.qp_num
            out._vendor_err[k] = w.vendor_err
            self.slab_put(slot)
            k += 1
        return k

    def close(self):
        """Close the QPs using this CQ, then destroy it. Idempotent."""
        if self._closed:
            return
        self._close_children()
        self._closed = True
        rc = ibv().destroy_cq(self.cq)
        self.cq = NULL
        live_add(LIVE_CQ, -1)
        check_rc(rc, "ibv_destroy_cq")

    def __dealloc__(self):
        if self.cq != NULL:
            ibv().destroy_cq(self.cq)
            live_add(LIVE_CQ, -1)
        PyMem_Free(self.gen)
        PyMem_Free(self.free_stack)
        PyMem_Free(self.cookies)

    def __del__(self):
        if not self._closed:
            warnings.warn("unclosed verbs CQ", ResourceWarning, source=self)
