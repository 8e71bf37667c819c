"""``mooncake.engine``: the published Mooncake Transfer Engine API, synchronous.

A drop-in for the published wheel's ``mooncake.engine.TransferEngine``: same method names,
arguments and int return codes (0 ok, -1 failure; ``batch_id`` 0 = failure;
``transfer_check_status`` 1 done / 0 in progress / -1 failed / -2 timed out). Underneath, the
async engine (:func:`mooncake.open_engine`) runs on a background loop thread.

Differences from the published engine, on purpose:

* local buffers passed to transfers must lie inside registered memory (``register_memory`` or
  ``allocate_managed_buffer``); the published TCP path reads any address, which turns a caller's
  bug into silent corruption;
* servers bind the host given to ``initialize`` (loopback stays loopback);
* the ``protocol`` argument is honoured for ``tcp``; other names fall back to the transports
  this machine has (as the published non-EFA builds do), and the choice is logged;
  ``MOONCAKE_TRANSPORTS=a,b`` overrides both.

Small synchronous transfers (host memory, tcp or shm, a peer already contacted) run on the
calling thread without a crossing to the loop thread (:mod:`mooncake._engine.syncpath`;
``MOONCAKE_SYNC_FASTPATH=0`` sends everything through the loop); results, bounds, pinning and
timeouts are the same either way.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from mooncake._core.transfer import Opcode, TransferRequest, TransferResult
from mooncake._engine import syncpath
from mooncake._engine import telemetry as _tel
from mooncake._engine.engine import Buffer, Engine, open_engine
from mooncake._engine.telemetry import TransferTelemetry
from mooncake._sync import LoopThread, close_at_exit, close_in_background, forget_at_exit
from mooncake.errors import InvalidArgumentError, MooncakeError

log = logging.getLogger("mooncake.engine")

SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False


class TransferOpcode(enum.IntEnum):
    """``mooncake.engine.TransferOpcode``: ``Read=0``, ``Write=1``."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` and ``msg`` (read-write, as in the published class)."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _timeout_base() -> float:
    """``MC_TRANSFER_TIMEOUT`` in seconds (default 30, at least 5), read at ``initialize`` as
    the published engine does."""
    try:
        base = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
    except ValueError:
        base = 30.0
    return max(base, 5.0)


def _timeout_s(length: int, base: float | None = None) -> float:
    """The deadline of a transfer: ``MC_TRANSFER_TIMEOUT`` plus 1 ns per byte, as published."""
    return (_timeout_base() if base is None else base) + length * 1e-9


# opcode ints (and the enum members, equal to them) -> the engine's opcodes, without an enum call
_OPCODES: dict[int, Opcode] = {0: Opcode.READ, 1: Opcode.WRITE}


@dataclass
class _Batch:
    future: Future[list[TransferResult]]
    length: int
    results: list[TransferResult] | None = field(default=None)
    telemetry: list[TransferTelemetry | None] = field(default_factory=list)


