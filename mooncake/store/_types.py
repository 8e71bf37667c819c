"""The module-level names of the published ``mooncake.store`` besides the client: task and
parallelism types, the host-memory allocator, and the NUMA and allocator-address helpers."""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import fcntl
import logging
import mmap
import os
import threading
import uuid
from typing import Any

from mooncake._core import store_types as st
from mooncake._core.store_types import TaskType

log = logging.getLogger("mooncake.store")


class TaskStatus(enum.IntEnum):
    """State of a copy or move task, with the published values (the wire's differ)."""

    PENDING = 0
    PROCESSING = 1
    SUCCESS = 3
    FAILED = 2

    @classmethod
    def of(cls, wire: st.TaskStatus) -> TaskStatus:
        return cls[st.TaskStatus(wire).name]


# module-level members as the published module exports them (its TaskStatus members were
# exported last, so FAILED and PROCESSING are the task states there, not the replica states)
PENDING = TaskStatus.PENDING
PROCESSING = TaskStatus.PROCESSING
SUCCESS = TaskStatus.SUCCESS
FAILED = TaskStatus.FAILED
REPLICA_COPY = TaskType.REPLICA_COPY
REPLICA_MOVE = TaskType.REPLICA_MOVE
#: the published ``TASK_NOT_FOUND`` code (``query_task`` of an id the master does not know)
TASK_NOT_FOUND = -1400


def task_id_tuple(task_id: str) -> tuple[int, int]:
    """A master task id (a UUID) as the published ``(high, low)`` pair of 64-bit ints."""
    u = uuid.UUID(hex=task_id).int
    return (u >> 64, u & ((1 << 64) - 1))


def task_id_str(task_id: Any) -> str:
    """The inverse of :func:`task_id_tuple` (raises ``TypeError`` on anything else)."""
    if (
        not isinstance(task_id, tuple)
        or len(task_id) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in task_id)
        or not all(0 <= x < (1 << 64) for x in task_id)
    ):
        raise TypeError(f"task_id must be a (high, low) pair of 64-bit ints, got {task_id!r}")
    return f"{task_id[0]:016x}{task_id[1]:016x}"


class QueryTaskResponse:
    """What ``query_task`` answers about a copy or move task (published field names).

    ``id`` is the ``(high, low)`` task id, ``type`` a :class:`TaskType`, ``status`` a
    :class:`TaskStatus`, ``assigned_client`` the client id that executes it, ``message`` why it
    failed. The master keeps no wall-clock times for tasks: both ``*_ms_epoch`` fields are 0.
    """

    __slots__ = (
        "assigned_client",
        "created_at_ms_epoch",
        "id",
        "last_updated_at_ms_epoch",
        "message",
        "status",
        "type",
    )

    def __init__(self) -> None:
        self.id: tuple[int, int] = (0, 0)
        self.type: TaskType = TaskType.REPLICA_COPY
        self.status: TaskStatus = TaskStatus.PENDING
        self.message = ""
        self.assigned_client = ""
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0

    def __repr__(self) -> str:
        return (
            f"QueryTaskResponse(id={self.id}, type={self.type.name}, status={self.status.name}, "
            f"assigned_client={self.assigned_client!r}, message={self.message!r})"
        )


_SHARED: dict[int, tuple[int, int]] = {}  # base -> (memfd, size) of live allocations
_SHARED_LOCK = threading.Lock()


def shared_memory_of(ptr: int, size: int) -> tuple[int, int, int] | None:
    """``(memfd, base, size)`` of the :class:`MooncakeHostMemAllocator` allocation holding
    ``[ptr, +size)`` (what a dummy client passes to its standalone client), or None."""
    with _SHARED_LOCK:
        for base, (fd, n) in _SHARED.items():
            if base <= ptr and ptr + size <= base + n:
                return fd, base, n
    return None


class MooncakeHostMemAllocator:
    """Page-aligned shared host memory: ``alloc(size)`` -> address (0 on failure),
    ``free(address)`` -> 0 (-1 for an address it did not allocate). Memory comes from
    ``memfd`` mappings, so it can be registered and shared like a store segment, and a dummy
    client's ``register_buffer`` can share it with its standalone client."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if size <= 0:
            return 0
        n = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = -1
        try:
            fd = os.memfd_create("mooncake-host-mem", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, n)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # shareable: never shrinks
            m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            log.error("MooncakeHostMemAllocator.alloc(%d): %s", size, e)
            return 0
        view = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(view)
        del view
        with self._lock:
            self._maps[addr] = m
        with _SHARED_LOCK:
            _SHARED[addr] = (fd, n)
        return addr

    def free(self, ptr: int) -> int:
        with self._lock:
            m = self._maps.pop(ptr, None)
        if m is None:
            return -1
        with _SHARED_LOCK:
            fd, _ = _SHARED.pop(ptr, (-1, 0))
        if fd >= 0:
            os.close(fd)
        try:
            m.close()
        except BufferError:  # still exported somewhere: it dies with the process
            log.warning("MooncakeHostMemAllocator.free(%#x): memory still in use", ptr)
        return 0


def bind_to_numa_node(node: int) -> None:
    """Run the calling thread on the CPUs of NUMA node ``node`` (a warning, nothing else, when
    the node does not exist or NUMA is not available; memory placement follows first touch)."""
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        with open(path) as f:
            spec = f.read().strip()
    except OSError:
        log.warning("bind_to_numa_node(%d): no such NUMA node; binding skipped", node)
        return
    cpus: set[int] = set()
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        elif part:
            cpus.add(int(part))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("bind_to_numa_node(%d): %s", node, e)


def _libc_addr(name: str) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    return int(ctypes.cast(getattr(libc, name), ctypes.c_void_p).value or 0)


def get_alloc_func_addr() -> int:
    """Address of a C ``void *alloc(size_t)`` (libc ``malloc``), for allocator hooks that take
    a function pointer (the published binding exports its own allocator the same way)."""
    return _libc_addr("malloc")


def get_free_func_addr() -> int:
    """Address of the matching C ``void free(void *)`` (libc ``free``)."""
    return _libc_addr("free")
