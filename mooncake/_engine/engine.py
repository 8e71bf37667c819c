"""The async Transfer Engine.

::

    async with open_engine("127.0.0.1") as engine:          # P2P metadata, TCP transport
        buf = await engine.allocate(1 << 20)                 # registered, pre-faulted
        await engine.write("127.0.0.1:15123", buf.addr, remote_addr, 4096)

An engine is one *segment*: it owns a handshake (RPC) server, one server per transport, and the
registry of local memory peers may touch, all in one task group that ``open_engine`` closes.
Its segment name is ``host:rpc_port`` in P2P mode (as in Mooncake).

Memory: ``register`` accepts numpy arrays, any writable C-contiguous buffer export, objects with
``__cuda_array_interface__`` (cupy arrays: GPU memory, location ``cuda:N``), or an
``(addr, length)`` pair (a device pointer with ``location="cuda:N"``); the exporting object is
kept alive (and so cannot be resized or freed) until ``unregister``. Overlapping or empty ranges
are refused. ``unregister`` waits until no transfer uses the region.

GPU memory: each request goes to the highest-priority transport that reaches the peer and
accepts the remote buffer (``cuda`` takes device buffers of peers on this host); when the local
side is device memory and that transport handles host memory only (``tcp``, ``shm``), the engine
stages it through pinned host chunks (:mod:`mooncake._engine.cudaio`); a TCP server stages its
own device regions the same way. The CUDA runtime is loaded on first need
(:func:`mooncake._fast.cuda.runtime`, or the ``cuda_runtime`` given to ``open_engine``).

Transfers: ``transfer(segment, requests)`` returns one :class:`TransferResult` per request.
Arguments that are wrong regardless of the peer (local ranges not registered, bad types) raise
before anything moves; outcomes that depend on the peer (its buffers, its liveness) come back
per request. ``read``/``write`` are single-request shortcuts that raise on failure.

Cancellation: cancelling ``transfer`` returns only once no transport can still touch the local
memory of its requests; connections used by the cancelled batch are closed, and any subset of
its bytes may have moved.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import math
import mmap
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
import anyio.abc
import numpy as np

from mooncake import _fast
from mooncake._core.descriptor import BufferDesc, SegmentDescriptor, now_timestamp
from mooncake._core.gpu import device_of, parse_location
from mooncake._core.handshake import Frame, FrameType
from mooncake._core.hostmem import check_backable
from mooncake._core.memory import MemoryRegistry, Region, check_range
from mooncake._core.transfer import (
    Opcode,
    TransferRequest,
    TransferResult,
    TransferStatus,
    completed,
    failed,
)
from mooncake._engine import telemetry as _tel
from mooncake._engine import tracing as _tracing
from mooncake._engine.handshake import HandshakeServer
from mooncake._engine.metadata import MetadataBackend, open_backend
from mooncake._engine.metrics import (
    LOG_MAX,
    EngineMetrics,
    MetricsServer,
    make_registry,
    serve_metrics,
)
from mooncake._engine.metrics import enabled as metrics_enabled
from mooncake._engine.metrics import env_port as metrics_env_port
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake._groups import unwrapped
from mooncake.errors import (
    ClosedError,
    CudaError,
    InvalidArgumentError,
    MooncakeError,
    NotSupportedError,
    PeerDiedError,
    PeerUnreachableError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._engine.cudaio import Completions, Stager
    from mooncake._fast.cuda import CudaRuntime

log = logging.getLogger("mooncake.engine")

MAX_NOTIFIES = 4096


@dataclass(frozen=True)
class Notify:
    """A notification received from a peer (``TransferNotify``)."""

    name: str
    msg: str


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


class TransferHandle:
    """A submitted batch: await :meth:`wait` or poll :attr:`status`."""

    def __init__(self, n: int) -> None:
        self._done = anyio.Event()
        self.results: list[TransferResult] | None = None
        self.error: BaseException | None = None
        self.n = n
        self._scope: anyio.CancelScope | None = None
        self.telemetry: _tel.TransferTelemetry | None = None
        """The batch's telemetry record once it is done (``None`` with telemetry off)."""

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def status(self) -> TransferStatus:
        if not self._done.is_set():
            return TransferStatus.PENDING
        if self.results is not None and all(r.ok for r in self.results):
            return TransferStatus.COMPLETED
        if self.results is None and self.error is None:
            return TransferStatus.CANCELED
        return TransferStatus.FAILED

    async def wait(self) -> list[TransferResult]:
        await self._done.wait()
        if self.error is not None:
            raise self.error
        if self.results is None:
            return [TransferResult(TransferStatus.CANCELED)] * self.n
        return self.results

    def cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()


