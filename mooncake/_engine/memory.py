"""The engine's memory family: what registration hands out, and the one owner of the pin
protocol.

* :func:`buffer_address` / :func:`device_array_address`: the address and length of what a
  caller registers (a buffer export, a ``__cuda_array_interface__`` object);
* :class:`Buffer` (engine-allocated host memory, a shared mapping) and :class:`DeviceMemory`
  (engine-allocated ``cudaMalloc`` memory);
* :class:`Pins`: the pin protocol. A region is pinned (``Region.users``) from a lookup made
  with no ``await`` since, until no thread, peer or device can touch it any more;
  ``unregister`` marks it closing and waits for the last release;
* :class:`Memory`: ``register`` / ``unregister`` / ``allocate`` over the registry, the
  transports' ``on_register``/``on_unregister`` and the pins, for one engine
  (:class:`MemoryHost` is all it asks of it).
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import numpy as np

from mooncake import _fast
from mooncake._core.gpu import device_of, parse_location
from mooncake._core.hostmem import check_backable
from mooncake._core.memory import MemoryRegistry, Region, check_range
from mooncake._core.transfer import TransferRequest
from mooncake.errors import CudaError, InvalidArgumentError, MooncakeError, RegistrationError

if TYPE_CHECKING:
    from mooncake._engine.gpu import Gpu
    from mooncake._engine.transports.base import Transport
    from mooncake._fast.cuda import CudaRuntime

log = logging.getLogger("mooncake.engine")


def buffer_address(obj: Any, *, writable: bool = True) -> tuple[int, int, memoryview]:
    """Address and byte length of a C-contiguous buffer export, and the export that pins it."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgumentError(
            f"expected a buffer (numpy array, bytearray, mmap...) or (addr, length), "
            f"got {type(obj).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise InvalidArgumentError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise InvalidArgumentError("buffer is read-only; peers could not write into it")
    flat = mv.cast("B") if mv.nbytes else mv
    if mv.nbytes == 0:
        raise InvalidArgumentError("buffer is empty")
    arr = np.frombuffer(flat, dtype=np.uint8)
    return int(arr.ctypes.data), mv.nbytes, mv


