"""One RDMA ``execute``: the Python half of a batch, around the compiled :class:`SliceBatch`.

The compiled batch (``mooncake/_fast/_rdma_batch.pyx``) cuts the requests into slices, picks
each slice's rail from the tables given here, posts WR chains and counts completions; this
side runs once per batch event, never per slice on the success path:

* before the first post and whenever slices come back new: rail tables per (location class,
  retry) from the topology matrices and rail health (:meth:`~mooncake._engine.transports.rdma_rails.Rails.options`),
  endpoints for the rails the batch chose (handshakes), then one pump of each NIC used;
* on an error event: classify each failed slice as today (a flushed WR is resent without
  counting a try, a remote access error refreshes the peer's descriptor once, any other error
  counts against the rail and retries elsewhere up to ``MC_RETRY_CNT``), retire the endpoint;
* at the end: per-request results from the batch's counters.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import anyio

from mooncake._core.descriptor import BufferDesc
from mooncake._core.memory import Region
from mooncake._core.rdma import RdmaSegment, nic_path
from mooncake._core.transfer import (
    Opcode,
    TransferRequest,
    TransferResult,
    TransferStatus,
    completed,
    failed,
)
from mooncake._engine.transports.base import PeerInfo
from mooncake._engine.transports.rdma_rails import Rails, _Endpoint
from mooncake._fast import verbs
from mooncake.errors import (
    MooncakeError,
    NotRegisteredError,
    NotSupportedError,
    PeerDiedError,
    PeerUnreachableError,
    ProtocolError,
    RemoteAccessError,
    TransferError,
    TransferTimeoutError,
)

_ACCESS_STATUSES = frozenset(
    (
        verbs.WC_REM_ACCESS_ERR,
        verbs.WC_LOC_PROT_ERR,
        verbs.WC_LOC_LEN_ERR,
        verbs.WC_REM_OP_ERR,
        9,  # REM_INV_REQ_ERR
    )
)
CANCEL_GRACE_S = 10.0


class BatchRun:
    """State of one ``execute`` that stays in Python: per-request errors, endpoints used.

    It works on the transport's :class:`~mooncake._engine.transports.rdma_rails.Rails` (the
    NICs, endpoints, rail health and counters), through its public members only.
    """

    def __init__(
        self,
        rails: Rails,
        peer: PeerInfo,
        seg: RdmaSegment | None,
        requests: Sequence[TransferRequest],
    ) -> None:
        self.rails = rails
        self.peer = peer
        self.seg = seg
        self.requests = requests
        n = len(requests)
        self.errors: list[MooncakeError | None] = [None] * n
        self.timed_out: set[int] = set()
        self.endpoints: set[_Endpoint] = set()
        self.eps: dict[int, _Endpoint] = {}  # rail index (li * npeer + pi) -> endpoint
        self.connect_errors: dict[int, MooncakeError] = {}
        self.need_refresh = False
        self.classes: dict[tuple[str, str], int] = {}
        self.class_keys: list[tuple[str, str]] = []
        self.regions: list[Region | None] = [None] * n
        self.npeer = len(seg.devices) if seg is not None else 1
        self.sb = self._build()
        self.sb.event = anyio.Event()

    # -- building -------------------------------------------------------------------------

    def _class(self, location: str, buf_location: str) -> int:
        key = (location, buf_location)
        c = self.classes.get(key)
        if c is None:
            c = self.classes[key] = len(self.class_keys)
            self.class_keys.append(key)
        return c

    def _rkeys(self, buf: BufferDesc, seg: RdmaSegment) -> list[int]:
        out = []
        for d in range(len(seg.devices)):
            try:
                out.append(seg.rkey(buf, d, f"{self.peer.segment} buffer"))
            except ProtocolError:
                out.append(-1)
        return out

    def _build(self) -> Any:
        rails, peer, seg = self.rails, self.peer, self.seg
        nnic = max(len(rails.nics), 1)
        regions = rails.host.registry.regions()  # sorted; includes regions being unregistered
        starts = [g.addr for g in regions]
        laddr: list[int] = []
        raddr: list[int] = []
        length: list[int] = []
        opcode: list[int] = []
        cls: list[int] = []
        lkeys: list[int] = []
        rkeys: list[int] = []
        mrs: list[Any] = []
        unsupported = (
            NotSupportedError(f"{peer.segment} publishes no RDMA devices") if seg is None else None
        )
        rk_memo: dict[int, list[int]] = {}
        for i, r in enumerate(self.requests):
            j = bisect.bisect_right(starts, r.local_addr) - 1
            region = regions[j] if j >= 0 and regions[j].covers(r.local_addr, r.length) else None
            buf = peer.descriptor.find_buffer(r.remote_addr, r.length)
            ok = False
            if region is None or "rdma_mrs" not in region.meta:
                self.errors[i] = NotRegisteredError(
                    f"local [{r.local_addr:#x}, +{r.length}) is not registered for RDMA"
                )
            elif buf is None:
                self.errors[i] = RemoteAccessError(
                    f"{peer.segment}: [{r.remote_addr:#x}, +{r.length}) is not inside one of "
                    "its registered buffers"
                )
            elif unsupported is not None:
                self.errors[i] = unsupported
            else:
                ok = True
            laddr.append(r.local_addr)
            raddr.append(r.remote_addr)
            length.append(r.length)
            opcode.append(verbs.OP_READ if r.opcode is Opcode.READ else verbs.OP_WRITE)
            if ok:
                assert region is not None and buf is not None and seg is not None
                self.regions[i] = region
                region_mrs = region.meta["rdma_mrs"]
                mrs.append(region_mrs)
                lkeys.extend(mr.lkey for mr in region_mrs)
                rk = rk_memo.get(id(buf))
                if rk is None:
                    rk = rk_memo[id(buf)] = self._rkeys(buf, seg)
                rkeys.extend(rk)
                cls.append(self._class(region.location, buf.name))
            else:
                mrs.append(None)
                lkeys.extend([0] * nnic)
                rkeys.extend([-1] * self.npeer)
                cls.append(0)
        frag = rails.cfg.slice_size // rails.cfg.fragment_ratio
        return verbs.SliceBatch(
            rails.batches,
            laddr,
            raddr,
            length,
            opcode,
            cls,
            lkeys,
            rkeys,
            mrs,
            nnic,
            self.npeer,
            rails.cfg.slice_size,
            frag,
            rails.rng.getrandbits(64),
        )

    # -- the loop -------------------------------------------------------------------------

    async def execute(self) -> list[TransferResult]:
        sb, rails = self.sb, self.rails
        try:
            while True:
                self._classify()
                if self.need_refresh and not sb.outstanding:
                    self.need_refresh = False
                    await self._refresh()
                    continue
                if not self.need_refresh and sb.has_new():
                    await self._dispatch()
                    continue
                if sb.finished():
                    break
                if rails.cfg.slice_timeout > 0 and sb.outstanding:
                    with anyio.move_on_after(rails.cfg.slice_timeout) as waited:
                        await self._wait()
                    if waited.cancelled_caught:
                        self._time_out()
                else:
                    await self._wait()
        finally:
            if sb.outstanding or sb.queued:
                await self._abandon()
            self._record_successes()
            sb.release()
        return self._results()

    async def _wait(self) -> None:
        sb = self.sb
        if not sb.event.is_set():
            await sb.event.wait()
        sb.event = anyio.Event()

    def _results(self) -> list[TransferResult]:
        sb = self.sb
        out = []
        for i, r in enumerate(self.requests):
            err = self.errors[i]
            moved = sb.moved(i)
            if err is not None and i in self.timed_out:
                out.append(TransferResult(TransferStatus.TIMEOUT, moved, err))
            elif err is not None:
                out.append(failed(err))
            elif moved != r.length:
                out.append(failed(TransferError(f"moved {moved} of {r.length} bytes")))
            else:
                out.append(completed(r.length))
        return out

    def _record_successes(self) -> None:
        for ridx in self.sb.rail_successes():
            ep = self.eps.get(ridx)
            if ep is not None:
                self.rails.health.record_success((ep.nic.index, ep.peer_path))

    # -- routing and posting --------------------------------------------------------------

    async def _dispatch(self) -> None:
        sb, rails, peer, seg = self.sb, self.rails, self.peer, self.seg
        assert seg is not None
        now = anyio.current_time()
        sb.clear_tables()
        for c, retry in sb.needed_tables():
            loc, buf_loc = self.class_keys[c]
            sb.set_table(c, retry, rails.options(loc, buf_loc, retry, peer, seg, now))
        touched = []
        for ridx in sb.choose():
            li, pi = divmod(ridx, self.npeer)
            nic = rails.nics[li]
            try:
                ep = await rails.endpoint(nic, peer, seg, pi)
            except MooncakeError as e:
                rail = (li, nic_path(peer.segment, seg.devices[pi].name))
                rails.health.record_error(rail, anyio.current_time())
                rails.stats["connect_errors"] += 1
                self.connect_errors[ridx] = (
                    e if isinstance(e, TransferError) else PeerUnreachableError(str(e))
                )
                sb.unqueue(ridx)
                continue
            if ep.rail is None or ep.broken:  # retired while we waited for the handshake
                sb.unqueue(ridx)
                self.connect_errors[ridx] = PeerDiedError(f"{nic.name} -> {ep.peer_path} broke")
                continue
            self.endpoints.add(ep)
            self.eps[ridx] = ep
            sb.attach(ridx, ep.rail)
            if nic not in touched:
                touched.append(nic)
        for nic in touched:
            rails.post(nic)

    # -- errors ---------------------------------------------------------------------------

    def _classify(self) -> None:
        sb, rails = self.sb, self.rails
        errs = sb.take_errors()
        if not errs:
            return
        for i, kind, code, ridx in errs:
            if kind in (verbs.ERR_WC, verbs.ERR_WC_STALE):
                name = verbs.wc_status_name(code)
                rails.stats[f"wc_{name}"] += 1
                # a stale one came from an endpoint of this rail that was already retired
                ep = self.eps.get(ridx) if kind == verbs.ERR_WC else None
                if ep is not None:
                    rails.retire(ep)
                if sb.cancelled:
                    continue
                req, off, n, _, _, _ = sb.slice_info(i)
                op = "READ" if self.requests[req].opcode is Opcode.READ else "WRITE"
                li, pi = divmod(ridx, self.npeer)
                assert self.seg is not None
                path = nic_path(self.peer.segment, self.seg.devices[pi].name)
                via = f"{rails.nics[li].name} -> {path}"
                what = (
                    f"{op} of [{self.requests[req].remote_addr + off:#x}, +{n}) via {via}: {name}"
                )
                if code == verbs.WC_WR_FLUSH_ERR:
                    # flushed behind another WR's error: not this rail's fault, just resend
                    self._retry(i, PeerDiedError(what), count=False)
                elif code in _ACCESS_STATUSES:
                    if sb.hold_access(i):
                        self.need_refresh = True
                    else:
                        self._fail(
                            i, RemoteAccessError(f"{what}: the peer refused the range or rkey")
                        )
                else:
                    if rails.health.record_error((li, path), anyio.current_time()):
                        rails.log_pause(rails.nics[li].name, path)
                    self._retry(i, PeerDiedError(what))
            elif sb.cancelled:
                continue
            elif kind == verbs.ERR_REFUSED:
                ep = self.eps.get(ridx)
                via = f"{ep.nic.name} -> {ep.peer_path}" if ep is not None else "?"
                if ep is not None and not ep.broken:
                    rails.log_refused(ep, code)
                    rails.retire(ep)
                self._retry(i, TransferError(f"{via}: ibv_post_send refused the WR (errno {code})"))
            elif kind == verbs.ERR_NO_RAIL:
                self._fail(
                    i,
                    PeerUnreachableError(
                        f"no usable RDMA rail to {self.peer.segment} (all paused or down)"
                    ),
                )
            elif kind == verbs.ERR_BAD_RKEY:
                self._fail(i, self._rkey_error(i, code))
            elif kind == verbs.ERR_UNQUEUED:
                err = self.connect_errors.get(ridx) or PeerUnreachableError("rail unavailable")
                self._retry(i, err)

    def _rkey_error(self, i: int, device: int) -> MooncakeError:
        req = self.sb.slice_info(i)[0]
        r = self.requests[req]
        assert self.seg is not None
        buf = self.peer.descriptor.find_buffer(r.remote_addr, r.length)
        if buf is None:
            return RemoteAccessError(f"{self.peer.segment}: buffer gone")
        try:
            self.seg.rkey(buf, device, f"{self.peer.segment} buffer")
        except ProtocolError as e:
            return e
        return ProtocolError(f"{self.peer.segment} buffer: no rkey for device {device}")

    def _retry(self, i: int, error: MooncakeError, count: bool = True) -> None:
        req = self.sb.slice_info(i)[0]
        if self.errors[req] is not None or not self.sb.retry(i, count, self.rails.cfg.retry_cnt):
            self._fail(i, error)
        else:
            self.rails.stats["retries"] += 1

    def _fail(self, i: int, error: MooncakeError) -> None:
        req = self.sb.slice_info(i)[0]
        if self.errors[req] is None:
            self.errors[req] = error
        self.sb.fail(i)

    # -- refresh, timeout, cancellation ---------------------------------------------------

    async def _refresh(self) -> None:
        """Re-read the peer's descriptor after a remote access error and re-aim the slices."""
        sb, rails = self.sb, self.rails
        held = sb.held()
        try:
            self.peer = await rails.host.peer(self.peer.segment, refresh=True)
            seg = rails.segment(self.peer)
            if seg is None or len(seg.devices) != self.npeer:
                raise ProtocolError(f"{self.peer.segment} changed its RDMA devices")
        except MooncakeError as e:
            for i in held:
                self._fail(i, e)
            return
        self.seg = seg
        for req in sorted({sb.slice_info(i)[0] for i in held}):
            r = self.requests[req]
            region = self.regions[req]
            buf = self.peer.descriptor.find_buffer(r.remote_addr, r.length)
            if buf is None or region is None:
                if self.errors[req] is None:
                    self.errors[req] = RemoteAccessError(
                        f"{self.peer.segment}: [{r.remote_addr:#x}, +{r.length}) is no longer "
                        "registered there (remote access error)"
                    )
                sb.fail_request(req)
            else:
                sb.set_request_keys(
                    req, self._class(region.location, buf.name), self._rkeys(buf, seg)
                )
        sb.release_held()

    def _time_out(self) -> None:
        """No completion for ``MC_SLICE_TIMEOUT`` s: fail the requests with WRs in flight and
        flush their QPs (the flushed WRs then finish those requests instead of retrying)."""
        rails = self.rails
        waiting = self.sb.posted_requests()
        for req in waiting:
            if self.errors[req] is None:
                self.errors[req] = TransferTimeoutError(
                    f"no completion within MC_SLICE_TIMEOUT={rails.cfg.slice_timeout:g} s"
                )
            self.timed_out.add(req)
        for ep in list(self.endpoints):
            if ep.inflight:
                rails.retire(ep)
                ep.to_error()
        rails.stats["timeouts"] += len(waiting)

    async def _abandon(self) -> None:
        """Cancelled or failed mid-batch: flush what is posted and wait for it, shielded."""
        sb, rails = self.sb, self.rails
        with anyio.CancelScope(shield=True):
            sb.cancel()
            for ep in self.endpoints:
                if ep.inflight:
                    rails.retire(ep)
                    ep.to_error()  # every WR still queued completes (flushed) right away
            with anyio.move_on_after(CANCEL_GRACE_S):
                while sb.outstanding:
                    await self._wait()
            if sb.outstanding:
                # the device never completed them: destroy the QPs, after which no DMA happens
                rails.log_never_completed(sb.outstanding)
                for ep in self.endpoints:
                    ep.close()  # settles the unreaped WRs of every batch using them (flushed)
                    rails.draining.discard(ep)
                if sb.outstanding:  # their QPs were destroyed elsewhere (transport closing)
                    sb.forget_posted()
            self._classify()  # count the flushes
