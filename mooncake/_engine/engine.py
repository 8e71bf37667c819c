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
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any, overload

import anyio
import anyio.abc

from mooncake._core.descriptor import BufferDesc, SegmentDescriptor, now_timestamp
from mooncake._core.handshake import Frame, FrameType
from mooncake._core.memory import MemoryRegistry, Region
from mooncake._core.transfer import (
    Opcode,
    TransferRequest,
    TransferResult,
    TransferStatus,
)
from mooncake._engine import telemetry as _tel
from mooncake._engine import tracing as _tracing
from mooncake._engine.batch import Batches, _op
from mooncake._engine.gpu import Gpu
from mooncake._engine.handshake import HandshakeServer
from mooncake._engine.memory import (
    Buffer,
    DeviceMemory,
    Memory,
    Pins,
    buffer_address,
    device_array_address,
)
from mooncake._engine.metadata import MetadataBackend, open_backend
from mooncake._engine.metrics import (
    EngineMetrics,
    MetricsServer,
    make_registry,
    serve_metrics,
)
from mooncake._engine.metrics import enabled as metrics_enabled
from mooncake._engine.metrics import env_port as metrics_env_port
from mooncake._engine.peers import PeerCache
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake._groups import unwrapped
from mooncake.errors import (
    ClosedError,
    InvalidArgumentError,
    MooncakeError,
)

if TYPE_CHECKING:
    from mooncake._engine.cudaio import Completions, Stager
    from mooncake._fast.cuda import CudaRuntime

__all__ = [
    "Buffer",
    "DeviceMemory",
    "Engine",
    "Notify",
    "TransferHandle",
    "buffer_address",
    "device_array_address",
    "open_engine",
]

log = logging.getLogger("mooncake.engine")

MAX_NOTIFIES = 4096


