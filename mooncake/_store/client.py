"""The async Mooncake Store client.

::

    async with mooncake.open_store("127.0.0.1:50051", segment_size=256 << 20) as store:
        await store.put("k", b"value")
        assert await store.get("k") == b"value"

A client plays both Mooncake roles. As a *storage server* it contributes one segment: a
memfd-backed buffer of ``segment_size`` bytes (:class:`~mooncake._store.shm.SharedSegment`),
registered with its transfer engine and mounted at the master; it pings the master every second
and remounts when told to (``NEED_REMOUNT``). As a *requester* it runs the flows of the published
client:

* **put** = ``PutStart`` (the master allocates up to ``replica_num`` replicas on distinct
  segments) -> write every replica -> ``PutEnd`` if every write succeeded, else ``PutRevoke``.
  A key that already exists is not an error and is left unchanged (Mooncake's idempotent put); a
  half-written object is never readable.
* **get** = ``GetReplicaList`` (grants a read lease) -> read one ``COMPLETE`` replica (the own
  segment first, then same-host ones, then remote; on a transfer failure the next replica) ->
  **fence**: the read fails with :class:`~mooncake.errors.LeaseExpiredError` if it finished
  after the lease it was granted ran out (measured from before the request was sent), because
  the master may then have reused the space (``get`` tries such a read once more with a fresh
  ``GetReplicaList``: a reader descheduled past its window is not a miss); a read from a same-host segment whose owner died
  while it was copying fails with :class:`~mooncake.errors.PeerDiedError`.

Where the bytes go: a replica on this client's own segment is a ``memcpy``; one on another
client of the same host is a ``memcpy`` into that client's memfd mapping
(:mod:`mooncake._store.shm`); anything else goes through the engine (TCP). ``MC_STORE_MEMCPY=0``
sends same-host replicas through the engine too.

GPU tier: with ``segment_location="cuda:N"`` the segment is device memory
(``engine.allocate(segment_size, location="cuda:N")``, a :class:`DeviceMemory`) and none of the
host paths above touch it: the client serves no memfd for it (same-host peers find no
:class:`ShmServer` and go through their engine: the ``cuda`` transport, or TCP staging through
pinned host memory), and replicas on the own device segment go through ``engine.transfer`` to
the own segment (copies on the engine's CUDA stream). Such a segment is mounted with
``Segment.location`` set, which the master reports per tier (``gpu``). Objects evicted from a
device segment are not demoted to the SSD tier (dropped, as without one).

Copying APIs (``put(key, bytes)``, ``get(key) -> bytes``) stage through a registered local buffer
of ``local_buffer_size`` bytes when a replica is remote; as in the published client a value (or
a batch) larger than that buffer is refused with ``INVALID_PARAMS``. Zero-copy APIs
(``put_from``, ``get_into`` and their batch forms) take buffers registered with
:meth:`Store.register_buffer` (or the engine) and never stage.

Errors raise :mod:`mooncake.errors` classes (their ``code`` is the published int code); batch
calls return one entry per key, an exception instance where that key failed.

Cancellation: cancelling a put revokes the object (if ``PutStart`` had succeeded) before
returning; cancelling a read leaves no side effect but the lease it was granted.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from mooncake._core import auth, rpc
from mooncake._core import store_types as st
from mooncake._core.gpu import device_of
from mooncake._core.hostmem import check_backable
from mooncake._core.master.tenants import check_tenant
from mooncake._core.policies import EvictionPolicy
from mooncake._core.staging import RangeAllocator
from mooncake._core.tiers import Admission, make_admission
from mooncake._engine.engine import DeviceMemory, Engine, open_engine
from mooncake._groups import unwrapped
from mooncake._store.admin import _Admin
from mooncake._store.draining import DrainReport, drain, drain_on_signal
from mooncake._store.master_conn import MasterConnection
from mooncake._store.metrics import StoreMetrics, instrument
from mooncake._store.moves import HEARTBEAT_S
from mooncake._store.shm import SharedSegment, ShmPeers, ShmServer
from mooncake._store.ssd import open_ssd_tier
from mooncake.errors import InvalidArgumentError, MooncakeError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mooncake._fast.cuda import CudaRuntime


log = logging.getLogger("mooncake.store")


@instrument
class Store(_Admin):
    """A connected store client. Create with :func:`open_store`.

    The families are its bases, one module each: :mod:`~mooncake._store.moves` (state,
    buffers, replica moves), :mod:`~mooncake._store.tiering` (the SSD tier),
    :mod:`~mooncake._store.writes` (puts), :mod:`~mooncake._store.reads` (gets),
    :mod:`~mooncake._store.ranges` (ranges and sessions), :mod:`~mooncake._store.admin`
    (queries, removal, tasks, extra segments); this class adds the lifecycle.
    """

    metrics: StoreMetrics | None = None
    """This client's counters (see :mod:`mooncake._store.metrics`); None when off."""

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The registry of this client's and its engine's metrics (docs/metrics.md)."""
        return self.engine.metrics_registry

    async def _start(self, tg: anyio.abc.TaskGroup) -> None:
        eng = self.engine
        self._shm = ShmPeers(eng.segment_name)
        await self.master.connect()
        if self.local_buffer_size:
            self.local_buffer = await eng.allocate(self.local_buffer_size)
            self._staging = RangeAllocator(self.local_buffer.length)
        if self.segment_size and device_of(self.segment_location) is not None:
            # device memory: no memfd, no ShmServer -- every peer goes through its engine
            dm = await eng.allocate(self.segment_size, location=self.segment_location)
            assert isinstance(dm, DeviceMemory)
            self.device_segment = dm
            self.mounted = st.Segment(
                id=str(uuid.uuid4()),
                name=eng.segment_name,
                base=dm.addr,
                size=dm.length,
                te_endpoint=eng.segment_name,
                protocol="tcp",
                location=self.segment_location,
            )
        elif self.segment_size:
            seg = SharedSegment(self.segment_size)
            self.segment = seg
            await anyio.to_thread.run_sync(seg.prefault)
            region = await eng.register((seg.addr, seg.size))
            region.owner = seg
            if self._shm.enabled:
                await tg.start(ShmServer(seg, eng.segment_name).serve)
            self.mounted = st.Segment(
                id=str(uuid.uuid4()),
                name=eng.segment_name,
                base=seg.addr,
                size=seg.size,
                te_endpoint=eng.segment_name,
                protocol="tcp",
            )
        if self.mounted is not None:
            await self.master.call(
                "MountSegment",
                rpc.MountSegmentParams(client_id=self.client_id, segment=self.mounted),
            )
        self._tg = tg
        # One heartbeat now (its answer needs nothing: a pure client is registered by it, a
        # mounted one is known): with the mount, this connection is already this client's
        # heartbeat connection, whose close tells the master at once that we are gone. From
        # now on every reconnection says "alive" first (MasterConnection.hello).
        hello = rpc.ClientParams(client_id=self.client_id)
        await self.master.call("Ping", hello)
        self.master.hello = hello
        if self.ssd is not None:
            await self._start_ssd()
            tg.start_soon(self._tier_loop)
        tg.start_soon(self._heartbeat)
        tg.start_soon(self.master.follow)  # an HA address: follow the leader key
        if self.mounted is not None:
            tg.start_soon(self._task_loop)
        self._started = True

    async def _remount(self) -> None:
        """After ``NEED_REMOUNT`` (the master restarted, or expired this client): mount the
        segment again and re-announce every object of the SSD tier (the master has forgotten
        them, and the version ids it gave them)."""
        segments = self.mounted_segments()
        if segments:
            await self.master.call(
                "ReMountSegment",
                rpc.ReMountSegmentParams(client_id=self.client_id, segments=segments),
            )
        if self.ssd is not None:
            async with self._tier_lock:
                self._unsettled.clear()
                self._disk_evictions.clear()  # versions the master no longer knows
                self._ssd_vid.clear()
                await self._announce_ssd(self.ssd.keys())

    async def _heartbeat(self) -> None:
        params = rpc.ClientParams(client_id=self.client_id)
        while True:
            await self.master.sleep_or_leader_change(HEARTBEAT_S)
            try:
                resp: st.PingResponse = await self.master.call("Ping", params)
                asked = resp.client_status == st.ClientStatus.NEED_REMOUNT
                asked, self.master.remount_asked = asked or self.master.remount_asked, False
                if asked and (self.mounted_segments() or self.ssd is not None):
                    log.warning("master asked %s to remount its segment", self.client_id)
                    await self._remount()
            except MooncakeError as e:
                log.warning("heartbeat to the master at %s failed: %s", self.master_address, e)

    async def _aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            for seg in self.mounted_segments():
                try:
                    with anyio.move_on_after(2):
                        await self.master.call(
                            "UnmountSegment",
                            rpc.UnmountSegmentParams(client_id=self.client_id, segment_id=seg.id),
                        )
                except MooncakeError as e:
                    # after a failed start the start's own error says it all: no second line
                    level = logging.WARNING if getattr(self, "_started", False) else logging.DEBUG
                    log.log(level, "unmounting from the master failed: %s", e)
            self._release_extra()
            with anyio.move_on_after(2):
                await self.master.aclose()
            self.master.close()
            self._shm.close()
            dm, self.device_segment = self.device_segment, None
            if dm is not None and not self.engine._closed:
                # a shared engine outlives the store: give the device memory back now
                await self.engine.unregister(dm)

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Drain this client's segments before leaving (:mod:`mooncake._store.draining`): no
        new replicas land on them, replicated objects are re-replicated elsewhere, sole copies
        moved where there is room, reads in flight finish; at most ``timeout_s`` (default 5 s,
        ``MC_STORE_DRAIN_TIMEOUT``). Close the store afterwards (that unmounts)."""
        self._check_open()
        return await drain(self, timeout_s)

    async def drain_on_signal(
        self, signals: Sequence[signal.Signals] = (signal.SIGTERM,), timeout_s: float | None = None
    ) -> DrainReport:
        """Wait for SIGTERM (or ``signals``; main thread only), then :meth:`drain`; returns the
        report. Run it in a task of the ``open_store`` block and leave the block after it."""
        self._check_open()
        return await drain_on_signal(self, signals, timeout_s)

    async def health(self) -> int:
        """0 healthy, 1 closed, 2 master unreachable (the published ``health_check`` codes)."""
        if self._closed:
            return 1
        try:
            with anyio.fail_after(5):
                await self.master.call("Ping", rpc.ClientParams(client_id=self.client_id))
        except (MooncakeError, TimeoutError):
            return 2
        return 0


