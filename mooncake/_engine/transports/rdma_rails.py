"""RDMA rail state: the NICs, endpoints, rail health and counters one transport owns.

:class:`Rails` holds what both the transport and a batch (``rdma_run.BatchRun``) work on:

* per local NIC (``_Nic``): a device context, a PD, one completion channel and one CQ, the
  compiled pump that reaps it and posts what rails queued, and a poller task;
* endpoints (``_Endpoint``): RC QPs from one local NIC to one peer NIC path, active ones
  (made by this side's handshake, :meth:`Rails.endpoint`) and passive ones (a peer's);
* the rail health (errors, pauses), the rail choice per slice class (:meth:`Rails.options`)
  and the event counters (``stats``).

:class:`RdmaConfig` (the tunables) lives here too, since the NICs are opened with it.
"""

from __future__ import annotations

import collections
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from mooncake._core.handshake import FrameType
from mooncake._core.rdma import (
    DEFAULT_FRAGMENT_RATIO,
    DEFAULT_RAIL_PAUSE_S,
    DEFAULT_RETRY_CNT,
    DEFAULT_SLICE_SIZE,
    ConnectionInfo,
    PriorityMatrix,
    RailHealth,
    RdmaSegment,
    decode_connection,
    decode_rdma_segment,
    nic_path,
)
from mooncake._engine.transports.base import EngineHost, PeerInfo
from mooncake._engine.transports.rdma_topology import discover
from mooncake._fast import verbs
from mooncake.errors import (
    MooncakeError,
    NotSupportedError,
    PeerUnreachableError,
    ProtocolError,
    VerbsError,
)

log = logging.getLogger("mooncake.rdma")

ACCESS = 1 | 2 | 4  # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
POLL_BATCH = 64
SIGNAL_EVERY = 16  # one signaled WR per 16 (and the last of every chain)
PUMP_BUDGET = 1 << 16  # WRs reaped + posted per pump run before yielding to the loop


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    try:
        return int(v) if v else default
    except ValueError:
        raise NotSupportedError(f"{name}={v!r} is not an integer") from None


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "")
    try:
        return float(v) if v else default
    except ValueError:
        raise NotSupportedError(f"{name}={v!r} is not a number") from None


@dataclass
class RdmaConfig:
    """Tunables, defaulting to Mooncake's environment variables and defaults."""

    devices: Sequence[str] | None = None  # None: every device (MC_TE_FILTERS narrows)
    slice_size: int = field(default_factory=lambda: _env_int("MC_SLICE_SIZE", DEFAULT_SLICE_SIZE))
    fragment_ratio: int = field(
        default_factory=lambda: _env_int("MC_FRAGMENT_RATIO", DEFAULT_FRAGMENT_RATIO)
    )
    num_qp_per_ep: int = field(default_factory=lambda: _env_int("MC_NUM_QP_PER_EP", 2))
    max_wr: int = field(default_factory=lambda: _env_int("MC_MAX_WR", 256))
    max_sge: int = field(default_factory=lambda: _env_int("MC_MAX_SGE", 4))
    max_inline: int = field(default_factory=lambda: _env_int("MC_MAX_INLINE", 64))
    max_cqe: int = field(default_factory=lambda: _env_int("MC_MAX_CQE_PER_CTX", 4096))
    ib_port: int = field(default_factory=lambda: _env_int("MC_IB_PORT", 1))
    gid_index: int = field(default_factory=lambda: _env_int("MC_GID_INDEX", -1))
    mtu: int = field(default_factory=lambda: _env_int("MC_MTU", 4096))
    traffic_class: int = field(default_factory=lambda: max(_env_int("MC_IB_TC", -1), 0))
    service_level: int = field(default_factory=lambda: max(_env_int("MC_IB_SL", -1), 0))
    retry_cnt: int = field(default_factory=lambda: _env_int("MC_RETRY_CNT", DEFAULT_RETRY_CNT))
    rail_pause_s: float = field(
        default_factory=lambda: _env_float("MC_RDMA_RAIL_PAUSE_SECONDS", DEFAULT_RAIL_PAUSE_S)
    )
    max_ep_per_ctx: int = field(default_factory=lambda: _env_int("MC_MAX_EP_PER_CTX", 65536))
    slice_timeout: float = field(default_factory=lambda: _env_float("MC_SLICE_TIMEOUT", 0.0))
    sysfs: str = "/sys"
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.devices is None:
            filt = os.environ.get("MC_TE_FILTERS", "")
            if filt:
                self.devices = [d for d in filt.split(",") if d]
        if self.slice_size <= 0 or self.fragment_ratio <= 0:
            raise NotSupportedError("MC_SLICE_SIZE and MC_FRAGMENT_RATIO must be positive")
        if not 1 <= self.num_qp_per_ep <= 64:
            raise NotSupportedError(f"MC_NUM_QP_PER_EP={self.num_qp_per_ep} outside [1, 64]")
        if self.max_wr < 1 or self.max_cqe < self.max_wr:
            raise NotSupportedError("MC_MAX_WR must be >= 1 and <= MC_MAX_CQE_PER_CTX")


