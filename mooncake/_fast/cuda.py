"""The CUDA runtime, reached without CUDA headers or a hard dependency.

One small interface (:class:`CudaRuntime`, C verb names in snake case) and three ways to provide it,
tried in this order by :func:`runtime`:

``dlopen``  the compiled ``_cuda`` extension: ``dlopen("libcudart.so...")`` + function pointers,
            host callbacks in C that write an eventfd without taking the GIL;
``ctypes``  the same calls through ctypes (the pure-Python twin; host callbacks take the GIL);
``cupy``    ``cupy.cuda.runtime`` (cupy wheels link the runtime statically, so this works where
            no ``libcudart.so`` is on the library path).

``MOONCAKE_CUDA_BACKEND=dlopen|ctypes|cupy`` forces one; ``MOONCAKE_NO_EXTENSIONS=1`` skips
``dlopen`` as it skips every compiled module. The package imports with none present;
:func:`runtime` then raises :class:`~mooncake.errors.NoGpuError` ("no usable GPU: ..."), as it does
for a driver that is too old (``cudaErrorInsufficientDriver``) or no device.

Every method raises :class:`~mooncake.errors.CudaError` (or ``NoGpuError``) on a failed call.
Addresses, streams and events are ints. Nothing here touches an event loop: completion is
signalled by :meth:`CudaRuntime.stream_notify_fd`, which enqueues a host callback that writes
``status + 1`` (as a u64) to an eventfd once the work before it on the stream has finished, so the
async layer can await the fd.
"""

from __future__ import annotations

import ctypes
import glob
import os
import struct
import sys
import threading
from typing import Any, Protocol, runtime_checkable

from mooncake.errors import CudaError, NoGpuError

# cudaError_t values the code acts on
SUCCESS = 0
ERROR_NOT_READY = 600
#: statuses that mean "there is no usable GPU here", not "this call went wrong"
NO_GPU_STATUSES = {
    3: "cudaErrorInitializationError",
    34: "cudaErrorStubLibrary",
    35: "cudaErrorInsufficientDriver",
    36: "cudaErrorCallRequiresNewerDriver",
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
    803: "cudaErrorSystemDriverMismatch",
    804: "cudaErrorCompatNotSupportedOnDevice",
}

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addressing
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
HOST_ALLOC_PORTABLE = 1
HOST_REGISTER_PORTABLE = 1
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
IPC_LAZY_ENABLE_PEER_ACCESS = 1
# cudaMemoryType
MEMORY_UNREGISTERED = 0
MEMORY_HOST = 1
MEMORY_DEVICE = 2
MEMORY_MANAGED = 3

LIBCUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


