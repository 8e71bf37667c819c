# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The RDMA transport's per-slice work in C: slicing, rail choice, WR chains, completions.

Python hands this module whole batches and is called back once per batch event (finished,
an error to classify, slices to re-route), never per slice:

* :class:`SliceBatch` holds one ``execute``'s requests and slices in C arrays: addresses,
  lengths, opcode, lkey per local NIC, rkey per peer device, the per-request location class,
  per-slice state, retry count and rail, per-rail queues (linked lists), per-request remaining
  slices and moved bytes. :meth:`SliceBatch.choose` gives every new slice a rail from rail
  tables the transport computes per (location class, retry) from the topology matrices and
  rail health (random among the options on a first try, the first option on retries, exactly
  as ``selectDevice``).
* :class:`Rail` is one endpoint's QPs (local NIC -> peer NIC). Batches with slices queued on
  a rail wait on it in FIFO order.
* :class:`NicPump` is one NIC's CQ. :meth:`NicPump.run` alternates reaping completions and
  refilling the rails of its NIC: each refill builds one linked WR chain per QP (one doorbell,
  one ``ibv_post_send``), signaled every ``signal_every`` WRs and at its end; a completion of a
  signaled WR retires every unsignaled WR posted before it on that QP (RC completes in order).
  Error and flush completions are reported for every WR, signaled or not.
* :class:`BatchEngine` maps WR cookies to batches: ``wr_id`` is the CQ slab's ``generation <<
  32 | slot`` and the slot's cookie is ``batch key << 32 | slice index`` (never a pointer).