class _Nic:
    """One local RDMA device and its PD, completion channel, CQ and poller."""

    def __init__(self, index: int, name: str, cfg: RdmaConfig) -> None:
        self.index = index
        self.name = name
        self.ctx = verbs.Context(name)
        try:
            port = self.ctx.query_port(cfg.ib_port)
            self.active = port["state"] == "ACTIVE"
            self.lid = int(port["lid"])
            self.link_layer = str(port["link_layer"])
            self.mtu = min(verbs.MTU_BYTES.get(port["active_mtu"], 1024), cfg.mtu)
            self.gid_index = self._pick_gid_index(cfg, int(port["gid_tbl_len"]))
            self.gid = self.ctx.query_gid(cfg.ib_port, self.gid_index)
            self.pd = verbs.PD(self.ctx)
            self.channel = verbs.CompChannel(self.ctx)
            self.cq = verbs.CQ(self.ctx, cfg.max_cqe, self.channel)
        except BaseException:
            self.ctx.close()
            raise
        self.pump: Any = None  # verbs.NicPump, made by the transport
        self.seen_posted = 0
        self.seen_completions = 0
        self.continuing = False
        self.scope: anyio.CancelScope | None = None

    def _pick_gid_index(self, cfg: RdmaConfig, table_len: int) -> int:
        if cfg.gid_index >= 0:
            return cfg.gid_index
        # auto (MC_GID_INDEX=-1): on RoCE prefer an IPv4-mapped GID (RoCE v2 over IPv4), else
        # the first non-zero entry; InfiniBand uses index 0
        if self.link_layer != "ETHERNET":
            return 0
        first = None
        for i in range(max(table_len, 1)):
            try:
                g = self.ctx.query_gid(cfg.ib_port, i)
            except VerbsError:
                continue
            if not any(g):
                continue
            if g[:10] == b"\0" * 10 and g[10:12] == b"\xff\xff":
                return i
            if first is None:
                first = i
        return first if first is not None else 0


class _Endpoint:
    """RC QPs from one local NIC to one peer NIC path; active ones post through ``rail``."""

    def __init__(self, nic: _Nic, peer_path: str, qps: list[Any], rail: Any = None) -> None:
        self.nic = nic
        self.peer_path = peer_path
        self.qps = qps
        self.rail = rail
        self.broken = False
        self.closed = False

    @property
    def inflight(self) -> int:
        return sum(q.inflight for q in self.qps)

    def mark_broken(self) -> None:
        self.broken = True
        if self.rail is not None:
            self.rail.set_broken()  # its queued slices go back to their batches

    def to_error(self) -> None:
        for q in self.qps:
            if not q.closed:
                try:
                    q.to_error()
                except MooncakeError as e:
                    log.debug("QP %d to ERR failed: %s", q.qp_num, e)

    def close(self) -> None:
        """Destroy the QPs; WRs they never completed are settled as flushed."""
        if self.closed:
            return
        self.closed = True
        if self.rail is not None:
            try:
                self.rail.close()
            except MooncakeError as e:  # the QPs are gone from our side either way
                log.warning("rdma: destroying the QPs to %s failed: %s", self.peer_path, e)
            return
        for q in self.qps:
            try:
                q.close()
            except MooncakeError as e:
                log.warning("rdma: destroying QP %d failed: %s", q.qp_num, e)


