# cython: language_level=3
"""Protection domain (``ibv_alloc_pd``): MRs and QPs of one PD can reach each other."""

import warnings

from mooncake._fast._ibv cimport *
from mooncake._fast._verbs_device cimport Context
from mooncake._fast._verbs_lib cimport Resource, check_rc, ibv, live_add, raise_errno, LIVE_PD


cdef class PD(Resource):
    """``PD(context)``; holds its context open. ``close()`` closes its QPs and MRs first."""

    def __cinit__(self, Context context not None):
        context._check_open()
        self.pd = NULL
        self.context = context
        self._closed = True  # until fully built: a failed __cinit__ must not warn
        self._close_rank = 4
        self.pd = ibv().alloc_pd(context.ctx)
        if self.pd == NULL:
            raise_errno(f"ibv_alloc_pd({context.name})")
        context._adopt(self)
        live_add(LIVE_PD, 1)
        self._closed = False

    def close(self):
        if self._closed:
            return
        self._close_children()
        self._closed = True
        rc = ibv().dealloc_pd(self.pd)
        self.pd = NULL
        live_add(LIVE_PD, -1)
        check_rc(rc, "ibv_dealloc_pd")

    def __dealloc__(self):
        if self.pd != NULL:
            ibv().dealloc_pd(self.pd)
            live_add(LIVE_PD, -1)

    def __del__(self):
        if not self._closed:
            warnings.warn("unclosed verbs PD", ResourceWarning, source=self)