Ownership is the verbs layer's: every posted WR holds a CQ slab slot, and with it its local MR
(so the registered buffer stays pinned) until it is reaped or its QP is destroyed
(:meth:`Rail.close` destroys the QPs first, then settles their unreaped WRs as flushed).
The same code posts to a real RNIC and to the software provider; the loops hold the GIL (they
touch the slab's Python references) and release it around ``post_send`` and ``poll_cq``.

There is no pure-Python twin: like the verbs layer it drives, it exists only compiled (without
the extensions the RDMA transport refuses to start).
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_cq cimport CQ
from mooncake._fast._verbs_lib cimport Resource
from mooncake._fast._verbs_qp cimport QP
from mooncake.errors import InvalidArgumentError, VerbsError

cdef enum:
    MAX_TABLE = 4096

# slice states
cdef enum:
    S_NEW = 0      # needs a rail (the transport calls choose())
    S_QUEUED = 1   # waiting on a rail's queue
    S_POSTED = 2   # a WR is in flight
    S_DONE = 3     # moved
    S_HELD = 4     # an error the transport has to classify (take_errors)
    S_DROPPED = 5  # finished without moving (request failed or batch abandoned)

# kinds of the errors handed to the transport
ERR_WC = 0        # a completion with this status
ERR_REFUSED = 1   # ibv_post_send refused the WR (code: errno)
ERR_NO_RAIL = 2   # no usable rail for this slice
ERR_BAD_RKEY = 3  # the peer's descriptor has no valid rkey for the chosen device (code: device)
ERR_UNQUEUED = 4  # taken off a rail whose endpoint could not be made (unqueue)
ERR_WC_STALE = 5  # a completion with this status from an endpoint the rail no longer uses

STATE_NAMES = {S_NEW: "new", S_QUEUED: "queued", S_POSTED: "posted", S_DONE: "done",
               S_HELD: "held", S_DROPPED: "dropped"}

cdef uint64_t SENTINEL_KEY = 0xffffffffu
cdef int WC_FLUSH = 5


cdef inline uint64_t _rand(uint64_t *s) noexcept nogil:
    # xorshift64*
    cdef uint64_t x = s[0]
    x ^= x >> 12
    x ^= x << 25
    x ^= x >> 27
    s[0] = x
    return x * <uint64_t>0x2545F4914F6CDD1D


cdef class BatchEngine:
    """The table of live batches (by key) shared by one transport's NIC pumps."""

    cdef list table
    cdef list free_keys
    cdef readonly int live
    cdef list woken

    def __cinit__(self):
        self.table = []
        self.free_keys = []
        self.live = 0
        self.woken = []

    cdef int _register(self, SliceBatch b) except -1:
        cdef int key
        if self.free_keys:
            key = self.free_keys.pop()
            self.table[key] = b
        else:
            key = len(self.table)
            if key >= 0x7fffffff:
                raise InvalidArgumentError("too many live RDMA batches")
            self.table.append(b)
        self.live += 1
        return key

    cdef void _release(self, int key) noexcept:
        self.table[key] = None
        self.free_keys.append(key)
        self.live -= 1

    cdef void _wake(self, SliceBatch b) noexcept:
        if not b.woken:
            b.woken = True
            self.woken.append(b)

    def take_woken(self):
        """Batches that became done, got errors or new slices since the last call."""
        out = self.woken
        self.woken = []
        for b in out:
            (<SliceBatch>b).woken = False
        return out

    def batches(self):
        return [b for b in self.table if b is not None]

    cdef int _settle(self, uint64_t cookie, int status, QP qp) except -1:
        """One WR of the batch ``cookie`` names is over (its slab slot is already free)."""
        cdef uint64_t key = cookie >> 32
        if key == SENTINEL_KEY or key >= <uint64_t>len(self.table):
            return 0
        cdef object o = self.table[key]
        if o is None:
            return 0
        cdef SliceBatch b = <SliceBatch>o
        cdef int32_t i = <int32_t>(cookie & 0xffffffffu)
        if i < 0 or i >= b.nslices or b.s_state[i] != S_POSTED:
            return 0
        b.outstanding -= 1
        cdef int32_t req = b.s_req[i]
        cdef int32_t ridx = b.s_rail[i]
        if status == 0:
            b.s_state[i] = S_DONE
            b.r_moved[req] += b.s_len[i]
            b.r_remaining[req] -= 1
            b.rail_ok[ridx] += 1
        elif b.cancelled:
            b.s_state[i] = S_DROPPED
            b.r_remaining[req] -= 1
            b._push_error(i, ERR_WC, status, ridx)  # counted (stats), not retried
        else:
            b.s_state[i] = S_HELD
            rail = b.rails[ridx]
            if rail is not None and qp in (<Rail>rail).qps:
                b._push_error(i, ERR_WC, status, ridx)
                (<Rail>rail)._break(self)
            else:  # posted on an earlier endpoint of this rail, already replaced
                b._push_error(i, ERR_WC_STALE, status, ridx)
            self._wake(b)
        if b.outstanding == 0 and b.queued == 0:
            self._wake(b)
        return 0


cdef class Rail:
    """``Rail(pump, qps)``: the QPs of one endpoint (local NIC -> peer NIC), posted by ``pump``.

    Batches with slices queued here wait in FIFO order; :meth:`NicPump.run` posts them as the
    QPs and the CQ slab have room. A broken rail (an error completion, a refused post, or
    :meth:`set_broken`) posts nothing more and sends its queued slices back to their batches as
    new (not counted as a try).
    """

    cdef readonly NicPump pump
    cdef readonly list qps
    cdef int nq
    cdef int next
    cdef readonly bint broken
    cdef readonly bint closed
    cdef list waiting      # [(SliceBatch, ridx)]
    cdef int wait_head
    cdef readonly long long queued
    cdef bint in_pump
    cdef readonly object refused  # (errno, qp_num) of the last refused post

    def __cinit__(self, NicPump pump not None, list qps not None):
        if not qps:
            raise InvalidArgumentError("a rail needs at least one QP")
        for q in qps:
            if (<QP?>q).send_cq is not pump.cq:
                raise InvalidArgumentError("a rail's QPs must complete on its pump's CQ")
        self.pump = pump
        self.qps = list(qps)
        self.nq = len(qps)
        self.next = 0
        self.waiting = []
        self.wait_head = 0
        self.queued = 0
        self.refused = None

    @property
    def inflight(self):
        return sum((<QP>q).inflight for q in self.qps)

    cdef int _attach(self, SliceBatch b, int32_t ridx) except -1:
        if not b.q_attached[ridx]:
            b.q_attached[ridx] = 1
            self.waiting.append((b, ridx))
        self.queued += b.q_new[ridx]
        b.q_new[ridx] = 0
        if not self.in_pump:
            self.in_pump = True
            self.pump.rails.append(self)
        return 0

    cdef int _break(self, BatchEngine eng) except -1:
        """Stop posting here; queued slices go back to their batches as new."""
        if self.broken:
            return 0
        self.broken = True
        cdef SliceBatch b
        cdef int32_t ridx
        cdef Py_ssize_t k
        for k in range(self.wait_head, len(self.waiting)):
            b, ridx = self.waiting[k]
            if b._requeue_rail(ridx) > 0:
                eng._wake(b)
        self.waiting = []
        self.wait_head = 0
        self.queued = 0
        return 0

    def set_broken(self):
        """Mark broken (the transport retired the endpoint)."""
        self._break(self.pump.engine)

    def close(self):
        """Destroy the QPs (no more DMA), then settle their unreaped WRs as flushed."""
        if self.closed:
            return
        self._break(self.pump.engine)
        self.closed = True
        cdef QP qp
        cdef CQ cq = self.pump.cq
        cdef list cookies
        cdef uint32_t slot
        cdef int cap, k
        errors = []
        for q in self.qps:
            qp = <QP>q
            cookies = []
            cap = qp.max_send_wr + 1
            for k in range(qp.fifo_count):
                slot = qp.fifo[(qp.fifo_head + k) % cap]
                if cq.owners[slot] is not None:
                    cookies.append(cq.cookies[slot])
            qp.fifo_count = 0
            try:
                qp.close()  # frees the QP's slab slots
            except Exception as e:  # gone from our side either way
                errors.append(e)
            for c in cookies:
                self.pump.engine._settle(c, WC_FLUSH, qp)
        if errors:
            raise errors[0]


cdef class NicPump:
    """``NicPump(engine, cq, poll_batch=64, signal_every=16)``: reaps one NIC's CQ and posts
    the queued slices of its rails."""

    cdef readonly BatchEngine engine
    cdef readonly CQ cq
    cdef mcv_wc *wc
    cdef int poll_batch
    cdef readonly int signal_every
    cdef list rails
    cdef readonly unsigned long long posted
    cdef readonly unsigned long long completions
    cdef readonly unsigned long long doorbells

    def __cinit__(self, BatchEngine engine not None, CQ cq not None, int poll_batch=64,
                  int signal_every=16):
        if poll_batch < 1 or poll_batch > 65536 or signal_every < 1:
            raise InvalidArgumentError("poll_batch in [1, 65536] and signal_every >= 1")
        self.engine = engine
        self.cq = cq
        self.poll_batch = poll_batch
        self.signal_every = signal_every
        self.rails = []
        self.wc = <mcv_wc *>PyMem_Calloc(poll_batch, sizeof(mcv_wc))
        if self.wc == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.wc)

    cdef int _retire_slot(self, uint32_t slot, int status, QP qp) except -1:
        cdef CQ cq = self.cq
        cdef uint64_t cookie = cq.cookies[slot]
        cq.slab_put(slot)
        self.engine._settle(cookie, status, qp)
        return 0

    cdef int _reap(self) except -1:
        """One poll of up to ``poll_batch`` CQEs; returns how many."""
        cdef CQ cq = self.cq
        cdef mcv_cq *c = cq.cq
        cdef int n, i, cap
        cdef uint64_t wr_id
        cdef uint32_t slot, g, s2
        cdef QP qp
        with nogil:
            n = c.context.ops.poll_cq(c, self.poll_batch, self.wc)
        if n < 0:
            cq._check_open()
            raise VerbsError(-n if n < -1 else 5, "ibv_poll_cq")
        for i in range(n):
            wr_id = self.wc[i].wr_id
            slot = <uint32_t>(wr_id & 0xffffffffu)
            g = <uint32_t>(wr_id >> 32)
            if slot >= <uint32_t>cq.slab_size or cq.gen[slot] != g or cq.owners[slot] is None:
                cq.stray += 1
                continue
            qp = <QP>cq.slot_qp[slot]
            cap = qp.max_send_wr + 1
            # everything posted before it on this QP is complete (RC order)
            while qp.fifo_count > 0:
                s2 = qp.fifo[qp.fifo_head]
                qp.fifo_head = (qp.fifo_head + 1) % cap
                qp.fifo_count -= 1
                if s2 == slot:
                    break
                self._retire_slot(s2, 0, qp)
            self._retire_slot(slot, self.wc[i].status, qp)
        self.completions += n
        return n

    cdef int _fill(self, Rail rail) except -1:
        """Post queued slices on ``rail``: one chain per QP with room. Returns WRs posted."""
        cdef CQ cq = self.cq
        cdef QP qp
        cdef int k, room, n, chosen, total = 0, cap, rc
        cdef Py_ssize_t posted
        cdef SliceBatch b
        cdef int32_t ridx, i, req, li
        cdef mcv_send_wr *w
        cdef mcv_send_wr *bad
        cdef uint64_t off
        cdef long long share
        cdef list mrs
        while not rail.broken and rail.wait_head < len(rail.waiting):
            chosen = -1
            for k in range(rail.nq):
                qp = <QP>rail.qps[(rail.next + k) % rail.nq]
                room = qp.max_send_wr - qp.inflight
                if room > cq.free_top:
                    room = cq.free_top
                if room > 0:
                    chosen = (rail.next + k) % rail.nq
                    break
            if chosen < 0:
                return total  # no room: completions on this NIC will call us again
            rail.next = (chosen + 1) % rail.nq
            share = (rail.queued + rail.nq - 1) // rail.nq  # spread over the QPs
            if share < room:
                room = <int>share
            if room < 1:
                room = 1
            cap = qp.max_send_wr + 1
            n = 0
            while n < room and rail.wait_head < len(rail.waiting):
                b, ridx = rail.waiting[rail.wait_head]
                li = ridx // b.npeer
                while n < room and b.q_head[ridx] >= 0:
                    i = b.q_head[ridx]
                    b.q_head[ridx] = b.s_next[i]
                    if b.q_head[ridx] < 0:
                        b.q_tail[ridx] = -1
                    b.q_count[ridx] -= 1
                    b.queued -= 1
                    rail.queued -= 1
                    req = b.s_req[i]
                    mrs = <list>b.r_mrs[req]
                    w = &qp.wrs[n]
                    w.wr_id = cq.slab_take(qp, <Resource>mrs[li],
                                           (<uint64_t>b.key << 32) | <uint32_t>i)
                    qp.fifo[(qp.fifo_head + qp.fifo_count) % cap] = <uint32_t>(w.wr_id & 0xffffffffu)
                    qp.fifo_count += 1
                    off = b.s_off[i]
                    w.next = &qp.wrs[n + 1]
                    w.sg_list = &qp.sges[n]
                    w.num_sge = 1
                    w.opcode = b.r_op[req]
                    w.send_flags = MCV_SEND_SIGNALED if (n + 1) % self.signal_every == 0 else 0
                    w.wr.rdma.remote_addr = b.r_raddr[req] + off
                    w.wr.rdma.rkey = <uint32_t>b.r_rkey[req * b.npeer + (ridx % b.npeer)]
                    qp.sges[n].addr = b.r_laddr[req] + off
                    qp.sges[n].length = <uint32_t>b.s_len[i]
                    qp.sges[n].lkey = b.r_lkey[req * b.nnic + li]
                    b.s_state[i] = S_POSTED
                    b.outstanding += 1
                    n += 1
                if b.q_head[ridx] < 0:
                    b.q_attached[ridx] = 0
                    rail.wait_head += 1
            if rail.wait_head >= len(rail.waiting):
                rail.waiting = []
                rail.wait_head = 0
            if n == 0:
                break
            qp.wrs[n - 1].next = NULL
            qp.wrs[n - 1].send_flags = MCV_SEND_SIGNALED
            bad = NULL
            with nogil:
                rc = qp.qp.context.ops.post_send(qp.qp, qp.wrs, &bad)
            self.doorbells += 1
            if rc == 0:
                posted = n
            else:
                posted = (bad - qp.wrs) if bad != NULL else 0
                self._refused(rail, qp, n, posted, rc if rc > 0 else -rc)
            self.posted += posted
            total += <int>posted
        return total

    cdef int _refused(self, Rail rail, QP qp, int n, Py_ssize_t posted, int err) except -1:
        """The device refused WRs ``posted..n-1`` of the chain just built on ``qp``."""
        cdef CQ cq = self.cq
        cdef int cap = qp.max_send_wr + 1
        cdef int k
        cdef uint32_t slot
        cdef uint64_t cookie
        cdef SliceBatch b
        cdef int32_t i
        cdef int rc
        cdef mcv_send_wr *bad
        # undo the refused suffix: slots, FIFO tail, slices back to their batches as errors
        for k in range(n - 1, <int>posted - 1, -1):
            slot = <uint32_t>(qp.wrs[k].wr_id & 0xffffffffu)
            cookie = cq.cookies[slot]
            cq.slab_put(slot)
            qp.fifo_count -= 1
            b = <SliceBatch>self.engine.table[cookie >> 32]
            i = <int32_t>(cookie & 0xffffffffu)
            b.outstanding -= 1
            if b.cancelled:
                b.s_state[i] = S_DROPPED
                b.r_remaining[b.s_req[i]] -= 1
            else:
                b.s_state[i] = S_HELD
                b._push_error(i, ERR_REFUSED, err, b.s_rail[i])
            self.engine._wake(b)
        rail.refused = (err, qp.qp_num)
        rail._break(self.engine)
        if posted > 0 and not (qp.wrs[posted - 1].send_flags & MCV_SEND_SIGNALED):
            # the accepted prefix ends unsignaled: move the QP to ERR and post a signaled
            # sentinel, whose (flushed) completion retires the prefix
            try:
                qp.to_error()
            except Exception:
                return 0
            qp.wrs[0].wr_id = cq.slab_take(qp, qp, SENTINEL_KEY << 32)
            qp.fifo[(qp.fifo_head + qp.fifo_count) % cap] = <uint32_t>(qp.wrs[0].wr_id & 0xffffffffu)
            qp.fifo_count += 1
            qp.wrs[0].next = NULL
            qp.wrs[0].num_sge = 0
            qp.wrs[0].sg_list = NULL
            qp.wrs[0].send_flags = MCV_SEND_SIGNALED
            qp.wrs[0].wr.rdma.remote_addr = 0
            qp.wrs[0].wr.rdma.rkey = 0
            bad = NULL
            with nogil:
                rc = qp.qp.context.ops.post_send(qp.qp, qp.wrs, &bad)
            if rc != 0:
                cq.slab_put(<uint32_t>(qp.wrs[0].wr_id & 0xffffffffu))
                qp.fifo_count -= 1
        return 0

    def run(self, long budget=1 << 16):
        """Reap and refill until nothing moves or ``budget`` completions+posts were handled.

        Returns True if work may be left (call again after yielding to the loop).
        """
        cdef long done = 0
        cdef int got, put
        cdef Py_ssize_t k
        cdef Rail rail
        while done < budget:
            got = 0
            while done < budget:
                put = self._reap()
                got += put
                done += put
                if put < self.poll_batch:
                    break
            put = 0
            if self.rails:
                keep = []
                for k in range(len(self.rails)):
                    rail = <Rail>self.rails[k]
                    put += self._fill(rail)
                    if not rail.broken and rail.wait_head < len(rail.waiting):
                        keep.append(rail)
                    else:
                        rail.in_pump = False
                self.rails = keep
            done += put
            if got == 0 and put == 0:
                return False
        return True

    def has_queued(self):
        return bool(self.rails)