class Rails:
    """The rail state of one RDMA transport: its NICs, endpoints, rail health and counters.

    Owned by :class:`~mooncake._engine.transports.rdma.RdmaTransport` (lifecycle, memory,
    the passive handshake) and handed to every
    :class:`~mooncake._engine.transports.rdma_run.BatchRun` (one ``execute``), which use only
    its public members. A rail is (local NIC index, peer NIC path); at most one active
    endpoint per rail, created on first use (:meth:`endpoint`), retired on an error
    (:meth:`retire`) and destroyed once its last WR is reaped.
    """

    def __init__(self, host: EngineHost, cfg: RdmaConfig) -> None:
        self.host = host
        self.cfg = cfg
        self.nics: list[_Nic] = []
        self.matrix = PriorityMatrix({}, 0)
        self.health = RailHealth(pause=cfg.rail_pause_s)
        self.rng = random.Random(cfg.seed)
        self.batches: Any = None  # verbs.BatchEngine: the live batches, by WR cookie
        self.pump_budget = PUMP_BUDGET
        self.active: dict[tuple[int, str], _Endpoint] = {}
        self.connecting: dict[tuple[int, str], anyio.Event] = {}
        self.passive: collections.OrderedDict[tuple[int, str], _Endpoint] = (
            collections.OrderedDict()
        )
        self.draining: set[_Endpoint] = set()
        self.stats = collections.Counter[str]()

    def open(self, names: Sequence[str]) -> None:
        """Open the devices ``names`` (contexts, PDs, CQs) and read their topology; on an error
        close what was opened and raise."""
        try:
            for i, n in enumerate(names):
                nic = _Nic(i, n, self.cfg)
                self.nics.append(nic)
                if not nic.active:
                    log.warning("RDMA device %s: port %d is not ACTIVE", n, self.cfg.ib_port)
            self.matrix = discover(list(names), self.cfg.sysfs)
        except BaseException:
            self.close()
            raise

    def start_pollers(self) -> None:
        """Make the batch table and one compiled pump per NIC; start each NIC's poller in the
        engine's task group."""
        self.batches = verbs.BatchEngine()
        for nic in self.nics:
            nic.pump = verbs.NicPump(self.batches, nic.cq, POLL_BATCH, SIGNAL_EVERY)
            self.host.task_group.start_soon(self.poller, nic)

    def accepted(self, nic: _Nic, path: str, qps: list[Any]) -> None:
        """Keep the passive endpoint ``qps`` a peer connected to ``nic`` from ``path``
        (replacing an older one from the same path; the oldest go past ``MC_MAX_EP_PER_CTX``
        per NIC)."""
        key = (nic.index, path)
        old = self.passive.pop(key, None)
        if old is not None:
            old.close()  # the peer re-established: its side of the old QPs is gone
        self.passive[key] = _Endpoint(nic, path, qps)
        while len(self.passive) > self.cfg.max_ep_per_ctx * max(len(self.nics), 1):
            _, ep = self.passive.popitem(last=False)
            ep.close()
        self.stats["accepts"] += 1

    def close(self) -> None:
        for nic in self.nics:
            if nic.scope is not None:
                nic.scope.cancel()
            nic.ctx.close()  # closes QPs, MRs, CQ, channel, PD in that order
        self.nics.clear()
        self.active.clear()
        self.passive.clear()
        self.draining.clear()

    # -- peers and endpoints -------------------------------------------------------------

    def segment(self, peer: PeerInfo) -> RdmaSegment | None:
        """The peer's RDMA devices and matrices (``None`` if it has none), decoded once per
        descriptor and cached in ``peer.state``; raises ``ProtocolError`` if unusable."""
        cached = peer.state.get("rdma")
        if cached is not None and cached[0] is peer.descriptor:
            return cached[1]  # type: ignore[no-any-return]
        seg = decode_rdma_segment(peer.descriptor)
        peer.state["rdma"] = (peer.descriptor, seg)
        return seg

    def forget(self, peer: PeerInfo) -> None:
        """Retire every active endpoint to ``peer`` and drop its decoded descriptor."""
        prefix = peer.segment + "@"
        for key, ep in list(self.active.items()):
            if ep.peer_path.startswith(prefix):
                del self.active[key]
                self.retire(ep)
        peer.state.pop("rdma", None)

    def retire(self, ep: _Endpoint) -> None:
        """Stop using ``ep``; destroy it once its last WR is reaped."""
        ep.mark_broken()
        if self.active.get((ep.nic.index, ep.peer_path)) is ep:
            del self.active[(ep.nic.index, ep.peer_path)]
        if ep.inflight == 0:
            ep.close()
            self.draining.discard(ep)
        else:
            self.draining.add(ep)

    # -- completions ----------------------------------------------------------------------

    @property
    def inflight(self) -> range:
        """A sized stand-in for the set of WRs posted and not reaped (``len`` is their count)."""
        return range(sum(n.cq.inflight for n in self.nics if not n.cq.closed))

    async def poller(self, nic: _Nic) -> None:
        with anyio.CancelScope() as scope:
            nic.scope = scope
            while True:
                nic.cq.req_notify()
                # after arming: a completion racing the arm is not missed
                if self.pump(nic):
                    await anyio.lowlevel.checkpoint()  # budget used up: let others run
                    continue
                await anyio.wait_readable(nic.channel.fd)
                try:
                    nic.channel.get_events()
                except VerbsError as e:  # the CQ is drained after re-arming regardless
                    log.warning("rdma: %s: reading completion events failed: %s", nic.name, e)

    def pump(self, nic: _Nic) -> bool:
        """Reap ``nic``'s completions and post what its rails have queued (compiled loop);
        wake the batches that finished or need a decision. True if work is left."""
        pump = nic.pump
        more = bool(pump.run(self.pump_budget))
        self.stats["posted"] += pump.posted - nic.seen_posted
        self.stats["completions"] += pump.completions - nic.seen_completions
        nic.seen_posted = pump.posted
        nic.seen_completions = pump.completions
        for b in self.batches.take_woken():
            b.event.set()
        if self.draining:
            for ep in [e for e in self.draining if e.nic is nic and e.inflight == 0]:
                ep.close()
                self.draining.discard(ep)
        return more

    def post(self, nic: _Nic) -> None:
        """Post what a batch just queued on ``nic`` (the poller takes over if work is left)."""
        if self.pump(nic) and not nic.continuing:
            nic.continuing = True
            self.host.task_group.start_soon(self._continue, nic)

    async def _continue(self, nic: _Nic) -> None:
        try:
            while True:
                await anyio.lowlevel.checkpoint()
                if nic.cq.closed or not self.pump(nic):
                    return
        finally:
            nic.continuing = False

    def log_pause(self, nic: str, peer_path: str) -> None:
        self.stats["rail_pauses"] += 1
        log.warning(
            "rdma: rail %s -> %s paused for %.0f s after repeated errors",
            nic,
            peer_path,
            self.health.pause,
        )

    def log_refused(self, ep: _Endpoint, err: int) -> None:
        log.warning(
            "rdma: posting on %s -> %s failed: %s", ep.nic.name, ep.peer_path, os.strerror(err)
        )

    def log_never_completed(self, n: int) -> None:
        log.error("rdma: %d WRs never completed; destroying their QPs", n)

    # -- endpoints ------------------------------------------------------------------------

    def new_qps(self, nic: _Nic, n: int) -> list[Any]:
        qps: list[Any] = []
        try:
            for _ in range(n):
                qp = verbs.QP(
                    nic.pd,
                    nic.cq,
                    max_send_wr=self.cfg.max_wr,
                    max_send_sge=self.cfg.max_sge,
                    max_inline=self.cfg.max_inline,
                )
                qps.append(qp)
                qp.to_init(self.cfg.ib_port, 0, ACCESS)
        except BaseException:
            for q in qps:
                q.close()
            raise
        return qps

    def connect_qps(
        self, nic: _Nic, qps: list[Any], remote: ConnectionInfo, lid: int, gid: bytes
    ) -> None:
        for q, rq in zip(qps, remote.qp_num, strict=True):
            q.to_rtr(
                rq,
                lid,
                gid,
                port=self.cfg.ib_port,
                sgid_index=nic.gid_index,
                mtu=nic.mtu,
                traffic_class=self.cfg.traffic_class,
                sl=self.cfg.service_level,
            )
            q.to_rts()

    async def endpoint(self, nic: _Nic, peer: PeerInfo, seg: RdmaSegment, dev: int) -> _Endpoint:
        path = nic_path(peer.segment, seg.devices[dev].name)
        key = (nic.index, path)
        while True:
            ep = self.active.get(key)
            if ep is not None and not ep.broken:
                return ep
            ev = self.connecting.get(key)
            if ev is None:
                break
            await ev.wait()  # someone else is connecting this rail: use theirs (or retry)
            if key not in self.active:
                raise PeerUnreachableError(f"connecting {nic.name} -> {path} failed")
        ev = anyio.Event()
        self.connecting[key] = ev
        try:
            ep = await self._handshake(nic, peer, seg, dev, path)
            self.active[key] = ep
            self.stats["connects"] += 1
            return ep
        finally:
            del self.connecting[key]
            ev.set()

    async def _handshake(
        self, nic: _Nic, peer: PeerInfo, seg: RdmaSegment, dev: int, path: str
    ) -> _Endpoint:
        from mooncake._engine import handshake

        qps = self.new_qps(nic, self.cfg.num_qp_per_ep)
        try:
            req = ConnectionInfo(
                nic_path(self.host.segment_name, nic.name),
                path,
                tuple(q.qp_num for q in qps),
                nic.lid,
                nic.gid,
            )
            frame = await handshake.request(
                peer.rpc_host, peer.rpc_port, FrameType.CONNECTION, req.to_json()
            )
            reply = decode_connection(frame.json())
            if reply.reply_msg:
                raise PeerUnreachableError(f"{path} refused the RDMA connection: {reply.reply_msg}")
            if len(reply.qp_num) != len(qps):
                raise ProtocolError(
                    f"{path} answered {len(reply.qp_num)} QP numbers for our {len(qps)}"
                )
            d = seg.devices[dev]
            lid = reply.lid if reply.lid is not None else d.lid
            gid = reply.gid if reply.gid is not None else d.gid
            self.connect_qps(nic, qps, reply, lid, gid)
        except BaseException:
            for q in qps:
                q.close()
            raise
        return _Endpoint(nic, path, qps, verbs.Rail(nic.pump, qps))

    def options(
        self,
        location: str,
        buf_location: str,
        retry: int,
        peer: PeerInfo,
        seg: RdmaSegment,
        now: float,
    ) -> list[tuple[int, list[int]]]:
        """For one (memory location, target location, retry): the usable local NICs in the
        order ``selectDevice`` tries them, each with its candidate peer devices (on a first try
        the usable preferred ones, one is drawn per slice; on retries the one rotation picks)."""
        active = [n.index for n in self.nics if n.active]
        out: list[tuple[int, list[int]]] = []
        tried: set[int] = set()
        pref, avail = seg.matrix.candidates(buf_location)
        while len(tried) < len(active):
            li = self.matrix.select(
                location, retry, self.rng, [a for a in active if a not in tried]
            )
            if li is None:
                break
            tried.add(li)
            ok = {
                d
                for d, dev in enumerate(seg.devices)
                if not self.health.paused((li, nic_path(peer.segment, dev.name)), now)
            }
            if retry == 0:
                choices = [d for d in pref if d in ok] or [d for d in avail if d in ok]
            else:
                pi = seg.matrix.select(buf_location, retry, self.rng, ok)
                choices = [] if pi is None else [pi]
            if choices:
                out.append((li, choices))
        if retry == 0:  # first tries spray over the preferred local NICs only, if any is usable
            pref_local = self.matrix.candidates(location)[0]
            out = [o for o in out if o[0] in pref_local] or out
        return out


__all__ = ["ACCESS", "Rails", "RdmaConfig"]