@dataclass(frozen=True)
class Notify:
    """A notification received from a peer (``TransferNotify``)."""

    name: str
    msg: str


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
        self._notifies: collections.deque[Notify] = collections.deque(maxlen=MAX_NOTIFIES)
        # the object families, each on the narrow part of this engine it needs
        self.gpu = Gpu(self, cuda_runtime)
        self.memory = Memory(self, self.registry)
        self.pins: Pins = self.memory.pins
        self.peer_cache = PeerCache(self)
        self.batches = Batches(self, self.peer_cache)
        # the same dicts, by their old names (the sync path and tests read them)
        self._peers: dict[str, PeerInfo] = self.peer_cache.table
        self._buffers: dict[int, Buffer] = self.memory.buffers
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
        await self.publish()
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
            self.peer_cache.forget_all_state()
            for t in self.transports:
                await t.aclose()
            self.memory.close_buffers()
            self.gpu.close(self.registry)
            self.memory.free_device_memory()

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
        self.check_open()
        if self.metrics is None:
            raise InvalidArgumentError("metrics are off (MC_METRICS=0)")
        if self.metrics_server is None:
            self.metrics_server = serve_metrics(self.metrics_registry, port, host)
        return self.metrics_server.port

    def check_open(self) -> None:
        """Raise :class:`~mooncake.errors.ClosedError` once the engine is closed."""
        if self._closed:
            raise ClosedError("engine is closed")

    # -- GPU ------------------------------------------------------------------------------

    @property
    def cuda(self) -> CudaRuntime:
        """The CUDA runtime (loaded on first use; :class:`~mooncake.errors.NoGpuError` if none)."""
        return self.gpu.runtime

    @property
    def cuda_completions(self) -> Completions:
        """The engine's bridge from CUDA stream completion to the event loop."""
        return self.gpu.completions

    @property
    def staging(self) -> Stager:
        """Pinned host chunks for moving device memory over host-only transports."""
        return self.gpu.staging

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

    def descriptor_changed(self) -> None:
        """Forget the cached descriptor (the registered buffers changed)."""
        self._desc_cache = None

    async def publish(self) -> None:
        """Publish the current descriptor where the metadata mode has a service (P2P peers
        ask for it instead)."""
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
        return await self.memory.register(
            obj, location=location, remote_accessible=remote_accessible
        )

    async def unregister(self, obj: Any) -> None:
        """Unregister by start address, region, buffer or the registered object itself.

        Waits until in-flight transfers touching the region are done (local ones, and peers'
        copies through ``shm`` and ``tcp``); new ones are refused from the moment this is
        called. When it returns, nothing this engine started (threads, peers it granted the
        range to, devices) touches the range any more. Cancelled while waiting for those
        transfers, it leaves the region registered as before; once they are done, it finishes
        the teardown even if cancelled.
        """
        await self.memory.unregister(obj)

    def acquire_region(self, addr: int, length: int, what: str = "local") -> Region:
        """Pin the region holding ``[addr, +length)`` (see :class:`Pins`)."""
        return self.pins.acquire(addr, length, what)

    def release_region(self, region: Region) -> None:
        """Drop a pin taken by :meth:`acquire_region`."""
        self.pins.release(region)

    @overload
    async def allocate(self, length: int) -> Buffer: ...
    @overload
    async def allocate(self, length: int, *, location: str) -> Buffer | DeviceMemory: ...
    async def allocate(self, length: int, *, location: str = "cpu:0") -> Buffer | DeviceMemory:
        """Allocate ``length`` bytes, register them and return the allocation.

        Host (``cpu:N``): page-aligned, pre-faulted :class:`Buffer`. Device (``cuda:N``):
        ``cudaMalloc`` memory as :class:`DeviceMemory`, freed by ``unregister`` or at close.
        """
        return await self.memory.allocate(length, location=location)

    # -- peers ----------------------------------------------------------------------------

    async def peer(self, segment: str, *, refresh: bool = False) -> PeerInfo:
        """The (cached) descriptor and connection state of ``segment``."""
        return await self.peer_cache.get(segment, refresh=refresh)

    def cached_peer(self, segment: str) -> PeerInfo | None:
        """The cached :class:`PeerInfo` of ``segment``, or ``None``; never looks it up."""
        return self._peers.get(segment)

    def peers(self) -> list[PeerInfo]:
        """A snapshot (a new list) of the cached peers."""
        return list(self._peers.values())

    def forget(self, segment: str) -> None:
        """Drop the cached descriptor and connections of ``segment``."""
        self.peer_cache.forget(segment)

    def _pick(self, peer: PeerInfo, name: str | None) -> Transport:
        return self.peer_cache.pick(peer, name)

    # -- transfers ------------------------------------------------------------------------

    def _validate(self, requests: Iterable[TransferRequest]) -> list[TransferRequest]:
        return self.batches.validate(requests)

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
            return await self.batches.run(segment, requests, transport)
        try:
            op = _op(requests) if requests else ""
            nbytes = sum(r.length for r in requests)
        except (AttributeError, TypeError):  # not requests: run() says what is wrong
            return await self.batches.run(segment, requests, transport)
        rec = tel.begin(segment, op, len(requests), nbytes)
        if _queued_since is not None:
            rec.queued_s = rec.t0 - _queued_since
            rec.t0 = _queued_since
        _tel.CURRENT.set(rec)
        verdict, err = "error", ""
        try:
            out = await self.batches.run(segment, requests, transport)
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

    def submit(
        self, segment: str, requests: Sequence[TransferRequest], *, transport: str | None = None
    ) -> TransferHandle:
        """Start a batch in the engine's task group; the handle reports its outcome."""
        self.check_open()
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


def _start_exporter(engine: Engine, port: int, host: str, from_env: bool) -> None:
    """Start ``engine``'s metrics exporter; a port from ``MC_METRICS_PORT`` that is taken
    (another engine of this process serves it) is logged, not an error."""
    try:
        engine.serve_metrics(port, host)
    except InvalidArgumentError as e:
        if not from_env:
            raise
        log.warning("MC_METRICS_PORT: %s; this engine serves none", e)


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
