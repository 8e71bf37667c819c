# cython: language_level=3
"""The libibverbs loader: dlopen, the entry-point table, errno -> exception, live counters.

Nothing here runs at import: the library is opened by :func:`load` (or the first object that
needs it), so the package imports on hosts without libibverbs. ``MOONCAKE_IBVERBS`` names the
library to open: a path, ``soft`` for the project's software provider
(``mooncake/_fast/libmcsoftverbs.so``), default ``libibverbs.so.1``. One process opens one
library; asking for another after the first load raises.
"""

import os
import weakref

from libc.errno cimport errno
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL

from mooncake._fast._ibv cimport *
from mooncake.errors import ClosedError, VerbsError, VerbsUnavailableError

DEFAULT_LIBRARY = "libibverbs.so.1"
SOFT_PROVIDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmcsoftverbs.so")

cdef IbvApi _api
cdef void *_handle = NULL
cdef object _loaded_path = None
cdef int _live[6]

# test hooks of the soft provider (absent from libibverbs)
ctypedef int (*mcsv_live_objects_t)(int *out, int n) noexcept nogil
ctypedef int (*mcsv_inject_fault_t)(const char *dev, int status, int count) noexcept nogil
ctypedef int (*mcsv_set_port_state_t)(const char *dev, int state) noexcept nogil
ctypedef long long (*mcsv_wr_count_t)(const char *dev) noexcept nogil
ctypedef int (*mcsv_set_stall_t)(const char *dev, int on) noexcept nogil
cdef mcsv_live_objects_t _mcsv_live_objects = NULL
cdef mcsv_inject_fault_t _mcsv_inject_fault = NULL
cdef mcsv_set_port_state_t _mcsv_set_port_state = NULL
cdef mcsv_wr_count_t _mcsv_wr_count = NULL
cdef mcsv_set_stall_t _mcsv_set_stall = NULL


def soft_provider_path():
    """Path of the software verbs provider built with the package (it may not exist)."""
    return SOFT_PROVIDER


def configured_path():
    """The library :func:`load` opens by default (``MOONCAKE_IBVERBS``, ``soft`` resolved)."""
    p = os.environ.get("MOONCAKE_IBVERBS", "") or DEFAULT_LIBRARY
    return SOFT_PROVIDER if p == "soft" else p


def loaded_path():
    """The library this process opened, or None."""
    return _loaded_path


cdef void *_sym(void *h, const char *name, bint required) except? NULL:
    cdef void *p = dlsym(h, name)
    if p == NULL and required:
        raise VerbsUnavailableError(
            f"{_loaded_path_or('?')}: missing symbol {name.decode()}"
        )
    return p


def _loaded_path_or(default):
    return _loaded_path if _loaded_path is not None else default


