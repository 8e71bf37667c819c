"""The ``rdma`` transport: one-sided RDMA WRITE/READ over RC queue pairs, Mooncake's RDMA mode.

The rail state (NICs, endpoints, rail health, counters) is a
:class:`~mooncake._engine.transports.rdma_rails.Rails` this transport owns and hands to each
batch (``rdma_run.BatchRun``). Per local NIC (``_Nic``): a device context, a PD, one completion channel and one CQ
(``MC_MAX_CQE_PER_CTX`` entries, whose slab also bounds the WRs in flight), and a poller task
that arms the CQ, drains it in batches and sleeps on the channel fd (``wait_readable``).
Every registered region gets an MR on every NIC; the descriptor publishes ``devices`` (name,
LID, GID), ``priority_matrix`` (NUMA/PCIe topology from sysfs) and per-buffer ``rkey``/``lkey``
arrays, field for field as the published engine does.

Endpoints: one per (local NIC, peer NIC path), ``MC_NUM_QP_PER_EP`` RC QPs, created on first
use: the active side sends a Connection frame (type 0) with its NIC paths, QP numbers, LID and
GID; the passive side builds as many QPs, connects them (INIT -> RTR -> RTS with Mooncake's
attributes) and replies with its own. Any error completion puts a QP in ERR, so the endpoint is
marked broken, drained (its remaining WRs flush) and destroyed; the next slice for that rail
re-handshakes a fresh one.

A batch is cut into slices (``MC_SLICE_SIZE``, tail merge, never across a region); each slice
picks its local NIC from the local topology for the memory's location and its peer NIC from the
peer's matrix for the target buffer's location (random among the preferred on the first try,
rotating over all on retries), skipping paused rails. Failed slices are retried up to
``MC_RETRY_CNT`` times on other rails; ``RAIL_ERROR_THRESHOLD`` errors within 5 s pause a rail
for ``MC_RDMA_RAIL_PAUSE_SECONDS``. A remote access error refreshes the peer's descriptor once
(its buffer may have been re-registered with a new rkey) before it fails the request.

Cancellation: posted WRs cannot be recalled. A cancelled ``execute`` stops posting, moves the
QPs it used to ERR (their WRs flush at once) and waits, shielded, for every completion before
returning, so no NIC touches the batch's memory afterwards.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

from mooncake._core.handshake import Frame, FrameType
from mooncake._core.memory import Region
from mooncake._core.rdma import (
    ConnectionInfo,
    decode_connection,
    format_gid,
    nic_path,
    split_nic_path,
)
from mooncake._core.transfer import (
    TransferRequest,
    TransferResult,
)
from mooncake._engine.transports.base import EngineHost, PeerInfo, Transport
from mooncake._engine.transports.rdma_rails import ACCESS, Rails, RdmaConfig, _Nic
from mooncake._engine.transports.rdma_run import BatchRun
from mooncake._fast import verbs
from mooncake.errors import (
    MooncakeError,
    ProtocolError,
    VerbsUnavailableError,
)

log = logging.getLogger("mooncake.rdma")


class RdmaTransport(Transport):
    """Mooncake's RDMA transport over the verbs layer (any libibverbs provider)."""

    name = "rdma"
    priority = 20
    wire_protocol = "rdma"

    def __init__(self, engine: EngineHost, config: RdmaConfig | None = None, **kwargs: Any) -> None:
        super().__init__(engine)
        self.cfg = config or RdmaConfig(**kwargs)
        self.rails = Rails(engine, self.cfg)

    @property
    def nics(self) -> list[_Nic]:
        """The local RDMA devices (opened at start)."""
        return self.rails.nics

    @property
    def stats(self) -> collections.Counter[str]:
        """Event counters (posted, completions, retries, connects, accepts, timeouts,
        ``wc_<status>``, rail_pauses); the metrics read them."""
        return self.rails.stats

    @property
    def _inflight(self) -> range:
        """A sized stand-in for the set of WRs posted and not reaped (``len`` is their count)."""
        return self.rails.inflight

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if not verbs.AVAILABLE:
            raise VerbsUnavailableError(verbs.UNAVAILABLE_REASON)
        verbs.load()
        names = list(self.cfg.devices) if self.cfg.devices else verbs.get_device_list()
        if not names:
            raise VerbsUnavailableError("no RDMA devices found")
        self.rails.open(names)
        self.engine.handshake.handlers[FrameType.CONNECTION] = self._on_connection
        self.rails.start_pollers()
        log.info(
            "rdma: devices %s",
            ", ".join(f"{n.name}(lid {n.lid}, gid {format_gid(n.gid)})" for n in self.nics),
        )

    def descriptor_fields(self) -> dict[str, Any]:
        names = [n.name for n in self.nics]
        return {
            "devices": [
                {"name": n.name, "lid": n.lid, "gid": format_gid(n.gid)} for n in self.nics
            ],
            "priority_matrix": self.rails.matrix.to_json(names),
        }

    async def aclose(self) -> None:
        self.engine.handshake.handlers.pop(FrameType.CONNECTION, None)
        self.rails.close()

    # -- memory ---------------------------------------------------------------------------

    async def on_register(self, region: Region) -> None:
        mrs = []
        try:
            for nic in self.nics:
                mrs.append(
                    verbs.MR.from_address(nic.pd, region.addr, region.length, ACCESS, region.owner)
                )
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        region.meta["rdma_mrs"] = mrs
        desc = dict(region.meta.get("desc", {}))
        desc["lkey"] = [mr.lkey for mr in mrs]
        desc["rkey"] = [mr.rkey for mr in mrs]
        region.meta["desc"] = desc

    async def on_unregister(self, region: Region) -> None:
        for mr in region.meta.pop("rdma_mrs", []):
            mr.close()
        desc = dict(region.meta.get("desc", {}))
        desc.pop("lkey", None)
        desc.pop("rkey", None)
        region.meta["desc"] = desc

    # -- peers ----------------------------------------------------------------------------

    def can_reach(self, peer: PeerInfo) -> bool:
        try:
            seg = self.rails.segment(peer)
        except ProtocolError as e:
            log.warning("%s: unusable RDMA descriptor: %s", peer.segment, e)
            return False
        return seg is not None and any(n.active for n in self.nics)

    def forget_peer(self, peer: PeerInfo) -> None:
        self.rails.forget(peer)

    async def _on_connection(self, frame: Frame) -> Any:
        """Passive side of the endpoint handshake."""
        r = self.rails
        try:
            info = decode_connection(frame.json())
            if info.reply_msg:
                raise ProtocolError("a connection request must not carry reply_msg")
            _, dev = split_nic_path(info.peer_nic_path)
            nic = next((n for n in self.nics if n.name == dev), None)
            if nic is None or not nic.active:
                return {"reply_msg": f"no active RDMA device {dev!r} here"}
            lid, gid = info.lid, info.gid
            if lid is None or gid is None:  # older engines: look the device up in their descriptor
                pseg_name, pdev = split_nic_path(info.local_nic_path)
                pinfo = await self.engine.peer(pseg_name)
                pseg = r.segment(pinfo)
                idx = pseg.device_index(pdev) if pseg else None
                if pseg is None or idx is None:
                    return {"reply_msg": f"device {pdev!r} not in {pseg_name}'s descriptor"}
                lid = pseg.devices[idx].lid if lid is None else lid
                gid = pseg.devices[idx].gid if gid is None else gid
            qps = r.new_qps(nic, len(info.qp_num))
            try:
                r.connect_qps(nic, qps, info, lid, gid)
            except BaseException:
                for q in qps:
                    q.close()
                raise
        except MooncakeError as e:
            log.warning("rdma: refused a connection request: %s", e)
            return {"reply_msg": str(e)[:512]}
        r.accepted(nic, info.local_nic_path, qps)
        return ConnectionInfo(
            nic_path(self.engine.segment_name, nic.name),
            info.local_nic_path,
            tuple(q.qp_num for q in qps),
            nic.lid,
            nic.gid,
        ).to_json()

    # -- transfers ------------------------------------------------------------------------

    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        return await BatchRun(self.rails, peer, self.rails.segment(peer), requests).execute()


__all__ = ["RdmaConfig", "RdmaTransport"]
