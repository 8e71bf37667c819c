# cython: language_level=3
"""libcudart through dlopen and function pointers (see ``mooncake._fast.cuda``).

No CUDA header is needed to build this: the few types and prototypes used are declared below
(ABI of CUDA >= 11: ``cudaPointerAttributes`` starts with ``type`` and, since CUDA 13, ends
with 8 reserved longs; ``cudaIpcMemHandle_t`` is 64
opaque bytes passed by value). The library is opened when a ``DlopenRuntime`` is made, so importing
this module never needs CUDA.

Calls that can block (synchronize, sync memcpy, IPC open) release the GIL. Completion callbacks
are plain C: they write ``status + 1`` to an eventfd from the CUDA callback thread without ever
taking the GIL, so a busy interpreter cannot delay the wake-up of the event loop.
"""

from libc.stdint cimport uint64_t, uintptr_t, intptr_t
from libc.string cimport memcpy as c_memcpy
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL
from posix.unistd cimport write

from mooncake._fast.cuda import check as _check_status
from mooncake.errors import CudaError

ctypedef int cudaError_t
ctypedef void *cudaStream_t
ctypedef void *cudaEvent_t

ctypedef struct cudaIpcMemHandle_t:
    char reserved[64]

ctypedef struct cudaPointerAttributes:
    int type
    int device
    void *devicePointer
    void *hostPointer
    long reserved[8]  # added in CUDA 13 (written by the runtime); harmless padding before

ctypedef void (*cudaStreamCallback_t)(cudaStream_t, cudaError_t, void *) noexcept nogil
ctypedef void (*cudaHostFn_t)(void *) noexcept nogil

ctypedef cudaError_t (*fn_intp)(int *) noexcept nogil
ctypedef cudaError_t (*fn_int)(int) noexcept nogil
ctypedef cudaError_t (*fn_ptrp_size)(void **, size_t) noexcept nogil
ctypedef cudaError_t (*fn_ptrp_size_uint)(void **, size_t, unsigned int) noexcept nogil
ctypedef cudaError_t (*fn_ptr)(void *) noexcept nogil
ctypedef cudaError_t (*fn_ptrp_uint)(void **, unsigned int) noexcept nogil
ctypedef cudaError_t (*fn_memset)(void *, int, size_t) noexcept nogil
ctypedef cudaError_t (*fn_host_register)(void *, size_t, unsigned int) noexcept nogil
ctypedef cudaError_t (*fn_attr)(cudaPointerAttributes *, const void *) noexcept nogil
ctypedef cudaError_t (*fn_ipc_get)(cudaIpcMemHandle_t *, void *) noexcept nogil
ctypedef cudaError_t (*fn_ipc_open)(void **, cudaIpcMemHandle_t, unsigned int) noexcept nogil
ctypedef cudaError_t (*fn_memcpy)(void *, const void *, size_t, int) noexcept nogil
ctypedef cudaError_t (*fn_memcpy_async)(
    void *, const void *, size_t, int, cudaStream_t) noexcept nogil
ctypedef cudaError_t (*fn_record)(cudaEvent_t, cudaStream_t) noexcept nogil
ctypedef cudaError_t (*fn_add_cb)(
    cudaStream_t, cudaStreamCallback_t, void *, unsigned int) noexcept nogil
ctypedef cudaError_t (*fn_host_fn)(cudaStream_t, cudaHostFn_t, void *) noexcept nogil
ctypedef const char *(*fn_err_name)(cudaError_t) noexcept nogil

DEF MEMCPY_DEFAULT = 4
DEF STREAM_NON_BLOCKING = 1
DEF EVENT_DISABLE_TIMING = 2
DEF HOST_ALLOC_PORTABLE = 1
DEF IPC_LAZY = 1
DEF ERROR_NOT_READY = 600


cdef void _notify_cb(cudaStream_t s, cudaError_t status, void *user) noexcept nogil:
    cdef uint64_t v = <uint64_t>status + 1
    write(<int><intptr_t>user, &v, 8)


cdef void _notify_fn(void *user) noexcept nogil:
    cdef uint64_t v = 1
    write(<int><intptr_t>user, &v, 8)


cdef void *_sym(void *lib, const char *name, bint required) except? NULL:
    cdef void *p = dlsym(lib, name)
    if p == NULL and required:
        raise AttributeError(f"{name.decode()} not found in libcudart")
    return p