@asynccontextmanager
async def open_store(
    master: str = "127.0.0.1:50051",
    *,
    hostname: str = "127.0.0.1",
    metadata: str = "P2PHANDSHAKE",
    segment_size: int = 16 << 20,
    local_buffer_size: int = 16 << 20,
    protocol: str = "tcp",
    engine: Engine | None = None,
    ssd_path: str | None = None,
    ssd_capacity: int = 0,
    ssd_policy: EvictionPolicy | str = "lru",
    promotion: Admission | str = "hits:2",
    ssd_direct_io: bool | None = None,
    ssd_sync: bool = True,
    segment_location: str = "cpu:0",
    cuda_runtime: CudaRuntime | None = None,
    metrics_port: int | None = None,
    tenant: str = "default",
    tenant_secret: str | None = None,
    verify: bool | None = None,
) -> AsyncIterator[Store]:
    """Connect to the master at ``master``, mount a segment and yield a :class:`Store`.

    ``master`` is ``host:port``, or ``etcd://host:port[;host:port...]`` for an HA cluster of
    masters: the client reads the leader from etcd (cluster id ``MC_STORE_CLUSTER_ID``), follows
    it across failovers and retries calls in flight there (:mod:`mooncake._store.master_conn`).

    ``segment_size`` 0 makes a pure client (contributes no memory); ``local_buffer_size`` 0
    disables the copying APIs' staging for remote replicas. Both are pre-faulted host memory
    (a ``cuda:N`` segment is not): sizes the machine cannot back now raise
    :class:`InvalidArgumentError` naming them and what is available
    (:mod:`mooncake._core.hostmem`; ``MC_MEMORY_CHECK=0`` skips the check). ``hostname`` is this client's
    address for peers (its engine binds it). Pass ``engine`` to share an existing engine (it is
    not closed on exit). On exit the segment is unmounted (objects stored in it disappear) and
    everything the client started stops.

    ``ssd_path`` (with ``ssd_capacity`` bytes) gives the client a local SSD tier
    (:mod:`mooncake._store.ssd`, evicting by ``ssd_policy``): objects the master evicts from this
    client's segment are demoted to it instead of dropped, gets of objects held only there are
    served from it (verified), and hits are promoted back to DRAM when ``promotion`` admits them
    (``"always"``, ``"never"``, ``"hits:N"``). Objects found in ``ssd_path`` at start are
    re-announced to the master (or dropped if their key was written again). See docs/tiers.md.

    ``segment_location`` ``"cuda:N"`` makes the segment GPU memory on device ``N`` (the GPU
    tier, see the module docstring); ``cuda_runtime`` is passed to the engine this opens (tests
    pass :class:`mooncake.testing.fake_cuda.FakeCudaRuntime`; ignored with ``engine``).

    ``metrics_port`` (default ``MC_METRICS_PORT``; ignored with ``engine``) serves
    :attr:`Store.metrics_registry` over HTTP on loopback (docs/metrics.md).

    ``tenant`` (``setup(tenant_id=...)``): the tenant whose keys this client reads and writes;
    another tenant's objects of the same key are other objects (docs/store.md, "Tenants").
    ``tenant_secret`` (default ``MOONCAKE_TENANT_SECRET``): this tenant's key derived from the
    cluster secret (:func:`mooncake._core.auth.tenant_key`), used instead of the cluster secret:
    the master then binds every connection of this client to ``tenant``, so it cannot act as
    another tenant (docs/security.md).

    ``verify`` turns verified reads on or off (default: ``MOONCAKE_STORE_CHECKSUM``, else
    :data:`mooncake._store.verify.DEFAULT`, off):
    writers record each value's CRC32C, every read checks the bytes it landed against it
    (:mod:`mooncake._store.verify`, docs/store.md).
    """
    if protocol not in ("tcp", "rdma", ""):
        raise InvalidArgumentError(f"protocol {protocol!r} is not supported (use 'tcp' or 'rdma')")
    # both are pre-faulted host memory: refuse at once what the machine cannot back
    host_segment = segment_size if device_of(segment_location) is None else 0
    check_backable(host_segment, "the segment (segment_size)")
    check_backable(local_buffer_size, "the local buffer (local_buffer_size)")
    check_backable(host_segment + local_buffer_size, "the segment and the local buffer together")
    store = Store(
        master,
        segment_size=segment_size,
        local_buffer_size=local_buffer_size,
        segment_location=segment_location,
    )
    store.admission = make_admission(promotion)
    bind_tenant(store.master, tenant, tenant_secret)
    if verify is not None:
        store.verify.enabled = verify
    async with AsyncExitStack() as stack:
        if ssd_path is not None:
            store.ssd = await stack.enter_async_context(
                open_ssd_tier(
                    ssd_path,
                    ssd_capacity,
                    policy=ssd_policy,
                    direct_io=ssd_direct_io,
                    sync=ssd_sync,
                    on_drop=store._on_ssd_drop,
                )
            )
        async with _open_with_engine(
            store, engine, hostname, metadata, cuda_runtime, metrics_port
        ) as opened:
            yield opened


