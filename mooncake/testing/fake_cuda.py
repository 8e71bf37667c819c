"""A FAKE CUDA runtime backed by host memory: a test double for logic tests only.

:class:`FakeCudaRuntime` implements :class:`mooncake._fast.cuda.CudaRuntime` without a GPU, so the
code above the runtime (IPC handle caching, per-peer streams, the completion bridge to the event
loop, staging through pinned buffers) runs unchanged in CI. It says nothing about CUDA's speed or
about the real driver; the GPU tests (``tests/test_gpu.py``) do that on a machine with a GPU.

What it models, and how:

* "device memory" is a ``memfd`` mapping per :meth:`malloc`, tagged with the current device; its
  addresses are ordinary host addresses, so copies are ``memmove``;
* IPC: a handle names the exporting pid and the memfd; :meth:`ipc_open_mem_handle` maps
  ``/proc/<pid>/fd/<fd>`` at a new address, so a handle exported by one process really opens in
  another and both see the same bytes. Opening in the exporting process fails, as with CUDA;
* streams are worker threads executing enqueued work in order: copies, host callbacks (the
  eventfd write of :meth:`stream_notify_fd`), event records. So completions really arrive
  asynchronously, from another thread;
* faults: :meth:`fail_next_copy` makes the next copy fail (the stream reports the status to its
  next callback); ``gate`` (a ``threading.Event``, set by default) holds every stream worker
  while cleared, so a test can observe that the event loop keeps running during a copy.

Copies that touch fake device memory are bounds-checked (``cudaErrorInvalidValue``, 1), which a
plain ``memmove`` would not catch. Counters (``ipc_opens``, ``ipc_closes``, ``copies``,
``streams_created``...) let tests assert caching.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake._fast.cuda import (
    MEMORY_DEVICE,
    MEMORY_HOST,
    MEMORY_UNREGISTERED,
    check,
    notify_bytes,
)
from mooncake.errors import CudaError

_MAGIC = b"FAKECUDA"
_HANDLE = struct.Struct("<8siiQi")
INVALID_VALUE = 1
INVALID_CONTEXT = 201
INVALID_RESOURCE_HANDLE = 400


@dataclass
class _Mem:
    base: int
    size: int
    kind: int  # MEMORY_DEVICE / MEMORY_HOST
    device: int
    mm: mmap.mmap | None  # None: cudaHostRegister'ed memory we do not own
    fd: int = -1  # memfd of an allocation we own (-1: host or opened mapping)
    opened: bool = False  # mapping of another process's allocation
    registered: bool = False  # cudaHostRegister'ed, not cudaHostAlloc'ed


def _addr_of(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)


class _Event:
    """A never-recorded event counts as complete, as in CUDA."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()
        self.status = 0