class Engine:
    """One segment. Create with :func:`open_engine`."""

    task_group: anyio.abc.TaskGroup

    def __init__(
        self,
        hostname: str,
        metadata: str,
        *,
        rpc_port: int,
        bind_host: str | None,
        transports: Sequence[str],
        tcp_lanes: int,
        segment_name: str | None = None,
        cuda_runtime: CudaRuntime | None = None,
    ) -> None:
        host, _, port = hostname.rpartition(":") if hostname.count(":") == 1 else (hostname, "", "")
        if port and not port.isdigit():
            raise InvalidArgumentError(f"bad port in local hostname {hostname!r}")
        self.hostname = host or hostname
        self._rpc_port_req = rpc_port or (int(port) if port else 0)
        if not 0 <= self._rpc_port_req < 65536:
            raise InvalidArgumentError(
                f"rpc_port {self._rpc_port_req} is out of range (0-65535; 0 picks a free port)"
            )
        self.bind_host = bind_host or self.hostname
        self.metadata_conn = metadata
        self.metadata: MetadataBackend = open_backend(metadata)
        if segment_name is not None and self.metadata.p2p:
            raise InvalidArgumentError(
                "segment_name is only for metadata services; P2P segment names are host:rpc_port"
            )
        if segment_name is not None and not segment_name.strip():
            raise InvalidArgumentError("segment_name must be non-empty")
        # Non-P2P (as in Mooncake): the segment name is the local server name as given.
        self._given_name = segment_name or hostname
        self.registry = MemoryRegistry()
        self.handshake = HandshakeServer()
        self.segment_name = ""
        self._transport_names = tuple(transports)
        self._tcp_lanes = tcp_lanes
        self.transports: list[Transport] = []
        self._peers: dict[str, PeerInfo] = {}
        self._peer_locks: dict[str, anyio.Lock] = collections.defaultdict(anyio.Lock)
        self._notifies: collections.deque[Notify] = collections.deque(maxlen=MAX_NOTIFIES)
        self._buffers: dict[int, Buffer] = {}
        self._device_mem: dict[int, DeviceMemory] = {}
        self._cuda = cuda_runtime
        self._completions: Completions | None = None
        self._stager: Stager | None = None
        self._closed = False
        self._desc_cache: dict[str, Any] | None = None
        self.metrics: EngineMetrics | None = EngineMetrics(self) if metrics_enabled() else None
        self.metrics_registry = make_registry(*([self.metrics] if self.metrics else []))
        self.metrics_server: MetricsServer | None = None
        self.telemetry: _tel.TelemetryRing | None = _tel.from_env()
        """Per-batch records (:mod:`mooncake._engine.telemetry`); ``None`` when turned off."""
        if self.telemetry is not None and self.metrics is not None:
            self.metrics_registry.register(_tel.TelemetryCollector(self.telemetry))

    # -- lifecycle ------------------------------------------------------------------------

    async def _start(self) -> None:
        from mooncake._engine.transports import make_transport

        self.handshake.handlers[FrameType.METADATA] = self._on_metadata
        self.handshake.handlers[FrameType.NOTIFY] = self._on_notify
        self.handshake.handlers[FrameType.PROBE] = self._on_probe
        try:
            self.rpc_port: int = await self.task_group.start(
                self.handshake.serve, self.bind_host, self._rpc_port_req
            )
        except OSError as e:
            raise InvalidArgumentError(
                f"rpc_port {self._rpc_port_req} on {self.bind_host}: cannot listen "
                f"({e.strerror or e}); pass rpc_port=0 for a free port"
            ) from e
        if self.metadata.p2p:
            self.segment_name = f"{self.hostname}:{self.rpc_port}"
        else:
            self.segment_name = self._given_name
        for name in self._transport_names:
            options: dict[str, Any] = {"lanes": self._tcp_lanes} if name == "tcp" else {}
            t = make_transport(name, self, **options)
            await t.start()
            self.transports.append(t)
        self.transports.sort(key=lambda t: -t.priority)
        await self.metadata.start(self)
        await self._publish()
        log.info(
            "engine %s up (transports: %s)", self.segment_name, [t.name for t in self.transports]
        )

    async def _unpublish(self) -> None:
        if not self.segment_name:
            return
        try:
            await self.metadata.unpublish(self.segment_name)
        except MooncakeError as e:
            log.warning("unpublishing %s failed: %s", self.segment_name, e)

    async def _aclose(self) -> None:
        """Release everything; runs after every engine task has ended."""
        self._closed = True
        if self.telemetry is not None:
            self.telemetry.close()
        with anyio.CancelScope(shield=True):
            await self.metadata.aclose()
            for peer in self._peers.values():
                for t in self.transports:
                    t.forget_peer(peer)
            for t in self.transports:
                await t.aclose()
            for region in self.registry.regions():
                region.closing = True  # a stale lookup re-validates and finds nothing
            for buf in list(self._buffers.values()):
                self.registry.remove(buf.addr)
                try:
                    buf._close()
                except BufferError:
                    # still viewed (e.g. a numpy array the caller holds): the mapping goes
                    # away with its last view instead of under it
                    pass
            self._buffers.clear()
            if self._stager is not None:
                for pool in (self._stager.pool, self._stager.server_pool):
                    for chunk in pool.chunks:
                        if self.registry.find(chunk, 1) is not None:
                            self.registry.remove(chunk)
                self._stager.close()
            if self._completions is not None:
                self._completions.close()
            for dm in list(self._device_mem.values()):
                self.registry.remove(dm.addr)
                try:
                    dm._rt.free(dm.addr)
                except CudaError as e:
                    log.warning("freeing %r at close failed: %s", dm, e)
            self._device_mem.clear()

    async def _withdraw(self) -> None:
        """First step of closing, while the servers still run: refuse new users of every
        region and have each transport withdraw what its peers were granted."""
        for region in self.registry.regions():
            region.closing = True
        for t in self.transports:
            try:
                await t.on_close()
            except MooncakeError as e:
                log.warning("closing %s: %s", t.name, e)

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve :attr:`metrics_registry` at ``http://host:port/metrics`` until the engine
        closes (port 0: a free one); returns the port. A second call returns the running
        exporter's port."""
        self._check_open()
        if self.metrics is None:
            raise InvalidArgumentError("metrics are off (MC_METRICS=0)")
        if self.metrics_server is None:
            self.metrics_server = serve_metrics(self.metrics_registry, port, host)
        return self.metrics_server.port

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine is closed")

    # -- GPU ------------------------------------------------------------------------------

    @property
    def cuda(self) -> CudaRuntime:
        """The CUDA runtime (loaded on first use; :class:`~mooncake.errors.NoGpuError` if none)."""
        if self._cuda is None:
            from mooncake._fast import cuda

            self._cuda = cuda.runtime()
        return self._cuda

    @property
    def cuda_completions(self) -> Completions:
        """The engine's bridge from CUDA stream completion to the event loop."""
        if self._completions is None:
            from mooncake._engine.cudaio import Completions

            self._completions = Completions(self.cuda)
        return self._completions

    @property
    def staging(self) -> Stager:
        """Pinned host chunks for moving device memory over host-only transports."""
        if self._stager is None:
            from mooncake._engine.cudaio import Stager

            self._stager = Stager(
                self.cuda, self.cuda_completions, on_new_chunk=self._register_staging_chunk
            )
        return self._stager

    async def _register_staging_chunk(self, addr: int, length: int) -> None:
        # Local-only registered memory like any other: every transport sees it (an RDMA
        # transport registers a memory region for it), peers never do.
        await self.register((addr, length), location="cpu:0", remote_accessible=False)

    def _check_device_range(self, addr: int, length: int, location: str) -> None:
        from mooncake._fast.cuda import MEMORY_DEVICE, MEMORY_MANAGED

        _, dev = parse_location(location)
        rt = self.cuda
        n = rt.get_device_count()
        if dev >= n:
            raise InvalidArgumentError(f"location {location!r}: this process sees {n} GPU(s)")
        for p in (addr, addr + length - 1):
            kind, pdev = rt.pointer_get_attributes(p)
            if kind not in (MEMORY_DEVICE, MEMORY_MANAGED):
                raise InvalidArgumentError(
                    f"[{addr:#x}, +{length}) is not device memory, but location is {location!r}"
                )
            if pdev != dev:
                raise InvalidArgumentError(
                    f"[{addr:#x}, +{length}) is on cuda:{pdev}, but location is {location!r}"
                )

    def _auto_location(self, addr: int) -> str:
        """``*``: ask the runtime when one is loaded (never load CUDA just for this)."""
        from mooncake._fast import cuda

        rt = self._cuda or cuda.loaded_runtime()
        if rt is not None:
            kind, dev = rt.pointer_get_attributes(addr)
            if kind in (cuda.MEMORY_DEVICE, cuda.MEMORY_MANAGED) and dev >= 0:
                return f"cuda:{dev}"
        return "cpu:0"

    # -- descriptor -----------------------------------------------------------------------

    def descriptor(self) -> SegmentDescriptor:
        """This segment's current descriptor (what peers see)."""
        protocol = next((t.wire_protocol for t in self.transports if t.wire_protocol), "tcp")
        fields: dict[str, Any] = {}
        for t in reversed(self.transports):
            fields.update(t.descriptor_fields())
        buffers = tuple(
            BufferDesc(r.location, r.addr, r.length, r.meta.get("desc", {}))
            for r in self.registry.regions()
            if r.remote_accessible
        )
        known = {"tcp_data_host", "tcp_data_port", "tcp_proto_version"}
        return SegmentDescriptor(
            name=self.segment_name,
            protocol=protocol,
            buffers=buffers,
            tcp_data_host=str(fields.get("tcp_data_host", "")),
            tcp_data_port=int(fields.get("tcp_data_port", 0)),
            tcp_proto_version=int(fields.get("tcp_proto_version", 2)),
            timestamp=now_timestamp(),
            extra={k: v for k, v in fields.items() if k not in known},
        )

    def descriptor_json(self) -> dict[str, Any]:
        if self._desc_cache is None:
            self._desc_cache = self.descriptor().to_json()
        return self._desc_cache

    async def _publish(self) -> None:
        self._desc_cache = None
        if not self.metadata.p2p:
            await self.metadata.publish(
                self.segment_name, self.descriptor_json(), self.hostname, self.rpc_port
            )

    # -- handshake handlers ---------------------------------------------------------------

    async def _on_metadata(self, frame: Frame) -> Any:
        return self.descriptor_json()

    async def _on_notify(self, frame: Frame) -> Any:
        obj = frame.json()
        if isinstance(obj, dict):
            self._notifies.append(Notify(str(obj.get("name", "")), str(obj.get("notify_msg", ""))))
        return {"name": "", "notify_msg": "success"}

    async def _on_probe(self, frame: Frame) -> Any:
        return {"status": "success"}

    # -- memory ---------------------------------------------------------------------------

    async def register(
        self,
        obj: Any,
        *,
        location: str = "*",
        remote_accessible: bool = True,
    ) -> Region:
        """Register a buffer, a device array or an ``(addr, length)`` pair; returns its region.

        ``location`` is ``cpu:N``, ``cuda:N`` or ``*`` (device arrays: their device; pairs: the
        runtime's answer when CUDA is already loaded, else ``cpu:0``). A ``cuda:N`` location is
        checked against the runtime: the whole range must be device memory of device N.
        """
        self._check_open()
        dev_arr = device_array_address(obj, writable=remote_accessible)
        if dev_arr is not None:
            addr, length = dev_arr
            check_range(addr, length, "register")
            owner: Any = obj
            if location in ("*", ""):
                _, dev = self.cuda.pointer_get_attributes(addr)
                location = f"cuda:{dev}"
        elif isinstance(obj, tuple):
            if len(obj) != 2:
                raise InvalidArgumentError("expected (addr, length)")
            addr, length = obj
            check_range(addr, length, "register")
            owner = None
            if location in ("*", ""):
                location = self._auto_location(addr)
        else:
            addr, length, owner = buffer_address(obj, writable=remote_accessible)
            if device_of(location) is not None:
                raise InvalidArgumentError(
                    f"a host buffer ({type(obj).__name__}) cannot have location {location!r}"
                )
        if location in ("*", ""):
            location = "cpu:0"
        if location.startswith("cuda"):
            self._check_device_range(addr, length, location)
        region = self.registry.add(Region(addr, length, location, owner, remote_accessible))
        done: list[Transport] = []
        try:
            for t in self.transports:
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
        await self._publish()
        return region

    async def unregister(self, obj: Any) -> None:
        """Unregister by start address, region, buffer or the registered object itself.

        Waits until in-flight transfers touching the region are done (local ones, and peers'
        copies through ``shm`` and ``tcp``); new ones are refused from the moment this is
        called. When it returns, nothing this engine started (threads, peers it granted the
        range to, devices) touches the range any more. Cancelled while waiting for those
        transfers, it leaves the region registered as before; once they are done, it finishes
        the teardown even if cancelled.
        """
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
        for t in self.transports:
            t.abort_users(region)  # peers quiet mid-request on it cannot hold it
        try:
            while region.users:
                released = region.meta["released"] = anyio.Event()
                await released.wait()
        except BaseException:
            # cancelled before anything was torn down: the region stays registered and usable
            region.closing = False
            region.meta.pop("released", None)
            for t in self.transports:
                t.reopen_users(region)
            raise
        # Past this point the teardown runs to the end even when cancelled: a region half
        # unregistered (some transports still serving it, or closing forever) is worse than a
        # late return. Each transport bounds its own step (shm: the revoke acknowledgement).
        with anyio.CancelScope(shield=True):
            try:
                for t in self.transports:
                    await t.on_unregister(region)
            finally:
                self.registry.remove(addr)
                self._desc_cache = None
                region.owner = None
                buf = self._buffers.pop(addr, None)
                if buf is not None:
                    buf._close()
                dm = self._device_mem.pop(addr, None)
                if dm is not None:
                    dm._rt.free(dm.addr)
        await self._publish()

    def acquire_region(self, addr: int, length: int, what: str = "local") -> Region:
        region = self.registry.require(addr, length, what)
        region.users += 1
        return region

    def release_region(self, region: Region) -> None:
        region.users -= 1
        if region.users == 0 and region.closing:
            released = region.meta.get("released")
            if released is not None:
                released.set()

    @overload
    async def allocate(self, length: int) -> Buffer: ...
    @overload
    async def allocate(self, length: int, *, location: str) -> Buffer | DeviceMemory: ...
    async def allocate(self, length: int, *, location: str = "cpu:0") -> Buffer | DeviceMemory:
        """Allocate ``length`` bytes, register them and return the allocation.

        Host (``cpu:N``): page-aligned, pre-faulted :class:`Buffer`. Device (``cuda:N``):
        ``cudaMalloc`` memory as :class:`DeviceMemory`, freed by ``unregister`` or at close.
        """
        self._check_open()
        if length <= 0:
            raise InvalidArgumentError(f"allocate: length must be positive, got {length}")
        kind, dev = parse_location(location)
        if kind == "cuda":
            rt = self.cuda
            rt.set_device(dev)
            ptr = rt.malloc(length)
            try:
                region = await self.register((ptr, length), location=location)
            except BaseException:
                rt.free(ptr)
                raise
            dm = DeviceMemory(rt, region, dev)
            region.owner = dm
            self._device_mem[ptr] = dm
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
        self._buffers[addr] = buf
        return buf

    # -- peers ----------------------------------------------------------------------------

    async def peer(self, segment: str, *, refresh: bool = False) -> PeerInfo:
        """The (cached) descriptor and connection state of ``segment``."""
        self._check_open()
        peer = self._peers.get(segment)
        if peer is not None and not refresh:
            return peer
        async with self._peer_locks[segment]:
            peer = self._peers.get(segment)
            if peer is not None and not refresh:
                return peer
            rec = await self.metadata.lookup(segment, self.descriptor_json())
            if peer is None:
                peer = PeerInfo(segment, rec.descriptor, rec.rpc_host, rec.rpc_port)
                self._peers[segment] = peer
            else:
                peer.descriptor = rec.descriptor
                peer.rpc_host, peer.rpc_port = rec.rpc_host, rec.rpc_port
            return peer

    def cached_peer(self, segment: str) -> PeerInfo | None:
        """The cached :class:`PeerInfo` of ``segment``, or ``None``; never looks it up."""
        return self._peers.get(segment)

    def peers(self) -> list[PeerInfo]:
        """A snapshot (a new list) of the cached peers."""
        return list(self._peers.values())

    def forget(self, segment: str) -> None:
        """Drop the cached descriptor and connections of ``segment``."""
        peer = self._peers.pop(segment, None)
        if peer is not None:
            for t in self.transports:
                t.forget_peer(peer)

    def _pick(self, peer: PeerInfo, name: str | None) -> Transport:
        if name:
            for t in self.transports:
                if t.name == name:
                    if not t.can_reach(peer):
                        raise NotSupportedError(f"transport {name!r} cannot reach {peer.segment}")
                    return t
            raise NotSupportedError(
                f"transport {name!r} is not installed (have {[t.name for t in self.transports]})"
            )
        for t in self.transports:
            if t.can_reach(peer):
                return t
        raise NotSupportedError(f"no installed transport reaches {peer.segment}")

    # -- transfers ------------------------------------------------------------------------

    def _validate(self, requests: Iterable[TransferRequest]) -> list[TransferRequest]:
        return self._validate_regions(requests)[0]

    def _validate_regions(
        self, requests: Iterable[TransferRequest]
    ) -> tuple[list[TransferRequest], list[Region]]:
        """Check every request; returns them and the local region of each.

        Hot path: a batch's requests usually share one local region, so the last one found is
        tried first, and plain-int ranges skip the general checks (same outcomes, fewer calls).
        """
        out: list[TransferRequest] = []
        regs: list[Region] = []
        last: Region | None = None
        for i, r in enumerate(requests):
            if not isinstance(r, TransferRequest):
                raise InvalidArgumentError(
                    f"requests[{i}] is {type(r).__name__}, not TransferRequest"
                )
            la, ra, n = r.local_addr, r.remote_addr, r.length
            if not (
                type(la) is int
                and type(ra) is int
                and type(n) is int
                and n > 0
                and la >= 0
                and ra >= 0
                and la + n <= _U64
                and ra + n <= _U64
            ):
                check_range(la, n, f"requests[{i}] local")
                check_range(ra, n, f"requests[{i}] remote")
            if last is None or last.closing or la < last.addr or la + n > last.addr + last.length:
                last = self.registry.require(la, n, f"requests[{i}] local")
            out.append(r)
            regs.append(last)
        return out, regs

    @_tracing.traced(
        "mooncake.transfer",
        lambda self, segment, requests, **_: {
            "mooncake.peer": segment,
            "mooncake.requests": len(requests),
        },
    )
    async def transfer(
        self,
        segment: str,
        requests: Sequence[TransferRequest],
        *,
        transport: str | None = None,
        _queued_since: float | None = None,
    ) -> list[TransferResult]:
        """Run a batch against ``segment``; one result per request, in order.

        With telemetry on, the batch's :class:`~mooncake._engine.telemetry.TransferTelemetry`
        is kept in :attr:`telemetry` and, once this returns (or raises), is
        ``telemetry.CURRENT.get()`` in the calling task."""
        tel = self.telemetry
        if tel is None:
            return await self._transfer(segment, requests, transport)
        try:
            op = _op(requests) if requests else ""
            nbytes = sum(r.length for r in requests)
        except (AttributeError, TypeError):  # not requests: _transfer says what is wrong
            return await self._transfer(segment, requests, transport)
        rec = tel.begin(segment, op, len(requests), nbytes)
        if _queued_since is not None:
            rec.queued_s = rec.t0 - _queued_since
            rec.t0 = _queued_since
        _tel.CURRENT.set(rec)
        verdict, err = "error", ""
        try:
            out = await self._transfer(segment, requests, transport)
            bad = next((r for r in out if not r.ok), None)
            verdict = "completed" if bad is None else "failed"
            err = "" if bad is None else f"{bad.error}"
            return out
        except anyio.get_cancelled_exc_class():
            verdict = "canceled"
            raise
        except BaseException as e:
            err = f"{type(e).__name__}: {e}"
            raise
        finally:
            tel.finish(rec, verdict, err)

    async def _transfer(
        self,
        segment: str,
        requests: Sequence[TransferRequest],
        transport: str | None = None,
    ) -> list[TransferResult]:
        self._check_open()
        reqs, regs = self._validate_regions(requests)
        if not reqs:
            return []
        if segment == self.segment_name:
            return await self._local(reqs, regs)
        try:
            peer = await self.peer(segment)
            missing = _uncovered(peer.descriptor, reqs, range(len(reqs)))
            if missing:  # the peer may have registered more since we cached its descriptor
                rec = _tel.CURRENT.get()
                if rec is not None:
                    rec.retries += 1
                peer = await self.peer(segment, refresh=True)
                missing = _uncovered(peer.descriptor, reqs, missing)
        except InvalidArgumentError:
            raise
        except MooncakeError as e:  # unreachable, unknown or malformed: every request fails
            self.forget(segment)
            if self.metrics is not None:
                self.metrics.failed_batch("", segment, _op(reqs), len(reqs), e)
            return [failed(e) for _ in reqs]
        results: list[TransferResult | None] = [None] * len(reqs)
        for i in missing:
            r = reqs[i]
            results[i] = failed(
                RemoteAccessError(
                    f"{segment}: [{r.remote_addr:#x}, +{r.length}) is not inside one "
                    "of its registered buffers"
                )
            )
        if missing and self.metrics is not None:
            err = results[missing[0]]
            assert err is not None and err.error is not None
            self.metrics.failed_batch("", segment, _op(reqs), len(missing), err.error)
        send_idx = (
            [i for i in range(len(reqs)) if results[i] is None]
            if missing
            else list(range(len(reqs)))
        )
        if send_idx:
            # The peer lookup above awaited: a local region may have been unregistered (or
            # replaced at the same address) since validation. Re-validate and pin in one step,
            # with no await in between; unregister waits for the pins.
            held = self._pin_locals(reqs, regs, send_idx)
            try:
                routes = self._route(peer, reqs, send_idx, transport, results)
                if len(routes) == 1:
                    ((t, idx),) = routes.items()
                    await self._execute(t, peer, reqs, regs, idx, results)
                elif routes:
                    async with anyio.create_task_group() as tg:
                        for t, idx in routes.items():
                            tg.start_soon(self._execute_part, t, peer, reqs, regs, idx, results)
            finally:
                self._release_all(held)
            for i in send_idx:
                res = results[i]
                if res is not None and isinstance(res.error, (PeerDiedError, PeerUnreachableError)):
                    self.forget(segment)
                    break
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    def _route(
        self,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        idx: list[int],
        name: str | None,
        results: list[TransferResult | None],
    ) -> dict[Transport, list[int]]:
        """Pick a transport per request: the first (by priority) that reaches the peer and
        accepts the buffer holding the remote range. Unroutable requests get a failed result."""
        cands = (
            [self._pick(peer, name)] if name else [t for t in self.transports if t.can_reach(peer)]
        )
        if not cands:
            raise NotSupportedError(f"no installed transport reaches {peer.segment}")
        routes: dict[Transport, list[int]] = {}
        for i in idx:
            r = reqs[i]
            buf = peer.descriptor.find_buffer(r.remote_addr, r.length)
            assert buf is not None
            t = next((t for t in cands if t.accepts(peer, buf)), None)
            if t is None:
                results[i] = failed(
                    NotSupportedError(
                        f"{peer.segment}: no transport among {[c.name for c in cands]} reaches "
                        f"its {buf.name} buffer [{buf.addr:#x}, +{buf.length})"
                    )
                )
            else:
                routes.setdefault(t, []).append(i)
        return routes

    async def _execute_part(
        self,
        t: Transport,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        regs: list[Region],
        idx: list[int],
        results: list[TransferResult | None],
    ) -> None:
        """One transport's share of a batch split over several: a batch-level failure of that
        transport fails its requests only (and never leaves as an exception group)."""
        try:
            await self._execute(t, peer, reqs, regs, idx, results)
        except MooncakeError as e:
            for i in idx:
                results[i] = failed(e)

    async def _execute(
        self,
        t: Transport,
        peer: PeerInfo,
        reqs: list[TransferRequest],
        regs: list[Region],
        idx: list[int],
        results: list[TransferResult | None],
    ) -> None:
        sub = [reqs[i] for i in idx]
        t0 = perf_counter()
        # the local regions were looked up (and pinned) by transfer(): no second lookup here
        devices = [] if t.device_memory else [device_of(regs[i].location) for i in idx]
        try:
            if t.device_memory or all(d is None for d in devices):
                out = await t.execute(peer, sub)
            else:
                out = await self.staging.run(partial(t.execute, peer), sub, devices)
        except MooncakeError as e:
            if self.metrics is not None:
                self.metrics.failed_batch(t.name, peer.segment, _op(sub), len(sub), e)
            raise
        t1 = perf_counter()
        rec = _tel.CURRENT.get()
        if rec is not None:
            rec.add_group(
                t.name,
                _nic(t, self.hostname),
                len(sub),
                sum(r.length for r in sub),
                t0,
                t1,
                sum(1 for r in out if not r.ok),
            )
        m = self.metrics
        if m is not None:
            m.log.append((t.name, peer.segment, sub, out, t1 - t0))
            if len(m.log) > LOG_MAX:
                m.drain()
        for i, res in zip(idx, out, strict=True):
            results[i] = res

    def _pin_locals(
        self, reqs: Sequence[TransferRequest], regs: list[Region], idx: Iterable[int]
    ) -> list[Region]:
        """Pin the local region of every ``reqs[i]`` (``i`` in ``idx``); returns the pins.

        The pinning rule, for every path that touches memory: a region is pinned from a lookup
        made with no ``await`` since, until no thread, peer or device can touch it any more.
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
            self._release_all(held)
            raise
        return held

    def _release_all(self, held: Iterable[Region]) -> None:
        for region in held:
            self.release_region(region)

    async def _local(self, reqs: list[TransferRequest], regs: list[Region]) -> list[TransferResult]:
        """Requests against this engine's own segment: copies between two local regions.

        Both regions of every request are pinned (looked up with no ``await`` since) before the
        first copy and released once the last one is done, so ``unregister`` of either waits
        for the copies, worker-thread ones included.
        """
        results: list[TransferResult | None] = [None] * len(reqs)
        t0 = perf_counter()
        held = self._pin_locals(reqs, regs, range(len(reqs)))
        remotes: list[Region | None] = []
        try:
            for i, r in enumerate(reqs):
                remote = self.registry.find(r.remote_addr, r.length)
                if remote is None or not remote.remote_accessible:
                    results[i] = failed(
                        RemoteAccessError(f"[{r.remote_addr:#x}, +{r.length}) not registered")
                    )
                    remotes.append(None)
                    continue
                remote.users += 1
                held.append(remote)
                remotes.append(remote)
            for i, r in enumerate(reqs):
                remote = remotes[i]
                if remote is None:
                    continue
                src, dst = (
                    (r.remote_addr, r.local_addr)
                    if r.opcode is Opcode.READ
                    else (r.local_addr, r.remote_addr)
                )
                dev = device_of(regs[i].location)
                if dev is None:
                    dev = device_of(remote.location)
                if dev is not None:
                    try:
                        await self.staging.copy(dst, src, r.length, dev)  # shielded wait
                    except MooncakeError as e:
                        results[i] = failed(e)
                        continue
                elif r.length >= (1 << 20):
                    # not abandoned on cancellation: returns only once the thread is done
                    await anyio.to_thread.run_sync(_fast.memcpy_at, dst, src, r.length)
                else:
                    _fast.memcpy_at(dst, src, r.length)
                results[i] = completed(r.length)
        finally:
            self._release_all(held)
        out = [r if r is not None else failed(TransferError("not attempted")) for r in results]
        t1 = perf_counter()
        rec = _tel.CURRENT.get()
        if rec is not None:
            nbytes = sum(r.length for r in reqs)
            nfail = sum(1 for r in out if not r.ok)
            rec.add_group("local", self.hostname, len(reqs), nbytes, t0, t1, nfail)
        m = self.metrics
        if m is not None:
            m.log.append(("local", self.segment_name, reqs, out, t1 - t0))
            if len(m.log) > LOG_MAX:
                m.drain()
        return out

    def submit(
        self, segment: str, requests: Sequence[TransferRequest], *, transport: str | None = None
    ) -> TransferHandle:
        """Start a batch in the engine's task group; the handle reports its outcome."""
        self._check_open()
        reqs = self._validate(requests)
        handle = TransferHandle(len(reqs))
        since = perf_counter()

        async def run() -> None:
            with anyio.CancelScope() as scope:
                handle._scope = scope
                try:
                    handle.results = await self.transfer(
                        segment, reqs, transport=transport, _queued_since=since
                    )
                except MooncakeError as e:
                    handle.error = e
                finally:
                    handle.telemetry = _tel.CURRENT.get()
            handle._done.set()

        self.task_group.start_soon(run)
        return handle

    async def read(
        self, segment: str, local: Any, remote_addr: int, length: int | None = None
    ) -> None:
        """Read ``length`` bytes at the peer's ``remote_addr`` into ``local``; raises on failure."""
        await self._one(segment, Opcode.READ, local, remote_addr, length)

    async def write(
        self, segment: str, local: Any, remote_addr: int, length: int | None = None
    ) -> None:
        """Write ``length`` bytes of ``local`` to the peer's ``remote_addr``; raises on failure."""
        await self._one(segment, Opcode.WRITE, local, remote_addr, length)

    async def _one(
        self, segment: str, op: Opcode, local: Any, remote_addr: int, length: int | None
    ) -> None:
        if isinstance(local, int):
            addr = local
            if length is None:
                raise InvalidArgumentError("length is required with an integer local address")
        elif isinstance(local, Buffer):
            addr, n = local.addr, local.length
            length = n if length is None else length
        else:
            addr, n, _ = buffer_address(local, writable=op is Opcode.READ)
            length = n if length is None else length
        (res,) = await self.transfer(segment, [TransferRequest(op, addr, remote_addr, length)])
        if not res.ok:
            assert res.error is not None
            raise res.error

    # -- notifications / probe ------------------------------------------------------------

    async def notify(self, segment: str, name: str, msg: str) -> None:
        """Send a notification to ``segment`` (handshake type 2)."""
        from mooncake._engine import handshake

        peer = await self.peer(segment)
        await handshake.request(
            peer.rpc_host, peer.rpc_port, FrameType.NOTIFY, {"name": name, "notify_msg": msg}
        )

    def get_notifies(self) -> list[Notify]:
        """Notifications received since the last call (at most the newest 4096 are kept)."""
        out = list(self._notifies)
        self._notifies.clear()
        return out

    async def probe(self, segment: str) -> bool:
        """Whether ``segment``'s handshake port answers a probe."""
        from mooncake._engine import handshake
        from mooncake._engine.metadata.p2p import split_segment

        try:
            peer = self._peers.get(segment)
            if peer is None and not self.metadata.p2p:
                peer = await self.peer(segment)
            host, port = (peer.rpc_host, peer.rpc_port) if peer else split_segment(segment)
            reply = await handshake.request(host, port, FrameType.PROBE, {})
            obj = reply.json()
            return isinstance(obj, dict) and obj.get("status") == "success"
        except MooncakeError:
            return False


