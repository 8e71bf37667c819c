"""The ``cuda`` transport: device memory of processes on one host, through CUDA IPC.

Exporter: every registered ``cuda:N`` region publishes the IPC handle of its allocation in the
buffer's ``shm_name`` (upper-case hex, as the published ``nvlink_intra`` transport does) plus
``ipc_offset`` when the region starts inside its allocation (:mod:`mooncake._core.gpu`). The
segment publishes ``cuda_host`` (kernel boot id) and ``cuda_process``.

Importer: a peer buffer's handle is opened once (``cudaIpcOpenMemHandle``) and cached per peer
(:class:`HandleCache`: LRU beyond ``MC_CUDA_MAX_OPEN_HANDLES``, never closing a mapping a copy is
using); requests become ``cudaMemcpyAsync`` on the peer's stream for the device doing the copy (the
local side's device, else the remote buffer's), and the batch completes through
:class:`~mooncake._engine.cudaio.Completions`, never blocking the event loop. A peer in this very
process (``cuda_process`` matches) needs no IPC: its pointers are ours.

Reach: peers that publish our ``cuda_host``, and published ``nvlink_intra`` peers (which publish
no host id; the import fails cleanly if they are elsewhere). Only device buffers that carry a handle
are reachable (:meth:`CudaTransport.accepts`); host buffers of the same peer go to ``tcp``/``shm``.

Staleness: like the published engine, an importer acts on its cached descriptor until a request
misses it. A peer that frees a registered device buffer and registers a new allocation at the
same address would leave importers copying through the old mapping, so exporters should not
reuse an address for a new registration while peers may hold the old descriptor (allocate the new
buffer before unregistering the old). A refresh closes mappings of buffers no longer published.

Device indices in ``cuda:N`` are the exporter's; importers open a handle on device N when they have
one, so both processes should see the same devices (same ``CUDA_VISIBLE_DEVICES``).

Cancellation: once enqueued, copies cannot be recalled; ``execute`` waits for them shielded, and a
forgotten peer's mappings are closed only after its last in-flight batch returns.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from mooncake._core.descriptor import BufferDesc, SegmentDescriptor
from mooncake._core.gpu import DeviceBuffer, buffer_fields, device_buffer, device_of
from mooncake._core.memory import Region
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, completed, failed
from mooncake._engine.cudaio import StreamSet
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake._fast.cuda import CudaRuntime
from mooncake.errors import CudaError, MooncakeError, ProtocolError, TransferError

log = logging.getLogger("mooncake.cuda")

DEFAULT_MAX_OPEN_HANDLES = 1024


def host_id() -> str:
    """Identity of this kernel boot: processes that share it share the GPUs (and IPC)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


_token: tuple[int, str] | None = None


def process_token() -> str:
    """A token unique to this process (renewed after fork)."""
    global _token
    pid = os.getpid()
    if _token is None or _token[0] != pid:
        _token = (pid, f"{pid}-{uuid.uuid4().hex[:16]}")
    return _token[1]


_opened: dict[tuple[int, bytes], list[int]] = {}
_opened_lock = threading.Lock()  # engines of one process may run on different loop threads


def ipc_open(rt: CudaRuntime, handle: bytes) -> int:
    """Open ``handle`` once per process: CUDA refuses (or double-maps) a second open, and several
    engines or peer states of one process may import the same buffer. Reference-counted."""
    key = (id(rt), handle)
    with _opened_lock:
        entry = _opened.get(key)
        if entry is None:
            entry = _opened[key] = [rt.ipc_open_mem_handle(handle), 0]
        entry[1] += 1
        return entry[0]


def ipc_close(rt: CudaRuntime, handle: bytes) -> None:
    """Drop one reference taken by :func:`ipc_open`; the last one closes the mapping."""
    key = (id(rt), handle)
    with _opened_lock:
        entry = _opened.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _opened[key]
    rt.ipc_close_mem_handle(entry[0])


@dataclass(eq=False)
class _Mapping:
    ptr: int
    users: int = 0


class HandleCache:
    """Opened IPC mappings of one peer, keyed by (allocation base, handle).

    ``acquire`` opens a handle at most once while it stays cached; ``release`` ends one use.
    Unused mappings beyond ``capacity`` are closed least-recently-used first; a mapping in use is
    never closed (the cache may then exceed ``capacity`` until uses end).
    """

    def __init__(self, rt: CudaRuntime, capacity: int = DEFAULT_MAX_OPEN_HANDLES) -> None:
        self.rt = rt
        self.capacity = max(1, capacity)
        self._maps: collections.OrderedDict[tuple[int, bytes], _Mapping] = collections.OrderedDict()
        self.opens = 0
        self.closes = 0

    def __len__(self) -> int:
        return len(self._maps)

    def acquire(self, buf: DeviceBuffer) -> int:
        """The local pointer of ``buf``'s allocation base (opened now or cached)."""
        m = self._maps.get(buf.key)
        if m is None:
            self._evict(self.capacity - 1)
            ndev = self.rt.get_device_count()
            self.rt.set_device(buf.device if buf.device < ndev else 0)
            m = _Mapping(ipc_open(self.rt, buf.handle))
            self.opens += 1
            self._maps[buf.key] = m
        else:
            self._maps.move_to_end(buf.key)
        m.users += 1
        return m.ptr

    def release(self, buf: DeviceBuffer) -> None:
        m = self._maps.get(buf.key)
        if m is not None and m.users > 0:
            m.users -= 1

    def _close(self, key: tuple[int, bytes]) -> None:
        self._maps.pop(key)
        try:
            ipc_close(self.rt, key[1])
        except CudaError as e:
            log.warning("closing an IPC mapping failed: %s", e)
        self.closes += 1

    def _evict(self, keep: int) -> None:
        for key in [k for k, m in self._maps.items() if m.users == 0]:
            if len(self._maps) <= keep:
                break
            self._close(key)

    def prune(self, live: set[tuple[int, bytes]]) -> None:
        """Close unused mappings whose buffer the peer no longer publishes."""
        for key in [k for k, m in self._maps.items() if m.users == 0 and k not in live]:
            self._close(key)

    def close(self) -> None:
        """Close every unused mapping (callers close only when nothing is in flight)."""
        self._evict(0)