@runtime_checkable
class CudaRuntime(Protocol):
    """What the engine needs from CUDA. Implemented by every backend and by the test double."""

    backend: str

    def get_device_count(self) -> int: ...
    def set_device(self, device: int) -> None: ...
    def get_device(self) -> int: ...
    def malloc(self, n: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_alloc(self, n: int) -> int: ...
    def free_host(self, ptr: int) -> None: ...
    def memset(self, ptr: int, value: int, n: int) -> None: ...
    def host_register(self, ptr: int, n: int) -> None:
        """Page-lock existing host memory (``cudaHostRegister``, portable)."""
        ...

    def host_unregister(self, ptr: int) -> None: ...
    def pointer_get_attributes(self, ptr: int) -> tuple[int, int]:
        """``(cudaMemoryType, device)`` of ``ptr``; ``(0, -1)`` for plain host memory."""
        ...

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation holding device pointer ``ptr``."""
        ...

    def ipc_get_mem_handle(self, ptr: int) -> bytes: ...
    def ipc_open_mem_handle(self, handle: bytes) -> int: ...
    def ipc_close_mem_handle(self, ptr: int) -> None: ...
    def stream_create(self) -> int: ...
    def stream_destroy(self, stream: int) -> None: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def memcpy(self, dst: int, src: int, n: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None: ...
    def event_create(self) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def event_query(self, event: int) -> bool:
        """True once the work captured by the event is done (raises if it failed)."""
        ...

    def event_synchronize(self, event: int) -> None: ...
    def stream_notify_fd(self, stream: int, fd: int) -> None:
        """Enqueue a host callback writing ``status + 1`` (u64) to eventfd ``fd``."""
        ...


def check(status: int, what: str, name: str | None = None) -> None:
    """Raise for a non-zero ``cudaError_t``: :class:`NoGpuError` or :class:`CudaError`."""
    if status == SUCCESS:
        return
    label = name or NO_GPU_STATUSES.get(status) or f"cudaError {status}"
    if status in NO_GPU_STATUSES:
        raise NoGpuError(f"no usable GPU: {what} failed with {label} ({status})")
    raise CudaError(f"{what} failed: {label} ({status})", status)


def notify_bytes(status: int) -> bytes:
    """What a completion callback writes to its eventfd."""
    return struct.pack("<Q", status + 1)


def library_candidates() -> list[str]:
    """Where ``libcudart`` may be: the loader's path first, then CUDA_HOME and pip's nvidia wheels."""
    out: list[str] = list(LIBCUDART_NAMES)
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for root in roots:
        if root:
            out += sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so*")), reverse=True)
    for p in sys.path:
        for sub in ("nvidia/cuda_runtime/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            out += sorted(glob.glob(os.path.join(p, sub, "libcudart.so*")), reverse=True)
    seen: set[str] = set()
    return [c for c in out if not (c in seen or seen.add(c))]  # type: ignore[func-returns-value]


# -- allocation base through the driver (every backend) --------------------------------------

_driver_lock = threading.Lock()
_driver: Any = None


def driver_address_range(ptr: int) -> tuple[int, int] | None:
    """``cuMemGetAddressRange`` from ``libcuda.so.1`` (present wherever a GPU works), or None."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                fn = lib.cuMemGetAddressRange_v2
                fn.restype = ctypes.c_int
                fn.argtypes = [
                    ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_size_t),
                    ctypes.c_uint64,
                ]
                _driver = fn
            except (OSError, AttributeError):
                _driver = False
    if not _driver:
        return None
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    if _driver(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
        return None
    return int(base.value), int(size.value)


# -- ctypes backend ---------------------------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _PointerAttributes(ctypes.Structure):
    # CUDA >= 11 layout; CUDA 13 appended ``long reserved[8]``, which the runtime writes, so it
    # is always allocated (harmless padding for CUDA 11/12).
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_long * 8),
    ]


_STREAM_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _write_status(fd: int, status: int) -> None:
    try:
        os.write(fd, notify_bytes(status))
    except OSError:  # the waiter is gone (closed fd): nothing to tell
        pass


@_STREAM_CB  # type: ignore[untyped-decorator]
def _stream_cb(stream: int, status: int, user: int | None) -> None:
    _write_status(int(user or 0), int(status))


@_HOST_FN  # type: ignore[untyped-decorator]
def _host_fn(user: int | None) -> None:
    _write_status(int(user or 0), 0)