_U64 = 1 << 64


def _start_exporter(engine: Engine, port: int, host: str, from_env: bool) -> None:
    """Start ``engine``'s metrics exporter; a port from ``MC_METRICS_PORT`` that is taken
    (another engine of this process serves it) is logged, not an error."""
    try:
        engine.serve_metrics(port, host)
    except InvalidArgumentError as e:
        if not from_env:
            raise
        log.warning("MC_METRICS_PORT: %s; this engine serves none", e)


def _nic(t: Transport, host: str) -> str:
    """The NIC(s) a transport's share could use: an RDMA transport's rails, else the host."""
    nics = getattr(t, "nics", None)
    if nics:
        return ",".join(str(getattr(n, "name", n)) for n in nics)
    return host


def _op(reqs: Sequence[TransferRequest]) -> str:
    """The ``op`` metrics label of a batch: ``read``, ``write`` or ``mixed``."""
    first = reqs[0].opcode
    if len(reqs) > 1 and any(r.opcode is not first for r in reqs):
        return "mixed"
    return "read" if first is Opcode.READ else "write"


def _uncovered(
    desc: SegmentDescriptor, reqs: Sequence[TransferRequest], idx: Iterable[int]
) -> list[int]:
    """Indices of ``idx`` whose remote range is not inside one buffer of ``desc``."""
    out = []
    last: BufferDesc | None = None
    for i in idx:
        r = reqs[i]
        ra = r.remote_addr
        if last is not None and last.addr <= ra and ra + r.length <= last.addr + last.length:
            continue
        last = desc.find_buffer(ra, r.length)
        if last is None:
            out.append(i)
    return out


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


