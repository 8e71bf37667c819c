"""The store client's SSD tier: demotion, SSD reads, promotion, draining, tier statistics.

Objects the master evicts from this client's segment are demoted to its SSD tier (one
task per :meth:`_Tiered._tier_round`), served from it when the master lists only an SSD copy,
and promoted back per the admission rule. See docs/tiers.md.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import anyio

from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.master.tenants import internal_key
from mooncake._core.misses import Miss, MissReason
from mooncake._core.tiers import SsdEntry
from mooncake._store.moves import TIER_POLL_S, _Mover, _Op, _value_addr
from mooncake._store.verify import NO_CRC, crc_of_bytes
from mooncake.errors import (
    InvalidArgumentError,
    MooncakeError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    RpcError,
    TierDataError,
    TransferError,
)

log = logging.getLogger("mooncake.store")


class _Tiered(_Mover):
    """The store client's SSD tier (part of :class:`~mooncake._store.client.Store`)."""

    def _on_ssd_drop(self, entry: SsdEntry, why: str) -> None:
        """The SSD tier let go of ``entry``: report evictions and losses to the master."""
        vid = self._ssd_vid.pop(entry.key, None)
        if vid is not None and why in ("evicted", "corrupt"):
            assert self.ssd is not None
            self._disk_evictions[entry.key] = (vid, self.ssd.index.policy.name, why)

    async def _start_ssd(self) -> None:
        """Mount the SSD tier at the master and re-announce what it recovered."""
        assert self.ssd is not None
        await self._announce_ssd([e.key for e in self.ssd.recovered])

    async def _announce_ssd(self, keys: Sequence[str]) -> None:
        """``MountLocalDisk``, then ``PutLocal`` each of ``keys`` still on the SSD tier (each
        gets a new version id); a key the master already has lives elsewhere now: its copy
        here is deleted, so no stale copy stays reachable."""
        tier = self.ssd
        assert tier is not None
        await self.master.call(
            "MountLocalDisk",
            rpc.LocalDiskParams(
                client_id=self.client_id, capacity=tier.capacity, tier_id=tier.tier_id
            ),
        )
        for key in keys:
            if key not in tier:
                continue
            try:
                vid: int = await self.master.call(
                    "PutLocal",
                    rpc.PutLocalParams(client_id=self.client_id, key=key, size=tier.size_of(key)),
                )
            except (ObjectAlreadyExistsError, InvalidArgumentError):
                # the key was written again meanwhile (or cannot be announced): drop our copy
                self._ssd_vid.pop(key, None)
                await tier.remove(key)
                continue
            self._ssd_vid[key] = vid

    async def _tier_loop(self) -> None:
        """Every ``TIER_POLL_S``: one :meth:`_tier_round`."""
        while True:
            try:
                await self._tier_round()
            except (MooncakeError, OSError) as e:
                log.warning("SSD tier round failed: %s", e)
            await anyio.sleep(TIER_POLL_S)

    async def _tier_round(self) -> None:
        """Report SSD evictions, delete copies the master no longer lists, do its demotions."""
        async with self._tier_lock:
            for t in list(self._unsettled.values()):
                await self._end_demotion(t)
            await self._report_disk_evictions()
            tasks: st.TierTasks = await self.master.call(
                "FetchTierTasks", rpc.ClientParams(client_id=self.client_id)
            )
            for d in tasks.drop:
                if self._ssd_vid.get(d.key) == d.vid:
                    del self._ssd_vid[d.key]
                    assert self.ssd is not None
                    await self.ssd.remove(d.key)
            for t in tasks.demote:
                await self._demote(t)

    async def _report_disk_evictions(self) -> None:
        while self._disk_evictions:
            key, (vid, policy, _) = next(iter(self._disk_evictions.items()))
            await self.master.call(
                "EvictDiskReplica",
                rpc.EvictDiskParams(client_id=self.client_id, key=key, vid=vid, policy=policy),
            )
            if self._disk_evictions.get(key, (None,))[0] == vid:
                del self._disk_evictions[key]

    async def _demote(self, t: st.DemoteTask) -> None:
        """Copy a DRAM replica of our segment to the SSD tier, then DemoteEnd (or Revoke)."""
        tier, seg = self.ssd, self.segment
        assert tier is not None
        params = rpc.TierKeyParams(client_id=self.client_id, key=t.key, vid=t.vid)
        ok = (
            seg is not None
            and not self._ssd_draining
            and t.segment_name == self.segment_name
            and t.size > 0
            and seg.addr <= t.addr
            and t.addr + t.size <= seg.addr + seg.size
        )
        if ok:
            assert seg is not None
            # The master keeps this extent allocated until DemoteEnd/Revoke: stable bytes.
            view = (ctypes.c_char * t.size).from_address(t.addr)
            try:
                await tier.put(t.key, memoryview(view).cast("B"))
            except (MooncakeError, OSError) as e:  # SSD full of busy objects, ENOSPC, EIO
                log.warning("demoting %r to the SSD tier failed: %s", t.key, e)
                ok = False
        if not ok:
            try:
                await self.master.call("DemoteRevoke", params)
            except MooncakeError:
                pass
            return
        self._ssd_vid[t.key] = t.vid
        await self._end_demotion(t)

    async def _end_demotion(self, t: st.DemoteTask) -> None:
        """``DemoteEnd`` for a copy on the SSD tier.

        The master's answer decides: success keeps the copy; an error answer (the version was
        removed or replaced, or the demotion was revoked) deletes it, since it must never be
        served. A *lost* answer (connection reset: the master may or may not have applied it)
        decides nothing: ``DemoteEnd`` is idempotent, so it is retried, and a copy whose outcome
        is still unknown is kept for the next tier round (it is served only while the master
        lists it, with its version).
        """
        tier = self.ssd
        assert tier is not None
        params = rpc.TierKeyParams(client_id=self.client_id, key=t.key, vid=t.vid)
        for attempt in range(3):
            try:
                await self.master.call("DemoteEnd", params)
            except RpcError as e:
                log.info("DemoteEnd of %r: answer lost (%s); retrying", t.key, e)
                await anyio.sleep(0.05 * (attempt + 1))
                continue
            except MooncakeError:
                if self._unsettled.get(t.key) is t:
                    del self._unsettled[t.key]
                if self._ssd_vid.get(t.key) == t.vid:
                    del self._ssd_vid[t.key]
                    await tier.remove(t.key)
                return
            if self._unsettled.get(t.key) is t:
                del self._unsettled[t.key]
            tier.counters.demotions += 1
            return
        self._unsettled[t.key] = t

    async def drain_ssd(self, grace_s: float = 0.0) -> None:
        """Stop using the SSD tier (``unmount_local_disk_segment``): after ``grace_s`` seconds
        every copy on it is dropped and reported to the master, and no more are demoted to it
        (the master then drops objects it evicts from this client's memory, as without one)."""
        self._check_open()
        tier = self.ssd
        if tier is None:
            return
        self._ssd_draining = True
        await anyio.sleep(grace_s)
        async with self._tier_lock:
            for key, vid in list(self._ssd_vid.items()):
                del self._ssd_vid[key]
                self._disk_evictions[key] = (vid, tier.index.policy.name, "drained")
                await tier.remove(key)
            await self._report_disk_evictions()

    async def _read_ssd(self, key: str, resp: st.GetReplicaListResponse) -> bytes:
        """The bytes of an object the master lists only on SSD copies (ours, if any). The
        SSD tier and the tier calls name the master's internal key (a tenant's key scoped)."""
        key = internal_key(self.master.tenant, key)
        tier = self.ssd
        lost = self._disk_evictions.get(key)
        if lost is not None and lost[0] == resp.vid and self.client_id in resp.disk_clients:
            # our SSD let it go and the master has not heard yet
            err = ObjectNotFoundError(f"object {key!r} left this client's SSD tier ({lost[2]})")
            if lost[2] == "evicted":
                err.miss = Miss(key, MissReason.EVICTED, policy=lost[1], tier="ssd")
            else:
                err.miss = Miss(key, MissReason.TRANSFER_FAILED, tier="ssd", detail=lost[2])
            raise err
        if (
            tier is None
            or self.client_id not in resp.disk_clients
            or self._ssd_vid.get(key) != resp.vid
        ):
            err = ObjectNotFoundError(
                f"object {key!r} is only on the SSD of client(s) {', '.join(resp.disk_clients)}; "
                "reading another client's SSD is not supported"
            )
            err.miss = Miss(key, MissReason.TRANSFER_FAILED, tier="ssd", detail="remote SSD")
            raise err
        try:
            data = await tier.get(key)
            self.offload_reads += 1
        except TierDataError:
            # already dropped from the tier; _on_ssd_drop queued the report to the master
            self.verify.mismatches[("ssd", self.client_id)] += 1
            raise
        want = self.verify.expected(resp)  # the writer's CRC, beyond the tier file's own
        if want != NO_CRC and not self.verify.check(
            want, crc_of_bytes(data), "ssd", self.client_id
        ):
            await tier.drop_corrupt(key)  # reported to the master as lost (_on_ssd_drop)
            raise TierDataError(
                f"SSD copy of {key!r} fails the CRC32C its writer recorded; dropped from the tier"
            )
        if self.admission.admit(key) and self._tg is not None:
            self._tg.start_soon(self._promote, key, resp.vid, data)
        return data

    async def _promote(self, key: str, vid: int, data: bytes) -> None:
        """Copy an SSD hit back to DRAM (PromoteStart -> write -> PromoteEnd)."""
        params = rpc.TierKeyParams(client_id=self.client_id, key=key, vid=vid)
        try:
            reps: list[st.ReplicaDescriptor] = await self.master.call("PromoteStart", params)
        except MooncakeError as e:
            log.debug("promotion of %r not started: %s", key, e)
            return
        try:
            addr, n, keep = _value_addr(data)
            r = reps[0]
            if r.length != n:
                raise TransferError(f"PromoteStart gave a {r.length}-byte replica for {n} bytes")
            if self._owns_any() and r.segment_name == self.segment_name:
                ctypes.memmove(self._own_extent(r.addr, n), addr, n)
            else:
                off = await self._stage(n)
                try:
                    assert self.local_buffer is not None
                    local = self.local_buffer.addr + off
                    ctypes.memmove(local, addr, n)
                    op = _Op(True, local, r, n)
                    await self._move([op])
                    if op.error is not None:
                        raise op.error
                finally:
                    self._unstage(off)
            del keep
            await self.master.call("PromoteEnd", params)
        except BaseException as e:
            # A background task: a failed promotion only leaves the object on SSD.
            with anyio.CancelScope(shield=True):
                try:
                    await self.master.call("PromoteRevoke", params)
                except MooncakeError:
                    pass
            if not isinstance(e, MooncakeError):
                raise
            log.debug("promotion of %r failed: %s", key, e)
            return
        assert self.ssd is not None
        self.ssd.counters.promotions += 1

    async def explain_miss(self, key: str) -> Miss:
        """Why ``key`` is not readable, as the master attributes it (no miss is counted)."""
        info: st.MissInfo = await self.master.call("ExplainMiss", rpc.KeyParams(key=key))
        return Miss(
            key,
            MissReason(info.reason),
            policy=info.policy,
            tier=info.tier,
            owner=info.owner,
            at=info.at or None,
        )

    async def tier_stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters: the master's view (``dram``, ``ssd``) and this client's SSD tier
        (``local_ssd``: hits, misses, evictions, demotions, promotions, errors, bytes...)."""
        out: dict[str, dict[str, int]] = await self.master.call("GetTierStats", rpc.Empty())
        if self.ssd is not None:
            out["local_ssd"] = self.ssd.stats()
        return out

    async def segment_tiers(self) -> dict[str, dict[str, int]]:
        """The master's mounted segments by memory tier (``dram``, ``gpu``): ``segments``,
        ``capacity`` and ``used`` bytes of each."""
        out: dict[str, dict[str, int]] = await self.master.call("GetSegmentTiers", rpc.Empty())
        return out