cdef class SliceBatch:
    """One ``execute``: requests cut into slices, routed and counted in C arrays.

    ``SliceBatch(engine, laddr, raddr, length, opcode, cls, lkeys, rkeys, mrs, nnic, npeer,
    slice_size, fragment_limit, seed)``: per request ``i`` (array-likes of length ``nreq``)
    the local and remote address, length, verbs opcode (0 WRITE, 4 READ) and location class;
    ``lkeys[i * nnic + li]``, ``rkeys[i * npeer + pi]`` (-1: no usable key on that device);
    ``mrs[i]`` the request's region's MRs by NIC (None for a request not to slice, whose
    ``length`` is then ignored). Slicing is Mooncake's: ``slice_size`` pieces, a tail of at
    most ``slice_size + fragment_limit`` merged into the last one.
    """

    cdef readonly BatchEngine engine
    cdef readonly int key
    cdef readonly int nreq
    cdef readonly int nslices
    cdef readonly int nnic
    cdef readonly int npeer
    cdef readonly int nrails
    cdef readonly long long outstanding
    cdef readonly long long queued
    cdef readonly bint cancelled
    cdef bint woken
    cdef bint registered
    cdef public object event
    cdef uint64_t rng
    # requests
    cdef uint64_t *r_laddr
    cdef uint64_t *r_raddr
    cdef int32_t *r_op
    cdef int32_t *r_cls
    cdef uint32_t *r_lkey
    cdef int64_t *r_rkey
    cdef int64_t *r_remaining
    cdef uint64_t *r_moved
    cdef uint8_t *r_failed
    cdef list r_mrs
    # slices
    cdef int32_t *s_req
    cdef uint64_t *s_off
    cdef uint64_t *s_len
    cdef uint8_t *s_retry
    cdef uint8_t *s_state
    cdef uint8_t *s_access
    cdef int32_t *s_rail
    cdef int32_t *s_next
    # rails
    cdef int32_t *q_head
    cdef int32_t *q_tail
    cdef int64_t *q_count
    cdef int64_t *rail_ok
    cdef int64_t *q_new
    cdef uint8_t *q_attached  # on the waiting list of rails[ridx]
    cdef list rails
    # errors to classify: (slice, kind, code, rail)
    cdef int32_t *e_slice
    cdef int32_t *e_kind
    cdef int32_t *e_code
    cdef int32_t *e_rail
    cdef int nerr
    cdef dict tables

    def __cinit__(self, BatchEngine engine not None, laddr, raddr, length, opcode, cls, lkeys,
                  rkeys, list mrs not None, int nnic, int npeer, long long slice_size,
                  long long fragment_limit, unsigned long long seed):
        cdef Py_ssize_t nreq = len(mrs)
        if nnic < 1 or npeer < 1 or slice_size < 1 or fragment_limit < 0:
            raise InvalidArgumentError("SliceBatch: nnic, npeer and slice_size must be positive")
        if not (len(laddr) == len(raddr) == len(length) == len(opcode) == len(cls) == nreq):
            raise InvalidArgumentError("SliceBatch: per-request arrays differ in length")
        if len(lkeys) != nreq * nnic or len(rkeys) != nreq * npeer:
            raise InvalidArgumentError("SliceBatch: lkeys/rkeys must be nreq*nnic / nreq*npeer")
        self.engine = engine
        self.nreq = <int>nreq
        self.nnic = nnic
        self.npeer = npeer
        self.nrails = nnic * npeer
        self.rng = seed | 1
        self.r_mrs = mrs
        self.tables = {}
        self.rails = [None] * self.nrails
        cdef Py_ssize_t n1 = nreq if nreq > 0 else 1
        self.r_laddr = <uint64_t *>PyMem_Calloc(n1, 8)
        self.r_raddr = <uint64_t *>PyMem_Calloc(n1, 8)
        self.r_op = <int32_t *>PyMem_Calloc(n1, 4)
        self.r_cls = <int32_t *>PyMem_Calloc(n1, 4)
        self.r_lkey = <uint32_t *>PyMem_Calloc(n1 * nnic, 4)
        self.r_rkey = <int64_t *>PyMem_Calloc(n1 * npeer, 8)
        self.r_remaining = <int64_t *>PyMem_Calloc(n1, 8)
        self.r_moved = <uint64_t *>PyMem_Calloc(n1, 8)
        self.r_failed = <uint8_t *>PyMem_Calloc(n1, 1)
        self.q_head = <int32_t *>PyMem_Calloc(self.nrails, 4)
        self.q_tail = <int32_t *>PyMem_Calloc(self.nrails, 4)
        self.q_count = <int64_t *>PyMem_Calloc(self.nrails, 8)
        self.rail_ok = <int64_t *>PyMem_Calloc(self.nrails, 8)
        self.q_attached = <uint8_t *>PyMem_Calloc(self.nrails, 1)
        self.q_new = <int64_t *>PyMem_Calloc(self.nrails, 8)
        if (self.r_laddr == NULL or self.r_raddr == NULL or self.r_op == NULL
                or self.r_cls == NULL or self.r_lkey == NULL or self.r_rkey == NULL
                or self.r_remaining == NULL or self.r_moved == NULL or self.r_failed == NULL
                or self.q_head == NULL or self.q_tail == NULL or self.q_count == NULL
                or self.rail_ok == NULL or self.q_attached == NULL or self.q_new == NULL):
            raise MemoryError()
        cdef Py_ssize_t i, k
        cdef long long total = 0, left, m, L
        cdef int op
        for i in range(nreq):
            self.r_laddr[i] = laddr[i]
            self.r_raddr[i] = raddr[i]
            op = opcode[i]
            if op != MCV_WR_RDMA_WRITE and op != MCV_WR_RDMA_READ:
                raise InvalidArgumentError(f"request {i}: opcode {op} is neither WRITE nor READ")
            self.r_op[i] = op
            self.r_cls[i] = cls[i]
            for k in range(nnic):
                self.r_lkey[i * nnic + k] = lkeys[i * nnic + k]
            for k in range(npeer):
                self.r_rkey[i * npeer + k] = rkeys[i * npeer + k]
            if mrs[i] is None:
                continue
            if len(mrs[i]) != nnic:
                raise InvalidArgumentError(f"request {i}: one MR per local NIC expected")
            L = length[i]
            if L <= 0:
                continue
            if L <= slice_size + fragment_limit:
                total += 1
            else:
                # full slices until what is left fits into one (tail merge)
                m = (L - fragment_limit - 1) // slice_size  # full slices before the tail
                total += m + 1
        if total >= 0x7fffffff:
            raise InvalidArgumentError("a batch of more than 2^31 slices")
        self.nslices = <int>total
        n1 = total if total > 0 else 1
        self.s_req = <int32_t *>PyMem_Calloc(n1, 4)
        self.s_off = <uint64_t *>PyMem_Calloc(n1, 8)
        self.s_len = <uint64_t *>PyMem_Calloc(n1, 8)
        self.s_retry = <uint8_t *>PyMem_Calloc(n1, 1)
        self.s_state = <uint8_t *>PyMem_Calloc(n1, 1)
        self.s_access = <uint8_t *>PyMem_Calloc(n1, 1)
        self.s_rail = <int32_t *>PyMem_Calloc(n1, 4)
        self.s_next = <int32_t *>PyMem_Calloc(n1, 4)
        self.e_slice = <int32_t *>PyMem_Calloc(n1, 4)
        self.e_kind = <int32_t *>PyMem_Calloc(n1, 4)
        self.e_code = <int32_t *>PyMem_Calloc(n1, 4)
        self.e_rail = <int32_t *>PyMem_Calloc(n1, 4)
        if (self.s_req == NULL or self.s_off == NULL or self.s_len == NULL
                or self.s_retry == NULL or self.s_state == NULL or self.s_access == NULL
                or self.s_rail == NULL or self.s_next == NULL or self.e_slice == NULL
                or self.e_kind == NULL or self.e_code == NULL or self.e_rail == NULL):
            raise MemoryError()
        cdef long long j = 0, off
        for i in range(nreq):
            if mrs[i] is None:
                continue
            L = length[i]
            off = 0
            while off < L:
                left = L - off
                m = left if left <= slice_size + fragment_limit else slice_size
                self.s_req[j] = <int32_t>i
                self.s_off[j] = <uint64_t>off
                self.s_len[j] = <uint64_t>m
                self.s_rail[j] = -1
                j += 1
                off += m
                self.r_remaining[i] += 1
        for k in range(self.nrails):
            self.q_head[k] = -1
            self.q_tail[k] = -1
        self.key = engine._register(self)
        self.registered = True

    def __dealloc__(self):
        PyMem_Free(self.r_laddr); PyMem_Free(self.r_raddr); PyMem_Free(self.r_op)
        PyMem_Free(self.r_cls); PyMem_Free(self.r_lkey); PyMem_Free(self.r_rkey)
        PyMem_Free(self.r_remaining); PyMem_Free(self.r_moved); PyMem_Free(self.r_failed)
        PyMem_Free(self.s_req); PyMem_Free(self.s_off); PyMem_Free(self.s_len)
        PyMem_Free(self.s_retry); PyMem_Free(self.s_state); PyMem_Free(self.s_access)
        PyMem_Free(self.s_rail); PyMem_Free(self.s_next)
        PyMem_Free(self.e_slice); PyMem_Free(self.e_kind); PyMem_Free(self.e_code)
        PyMem_Free(self.e_rail)
        PyMem_Free(self.q_head); PyMem_Free(self.q_tail); PyMem_Free(self.q_count)
        PyMem_Free(self.rail_ok); PyMem_Free(self.q_attached); PyMem_Free(self.q_new)

    def release(self):
        """Leave the engine's table (only once nothing is posted or queued)."""
        if self.outstanding or self.queued:
            raise InvalidArgumentError(
                f"batch has {self.outstanding} WRs in flight and {self.queued} queued"
            )
        if self.registered:
            self.registered = False
            self.engine._release(self.key)

    cdef void _push_error(self, int32_t i, int kind, int code, int32_t ridx) noexcept:
        if self.nerr < self.nslices:
            self.e_slice[self.nerr] = i
            self.e_kind[self.nerr] = kind
            self.e_code[self.nerr] = code
            self.e_rail[self.nerr] = ridx
            self.nerr += 1

    cdef int _enqueue(self, int32_t i, int32_t ridx) except -1:
        self.s_rail[i] = ridx
        self.s_state[i] = S_QUEUED
        self.s_next[i] = -1
        if self.q_tail[ridx] >= 0:
            self.s_next[self.q_tail[ridx]] = i
        else:
            self.q_head[ridx] = i
        self.q_tail[ridx] = i
        self.q_count[ridx] += 1
        self.q_new[ridx] += 1
        self.queued += 1
        return 0

    cdef long long _requeue_rail(self, int32_t ridx) except -1:
        """Queued slices of rail ``ridx`` become new again (their rail broke)."""
        cdef int32_t i = self.q_head[ridx]
        cdef long long n = 0
        while i >= 0:
            self.s_state[i] = S_NEW
            self.s_rail[i] = -1
            i = self.s_next[i]
            n += 1
        self.q_head[ridx] = -1
        self.q_tail[ridx] = -1
        self.q_count[ridx] = 0
        self.q_new[ridx] = 0
        self.queued -= n
        self.q_attached[ridx] = 0
        self.rails[ridx] = None
        return n

    # -- rail choice ----------------------------------------------------------------------

    def needed_tables(self):
        """``{(class, retry)}`` of the new slices whose table is not set."""
        out = set()
        cdef int32_t i, req
        cdef int lastc = -1, lastr = -1
        for i in range(self.nslices):
            if self.s_state[i] != S_NEW:
                continue
            req = self.s_req[i]
            if self.r_failed[req]:
                continue
            if self.r_cls[req] == lastc and self.s_retry[i] == lastr:
                continue
            lastc = self.r_cls[req]
            lastr = self.s_retry[i]
            if (lastc, lastr) not in self.tables:
                out.add((lastc, lastr))
        return out

    def set_table(self, int cls, int retry, options):
        """Rail options for (class, retry): ``[(local nic, [peer devices...]), ...]`` in the
        order ``selectDevice`` tries them; empty: no usable rail."""
        enc = []
        for li, choices in options:
            if not 0 <= li < self.nnic or not choices:
                raise InvalidArgumentError(f"rail option ({li}, {choices}) out of range")
            for p in choices:
                if not 0 <= p < self.npeer:
                    raise InvalidArgumentError(f"peer device {p} out of range")
            enc.append(li)
            enc.append(len(choices))
            enc.extend(choices)
        if len(enc) > MAX_TABLE:
            raise InvalidArgumentError(f"rail table of {len(enc)} entries (at most {MAX_TABLE})")
        self.tables[(cls, retry)] = (len(options), tuple(enc))

    def clear_tables(self):
        self.tables.clear()

    def choose(self):
        """Give every new slice a rail; returns the rails (``ridx``) that got slices and are
        not attached yet. Slices with no usable rail or no rkey become errors."""
        cdef int32_t i, req, ridx, li, pi, opt, nch, pos
        cdef int lastc = -1, lastr = -1, nopts = 0, k
        cdef int32_t enc[MAX_TABLE]
        cdef tuple t
        newly = []
        for i in range(self.nslices):
            if self.s_state[i] != S_NEW:
                continue
            req = self.s_req[i]
            if self.r_failed[req]:
                self.s_state[i] = S_DROPPED
                self.r_remaining[req] -= 1
                continue
            if self.r_cls[req] != lastc or self.s_retry[i] != lastr:
                lastc = self.r_cls[req]
                lastr = self.s_retry[i]
                nopts, t = self.tables[(lastc, lastr)]
                for k in range(len(t)):
                    enc[k] = t[k]
            if nopts == 0:
                self.s_state[i] = S_HELD
                self._push_error(i, ERR_NO_RAIL, 0, -1)
                continue
            if lastr == 0:
                opt = <int32_t>(_rand(&self.rng) % <uint64_t>nopts)
            else:
                opt = 0
            pos = 0
            while opt > 0:
                pos += 2 + enc[pos + 1]
                opt -= 1
            li = enc[pos]
            nch = enc[pos + 1]
            pi = enc[pos + 2 + (<int32_t>(_rand(&self.rng) % <uint64_t>nch) if lastr == 0 else 0)]
            if self.r_rkey[req * self.npeer + pi] < 0:
                self.s_state[i] = S_HELD
                self._push_error(i, ERR_BAD_RKEY, pi, -1)
                continue
            ridx = li * self.npeer + pi
            self._enqueue(i, ridx)
        return [k for k in range(self.nrails) if self.q_new[k] > 0]

    def attach(self, int ridx, Rail rail not None):
        """Queue this batch's slices for ``ridx`` on ``rail`` (posted by its pump's run)."""
        if rail.broken:
            raise InvalidArgumentError("attach to a broken rail")
        self.rails[ridx] = rail
        if self.q_new[ridx] > 0:
            rail._attach(self, ridx)

    def unqueue(self, int ridx):
        """Take the slices queued for ``ridx`` back as errors (its endpoint failed); returns
        how many (see :meth:`take_errors`, kind ``ERR_UNQUEUED``)."""
        cdef int32_t i = self.q_head[ridx]
        cdef long long n = 0
        while i >= 0:
            self.s_state[i] = S_HELD
            self._push_error(i, ERR_UNQUEUED, 0, ridx)
            i = self.s_next[i]
            n += 1
        rail = self.rails[ridx]
        if rail is not None and self.q_attached[ridx]:
            (<Rail>rail).queued -= n - self.q_new[ridx]
        self.q_head[ridx] = -1
        self.q_tail[ridx] = -1
        self.q_count[ridx] = 0
        self.q_new[ridx] = 0
        self.queued -= n
        self.q_attached[ridx] = 0
        self.rails[ridx] = None
        return n

    # -- errors ---------------------------------------------------------------------------

    def take_errors(self):
        """``[(slice, kind, code, ridx)]`` handed over since the last call; the slices are held
        until :meth:`retry` or :meth:`fail` (or :meth:`hold_access`) decides."""
        out = [(self.e_slice[k], self.e_kind[k], self.e_code[k], self.e_rail[k])
               for k in range(self.nerr)]
        self.nerr = 0
        return out

    def retry(self, int i, bint count=True, int limit=255):
        """Send held slice ``i`` again (a new rail); False if its tries are used up."""
        self._check(i, S_HELD)
        if count:
            if self.s_retry[i] >= limit or self.s_retry[i] >= 254:
                return False
            self.s_retry[i] += 1
        self.s_state[i] = S_NEW
        self.s_rail[i] = -1
        return True

    def fail(self, int i):
        """Held slice ``i`` is over without moving; its request fails."""
        self._check(i, S_HELD)
        self.s_state[i] = S_DROPPED
        self.r_failed[self.s_req[i]] = 1
        self.r_remaining[self.s_req[i]] -= 1

    def hold_access(self, int i):
        """A remote access error on held slice ``i``: True the first time (it is to be resent
        after a descriptor refresh, and stays held), False after that."""
        self._check(i, S_HELD)
        if self.s_access[i]:
            return False
        self.s_access[i] = 1
        return True

    cdef int _check(self, int i, int state) except -1:
        if not 0 <= i < self.nslices or self.s_state[i] != state:
            raise InvalidArgumentError(f"slice {i} is not {STATE_NAMES[state]}")
        return 0

    def set_request_keys(self, int req, int cls, rkeys):
        """After a descriptor refresh: request ``req``'s class and rkeys per peer device."""
        cdef int k
        if len(rkeys) != self.npeer:
            raise InvalidArgumentError("one rkey per peer device")
        self.r_cls[req] = cls
        for k in range(self.npeer):
            self.r_rkey[req * self.npeer + k] = rkeys[k]

    def fail_request(self, int req):
        """Request ``req`` failed: its new and held slices are dropped now, the rest when
        they come back."""
        cdef int32_t i
        self.r_failed[req] = 1
        for i in range(self.nslices):
            if self.s_req[i] == req and (self.s_state[i] == S_NEW or self.s_state[i] == S_HELD):
                self.s_state[i] = S_DROPPED
                self.r_remaining[req] -= 1

    def forget_posted(self):
        """Posted slices are dropped uncounted: only once every QP they were posted on is
        destroyed (no device touches their memory any more) and their completions are gone."""
        cdef int32_t i
        for i in range(self.nslices):
            if self.s_state[i] == S_POSTED:
                self.s_state[i] = S_DROPPED
                self.r_remaining[self.s_req[i]] -= 1
        self.outstanding = 0

    def held(self):
        """Slices held (each waits for retry/fail/a refresh)."""
        return [i for i in range(self.nslices) if self.s_state[i] == S_HELD]

    def release_held(self):
        """Held slices become new again (after a descriptor refresh), not counted as a try."""
        cdef int32_t i
        for i in range(self.nslices):
            if self.s_state[i] == S_HELD:
                self.s_state[i] = S_NEW

    def cancel(self):
        """Stop: new, held and queued slices are dropped; posted ones finish uncounted."""
        cdef int32_t i, ridx
        self.cancelled = True
        for ridx in range(self.nrails):
            if self.q_count[ridx] > 0:
                self.unqueue(ridx)
        self.nerr = 0
        for i in range(self.nslices):
            if self.s_state[i] == S_NEW or self.s_state[i] == S_HELD:
                self.s_state[i] = S_DROPPED
                self.r_remaining[self.s_req[i]] -= 1

    # -- state ----------------------------------------------------------------------------

    def has_new(self):
        cdef int32_t i
        for i in range(self.nslices):
            if self.s_state[i] == S_NEW:
                return True
        return False

    def finished(self):
        """Nothing new, queued, held or in flight."""
        cdef int32_t i
        if self.outstanding or self.queued or self.nerr:
            return False
        for i in range(self.nslices):
            if self.s_state[i] == S_NEW or self.s_state[i] == S_HELD:
                return False
        return True

    def moved(self, int req):
        return self.r_moved[req]

    def remaining(self, int req):
        return self.r_remaining[req]

    def failed(self, int req):
        return bool(self.r_failed[req])

    def slice_info(self, int i):
        """``(request, offset, length, retry, state, ridx)`` of slice ``i``."""
        if not 0 <= i < self.nslices:
            raise InvalidArgumentError(f"slice {i} out of range")
        return (self.s_req[i], self.s_off[i], self.s_len[i], self.s_retry[i],
                STATE_NAMES[self.s_state[i]], self.s_rail[i])

    def posted_requests(self):
        """Requests with WRs in flight."""
        out = set()
        cdef int32_t i
        for i in range(self.nslices):
            if self.s_state[i] == S_POSTED:
                out.add(self.s_req[i])
        return out

    def rail_successes(self):
        """``{ridx: completions}`` since the last call (for rail health)."""
        out = {}
        cdef int k
        for k in range(self.nrails):
            if self.rail_ok[k]:
                out[k] = self.rail_ok[k]
                self.rail_ok[k] = 0
        return out