def load(path=None):
    """Open the verbs library (idempotent); returns the path opened.

    Raises :class:`VerbsUnavailableError` if it cannot be opened or lacks an entry point, or if
    another library was already loaded in this process.
    """
    global _handle, _loaded_path
    global _mcsv_live_objects, _mcsv_inject_fault, _mcsv_set_port_state, _mcsv_wr_count
    global _mcsv_set_stall
    want = configured_path() if path is None else ("" + path)
    if want == "soft":
        want = SOFT_PROVIDER
    if _handle != NULL:
        if want != _loaded_path and path is not None:
            raise VerbsUnavailableError(
                f"verbs library {_loaded_path!r} already loaded; cannot switch to {want!r}"
            )
        return _loaded_path
    cdef bytes bpath = os.fsencode(want)
    cdef void *h = dlopen(bpath, RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        msg = dlerror()
        raise VerbsUnavailableError(
            f"cannot load verbs library {want!r}: {msg.decode(errors='replace') if msg else '?'}"
            " (install libibverbs1, or set MOONCAKE_IBVERBS=soft for the software provider)"
        )
    _loaded_path = want
    try:
        _api.get_device_list = <ibv_get_device_list_t>_sym(h, b"ibv_get_device_list", True)
        _api.free_device_list = <ibv_free_device_list_t>_sym(h, b"ibv_free_device_list", True)
        _api.get_device_name = <ibv_get_device_name_t>_sym(h, b"ibv_get_device_name", True)
        _api.open_device = <ibv_open_device_t>_sym(h, b"ibv_open_device", True)
        _api.close_device = <ibv_close_device_t>_sym(h, b"ibv_close_device", True)
        _api.query_device = <ibv_query_device_t>_sym(h, b"ibv_query_device", True)
        _api.query_port = <ibv_query_port_t>_sym(h, b"ibv_query_port", True)
        _api.query_gid = <ibv_query_gid_t>_sym(h, b"ibv_query_gid", True)
        _api.alloc_pd = <ibv_alloc_pd_t>_sym(h, b"ibv_alloc_pd", True)
        _api.dealloc_pd = <ibv_dealloc_pd_t>_sym(h, b"ibv_dealloc_pd", True)
        _api.reg_mr = <ibv_reg_mr_t>_sym(h, b"ibv_reg_mr", True)
        _api.dereg_mr = <ibv_dereg_mr_t>_sym(h, b"ibv_dereg_mr", True)
        _api.create_comp_channel = <ibv_create_comp_channel_t>_sym(h, b"ibv_create_comp_channel", True)
        _api.destroy_comp_channel = <ibv_destroy_comp_channel_t>_sym(h, b"ibv_destroy_comp_channel", True)
        _api.create_cq = <ibv_create_cq_t>_sym(h, b"ibv_create_cq", True)
        _api.destroy_cq = <ibv_destroy_cq_t>_sym(h, b"ibv_destroy_cq", True)
        _api.get_cq_event = <ibv_get_cq_event_t>_sym(h, b"ibv_get_cq_event", True)
        _api.ack_cq_events = <ibv_ack_cq_events_t>_sym(h, b"ibv_ack_cq_events", True)
        _api.create_qp = <ibv_create_qp_t>_sym(h, b"ibv_create_qp", True)
        _api.modify_qp = <ibv_modify_qp_t>_sym(h, b"ibv_modify_qp", True)
        _api.destroy_qp = <ibv_destroy_qp_t>_sym(h, b"ibv_destroy_qp", True)
    except BaseException:
        _loaded_path = None
        raise
    _mcsv_live_objects = <mcsv_live_objects_t>dlsym(h, b"mcsv_live_objects")
    _mcsv_inject_fault = <mcsv_inject_fault_t>dlsym(h, b"mcsv_inject_fault")
    _mcsv_set_port_state = <mcsv_set_port_state_t>dlsym(h, b"mcsv_set_port_state")
    _mcsv_wr_count = <mcsv_wr_count_t>dlsym(h, b"mcsv_wr_count")
    _mcsv_set_stall = <mcsv_set_stall_t>dlsym(h, b"mcsv_set_stall")
    _handle = h
    return _loaded_path


cdef IbvApi *ibv() except NULL:
    if _handle == NULL:
        load()
    return &_api


cdef int check_rc(int rc, str what) except -1:
    """libibverbs returns 0 or a positive errno (some calls -1 with errno set)."""
    if rc == 0:
        return 0
    if rc < 0:
        rc = errno if rc == -1 and errno else -rc
    raise VerbsError(rc, what)


cdef int raise_errno(str what) except -1:
    """For calls that return NULL and set errno."""
    raise VerbsError(errno if errno else 5, what)


cdef void live_add(int kind, int delta) noexcept:
    _live[kind] += delta


_KINDS = ("contexts", "pds", "mrs", "cqs", "qps", "channels")


def live_objects():
    """Verbs objects this process's layer holds open, by kind (the teardown checks use it)."""
    return {k: _live[i] for i, k in enumerate(_KINDS)}


def provider_live_objects():
    """The soft provider's own count of live objects (None when the library is not it)."""
    cdef int out[6]
    if _handle == NULL or _mcsv_live_objects == NULL:
        return None
    _mcsv_live_objects(out, 6)
    return {k: out[i] for i, k in enumerate(_KINDS)}


def is_soft_provider():
    """True when the loaded library is the software provider (it has the test hooks)."""
    return _handle != NULL and _mcsv_live_objects != NULL


def _require_soft():
    if _handle == NULL:
        load()
    if _mcsv_inject_fault == NULL:
        raise VerbsUnavailableError("fault hooks need the software verbs provider (MOONCAKE_IBVERBS=soft)")


def soft_inject_fault(str device, int status, int count):
    """Soft provider: the next ``count`` WRs through ``device`` complete with ``status``."""
    _require_soft()
    cdef bytes b = device.encode()
    rc = _mcsv_inject_fault(b, status, count)
    if rc < 0:
        raise VerbsError(-rc, "mcsv_inject_fault")


def soft_set_port_state(str device, bint up):
    """Soft provider: take ``device``'s port down (WRs through it fail) or bring it back up."""
    _require_soft()
    cdef bytes b = device.encode()
    rc = _mcsv_set_port_state(b, 4 if up else 1)
    if rc < 0:
        raise VerbsError(-rc, "mcsv_set_port_state")


def soft_wr_count(str device):
    """Soft provider: WRs executed through ``device`` (either end) on this fabric."""
    _require_soft()
    cdef bytes b = device.encode()
    return _mcsv_wr_count(b)


cdef class Resource:
    """Shared lifetime rules of the verbs objects.

    A child holds a strong reference to its parent (so a parent's C object outlives every child's)
    and the parent a weak set of its children, which ``close()`` closes first (QPs before MRs
    before CQs before channels before PDs). ``close()`` is idempotent; a closed object's methods
    raise :class:`ClosedError`. ``inflight`` counts posted WRs whose completion is not reaped yet.
    """

    def __cinit__(self):
        self._closed = False
        self.inflight = 0
        self._close_rank = 9
        self._children = None

    cdef int _adopt(self, Resource child) except -1:
        if self._children is None:
            self._children = weakref.WeakSet()
        self._children.add(child)
        return 0

    cdef int _close_children(self) except -1:
        if self._children:
            kids = sorted(self._children, key=lambda c: (<Resource>c)._close_rank)
            for c in kids:
                c.close()
        return 0

    cdef int _check_open(self) except -1:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        return 0

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        raise NotImplementedError


def soft_set_stall(str device, bint on):
    """Soft provider: WRs through ``device`` are accepted but never complete (until their QP
    goes to ERR and flushes them), or resume normal service."""
    _require_soft()
    cdef bytes b = device.encode()
    rc = _mcsv_set_stall(b, 1 if on else 0)
    if rc < 0:
        raise VerbsError(-rc, "mcsv_set_stall")