cdef class DlopenRuntime:
    """The CUDA runtime loaded from ``path`` (``OSError`` if it cannot be opened)."""

    cdef void *_lib
    cdef readonly str path
    cdef fn_intp _get_device_count
    cdef fn_int _set_device
    cdef fn_intp _get_device
    cdef fn_ptrp_size _malloc
    cdef fn_ptr _free
    cdef fn_ptrp_size_uint _host_alloc
    cdef fn_ptr _free_host
    cdef fn_memset _memset
    cdef fn_host_register _host_register
    cdef fn_ptr _host_unregister
    cdef fn_attr _attrs
    cdef fn_ipc_get _ipc_get
    cdef fn_ipc_open _ipc_open
    cdef fn_ptr _ipc_close
    cdef fn_ptrp_uint _stream_create
    cdef fn_ptr _stream_destroy
    cdef fn_ptr _stream_sync
    cdef fn_memcpy _memcpy
    cdef fn_memcpy_async _memcpy_async
    cdef fn_ptrp_uint _event_create
    cdef fn_ptr _event_destroy
    cdef fn_record _event_record
    cdef fn_ptr _event_query
    cdef fn_ptr _event_sync
    cdef fn_add_cb _add_cb
    cdef fn_host_fn _host_fn
    cdef fn_err_name _err_name

    backend = "dlopen"

    def __cinit__(self, str path):
        self._lib = NULL
        self.path = path
        cdef bytes bpath = path.encode()
        self._lib = dlopen(bpath, RTLD_NOW | RTLD_LOCAL)
        if self._lib == NULL:
            err = dlerror()
            raise OSError(err.decode() if err != NULL else f"dlopen({path}) failed")
        cdef void *lib = self._lib
        self._get_device_count = <fn_intp>_sym(lib, b"cudaGetDeviceCount", True)
        self._set_device = <fn_int>_sym(lib, b"cudaSetDevice", True)
        self._get_device = <fn_intp>_sym(lib, b"cudaGetDevice", True)
        self._malloc = <fn_ptrp_size>_sym(lib, b"cudaMalloc", True)
        self._free = <fn_ptr>_sym(lib, b"cudaFree", True)
        self._host_alloc = <fn_ptrp_size_uint>_sym(lib, b"cudaHostAlloc", True)
        self._free_host = <fn_ptr>_sym(lib, b"cudaFreeHost", True)
        self._memset = <fn_memset>_sym(lib, b"cudaMemset", True)
        self._host_register = <fn_host_register>_sym(lib, b"cudaHostRegister", True)
        self._host_unregister = <fn_ptr>_sym(lib, b"cudaHostUnregister", True)
        self._attrs = <fn_attr>_sym(lib, b"cudaPointerGetAttributes", True)
        self._ipc_get = <fn_ipc_get>_sym(lib, b"cudaIpcGetMemHandle", True)
        self._ipc_open = <fn_ipc_open>_sym(lib, b"cudaIpcOpenMemHandle", True)
        self._ipc_close = <fn_ptr>_sym(lib, b"cudaIpcCloseMemHandle", True)
        self._stream_create = <fn_ptrp_uint>_sym(lib, b"cudaStreamCreateWithFlags", True)
        self._stream_destroy = <fn_ptr>_sym(lib, b"cudaStreamDestroy", True)
        self._stream_sync = <fn_ptr>_sym(lib, b"cudaStreamSynchronize", True)
        self._memcpy = <fn_memcpy>_sym(lib, b"cudaMemcpy", True)
        self._memcpy_async = <fn_memcpy_async>_sym(lib, b"cudaMemcpyAsync", True)
        self._event_create = <fn_ptrp_uint>_sym(lib, b"cudaEventCreateWithFlags", True)
        self._event_destroy = <fn_ptr>_sym(lib, b"cudaEventDestroy", True)
        self._event_record = <fn_record>_sym(lib, b"cudaEventRecord", True)
        self._event_query = <fn_ptr>_sym(lib, b"cudaEventQuery", True)
        self._event_sync = <fn_ptr>_sym(lib, b"cudaEventSynchronize", True)
        self._add_cb = <fn_add_cb>_sym(lib, b"cudaStreamAddCallback", False)
        self._host_fn = <fn_host_fn>_sym(lib, b"cudaLaunchHostFunc", True)
        self._err_name = <fn_err_name>_sym(lib, b"cudaGetErrorName", True)

    def __dealloc__(self):
        # The library stays loaded: CUDA keeps threads and callbacks that point into it.
        pass

    cdef int _check(self, cudaError_t st, str what) except -1:
        cdef const char *name
        if st != 0:
            name = self._err_name(st)
            _check_status(st, what, name.decode() if name != NULL else None)
        return 0

    def get_device_count(self):
        cdef int n = 0
        self._check(self._get_device_count(&n), "cudaGetDeviceCount")
        return n

    def set_device(self, int device):
        self._check(self._set_device(device), f"cudaSetDevice({device})")

    def get_device(self):
        cdef int n = 0
        self._check(self._get_device(&n), "cudaGetDevice")
        return n

    def malloc(self, size_t n):
        cdef void *p = NULL
        cdef cudaError_t st
        with nogil:
            st = self._malloc(&p, n)
        self._check(st, f"cudaMalloc({n})")
        return <uintptr_t>p

    def free(self, uintptr_t ptr):
        cdef cudaError_t st
        with nogil:
            st = self._free(<void *>ptr)
        self._check(st, "cudaFree")

    def host_alloc(self, size_t n):
        cdef void *p = NULL
        cdef cudaError_t st
        with nogil:
            st = self._host_alloc(&p, n, HOST_ALLOC_PORTABLE)
        self._check(st, f"cudaHostAlloc({n})")
        return <uintptr_t>p

    def free_host(self, uintptr_t ptr):
        cdef cudaError_t st
        with nogil:
            st = self._free_host(<void *>ptr)
        self._check(st, "cudaFreeHost")

    def memset(self, uintptr_t ptr, int value, size_t n):
        cdef cudaError_t st
        with nogil:
            st = self._memset(<void *>ptr, value, n)
        self._check(st, "cudaMemset")

    def host_register(self, uintptr_t ptr, size_t n):
        cdef cudaError_t st
        with nogil:
            st = self._host_register(<void *>ptr, n, HOST_ALLOC_PORTABLE)
        self._check(st, f"cudaHostRegister({n})")

    def host_unregister(self, uintptr_t ptr):
        cdef cudaError_t st
        with nogil:
            st = self._host_unregister(<void *>ptr)
        self._check(st, "cudaHostUnregister")

    def pointer_get_attributes(self, uintptr_t ptr):
        cdef cudaPointerAttributes a
        a.type = 0
        a.device = -1
        self._check(self._attrs(&a, <const void *>ptr), "cudaPointerGetAttributes")
        return a.type, a.device

    def mem_get_address_range(self, uintptr_t ptr):
        from mooncake._fast.cuda import driver_address_range
        r = driver_address_range(ptr)
        if r is None:
            raise CudaError(f"cuMemGetAddressRange({ptr:#x}) failed: not a device allocation?")
        return r

    def ipc_get_mem_handle(self, uintptr_t ptr):
        cdef cudaIpcMemHandle_t h
        self._check(self._ipc_get(&h, <void *>ptr), "cudaIpcGetMemHandle")
        return (<char *>h.reserved)[:64]

    def ipc_open_mem_handle(self, bytes handle):
        if len(handle) != 64:
            raise ValueError(f"IPC handle must be 64 bytes, got {len(handle)}")
        cdef cudaIpcMemHandle_t h
        cdef const char *src = handle
        c_memcpy(h.reserved, src, 64)
        cdef void *p = NULL
        cdef cudaError_t st
        with nogil:
            st = self._ipc_open(&p, h, IPC_LAZY)
        self._check(st, "cudaIpcOpenMemHandle")
        return <uintptr_t>p

    def ipc_close_mem_handle(self, uintptr_t ptr):
        cdef cudaError_t st
        with nogil:
            st = self._ipc_close(<void *>ptr)
        self._check(st, "cudaIpcCloseMemHandle")

    def stream_create(self):
        cdef void *s = NULL
        self._check(self._stream_create(&s, STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        return <uintptr_t>s

    def stream_destroy(self, uintptr_t stream):
        self._check(self._stream_destroy(<void *>stream), "cudaStreamDestroy")

    def stream_synchronize(self, uintptr_t stream):
        cdef cudaError_t st
        with nogil:
            st = self._stream_sync(<void *>stream)
        self._check(st, "cudaStreamSynchronize")

    def memcpy(self, uintptr_t dst, uintptr_t src, size_t n):
        cdef cudaError_t st
        with nogil:
            st = self._memcpy(<void *>dst, <const void *>src, n, MEMCPY_DEFAULT)
        self._check(st, "cudaMemcpy")

    def memcpy_async(self, uintptr_t dst, uintptr_t src, size_t n, uintptr_t stream):
        cdef cudaError_t st
        with nogil:
            st = self._memcpy_async(<void *>dst, <const void *>src, n, MEMCPY_DEFAULT,
                                    <cudaStream_t>stream)
        self._check(st, "cudaMemcpyAsync")

    def event_create(self):
        cdef void *e = NULL
        self._check(self._event_create(&e, EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")
        return <uintptr_t>e

    def event_destroy(self, uintptr_t event):
        self._check(self._event_destroy(<void *>event), "cudaEventDestroy")

    def event_record(self, uintptr_t event, uintptr_t stream):
        self._check(self._event_record(<cudaEvent_t>event, <cudaStream_t>stream), "cudaEventRecord")

    def event_query(self, uintptr_t event):
        cdef cudaError_t st = self._event_query(<void *>event)
        if st == ERROR_NOT_READY:
            return False
        self._check(st, "cudaEventQuery")
        return True

    def event_synchronize(self, uintptr_t event):
        cdef cudaError_t st
        with nogil:
            st = self._event_sync(<void *>event)
        self._check(st, "cudaEventSynchronize")

    def stream_notify_fd(self, uintptr_t stream, int fd):
        cdef cudaError_t st
        if self._add_cb != NULL:  # reports a failed stream to the callback
            st = self._add_cb(<cudaStream_t>stream, _notify_cb, <void *><intptr_t>fd, 0)
            self._check(st, "cudaStreamAddCallback")
        else:
            st = self._host_fn(<cudaStream_t>stream, _notify_fn, <void *><intptr_t>fd)
            self._check(st, "cudaLaunchHostFunc")
