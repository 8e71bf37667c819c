# cython: language_level=3
"""Memory region (``ibv_reg_mr``).

``MR(pd, obj, access)`` registers a writable buffer-protocol object and keeps it *exported*
(a held ``Py_buffer``) until the MR is closed, so a bytearray cannot be resized or an mmap
closed under the NIC. ``MR.from_address(pd, addr, length, access, owner)`` registers raw
memory and keeps ``owner`` alive instead. Closing an MR with posted-but-unreaped WRs raises
:class:`RegionBusyError`: the WRs may still touch it.
"""

import warnings

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_SIMPLE
from libc.stdint cimport uintptr_t

from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_pd cimport PD
from mooncake._fast._verbs_lib cimport Resource, check_rc, ibv, live_add, raise_errno, LIVE_MR
from mooncake.errors import InvalidArgumentError, RegionBusyError

ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4
ACCESS_DEFAULT = 1 | 2 | 4


cdef class MR(Resource):
    """A registered memory region; ``addr``, ``length``, ``lkey``, ``rkey`` are read-only."""

    def __cinit__(self, PD pd not None, obj=None, int access=ACCESS_DEFAULT, *,
                  addr=None, length=None, owner=None):
        pd._check_open()
        self.mr = NULL
        self.has_view = False
        self.pd = pd
        self._closed = True  # until fully built: a failed __cinit__ must not warn
        self._close_rank = 1
        self.access = access
        cdef void *p
        cdef size_t n
        if obj is not None:
            flags = PyBUF_WRITABLE if access & (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE) else PyBUF_SIMPLE
            PyObject_GetBuffer(obj, &self.view, flags)
            self.has_view = True
            p = self.view.buf
            n = <size_t>self.view.len
            self.owner = obj
        else:
            if addr is None or length is None:
                raise InvalidArgumentError("MR needs a buffer object or addr= and length=")
            if addr <= 0 or length <= 0:
                raise InvalidArgumentError(f"MR range [{addr:#x}, +{length}) is empty or invalid")
            p = <void *><uintptr_t>addr
            n = <size_t>length
            self.owner = owner
        if n == 0:
            self._release_view()
            raise InvalidArgumentError("cannot register an empty buffer")
        cdef IbvApi *api = ibv()
        with nogil:  # registration pins pages: can take long for big regions
            self.mr = api.reg_mr(pd.pd, p, n, access)
        if self.mr == NULL:
            self._release_view()
            raise_errno(f"ibv_reg_mr([{<uintptr_t>p:#x}, +{n}))")
        self.addr = <uintptr_t>p
        self.length = n
        self.lkey = self.mr.lkey
        self.rkey = self.mr.rkey
        pd._adopt(self)
        live_add(LIVE_MR, 1)
        self._closed = False

    @staticmethod
    def from_address(PD pd, addr, length, int access=ACCESS_DEFAULT, owner=None):
        """Register raw memory ``[addr, addr+length)``; ``owner`` is kept alive meanwhile."""
        return MR(pd, None, access, addr=addr, length=length, owner=owner)

    cdef _release_view(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        self.owner = None

    def covers(self, size_t addr, size_t length):
        """True if ``[addr, addr+length)`` lies inside this region."""
        return self.addr <= addr and addr + length <= self.addr + self.length

    def close(self):
        """Deregister and release the buffer. :class:`RegionBusyError` while WRs are in flight."""
        if self._closed:
            return
        if self.inflight:
            raise RegionBusyError(
                f"MR [{self.addr:#x}, +{self.length}) has {self.inflight} posted work requests"
                " not yet completed"
            )
        self._closed = True
        rc = ibv().dereg_mr(self.mr)
        self.mr = NULL
        self._release_view()
        live_add(LIVE_MR, -1)
        check_rc(rc, "ibv_dereg_mr")

    def __dealloc__(self):
        if self.mr != NULL:
            ibv().dereg_mr(self.mr)
            live_add(LIVE_MR, -1)
        if self.has_view:
            PyBuffer_Release(&self.view)

    def __del__(self):
        if not self._closed:
            warnings.warn(f"unclosed verbs MR [{self.addr:#x}, +{self.length})", ResourceWarning,
                          source=self)