class TransferEngine:
    """The published ``TransferEngine``; call :meth:`initialize` first."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._loop: LoopThread | None = None
        self._engine: Engine | None = None
        self._owns_loop = True  # False for the view a store's get_engine() returns
        self._exit_token: int | None = None
        self._managed: dict[int, Buffer] = {}
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count(1)
        self._fast: syncpath.SyncPath | None = None
        self._tbase = 30.0
        # batch id -> its telemetry box, kept after the batch is freed (bounded, oldest out)
        self._telemetry: collections.OrderedDict[int, list[TransferTelemetry | None]] = (
            collections.OrderedDict()
        )
        self._sync_telemetry = threading.local()

    # -- lifecycle ------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Start the engine. 0 on success, -1 on failure (the reason is logged)."""
        return self._init(local_hostname, metadata_server, protocol)

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """Like :meth:`initialize` with the connection string ``metadata_type://metadata_server``."""
        conn = metadata_server
        if metadata_type and metadata_server.upper() != "P2PHANDSHAKE":
            conn = f"{metadata_type}://{metadata_server}"
        return self._init(local_hostname, conn, protocol)

    def _init(self, hostname: str, metadata: str, protocol: str) -> int:
        if self._engine is not None:
            log.error("initialize: engine already initialized")
            return -1
        transports = ["tcp"] if (protocol or "tcp").lower() == "tcp" else None
        if os.environ.get("MOONCAKE_TRANSPORTS", "").strip():
            transports = None  # the explicit list wins (open_engine reads it)
        elif transports is None:
            log.warning("protocol %r: using the transports available here", protocol)
        self._tbase = _timeout_base()
        loop = LoopThread(name="mooncake-engine")
        try:
            self._engine = loop.enter(
                open_engine(
                    hostname or "127.0.0.1", metadata or "P2PHANDSHAKE", transports=transports
                )
            )
        except (MooncakeError, OSError) as e:
            log.error("initialize failed: %s", e)
            loop.close()
            return -1
        self._loop = loop
        if syncpath.enabled():
            self._fast = syncpath.SyncPath(self._engine, loop)
        self._exit_token = close_at_exit(self)
        return 0

    def close(self) -> None:
        """Stop the engine and its loop thread (not in the published API; idempotent). The
        view of a store's engine (``MooncakeDistributedStore.get_engine()``) only lets go."""
        fast, self._fast = self._fast, None
        loop, self._loop = self._loop, None
        self._engine = None
        forget_at_exit(self._exit_token)
        if fast is not None:
            fast.close()
        if loop is not None and self._owns_loop:
            loop.close()

    def __del__(self) -> None:
        # never blocks: at interpreter exit the atexit hook has closed it already
        if getattr(self, "_loop", None) is not None and getattr(self, "_owns_loop", False):
            close_in_background(self.close)

    def _e(self) -> tuple[LoopThread, Engine]:
        if self._loop is None or self._engine is None:
            raise MooncakeError("TransferEngine is not initialized")
        return self._loop, self._engine

    # -- metrics (not in the published API; docs/metrics.md) -----------------------------

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The engine's ``prometheus_client`` ``CollectorRegistry`` (add ``.metrics`` of the
        engine to your own registry instead with ``registry.register(...)``)."""
        return self._e()[1].metrics_registry

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve the engine's metrics over HTTP until it closes; returns the port.
        ``MC_METRICS_PORT`` starts the same exporter at ``initialize``."""
        return self._e()[1].serve_metrics(port, host)

    # -- info -----------------------------------------------------------------------------

    def get_rpc_port(self) -> int:
        return self._e()[1].rpc_port

    def get_local_topology(self, device_name: str | None = None) -> str:
        """This host's RDMA topology as Mooncake's JSON matrix (``{}`` without RDMA devices);
        ``device_name`` (comma-separated) keeps only those devices."""
        from mooncake._engine.transports.rdma_topology import local_topology_json

        return local_topology_json(device_name)

    def get_engine(self) -> TransferEngine:
        return self

    def get_engine_ptr(self) -> int:
        return id(self)

    def get_first_buffer_address(self, segment_name: str) -> int:
        loop, engine = self._e()
        try:
            if segment_name == engine.segment_name:
                regions = engine.registry.regions()
                return regions[0].addr if regions else 0
            peer = loop.call(engine.peer, segment_name)
            return peer.descriptor.buffers[0].addr if peer.descriptor.buffers else 0
        except MooncakeError as e:
            log.error("get_first_buffer_address(%s): %s", segment_name, e)
            return 0

    def warmup_efa_segment(self, segment_name: str) -> int:
        return 0

    # -- memory ---------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        loop, engine = self._e()
        try:
            loop.call(_register, engine, buffer_addr, capacity, location)
            return 0
        except MooncakeError as e:
            log.error("register_memory(%#x, %d): %s", buffer_addr, capacity, e)
            return int(e.code) if int(e.code) < 0 else -1

    def unregister_memory(self, buffer_addr: int) -> int:
        loop, engine = self._e()
        try:
            loop.call(engine.unregister, buffer_addr)
            return 0
        except MooncakeError as e:
            log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return -1

    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int:
        if len(buffer_addresses) != len(capacities):
            log.error(
                "batch_register_memory: %d addresses, %d capacities",
                len(buffer_addresses),
                len(capacities),
            )
            return -1
        for a, c in zip(buffer_addresses, capacities, strict=True):
            rc = self.register_memory(a, c, location)
            if rc:
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        rc = 0
        for a in buffer_addresses:
            rc = self.unregister_memory(a) or rc
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate and register ``length`` bytes; the address, or 0 on failure."""
        loop, engine = self._e()
        try:
            buf = loop.call(engine.allocate, length)
        except (MooncakeError, OSError) as e:
            log.error("allocate_managed_buffer(%d): %s", length, e)
            return 0
        self._managed[buf.addr] = buf
        return buf.addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        loop, engine = self._e()
        buf = self._managed.pop(buffer_addr, None)
        if buf is None:
            log.error("free_managed_buffer: %#x was not allocated here", buffer_addr)
            return -1
        loop.call(engine.unregister, buf)
        return 0

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        if length > len(src):
            return -1
        region = self._e()[1].registry.find(dest_address, length)
        if region is None:
            log.error("write_bytes_to_buffer: [%#x, +%d) not registered", dest_address, length)
            return -1
        ctypes.memmove(dest_address, src, length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        region = self._e()[1].registry.find(source_address, length)
        if region is None:
            log.error("read_bytes_from_buffer: [%#x, +%d) not registered", source_address, length)
            return b""
        return ctypes.string_at(source_address, length)

    # -- transfers ------------------------------------------------------------------------

    def _requests(
        self,
        opcode: int,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> list[TransferRequest]:
        if not (len(buffers) == len(peer_addresses) == len(lengths)):
            raise InvalidArgumentError(
                f"list lengths differ: {len(buffers)} buffers, {len(peer_addresses)} peer "
                f"addresses, {len(lengths)} lengths"
            )
        op = Opcode(int(opcode))
        return [
            TransferRequest(op, b, p, n)
            for b, p, n in zip(buffers, peer_addresses, lengths, strict=True)
        ]

    def _sync(
        self,
        target: str,
        reqs: list[TransferRequest],
        notify: TransferNotify | None = None,
    ) -> int:
        loop, engine = self._e()
        timeout = _timeout_s(sum(r.length for r in reqs), self._tbase)
        box: list[TransferTelemetry | None] = []
        try:
            results = loop.call(_transfer_with_deadline, engine, target, reqs, timeout, box)
        except (MooncakeError, TimeoutError) as e:
            self._sync_telemetry.last = box
            log.error("transfer to %s failed: %s", target, e)
            return -1
        self._sync_telemetry.last = box
        bad = [r for r in results if not r.ok]
        return self._finish(target, bad, len(results), notify)

    def _finish(
        self, target: str, bad: list[TransferResult], n: int, notify: TransferNotify | None
    ) -> int:
        if bad:
            log.error(
                "transfer to %s: %d/%d requests failed: %s", target, len(bad), n, bad[0].error
            )
            return -1
        if notify is not None:
            loop, engine = self._e()
            try:
                loop.call(engine.notify, target, notify.name, notify.msg)
            except MooncakeError as e:
                log.error("notify to %s failed: %s", target, e)
                return -1
        return 0

    def _sync_lists(
        self,
        target: str,
        opcode: int,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
        notify: TransferNotify | None,
    ) -> int:
        """A sync batch: on the calling thread when small and simple, else through the loop."""
        fast = self._fast
        bad: list[TransferResult] | None = None
        if fast is not None:
            try:
                op = _OPCODES.get(opcode) if type(opcode) is not bool else None
                same = len(buffers) == len(peer_addresses) == len(lengths)
                timeout = _timeout_s(sum(lengths), self._tbase) if op is not None and same else None
            except TypeError:  # unhashable opcode, lengths that are not numbers...
                timeout = None
            if timeout is not None:
                assert op is not None
                try:
                    bad = fast.transfer(target, op, buffers, peer_addresses, lengths, timeout)
                except (MooncakeError, TimeoutError) as e:
                    log.error("transfer to %s failed: %s", target, e)
                    return -1
            if bad is not None:
                return self._finish(target, bad, len(lengths), notify)
        try:
            reqs = self._requests(opcode, buffers, peer_addresses, lengths)
        except (MooncakeError, ValueError) as e:
            log.error("batch_transfer_sync: %s", e)
            return -1
        return self._sync(target, reqs, notify)

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, Write, [buffer], [peer_buffer_address], [length], None
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, Read, [buffer], [peer_buffer_address], [length], None
        )

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, opcode, [buffer], [peer_buffer_address], [length], notify
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, Write, buffers, peer_buffer_addresses, lengths, None
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, Read, buffers, peer_buffer_addresses, lengths, None
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        return self._sync_lists(
            target_hostname, opcode, buffers, peer_buffer_addresses, lengths, notify
        )

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Write
        )

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Read
        )

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: int,
        transport_hint: str = "",
    ) -> int:
        """Submit a batch; its id (> 0), or 0 on failure."""
        loop, engine = self._e()
        try:
            reqs = self._requests(opcode, buffers, peer_buffer_addresses, lengths)
            engine._validate(reqs)
        except (MooncakeError, ValueError) as e:
            log.error("batch_transfer_async: %s", e)
            return 0
        total = sum(r.length for r in reqs)
        timeout = _timeout_s(total, self._tbase)
        box: list[TransferTelemetry | None] = []
        fut = loop.submit(_transfer_with_deadline, engine, target_hostname, reqs, timeout, box)
        bid = next(self._ids)
        self._batches[bid] = _Batch(fut, total, telemetry=box)
        tel = self._telemetry
        tel[bid] = box
        cap = engine.telemetry.capacity if engine.telemetry is not None else 0
        while len(tel) > cap:
            tel.popitem(last=False)
        return bid

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        return self.batch_transfer_async(
            target_hostname, [buffer], [peer_buffer_address], [length], Write
        )

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Wait for every listed batch and free it; 0 if all completed, else -1."""
        rc = 0
        for bid in batch_ids:
            batch = self._batches.pop(bid, None)
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %d", bid)
                rc = -1
                continue
            try:
                results = batch.future.result()
            except (MooncakeError, TimeoutError) as e:
                log.error("batch %d failed: %s", bid, e)
                rc = -1
                continue
            if not all(r.ok for r in results):
                rc = -1
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed (freed), 0 in progress, -1 failed (freed), -2 timed out (freed)."""
        batch = self._batches.get(batch_id)
        if batch is None:
            return -1
        if not batch.future.done():
            # The loop ends the batch at its deadline (TimeoutError: -2 below) once no transport
            # touches its memory any more; answering -2 before that would free the caller's
            # buffers under a running batch.
            return 0
        self._batches.pop(batch_id, None)
        try:
            results = batch.future.result()
        except TimeoutError:
            return -2
        except (MooncakeError, Exception):
            return -1
        return 1 if all(r.ok for r in results) else -1

    # -- telemetry -------------------------------------------------------------------------

    def get_transfer_telemetry(self, batch_id: int = 0) -> dict[str, Any] | None:
        """The telemetry of batch ``batch_id`` (from :meth:`batch_transfer_async`), or with
        ``0`` of this thread's last synchronous transfer: a dict with NIXL's
        ``getXferTelemetry`` fields (``start_time``, ``post_duration``, ``xfer_duration``,
        ``total_bytes``, ``desc_count``) and this engine's (``queued_s``, ``posted_s``,
        ``wire_s``, ``completed_s``, ``groups`` of transport/NIC/bytes, ``retries``,
        ``verdict``, ``error``; docs/metrics.md). ``None`` for an unknown or unfinished batch,
        one that left the ring, or with telemetry off (``MOONCAKE_TRANSFER_TELEMETRY_RING=0``)."""
        _, engine = self._e()
        tel = engine.telemetry
        if tel is None:
            return None
        rec: TransferTelemetry | None = None
        if batch_id == 0:
            box = getattr(self._sync_telemetry, "last", None)
            fast = tel.last_sync()
            rec = box[0] if box else None
            if fast is not None and (rec is None or fast.t0 > rec.t0):
                rec = fast
        else:
            box = self._telemetry.get(batch_id)
            rec = box[0] if box else None
        return rec.as_dict() if rec is not None else None

    def get_slowest_transfers(self, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` slowest batches the ring holds, slowest first (see
        :meth:`get_transfer_telemetry` for the fields)."""
        _, engine = self._e()
        tel = engine.telemetry
        return [r.as_dict() for r in tel.slowest(n)] if tel is not None else []

    # -- notifications / probe ------------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        _, engine = self._e()
        return [TransferNotify(n.name, n.msg) for n in engine.get_notifies()]

    def send_probe(self, peer_server_name: str) -> int:
        loop, engine = self._e()
        return 0 if loop.call(engine.probe, peer_server_name) else -1


async def _register(engine: Engine, addr: int, length: int, location: str) -> None:
    await engine.register((addr, length), location=location)


async def _transfer_with_deadline(
    engine: Engine,
    target: str,
    reqs: list[TransferRequest],
    seconds: float,
    box: list[TransferTelemetry | None] | None = None,
) -> list[TransferResult]:
    try:
        with anyio.fail_after(seconds):
            return await engine.transfer(target, reqs)
    except TimeoutError:
        rec = _tel.CURRENT.get()
        if rec is not None:
            rec.verdict = "timed_out"
        raise
    finally:
        if box is not None:
            box.append(_tel.CURRENT.get())


__all__ = [
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "Read",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "Write",
]
