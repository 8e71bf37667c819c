"""The transport interface: what the engine needs from TCP, shm, RDMA and CUDA alike.

A transport

* says which peers it can reach (``can_reach``, from the peer's descriptor),
* contributes fields to this engine's segment descriptor (``descriptor_fields``),
* registers memory its own way (``on_register`` / ``on_unregister``: an MR per NIC, a memfd
  export, an IPC handle...), and
* executes a batch of requests against one peer (``execute``), returning one result per request.

Contract for ``execute``: requests are already validated (local ranges registered and pinned by
the engine for the duration of the call, remote ranges inside the peer's descriptor). It must
not return, even when cancelled, while the transport or the peer may still touch the local
memory of any request: a transport with posted work it cannot recall (RDMA WRs, CUDA copies)
shields the wait for those completions. Failures of individual requests are results, not
exceptions; an exception means the batch as a whole could not be attempted.

:class:`EngineHost` is what a transport (and the metadata watcher, and the metrics collector)
may ask of the engine that owns it. It lives here, in the leaf those modules import, so that
none of them imports :class:`~mooncake._engine.engine.Engine`, which imports them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from mooncake._core.descriptor import BufferDesc, SegmentDescriptor
from mooncake._core.memory import MemoryRegistry, Region
from mooncake._core.transfer import TransferRequest, TransferResult

if TYPE_CHECKING:
    import anyio.abc

    from mooncake._engine.cudaio import Completions, Stager
    from mooncake._engine.handshake import HandshakeServer
    from mooncake._fast.cuda import CudaRuntime


@dataclass(eq=False)
class PeerInfo:
    """What the engine knows about one remote segment (cached, refreshed on a miss)."""

    segment: str
    descriptor: SegmentDescriptor
    rpc_host: str
    rpc_port: int
    # transport-private state (connections, mapped segments, endpoints), keyed by transport name
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def data_host(self) -> str:
        return self.descriptor.tcp_data_host or self.rpc_host


class EngineHost(Protocol):
    """What the children of an engine (transports, metadata watch, metrics) may use of it.

    :class:`~mooncake._engine.engine.Engine` implements it. Everything here is read-only for
    the children: they start tasks in ``task_group``, read the registry and the peer cache,
    and ask the engine to look a peer up (``peer``) or drop it (``forget``); they never
    replace an attribute.
    """

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """The engine's task group (valid between start and close)."""

    @property
    def registry(self) -> MemoryRegistry:
        """The local registered regions."""

    @property
    def segment_name(self) -> str:
        """This engine's segment name (set once started)."""

    @property
    def hostname(self) -> str:
        """The host name peers reach this engine by."""

    @property
    def bind_host(self) -> str:
        """The address the engine's servers bind."""

    @property
    def handshake(self) -> HandshakeServer:
        """The handshake server transports add their frame handlers to."""

    @property
    def transports(self) -> Sequence[Transport]:
        """The installed transports, highest priority first."""

    @property
    def cuda(self) -> CudaRuntime:
        """The CUDA runtime (raises where there is none)."""

    @property
    def cuda_completions(self) -> Completions:
        """The engine's CUDA completion waiter."""

    @property
    def staging(self) -> Stager:
        """Pinned host buffers that device memory is staged through."""

    async def peer(self, segment: str, *, refresh: bool = False) -> PeerInfo:
        """The cached :class:`PeerInfo` of ``segment``, looked up in the metadata on a miss
        (or always, with ``refresh``)."""

    def cached_peer(self, segment: str) -> PeerInfo | None:
        """The cached :class:`PeerInfo` of ``segment``, or ``None``; never looks it up."""

    def peers(self) -> list[PeerInfo]:
        """A snapshot of the cached peers."""

    def forget(self, segment: str) -> None:
        """Drop the cached peer ``segment`` and every transport's state for it."""


class Transport(abc.ABC):
    """Base class of every transport. One instance per engine."""

    #: short name used in ``transport=`` overrides and logs
    name: ClassVar[str]
    #: higher wins when several transports reach a peer
    priority: ClassVar[int] = 0
    #: the descriptor ``protocol`` this transport answers to for published-Mooncake peers
    wire_protocol: ClassVar[str | None] = None
    #: whether ``execute`` takes local *device* addresses itself; the engine stages device
    #: memory through pinned host buffers for transports that do not (mooncake._engine.cudaio)
    device_memory: ClassVar[bool] = False

    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    async def start(self) -> None:
        """Start servers/tasks in ``self.engine.task_group``; return once ready."""

    def descriptor_fields(self) -> dict[str, Any]:
        """Fields merged into this engine's segment descriptor."""
        return {}

    @abc.abstractmethod
    def can_reach(self, peer: PeerInfo) -> bool:
        """Whether this transport can move bytes to/from ``peer``."""

    def accepts(self, peer: PeerInfo, buffer: BufferDesc) -> bool:
        """Whether this transport can reach the peer's ``buffer`` (default: any buffer).

        The engine routes each request to the highest-priority transport that reaches the peer
        and accepts the buffer holding its remote range (e.g. ``cuda`` only device buffers).
        """
        return True

    async def on_register(self, region: Region) -> None:
        """Called after a region is added to the registry (before it is published)."""

    def abort_users(self, region: Region) -> None:
        """Called when ``region``'s unregistration begins: refuse it from now on and end what
        a peer holds on it that would otherwise wait for the peer (a server connection inside
        a request on it). Must not block."""

    def reopen_users(self, region: Region) -> None:
        """Undo :meth:`abort_users`: the unregistration of ``region`` was cancelled before
        anything was torn down, and the region stays registered and served. Must not block."""

    async def on_unregister(self, region: Region) -> None:
        """Called once no transfer uses ``region`` any more, before it is dropped.

        When it returns, no peer this transport granted the range to may touch it any more.
        """

    async def on_close(self) -> None:
        """Called once when the engine starts closing, while its tasks (servers) still run and
        every region is already marked closing: withdraw what peers were granted, as
        ``on_unregister`` does, so nothing of theirs touches our memory after the close."""

    @abc.abstractmethod
    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        """Run ``requests`` against ``peer``; one result per request, in order."""

    def forget_peer(self, peer: PeerInfo) -> None:
        """Drop cached per-peer state (connections...) without waiting."""

    async def aclose(self) -> None:
        """Release everything; called once when the engine closes."""