def device_array_address(obj: Any, *, writable: bool = True) -> tuple[int, int] | None:
    """``(ptr, nbytes)`` of an object exposing ``__cuda_array_interface__``, else None."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    try:
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = int(str(cai["typestr"])[2:])
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"malformed __cuda_array_interface__: {e}") from None
    n = itemsize
    for d in shape:
        n *= d
    if strides is not None:
        expect, step = [], itemsize
        for d in reversed(shape):
            expect.append(step)
            step *= d
        if tuple(strides) != tuple(reversed(expect)):
            raise InvalidArgumentError("device array must be C-contiguous")
    if n == 0 or not ptr:
        raise InvalidArgumentError("device array is empty")
    if writable and readonly:
        raise InvalidArgumentError("device array is read-only; peers could not write into it")
    return int(ptr), n


class DeviceMemory:
    """Engine-allocated, registered device memory (``engine.allocate(n, location="cuda:N")``)."""

    def __init__(self, rt: CudaRuntime, region: Region, device: int) -> None:
        self._rt = rt
        self.region = region
        self.addr = region.addr
        self.length = region.length
        self.device = device

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"<DeviceMemory cuda:{self.device} {self.addr:#x} +{self.length}>"


class Buffer(mmap.mmap):
    """Engine-allocated, registered, pre-faulted memory (``engine.allocate``).

    It is the shared mapping itself, so it supports the buffer protocol: ``memoryview(buf)``,
    ``np.frombuffer(buf, np.uint8)``, ``bytes(buf[:16])`` and ``buf[0:4] = b"abcd"`` all work on
    the registered bytes (``buf.view`` and ``buf.numpy()`` are the same views). ``buf.addr`` is
    its address for transfer requests, ``len(buf)`` its length (a whole number of pages).

    Backed by a memfd where the kernel has them (``fd``; else -1), so that a same-host peer's
    ``shm`` transport can map it; the engine closes the mapping and the fd on unregister/close.
    ``close()`` is refused: unmapping registered memory under the engine would let a transfer
    write into freed pages (``await engine.unregister(buf)`` releases it).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # mmap's arguments, set in __new__
        self.region: Region | None = None
        self.addr = 0
        self.length = 0
        self.fd = -1

    def _attach(self, region: Region, fd: int) -> None:
        self.region = region
        self.addr = region.addr
        self.length = region.length
        self.fd = fd

    def close(self) -> None:
        raise InvalidArgumentError(
            "an engine Buffer is closed by the engine: await engine.unregister(buf) (or leave "
            "the open_engine block)"
        )

    def _close(self) -> None:
        """Unmap (``BufferError`` while a view is exported) and close the memfd either way:
        a mapping that outlives this keeps its pages without the fd."""
        try:
            mmap.mmap.close(self)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    @property
    def view(self) -> memoryview:
        return memoryview(self)

    def numpy(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return np.frombuffer(self, dtype=np.uint8)

    def __repr__(self) -> str:
        return f"<Buffer {self.addr:#x} +{self.length}>"


_M = TypeVar("_M", bound=mmap.mmap)


def _map_shared(size: int, cls: type[_M]) -> tuple[_M, int]:
    """A shared mapping (a ``cls``) of ``size`` bytes: memfd-backed where possible (fd, else -1).

    The memfd is sealed at its size (no shrink, no grow, no further seals): a peer mapping it
    (``shm``) can never be made to fault past its end by a truncate, and checks the seal.
    """
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        try:
            fd = memfd_create("mooncake-buffer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(
                    fd,
                    fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
                )
                return cls(fd, size, flags=mmap.MAP_SHARED), fd
            except BaseException:
                os.close(fd)
                raise
    return cls(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS), -1


class Pins:
    """The pin protocol over one registry: the only code that counts ``Region.users`` up or
    down and wakes an ``unregister`` waiting for the last user.

    The rule, for every path that touches memory: a region is pinned from a lookup made with
    no ``await`` since, until no thread, peer or device can touch it any more. A region that
    is closing takes no new pins through :meth:`acquire` (the registry refuses it) and one
    found stale by :meth:`pin_locals` is looked up again.
    """

    def __init__(self, registry: MemoryRegistry) -> None:
        self.registry = registry

    def acquire(self, addr: int, length: int, what: str = "local") -> Region:
        """Pin the region holding ``[addr, +length)`` (:class:`NotRegisteredError` if none)."""
        region = self.registry.require(addr, length, what)
        region.users += 1
        return region

    def pin(self, region: Region) -> None:
        """Pin ``region``, found by a lookup with no ``await`` since (it is not closing)."""
        region.users += 1

    def release(self, region: Region) -> None:
        """Drop one pin; the last one of a closing region wakes its ``unregister``."""
        region.users -= 1
        if region.users == 0 and region.closing:
            released = region.meta.get("released")
            if released is not None:
                released.set()

    def pin_locals(
        self, reqs: Sequence[TransferRequest], regs: list[Region], idx: Iterable[int]
    ) -> list[Region]:
        """Pin the local region of every ``reqs[i]`` (``i`` in ``idx``); returns the pins.

        ``regs`` comes from a lookup that may be stale (an ``await`` since): a region that
        started closing is looked up again (it may have been replaced at the same address) and
        ``regs`` updated; a range no longer registered raises :class:`NotRegisteredError`,
        leaving nothing pinned.
        """
        held: list[Region] = []
        try:
            for i in idx:
                region = regs[i]
                if region.closing:
                    r = reqs[i]
                    region = regs[i] = self.registry.require(r.local_addr, r.length, "local")
                region.users += 1
                held.append(region)
        except BaseException:
            self.release_all(held)
            raise
        return held

    def release_all(self, held: Iterable[Region]) -> None:
        """:meth:`release` every region of ``held``."""
        for region in held:
            self.release(region)

    async def wait_released(self, region: Region) -> None:
        """Wait until ``region`` (already marked closing) has no pins left. Cancelled, it
        leaves no waiter behind (the region's ``released`` event is dropped)."""
        try:
            while region.users:
                released = region.meta["released"] = anyio.Event()
                await released.wait()
        except BaseException:
            region.meta.pop("released", None)
            raise


class MemoryHost(Protocol):
    """What :class:`Memory` asks of its engine."""

    @property
    def transports(self) -> Sequence[Transport]:
        """The installed transports (each registers memory its own way)."""

    @property
    def gpu(self) -> Gpu:
        """The engine's GPU family (device checks, the runtime for device allocations)."""

    def check_open(self) -> None:
        """Raise :class:`~mooncake.errors.ClosedError` once the engine is closed."""

    def descriptor_changed(self) -> None:
        """Forget the cached descriptor (the registered buffers changed)."""

    async def publish(self) -> None:
        """Publish the current descriptor where the metadata mode has a service."""


class Memory:
    """Registration for one engine: the registry, the pins, and what the engine allocated."""

    def __init__(self, host: MemoryHost, registry: MemoryRegistry) -> None:
        self._host = host
        self.registry = registry
        self.pins = Pins(registry)
        self.buffers: dict[int, Buffer] = {}
        self.device_mem: dict[int, DeviceMemory] = {}

    async def register(
        self,
        obj: Any,
        *,
        location: str = "*",
        remote_accessible: bool = True,
    ) -> Region:
        """See :meth:`mooncake._engine.engine.Engine.register`."""
        host = self._host
        host.check_open()
        dev_arr = device_array_address(obj, writable=remote_accessible)
        if dev_arr is not None:
            addr, length = dev_arr
            check_range(addr, length, "register")
            owner: Any = obj
            if location in ("*", ""):
                _, dev = host.gpu.runtime.pointer_get_attributes(addr)
                location = f"cuda:{dev}"
        elif isinstance(obj, tuple):
            if len(obj) != 2:
                raise InvalidArgumentError("expected (addr, length)")
            addr, length = obj
            check_range(addr, length, "register")
            owner = None
            if location in ("*", ""):
                location = host.gpu.auto_location(addr)
        else:
            addr, length, owner = buffer_address(obj, writable=remote_accessible)
            if device_of(location) is not None:
                raise InvalidArgumentError(
                    f"a host buffer ({type(obj).__name__}) cannot have location {location!r}"
                )
        if location in ("*", ""):
            location = "cpu:0"
        if location.startswith("cuda"):
            host.gpu.check_device_range(addr, length, location)
        region = self.registry.add(Region(addr, length, location, owner, remote_accessible))
        done: list[Transport] = []
        try:
            for t in host.transports:
                await t.on_register(region)
                done.append(t)
        except BaseException:
            # roll back on the transports that took it (they may hold pins, exports...)
            with anyio.CancelScope(shield=True):
                for t in reversed(done):
                    try:
                        await t.on_unregister(region)
                    except MooncakeError as e:
                        log.warning("rolling back registration on %s: %s", t.name, e)
            self.registry.remove(addr)
            raise
        await host.publish()
        return region

    async def unregister(self, obj: Any) -> None:
        """See :meth:`mooncake._engine.engine.Engine.unregister`."""
        host = self._host
        if isinstance(obj, (Region, Buffer, DeviceMemory)):
            addr = obj.addr
        elif isinstance(obj, int):
            addr = obj
        elif (dev_arr := device_array_address(obj, writable=False)) is not None:
            addr = dev_arr[0]
        else:
            addr = buffer_address(obj, writable=False)[0]
        region = self.registry.get(addr)
        if region.closing:
            raise RegistrationError(f"region at {addr:#x} is already being unregistered")
        region.closing = True
        for t in host.transports:
            t.abort_users(region)  # peers quiet mid-request on it cannot hold it
        try:
            await self.pins.wait_released(region)
        except BaseException:
            # cancelled before anything was torn down: the region stays registered and usable
            region.closing = False
            for t in host.transports:
                t.reopen_users(region)
            raise
        # Past this point the teardown runs to the end even when cancelled: a region half
        # unregistered (some transports still serving it, or closing forever) is worse than a
        # late return. Each transport bounds its own step (shm: the revoke acknowledgement).
        with anyio.CancelScope(shield=True):
            try:
                for t in host.transports:
                    await t.on_unregister(region)
            finally:
                self.registry.remove(addr)
                host.descriptor_changed()
                region.owner = None
                buf = self.buffers.pop(addr, None)
                if buf is not None:
                    buf._close()
                dm = self.device_mem.pop(addr, None)
                if dm is not None:
                    dm._rt.free(dm.addr)
        await host.publish()

    async def allocate(self, length: int, *, location: str = "cpu:0") -> Buffer | DeviceMemory:
        """See :meth:`mooncake._engine.engine.Engine.allocate`."""
        self._host.check_open()
        if length <= 0:
            raise InvalidArgumentError(f"allocate: length must be positive, got {length}")
        kind, dev = parse_location(location)
        if kind == "cuda":
            rt = self._host.gpu.runtime
            rt.set_device(dev)
            ptr = rt.malloc(length)
            try:
                region = await self.register((ptr, length), location=location)
            except BaseException:
                rt.free(ptr)
                raise
            dm = DeviceMemory(rt, region, dev)
            region.owner = dm
            self.device_mem[ptr] = dm
            return dm
        size = math.ceil(length / mmap.PAGESIZE) * mmap.PAGESIZE
        check_backable(size, "a buffer")  # pre-faulted: too large would end in the OOM killer
        buf, fd = _map_shared(size, Buffer)
        try:
            addr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
            await anyio.to_thread.run_sync(_fast.prefault, addr, size)
            region = await self.register((addr, size), location=location)
        except BaseException:
            mmap.mmap.close(buf)
            if fd >= 0:
                os.close(fd)
            raise
        region.owner = buf
        if fd >= 0:
            region.meta["memfd"] = fd
        buf._attach(region, fd)
        self.buffers[addr] = buf
        return buf

    def close_buffers(self) -> None:
        """At engine close (no task left): mark every region closing (a stale lookup
        re-validates and finds nothing) and unmap the engine's host buffers."""
        for region in self.registry.regions():
            region.closing = True
        for buf in list(self.buffers.values()):
            self.registry.remove(buf.addr)
            try:
                buf._close()
            except BufferError:
                # still viewed (e.g. a numpy array the caller holds): the mapping goes
                # away with its last view instead of under it
                pass
        self.buffers.clear()

    def free_device_memory(self) -> None:
        """At engine close: free the engine's device allocations (failures are logged)."""
        for dm in list(self.device_mem.values()):
            self.registry.remove(dm.addr)
            try:
                dm._rt.free(dm.addr)
            except CudaError as e:
                log.warning("freeing %r at close failed: %s", dm, e)
        self.device_mem.clear()
