# cython: language_level=3
"""Device list and device context (``ibv_get_device_list`` / ``ibv_open_device``)."""

import warnings

from libc.errno cimport errno
from libc.string cimport memset

from libc.stdint cimport uint8_t
from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_lib cimport Resource, check_rc, ibv, live_add, raise_errno, LIVE_CONTEXT
from mooncake.errors import InvalidArgumentError, VerbsUnavailableError

cdef extern from *:
    """
    #include <errno.h>
    static void mc_clear_errno(void) { errno = 0; }
    """
    void mc_clear_errno() nogil


PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "UNSPECIFIED", 1: "INFINIBAND", 2: "ETHERNET"}


def get_device_list():
    """Names of the RDMA devices libibverbs sees, in its order.

    Raises :class:`VerbsUnavailableError` when the library cannot enumerate devices at all (no
    kernel support: libibverbs fails with ENOSYS); an empty list means none are present.
    """
    cdef IbvApi *api = ibv()
    cdef int n = 0
    cdef mcv_device **lst
    mc_clear_errno()  # so a stale errno is never reported as this call's
    with nogil:
        lst = api.get_device_list(&n)
    if lst == NULL:
        e = errno or 5
        raise VerbsUnavailableError(
            f"ibv_get_device_list failed: [errno {e}] {__import__('os').strerror(e)}"
            " (no RDMA kernel support on this host?)"
        )
    try:
        return [api.get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        api.free_device_list(lst)


cdef class Context(Resource):
    """An opened RDMA device (``ibv_context``). ``Context(name)`` opens the device by name."""

    def __cinit__(self, str name):
        self.ctx = NULL
        self.name = name
        self._closed = True  # until fully built: a failed __cinit__ must not warn
        self._close_rank = 5
        cdef IbvApi *api = ibv()
        cdef int n = 0
        cdef mcv_device **lst = api.get_device_list(&n)
        cdef mcv_device *dev = NULL
        if lst == NULL:
            raise_errno("ibv_get_device_list")
        try:
            for i in range(n):
                if api.get_device_name(lst[i]).decode() == name:
                    dev = lst[i]
                    break
            if dev == NULL:
                raise InvalidArgumentError(f"no RDMA device named {name!r}")
            self.ctx = api.open_device(dev)
            if self.ctx == NULL:
                raise_errno(f"ibv_open_device({name})")
        finally:
            # an opened context holds its own reference to the device (libibverbs refcounts it)
            api.free_device_list(lst)
        live_add(LIVE_CONTEXT, 1)
        self._closed = False

    def close(self):
        """Close every child (QPs, MRs, CQs, channels, PDs), then the device. Idempotent."""
        if self._closed:
            return
        self._close_children()
        self._closed = True
        cdef IbvApi *api = ibv()
        rc = api.close_device(self.ctx)
        self.ctx = NULL
        live_add(LIVE_CONTEXT, -1)
        check_rc(rc, f"ibv_close_device({self.name})")

    def __dealloc__(self):
        if self.ctx != NULL:
            ibv().close_device(self.ctx)
            live_add(LIVE_CONTEXT, -1)

    def __del__(self):
        if not self._closed:
            warnings.warn(f"unclosed verbs Context {self.name!r}", ResourceWarning, source=self)

    def query_device(self):
        """``ibv_query_device`` as a dict of the fields the transport uses."""
        self._check_open()
        cdef mcv_device_attr a
        memset(&a, 0, sizeof(a))
        check_rc(ibv().query_device(self.ctx, &a), f"ibv_query_device({self.name})")
        return {
            "fw_ver": a.fw_ver.decode(errors="replace"),
            "node_guid": a.node_guid,
            "max_mr_size": a.max_mr_size,
            "max_qp": a.max_qp,
            "max_qp_wr": a.max_qp_wr,
            "max_sge": a.max_sge,
            "max_cq": a.max_cq,
            "max_cqe": a.max_cqe,
            "max_mr": a.max_mr,
            "max_qp_rd_atom": a.max_qp_rd_atom,
            "max_qp_init_rd_atom": a.max_qp_init_rd_atom,
            "phys_port_cnt": a.phys_port_cnt,
        }

    def query_port(self, int port=1):
        """``ibv_query_port``: state, MTUs, LID, GID table length, link layer."""
        self._check_open()
        cdef mcv_port_attr a
        memset(&a, 0, sizeof(a))
        check_rc(ibv().query_port(self.ctx, <uint8_t>port, &a), f"ibv_query_port({self.name}, {port})")
        return {
            "state": PORT_STATES.get(a.state, str(a.state)),
            "max_mtu": a.max_mtu,
            "active_mtu": a.active_mtu,
            "gid_tbl_len": a.gid_tbl_len,
            "max_msg_sz": a.max_msg_sz,
            "lid": a.lid,
            "link_layer": LINK_LAYERS.get(a.link_layer, str(a.link_layer)),
        }

    def query_gid(self, int port=1, int index=0):
        """``ibv_query_gid``: the 16 raw bytes of GID ``index``."""
        self._check_open()
        cdef mcv_gid g
        memset(&g, 0, sizeof(g))
        check_rc(ibv().query_gid(self.ctx, <uint8_t>port, index, &g),
                 f"ibv_query_gid({self.name}, {port}, {index})")
        return bytes(g.raw[:16])