@asynccontextmanager
async def open_engine(
    hostname: str = "127.0.0.1",
    metadata: str = "P2PHANDSHAKE",
    *,
    rpc_port: int = 0,
    bind_host: str | None = None,
    transports: Sequence[str] | None = None,
    tcp_lanes: int | None = None,
    segment_name: str | None = None,
    cuda_runtime: CudaRuntime | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> AsyncIterator[Engine]:
    """Start an engine and yield it; everything it started stops when the block exits.

    ``hostname`` is the address peers use to reach this engine and, unless ``bind_host`` says
    otherwise, the address its servers bind (loopback by default, never all interfaces
    unasked). ``metadata`` takes Mooncake's connection strings. ``transports`` defaults to
    every transport usable here (``MC_FORCE_TCP=1`` keeps only ``tcp``).

    With a metadata service (``http://``, ``etcd://``, ``redis://``) the segment name is
    ``segment_name`` if given, else ``hostname`` exactly as given (Mooncake's
    ``local_server_name``); its handshake address is published under ``rpc_meta``.
    ``cuda_runtime`` replaces the process-wide CUDA runtime for this engine (an object
    implementing :class:`mooncake._fast.cuda.CudaRuntime`; tests pass a fake).

    ``metrics_port`` (default ``MC_METRICS_PORT``; 0 picks a free port, unset serves nothing)
    serves ``engine.metrics_registry`` at ``http://metrics_host:port/metrics`` while the engine
    is open (``engine.metrics_server.port``); see docs/metrics.md. A port given here that
    cannot be bound raises :class:`InvalidArgumentError`; one from ``MC_METRICS_PORT`` already
    taken (a second engine in the process) is logged and skipped.
    """
    from_env = metrics_port is None
    if metrics_port is None:
        metrics_port = metrics_env_port()
    if transports is None:
        from mooncake._engine.transports import default_transports

        transports = default_transports()
    lanes = tcp_lanes or int(os.environ.get("MC_TCP_LANES_PER_PEER", "4") or 4)
    if "cuda" in transports and cuda_runtime is None:
        from mooncake._fast import cuda

        cuda_runtime = cuda.runtime()  # NoGpuError here, plainly, not from inside the task group
    engine = Engine(
        hostname,
        metadata,
        rpc_port=rpc_port,
        bind_host=bind_host,
        transports=transports,
        tcp_lanes=lanes,
        segment_name=segment_name,
        cuda_runtime=cuda_runtime,
    )
    try:
        # the block's exception and setup errors leave as themselves, not as a group
        with unwrapped():
            async with anyio.create_task_group() as tg:
                engine.task_group = tg
                try:
                    await engine._start()
                    if metrics_port is not None and engine.metrics is not None:
                        _start_exporter(engine, metrics_port, metrics_host, from_env)
                    yield engine
                finally:
                    if engine.metrics_server is not None:
                        engine.metrics_server.close()
                    engine._closed = True
                    with anyio.CancelScope(shield=True):
                        await engine._unpublish()
                        await engine._withdraw()
                    tg.cancel_scope.cancel()
    finally:
        # every task (servers, submitted batches) has ended: release what they used
        await engine._aclose()