class CtypesRuntime:
    """libcudart through ctypes (the pure-Python twin of ``_cuda.DlopenRuntime``)."""

    backend = "ctypes"

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self._lib = lib
        c_int, c_void_p, c_size_t, c_uint = (
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
        )
        P = ctypes.POINTER
        sigs: dict[str, list[Any]] = {
            "cudaGetDeviceCount": [P(c_int)],
            "cudaSetDevice": [c_int],
            "cudaGetDevice": [P(c_int)],
            "cudaMalloc": [P(c_void_p), c_size_t],
            "cudaFree": [c_void_p],
            "cudaHostAlloc": [P(c_void_p), c_size_t, c_uint],
            "cudaFreeHost": [c_void_p],
            "cudaMemset": [c_void_p, c_int, c_size_t],
            "cudaHostRegister": [c_void_p, c_size_t, c_uint],
            "cudaHostUnregister": [c_void_p],
            "cudaPointerGetAttributes": [P(_PointerAttributes), c_void_p],
            "cudaIpcGetMemHandle": [P(_IpcHandle), c_void_p],
            "cudaIpcOpenMemHandle": [P(c_void_p), _IpcHandle, c_uint],
            "cudaIpcCloseMemHandle": [c_void_p],
            "cudaStreamCreateWithFlags": [P(c_void_p), c_uint],
            "cudaStreamDestroy": [c_void_p],
            "cudaStreamSynchronize": [c_void_p],
            "cudaMemcpy": [c_void_p, c_void_p, c_size_t, c_int],
            "cudaMemcpyAsync": [c_void_p, c_void_p, c_size_t, c_int, c_void_p],
            "cudaEventCreateWithFlags": [P(c_void_p), c_uint],
            "cudaEventDestroy": [c_void_p],
            "cudaEventRecord": [c_void_p, c_void_p],
            "cudaEventQuery": [c_void_p],
            "cudaEventSynchronize": [c_void_p],
            "cudaLaunchHostFunc": [c_void_p, _HOST_FN, c_void_p],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.restype = c_int
            fn.argtypes = args
        self._add_cb: Any = getattr(lib, "cudaStreamAddCallback", None)
        if self._add_cb is not None:  # deprecated, but reports stream errors to the callback
            self._add_cb.restype = c_int
            self._add_cb.argtypes = [c_void_p, _STREAM_CB, c_void_p, c_uint]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [c_int]

    def _check(self, status: int, what: str) -> None:
        if status:
            raw = self._lib.cudaGetErrorName(status)
            check(status, what, raw.decode() if raw else None)

    def get_device_count(self) -> int:
        n = ctypes.c_int()
        self._check(self._lib.cudaGetDeviceCount(ctypes.byref(n)), "cudaGetDeviceCount")
        return n.value

    def set_device(self, device: int) -> None:
        self._check(self._lib.cudaSetDevice(device), f"cudaSetDevice({device})")

    def get_device(self) -> int:
        n = ctypes.c_int()
        self._check(self._lib.cudaGetDevice(ctypes.byref(n)), "cudaGetDevice")
        return n.value

    def malloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(p), n), f"cudaMalloc({n})")
        return int(p.value or 0)

    def free(self, ptr: int) -> None:
        self._check(self._lib.cudaFree(ptr), "cudaFree")

    def host_alloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self._check(
            self._lib.cudaHostAlloc(ctypes.byref(p), n, HOST_ALLOC_PORTABLE), f"cudaHostAlloc({n})"
        )
        return int(p.value or 0)

    def free_host(self, ptr: int) -> None:
        self._check(self._lib.cudaFreeHost(ptr), "cudaFreeHost")

    def memset(self, ptr: int, value: int, n: int) -> None:
        self._check(self._lib.cudaMemset(ptr, value, n), "cudaMemset")

    def host_register(self, ptr: int, n: int) -> None:
        self._check(
            self._lib.cudaHostRegister(ptr, n, HOST_REGISTER_PORTABLE), f"cudaHostRegister({n})"
        )

    def host_unregister(self, ptr: int) -> None:
        self._check(self._lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    def pointer_get_attributes(self, ptr: int) -> tuple[int, int]:
        a = _PointerAttributes()
        self._check(
            self._lib.cudaPointerGetAttributes(ctypes.byref(a), ptr), "cudaPointerGetAttributes"
        )
        return a.type, a.device

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        r = driver_address_range(ptr)
        if r is None:
            raise CudaError(f"cuMemGetAddressRange({ptr:#x}) failed: not a device allocation?")
        return r

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(h), ptr), "cudaIpcGetMemHandle")
        return bytes(ctypes.string_at(ctypes.addressof(h), 64))

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        h = _IpcHandle.from_buffer_copy(handle)
        p = ctypes.c_void_p()
        self._check(
            self._lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, IPC_LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
        return int(p.value or 0)

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self._check(
            self._lib.cudaStreamCreateWithFlags(ctypes.byref(s), STREAM_NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._check(self._lib.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self._check(self._lib.cudaMemcpy(dst, src, n, MEMCPY_DEFAULT), "cudaMemcpy")

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self._check(
            self._lib.cudaMemcpyAsync(dst, src, n, MEMCPY_DEFAULT, stream), "cudaMemcpyAsync"
        )

    def event_create(self) -> int:
        e = ctypes.c_void_p()
        self._check(
            self._lib.cudaEventCreateWithFlags(ctypes.byref(e), EVENT_DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        return int(e.value or 0)

    def event_destroy(self, event: int) -> None:
        self._check(self._lib.cudaEventDestroy(event), "cudaEventDestroy")

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def event_query(self, event: int) -> bool:
        st = self._lib.cudaEventQuery(event)
        if st == ERROR_NOT_READY:
            return False
        self._check(st, "cudaEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._check(self._lib.cudaEventSynchronize(event), "cudaEventSynchronize")

    def stream_notify_fd(self, stream: int, fd: int) -> None:
        if self._add_cb is not None:
            self._check(self._add_cb(stream, _stream_cb, fd, 0), "cudaStreamAddCallback")
        else:
            self._check(self._lib.cudaLaunchHostFunc(stream, _host_fn, fd), "cudaLaunchHostFunc")


# -- cupy backend -----------------------------------------------------------------------------


class CupyRuntime:
    """``cupy.cuda.runtime`` behind the same interface."""

    backend = "cupy"

    def __init__(self) -> None:
        import cupy  # noqa: F401  (import errors are the caller's "not available")
        from cupy.cuda import runtime as rt

        self._rt = rt
        self._err = rt.CUDARuntimeError

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._err as e:
            status = int(getattr(e, "status", -1))
            check(status if status else -1, what, str(e))

    def get_device_count(self) -> int:
        return int(self._call("cudaGetDeviceCount", self._rt.getDeviceCount))

    def set_device(self, device: int) -> None:
        self._call(f"cudaSetDevice({device})", self._rt.setDevice, device)

    def get_device(self) -> int:
        return int(self._call("cudaGetDevice", self._rt.getDevice))

    def malloc(self, n: int) -> int:
        return int(self._call(f"cudaMalloc({n})", self._rt.malloc, n))

    def free(self, ptr: int) -> None:
        self._call("cudaFree", self._rt.free, ptr)

    def host_alloc(self, n: int) -> int:
        return int(self._call(f"cudaHostAlloc({n})", self._rt.hostAlloc, n, HOST_ALLOC_PORTABLE))

    def free_host(self, ptr: int) -> None:
        self._call("cudaFreeHost", self._rt.freeHost, ptr)

    def memset(self, ptr: int, value: int, n: int) -> None:
        self._call("cudaMemset", self._rt.memset, ptr, value, n)

    def host_register(self, ptr: int, n: int) -> None:
        self._call(f"cudaHostRegister({n})", self._rt.hostRegister, ptr, n, HOST_REGISTER_PORTABLE)

    def host_unregister(self, ptr: int) -> None:
        self._call("cudaHostUnregister", self._rt.hostUnregister, ptr)

    def pointer_get_attributes(self, ptr: int) -> tuple[int, int]:
        a = self._call("cudaPointerGetAttributes", self._rt.pointerGetAttributes, ptr)
        return int(a.type), int(a.device)

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        r = driver_address_range(ptr)
        if r is None:
            raise CudaError(f"cuMemGetAddressRange({ptr:#x}) failed: not a device allocation?")
        return r

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        return bytes(self._call("cudaIpcGetMemHandle", self._rt.ipcGetMemHandle, ptr))

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        return int(
            self._call(
                "cudaIpcOpenMemHandle",
                self._rt.ipcOpenMemHandle,
                handle,
                IPC_LAZY_ENABLE_PEER_ACCESS,
            )
        )

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self._call("cudaIpcCloseMemHandle", self._rt.ipcCloseMemHandle, ptr)

    def stream_create(self) -> int:
        return int(
            self._call(
                "cudaStreamCreateWithFlags", self._rt.streamCreateWithFlags, STREAM_NON_BLOCKING
            )
        )

    def stream_destroy(self, stream: int) -> None:
        self._call("cudaStreamDestroy", self._rt.streamDestroy, stream)

    def stream_synchronize(self, stream: int) -> None:
        self._call("cudaStreamSynchronize", self._rt.streamSynchronize, stream)

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self._call("cudaMemcpy", self._rt.memcpy, dst, src, n, MEMCPY_DEFAULT)

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self._call("cudaMemcpyAsync", self._rt.memcpyAsync, dst, src, n, MEMCPY_DEFAULT, stream)

    def event_create(self) -> int:
        return int(
            self._call(
                "cudaEventCreateWithFlags", self._rt.eventCreateWithFlags, EVENT_DISABLE_TIMING
            )
        )

    def event_destroy(self, event: int) -> None:
        self._call("cudaEventDestroy", self._rt.eventDestroy, event)

    def event_record(self, event: int, stream: int) -> None:
        self._call("cudaEventRecord", self._rt.eventRecord, event, stream)

    def event_query(self, event: int) -> bool:
        st = int(self._rt.eventQuery(event))
        if st == ERROR_NOT_READY:
            return False
        check(st, "cudaEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._call("cudaEventSynchronize", self._rt.eventSynchronize, event)

    def stream_notify_fd(self, stream: int, fd: int) -> None:
        def cb(_stream: int, status: int, arg: int) -> None:
            _write_status(arg, int(status))

        self._call("cudaStreamAddCallback", self._rt.streamAddCallback, stream, cb, fd, 0)


# -- selection --------------------------------------------------------------------------------

_lock = threading.Lock()
_runtime: CudaRuntime | None = None
_failure: NoGpuError | None = None


def _load(backend: str) -> CudaRuntime:
    if backend == "cupy":
        try:
            rt: CudaRuntime = CupyRuntime()
        except ImportError as e:
            raise NoGpuError(f"no usable GPU: cupy is not importable ({e})") from None
        return rt
    errors = []
    for cand in library_candidates():
        try:
            if backend == "dlopen":
                from mooncake._fast import _cuda  # type: ignore[attr-defined]

                return _cuda.DlopenRuntime(cand)  # type: ignore[no-any-return]
            return CtypesRuntime(cand)
        except ImportError as e:
            raise NoGpuError(f"no usable GPU: the _cuda extension is not built ({e})") from None
        except (OSError, AttributeError) as e:
            errors.append(f"{cand}: {e}")
    raise NoGpuError("no usable GPU: libcudart not found (" + "; ".join(errors[:3]) + ")")


def runtime() -> CudaRuntime:
    """The process-wide CUDA runtime, loaded once; :class:`NoGpuError` when there is no usable GPU.

    A runtime that loads but sees no device (or a too-old driver) is refused here too, so callers
    get one clear error up front rather than a failure inside the first copy.
    """
    global _runtime, _failure
    with _lock:
        if _runtime is not None:
            return _runtime
        if _failure is not None:
            raise _failure
        forced = os.environ.get("MOONCAKE_CUDA_BACKEND", "")
        no_ext = os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0")
        order = (
            [forced] if forced else (["ctypes", "cupy"] if no_ext else ["dlopen", "ctypes", "cupy"])
        )
        reasons: list[str] = []
        for backend in order:
            if backend not in ("dlopen", "ctypes", "cupy"):
                raise NoGpuError(
                    f"MOONCAKE_CUDA_BACKEND={backend!r}: expected dlopen, ctypes or cupy"
                )
            try:
                rt = _load(backend)
                n = rt.get_device_count()
                if n <= 0:
                    raise NoGpuError("no usable GPU: the runtime reports no device")
            except NoGpuError as e:
                reasons.append(f"{backend}: {e}")
                continue
            except CudaError as e:
                reasons.append(f"{backend}: {e}")
                continue
            _runtime = rt
            return rt
        _failure = NoGpuError("no usable GPU (" + " | ".join(reasons) + ")")
        raise _failure


def loaded_runtime() -> CudaRuntime | None:
    """The runtime if :func:`runtime` already loaded one (never loads: CUDA init is not free)."""
    return _runtime


def is_available() -> bool:
    """Whether :func:`runtime` finds a usable GPU."""
    try:
        runtime()
    except NoGpuError:
        return False
    return True


__all__ = [
    "NO_GPU_STATUSES",
    "CtypesRuntime",
    "CudaRuntime",
    "CupyRuntime",
    "check",
    "is_available",
    "library_candidates",
    "loaded_runtime",
    "notify_bytes",
    "runtime",
]