class _PeerCuda:
    """Per-peer state: the handle cache, one stream per device, in-flight batches."""

    def __init__(self, rt: CudaRuntime, capacity: int) -> None:
        self.cache = HandleCache(rt, capacity)
        self.streams = StreamSet(rt)
        self.inflight = 0
        self.closed = False
        self.descriptor: SegmentDescriptor | None = None

    def close(self) -> None:
        self.cache.close()
        self.streams.close()


PAGEABLE_THREAD_THRESHOLD = 256 << 10


def _issue(rt: CudaRuntime, dev: int, dst: int, src: int, n: int, stream: int) -> None:
    rt.set_device(dev)  # the current device is per thread
    rt.memcpy_async(dst, src, n, stream)


class CudaTransport(Transport):
    name = "cuda"
    priority = 30
    device_memory = True
    wire_protocol = None  # the descriptor keeps "tcp" so published TCP peers still reach us

    def __init__(
        self, engine: Any, *, max_open_handles: int | None = None, pin_host: bool | None = None
    ) -> None:
        super().__init__(engine)
        env = os.environ.get("MC_CUDA_MAX_OPEN_HANDLES", "")
        self.max_open_handles = max_open_handles or int(env or DEFAULT_MAX_OPEN_HANDLES)
        #: page-lock registered host memory (MC_CUDA_PIN_HOST=1; off by default: pinning a large
        #: store segment takes time and counts against the memlock limit)
        self.pin_host = (
            pin_host
            if pin_host is not None
            else os.environ.get("MC_CUDA_PIN_HOST", "") not in ("", "0")
        )
        self._host = host_id()
        self._states: list[_PeerCuda] = []

    @property
    def rt(self) -> CudaRuntime:
        rt: CudaRuntime = self.engine.cuda
        return rt

    async def start(self) -> None:
        self.rt  # noqa: B018  (load the runtime now: NoGpuError at open, not at first transfer)

    def descriptor_fields(self) -> dict[str, Any]:
        return {"cuda_host": self._host, "cuda_process": process_token()}

    def can_reach(self, peer: PeerInfo) -> bool:
        d = peer.descriptor
        host = d.extra.get("cuda_host")
        if host is None:
            return "nvlink_intra" in d.protocol.split(",")
        return bool(host == self._host)

    def accepts(self, peer: PeerInfo, buffer: BufferDesc) -> bool:
        return device_of(buffer.name) is not None and "shm_name" in buffer.extra

    async def on_register(self, region: Region) -> None:
        if device_of(region.location) is None:
            if self.pin_host:
                await self._pin(region)
            return
        if not region.remote_accessible:
            return
        rt = self.rt
        dev = device_of(region.location)
        assert dev is not None
        rt.set_device(dev)  # the driver query below needs this device's context current
        try:
            base, _size = rt.mem_get_address_range(region.addr)
        except CudaError as e:
            # Without the allocation base we can only assume the region starts it, as the
            # published engine always does.
            log.warning("no allocation range for %#x (%s); assuming offset 0", region.addr, e)
            base = region.addr
        # the handle of the allocation (cudaIpcGetMemHandle documents base pointers only)
        handle = rt.ipc_get_mem_handle(base)
        region.meta.setdefault("desc", {}).update(buffer_fields(handle, region.addr - base))

    async def _pin(self, region: Region) -> None:
        """Page-lock a host region so copies with peers' GPUs are DMA, not staged by the driver.

        Locking many pages takes time (a worker thread does it); failure (memlock limits,
        unsupported mappings) leaves the region pageable, which still works, more slowly.
        """
        rt = self.rt
        from mooncake._fast.cuda import MEMORY_HOST

        if rt.pointer_get_attributes(region.addr)[0] == MEMORY_HOST:
            return  # already page-locked (cudaHostAlloc: the staging chunks)

        def pin() -> None:
            rt.set_device(0)  # cudaHostRegister needs a context on this thread
            rt.host_register(region.addr, region.length)

        try:
            await anyio.to_thread.run_sync(pin)
        except MooncakeError as e:
            log.warning("cannot pin [%#x, +%d): %s", region.addr, region.length, e)
            return
        region.meta["cuda_pinned"] = True

    async def on_unregister(self, region: Region) -> None:
        if region.meta.pop("cuda_pinned", False):
            rt = self.rt

            def unpin() -> None:
                rt.set_device(0)
                rt.host_unregister(region.addr)

            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(unpin)

    def _state(self, peer: PeerInfo) -> _PeerCuda:
        st = peer.state.get(self.name)
        if st is None or st.closed:
            st = peer.state[self.name] = _PeerCuda(self.rt, self.max_open_handles)
            self._states.append(st)
        assert isinstance(st, _PeerCuda)
        return st

    def forget_peer(self, peer: PeerInfo) -> None:
        st = peer.state.pop(self.name, None)
        if isinstance(st, _PeerCuda):
            st.closed = True
            if st.inflight == 0:
                self._drop(st)

    def _drop(self, st: _PeerCuda) -> None:
        st.close()
        if st in self._states:
            self._states.remove(st)

    def _sync_descriptor(self, st: _PeerCuda, desc: SegmentDescriptor) -> None:
        if st.descriptor is desc:
            return
        live = set()
        for b in desc.buffers:
            try:
                db = device_buffer(b.name, b.addr, b.length, b.extra)
            except ProtocolError:
                continue
            if db is not None:
                live.add(db.key)
        st.cache.prune(live)
        st.descriptor = desc

    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        rt = self.rt
        st = self._state(peer)
        self._sync_descriptor(st, peer.descriptor)
        same_process = peer.descriptor.extra.get("cuda_process") == process_token()
        registry = self.engine.registry
        results: list[TransferResult | None] = [None] * len(requests)
        on_stream: dict[int, list[int]] = {}
        held: list[DeviceBuffer] = []
        pageable: list[tuple[int, int, int, int, int, int]] = []
        st.inflight += 1
        try:
            # Enqueue everything first (no awaits: set_device + enqueue stay together on this
            # thread), then wait for each stream once.
            for i, r in enumerate(requests):
                try:
                    buf = peer.descriptor.find_buffer(r.remote_addr, r.length)
                    db = (
                        device_buffer(buf.name, buf.addr, buf.length, buf.extra)
                        if buf is not None
                        else None
                    )
                    if db is None:
                        raise TransferError(
                            f"{peer.segment}: [{r.remote_addr:#x}, +{r.length}) is not in a "
                            "device buffer with an IPC handle"
                        )
                    if same_process:
                        remote = r.remote_addr
                    else:
                        remote = st.cache.acquire(db) + db.offset + (r.remote_addr - db.addr)
                        held.append(db)
                    local = registry.find(r.local_addr, r.length)
                    ldev = device_of(local.location) if local is not None else None
                    dev = ldev if ldev is not None else db.device
                    stream = st.streams.get(dev)
                    dst, src = (
                        (r.local_addr, remote)
                        if r.opcode is Opcode.READ
                        else (remote, r.local_addr)
                    )
                    pinned = local is not None and local.meta.get("cuda_pinned", False)
                    if ldev is None and not pinned and r.length >= PAGEABLE_THREAD_THRESHOLD:
                        # cudaMemcpyAsync to/from pageable host memory returns only once the
                        # bytes have moved: keep that wait off the event loop.
                        pageable.append((i, dev, dst, src, r.length, stream))
                        continue
                    rt.memcpy_async(dst, src, r.length, stream)
                    on_stream.setdefault(stream, []).append(i)
                except MooncakeError as e:
                    results[i] = failed(e)

            if pageable:
                with anyio.CancelScope(shield=True):  # started copies cannot be recalled
                    for i, dev, dst, src, n, stream in pageable:
                        try:
                            await anyio.to_thread.run_sync(_issue, rt, dev, dst, src, n, stream)
                        except MooncakeError as e:
                            results[i] = failed(e)
                            continue
                        on_stream.setdefault(stream, []).append(i)

            async def wait(stream: int, idx: list[int]) -> None:
                try:
                    await self.engine.cuda_completions.wait(stream)
                except MooncakeError as e:
                    for i in idx:
                        results[i] = failed(e)
                    return
                for i in idx:
                    results[i] = completed(requests[i].length)

            if len(on_stream) == 1:
                ((s, idx),) = on_stream.items()
                await wait(s, idx)
            elif on_stream:
                async with anyio.create_task_group() as tg:
                    for s, idx in on_stream.items():
                        tg.start_soon(wait, s, idx)
        finally:
            for db in held:
                st.cache.release(db)
            st.inflight -= 1
            if st.closed and st.inflight == 0:
                self._drop(st)
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    async def aclose(self) -> None:
        for st in list(self._states):
            st.closed = True
            if st.inflight == 0:
                self._drop(st)
        for region in self.engine.registry.regions():
            if region.meta.pop("cuda_pinned", False):
                try:
                    self.rt.host_unregister(region.addr)
                except MooncakeError as e:
                    log.warning("unpinning [%#x, +%d) at close: %s", region.addr, region.length, e)