class _Stream:
    def __init__(self, rt: FakeCudaRuntime, device: int) -> None:
        self.device = device
        self.q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.status = 0  # error of the last failed copy, reported by the next callback
        self._rt = rt
        self.thread = threading.Thread(target=self._run, name="fake-cuda-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            self._rt.gate.wait()
            op()


class FakeCudaRuntime:
    """Host-memory stand-in for the CUDA runtime (see the module docstring). Test double only."""

    backend = "fake"

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._mems: list[_Mem] = []
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self._next_id = 1
        self._fail_next: int = 0
        self.gate = threading.Event()
        self.gate.set()
        self.ipc_opens = 0
        self.ipc_closes = 0
        self.copies = 0
        self.streams_created = 0
        self.notifies = 0
        self.host_registers = 0

    # -- devices -------------------------------------------------------------------------

    def get_device_count(self) -> int:
        return self.devices

    def set_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            check(101, f"cudaSetDevice({device})", "cudaErrorInvalidDevice")
        self._tls.device = device

    def get_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    # -- memory --------------------------------------------------------------------------

    def _add(self, mem: _Mem) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, mem.base)
            self._starts.insert(i, mem.base)
            self._mems.insert(i, mem)

    def _remove(self, base: int, opened: bool | None = None, kind: int | None = None) -> _Mem:
        with self._lock:
            i = bisect.bisect_left(self._starts, base)
            if i == len(self._starts) or self._starts[i] != base:
                raise CudaError(f"fake: {base:#x} is not an allocation base", INVALID_VALUE)
            mem = self._mems[i]
            if (opened is not None and mem.opened != opened) or (
                kind is not None and mem.kind != kind
            ):
                raise CudaError(f"fake: {base:#x} is not that kind of allocation", INVALID_VALUE)
            del self._starts[i]
            del self._mems[i]
            return mem

    def _find(self, ptr: int) -> _Mem | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0 and ptr < self._mems[i].base + self._mems[i].size:
                return self._mems[i]
        return None

    def malloc(self, n: int) -> int:
        if n <= 0:
            raise CudaError("fake cudaMalloc: size must be positive", INVALID_VALUE)
        fd = os.memfd_create("fake-cuda", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mem = _Mem(_addr_of(mm), n, MEMORY_DEVICE, self.get_device(), mm, fd)
        self._add(mem)
        return mem.base

    def free(self, ptr: int) -> None:
        mem = self._remove(ptr, opened=False, kind=MEMORY_DEVICE)
        assert mem.mm is not None
        mem.mm.close()
        os.close(mem.fd)

    def host_alloc(self, n: int) -> int:
        if n <= 0:
            raise CudaError("fake cudaHostAlloc: size must be positive", INVALID_VALUE)
        mm = mmap.mmap(-1, n, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        mem = _Mem(_addr_of(mm), n, MEMORY_HOST, self.get_device(), mm)
        self._add(mem)
        return mem.base

    def free_host(self, ptr: int) -> None:
        mem = self._remove(ptr, kind=MEMORY_HOST)
        if mem.mm is None:
            raise CudaError("fake cudaFreeHost: memory was cudaHostRegister'ed", INVALID_VALUE)
        mem.mm.close()

    def host_register(self, ptr: int, n: int) -> None:
        """Page-lock existing memory: recorded as pinned host memory (the bytes stay where they are)."""
        if n <= 0:
            raise CudaError("fake cudaHostRegister: size must be positive", INVALID_VALUE)
        if self._find(ptr) is not None or self._find(ptr + n - 1) is not None:
            raise CudaError("fake cudaHostRegister: already registered", 712)
        self._add(_Mem(ptr, n, MEMORY_HOST, self.get_device(), None, registered=True))
        self.host_registers += 1

    def host_unregister(self, ptr: int) -> None:
        mem = self._remove(ptr, kind=MEMORY_HOST)
        if not mem.registered:
            raise CudaError("fake cudaHostUnregister: not cudaHostRegister'ed", INVALID_VALUE)

    def memset(self, ptr: int, value: int, n: int) -> None:
        self._check_range(ptr, n, "cudaMemset")
        ctypes.memset(ptr, value, n)

    def pointer_get_attributes(self, ptr: int) -> tuple[int, int]:
        mem = self._find(ptr)
        if mem is None:
            return MEMORY_UNREGISTERED, -1
        return mem.kind, mem.device

    def mem_get_address_range(self, ptr: int) -> tuple[int, int]:
        mem = self._find(ptr)
        if mem is None or mem.kind != MEMORY_DEVICE:
            raise CudaError(f"fake cuMemGetAddressRange({ptr:#x}): not device memory", 1)
        return mem.base, mem.size

    def _check_range(self, ptr: int, n: int, what: str) -> None:
        mem = self._find(ptr)
        if mem is not None and ptr + n > mem.base + mem.size:
            raise CudaError(
                f"fake {what}: [{ptr:#x}, +{n}) runs past its allocation", INVALID_VALUE
            )

    # -- IPC -----------------------------------------------------------------------------

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        mem = self._find(ptr)
        if mem is None or mem.kind != MEMORY_DEVICE or mem.opened:
            raise CudaError(f"fake cudaIpcGetMemHandle({ptr:#x}): not a cudaMalloc", INVALID_VALUE)
        raw = _HANDLE.pack(_MAGIC, os.getpid(), mem.fd, mem.size, mem.device)
        return raw.ljust(64, b"\0")

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        if len(handle) != 64:
            raise CudaError("fake cudaIpcOpenMemHandle: handle must be 64 bytes", INVALID_VALUE)
        magic, pid, fd, size, device = _HANDLE.unpack_from(handle)
        if magic != _MAGIC:
            raise CudaError("fake cudaIpcOpenMemHandle: not a handle", INVALID_RESOURCE_HANDLE)
        if pid == os.getpid():
            raise CudaError(
                "fake cudaIpcOpenMemHandle: handle exported by this process", INVALID_CONTEXT
            )
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise CudaError(f"fake cudaIpcOpenMemHandle: {e}", INVALID_RESOURCE_HANDLE) from None
        try:
            mm = mmap.mmap(own, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(own)
        mem = _Mem(_addr_of(mm), size, MEMORY_DEVICE, device, mm, opened=True)
        self._add(mem)
        self.ipc_opens += 1
        return mem.base

    def ipc_close_mem_handle(self, ptr: int) -> None:
        mem = self._remove(ptr, opened=True)
        assert mem.mm is not None
        mem.mm.close()
        self.ipc_closes += 1

    # -- streams, copies, events -----------------------------------------------------------

    def _stream(self, stream: int) -> _Stream:
        s = self._streams.get(stream)
        if s is None:
            raise CudaError(f"fake: unknown stream {stream:#x}", INVALID_RESOURCE_HANDLE)
        return s

    def stream_create(self) -> int:
        with self._lock:
            sid = self._next_id
            self._next_id += 1
        self._streams[sid] = _Stream(self, self.get_device())
        self.streams_created += 1
        return sid

    def stream_destroy(self, stream: int) -> None:
        s = self._streams.pop(stream, None)
        if s is None:
            raise CudaError(f"fake: unknown stream {stream:#x}", INVALID_RESOURCE_HANDLE)
        s.q.put(None)
        s.thread.join()

    def stream_synchronize(self, stream: int) -> None:
        done = threading.Event()
        self._stream(stream).q.put(done.set)
        done.wait()

    def fail_next_copy(self, status: int = 700) -> None:
        """Make the next ``memcpy_async`` fail on its stream with ``status`` (700: illegal address)."""
        self._fail_next = status

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self._check_range(dst, n, "cudaMemcpy")
        self._check_range(src, n, "cudaMemcpy")
        ctypes.memmove(dst, src, n)
        self.copies += 1

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        s = self._stream(stream)
        self._check_range(dst, n, "cudaMemcpyAsync")
        self._check_range(src, n, "cudaMemcpyAsync")
        fail, self._fail_next = self._fail_next, 0

        def op() -> None:
            if fail:
                s.status = fail
                return
            ctypes.memmove(dst, src, n)
            self.copies += 1

        s.q.put(op)

    def stream_notify_fd(self, stream: int, fd: int) -> None:
        s = self._stream(stream)
        self.notifies += 1

        def op() -> None:
            status, s.status = s.status, 0
            try:
                os.write(fd, notify_bytes(status))
            except OSError:
                pass

        s.q.put(op)

    def event_create(self) -> int:
        with self._lock:
            eid = self._next_id
            self._next_id += 1
        self._events[eid] = _Event()
        return eid

    def event_destroy(self, event: int) -> None:
        if self._events.pop(event, None) is None:
            raise CudaError(f"fake: unknown event {event}", INVALID_RESOURCE_HANDLE)

    def _event(self, event: int) -> _Event:
        ev = self._events.get(event)
        if ev is None:
            raise CudaError(f"fake: unknown event {event}", INVALID_RESOURCE_HANDLE)
        return ev

    def event_record(self, event: int, stream: int) -> None:
        ev = self._event(event)
        s = self._stream(stream)
        ev.done.clear()
        ev.status = 0

        def op() -> None:
            ev.status, s.status = s.status, 0
            ev.done.set()

        s.q.put(op)

    def event_query(self, event: int) -> bool:
        ev = self._event(event)
        if not ev.done.is_set():
            return False
        check(ev.status, "cudaEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        ev = self._event(event)
        ev.done.wait()
        check(ev.status, "cudaEventSynchronize")

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every stream worker and unmap everything (end of a test)."""
        self.gate.set()
        for sid in list(self._streams):
            self.stream_destroy(sid)
        with self._lock:
            mems, self._mems, self._starts = self._mems, [], []
        for mem in mems:
            try:
                if mem.mm is not None:
                    mem.mm.close()
            except BufferError:
                pass
            if mem.fd >= 0:
                os.close(mem.fd)

    def live(self) -> dict[str, int]:
        """Counts of live allocations by kind and of streams (tests check these balance)."""
        out = {"device": 0, "host": 0, "opened": 0, "streams": len(self._streams)}
        with self._lock:
            for m in self._mems:
                key = "opened" if m.opened else ("device" if m.kind == MEMORY_DEVICE else "host")
                out[key] += 1  # "host": cudaHostAlloc'ed and cudaHostRegister'ed
        return out


def view(ptr: int, n: int) -> Any:
    """A numpy uint8 view of fake device memory (valid while the allocation lives)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


__all__ = ["FakeCudaRuntime", "view"]