def bind_tenant(master: MasterConnection, tenant: str, tenant_secret: str | None) -> None:
    """Set ``master``'s tenant and, with a tenant key, authenticate it as that tenant."""
    name = check_tenant(tenant)
    master.tenant = name
    key = tenant_secret if tenant_secret is not None else os.environ.get(auth.TENANT_SECRET_ENV)
    if key:
        if not name:
            raise InvalidArgumentError(
                f"{auth.TENANT_SECRET_ENV} is set but tenant_id is the default tenant: a tenant "
                "key authenticates a named tenant only"
            )
        master.secret = key.encode()
        master.auth_tenant = name


@asynccontextmanager
async def _open_with_engine(
    store: Store,
    engine: Engine | None,
    hostname: str,
    metadata: str,
    cuda_runtime: CudaRuntime | None = None,
    metrics_port: int | None = None,
) -> AsyncIterator[Store]:
    async with _engine_for(engine, hostname, metadata, cuda_runtime, metrics_port) as eng:
        store.engine = eng
        if eng.metrics is not None:
            store.metrics = StoreMetrics(store)
            eng.metrics_registry.register(store.metrics)
        try:
            with unwrapped():  # the block's exception and setup errors leave as themselves
                async with anyio.create_task_group() as tg:
                    try:
                        await store._start(tg)
                        yield store
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            if hasattr(store, "_shm"):
                await store._aclose()
            else:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await store.master.aclose()
                store.master.close()
            if store.metrics is not None:
                eng.metrics_registry.unregister(store.metrics)


@asynccontextmanager
async def _engine_for(
    engine: Engine | None,
    hostname: str,
    metadata: str,
    cuda_runtime: CudaRuntime | None = None,
    metrics_port: int | None = None,
) -> AsyncIterator[Engine]:
    if engine is not None:
        yield engine
        return
    async with open_engine(
        hostname, metadata, cuda_runtime=cuda_runtime, metrics_port=metrics_port
    ) as eng:
        yield eng


__all__ = ["Store", "open_store"]
