"""Reads and what they hold: leases, read windows, groups, soft pins, and eviction."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from mooncake._core.master.base import _StateBase
from mooncake._core.master.config import _compile, format_miss
from mooncake._core.master.records import KeySet, _Object
from mooncake._core.misses import PREDATES_DETAIL
from mooncake._core.policies import Pin
from mooncake._core.rpc_types import Item
from mooncake._core.store_types import GetReplicaListResponse, ReplicaDescriptor, ReplicaStatus
from mooncake.errors import MooncakeError, ObjectNotFoundError, ReplicaNotFoundError


class _Leases(_StateBase):
    """Replica lookups (with their leases and read windows), groups, soft pins, eviction."""

    # -- reads -----------------------------------------------------------------------------

    def get_replica_list(
        self, key: str, now: float, *, for_read: bool = True
    ) -> GetReplicaListResponse:
        """Replicas of the readable version of ``key``; extends its lease.

        ``for_read`` also opens a *read window* of ``read_fence_ttl`` plus ``read_fence_s_per_mib``
        per MiB of the object (at most the lease; i.e. reads slower than ~100 MB/s fail): until it
        closes, the space of this version is not reused even if the object is force-removed or
        replaced, and the client fails any read that finishes after it (``read_ttl_ms``). A
        descriptor-only query (``for_read=False``) opens none.
        """
        objects = self._objects
        h = objects.table.find(key)
        if h >= 0 and h not in objects.hot:
            cold = self._cold_replica_list(h, now, for_read)
            if cold is not None:
                return cold
        obj = objects.get(key)
        if obj is None or obj.readable is None:
            # A key whose only version is still being written has no complete version to
            # read: not found (as ExistKey says), not "not ready" -- the write is ordered after
            # this read.
            self.stats.get_misses += 1
            self.tiers["dram"].misses += 1
            miss = self.misses.classify(key)
            why = f" ({miss.detail})" if miss.detail == PREDATES_DETAIL else ""
            raise ObjectNotFoundError(f"object {key!r} not found {format_miss(miss)}{why}")
        ver = obj.readable
        replicas = ver.replicas
        if self.quarantine and replicas:
            replicas = [r for r in replicas if r.seg.segment.name not in self.quarantine]
            if not replicas and not ver.disk:
                self.stats.get_misses += 1
                self.tiers["dram"].misses += 1
                names = sorted({r.seg.segment.name for r in ver.replicas})
                raise ReplicaNotFoundError(
                    f"object {key!r} has no reachable replica: its holder(s) {', '.join(names)} "
                    "failed a transfer and have not been heard from since"
                )
        ttl = self.config.default_kv_lease_ttl
        self._extend_lease(obj, now + ttl)
        read_ttl = min(
            ttl,
            self.config.read_fence_ttl + self.config.read_fence_s_per_mib * ver.size / (1 << 20),
        )
        if for_read:
            obj.read_deadline = max(obj.read_deadline, now + read_ttl)
        if obj.h in self.policy:
            self.policy.on_access(obj.h, now)
        self.stats.gets += 1
        if replicas:
            self.tiers["dram"].hits += 1
        else:
            self.tiers["dram"].misses += 1
            self.tiers["ssd"].hits += 1
        return GetReplicaListResponse(
            replicas=[r.descriptor(ReplicaStatus.COMPLETE) for r in replicas],
            lease_ttl_ms=int(ttl * 1000),
            size=ver.size,
            read_ttl_ms=int(read_ttl * 1000),
            vid=ver.vid,
            disk_clients=list(ver.disk),
            crc=self.crc_of(obj.h, ver.vid),
        )

    def _cold_replica_list(
        self, h: int, now: float, for_read: bool
    ) -> GetReplicaListResponse | None:
        """:meth:`get_replica_list` of a cold object, read from its row (``None``: its
        segment is quarantined, the general path answers)."""
        t = self._objects.table
        sn, addr, size, vid, lease, read, _ = t.cold_row(h)
        seg = self._objects.segs[sn].segment
        if self.quarantine and seg.name in self.quarantine:
            return None
        cfg = self.config
        ttl = cfg.default_kv_lease_ttl
        read_ttl = min(ttl, cfg.read_fence_ttl + cfg.read_fence_s_per_mib * size / (1 << 20))
        lease = max(lease, now + ttl)
        if for_read:
            read = max(read, now + read_ttl)
        t.set_deadlines(h, lease, read)
        if h in self.policy:
            self.policy.on_access(h, now)
        self.stats.gets += 1
        self.tiers["dram"].hits += 1
        return GetReplicaListResponse(
            replicas=[
                ReplicaDescriptor(
                    segment_name=seg.name,
                    addr=addr,
                    length=size,
                    status=ReplicaStatus.COMPLETE,
                    protocol=seg.protocol,
                )
            ],
            lease_ttl_ms=int(ttl * 1000),
            size=size,
            read_ttl_ms=int(read_ttl * 1000),
            vid=vid,
            disk_clients=[],
            crc=self.crc_of(h, vid),
        )

    def batch_get_replica_list(
        self, keys: list[str], now: float, *, for_read: bool = True
    ) -> list[Item[GetReplicaListResponse]]:
        out: list[Item[GetReplicaListResponse]] = []
        for key in keys:
            try:
                out.append(Item(code=0, value=self.get_replica_list(key, now, for_read=for_read)))
            except MooncakeError as e:
                out.append(Item(code=int(e.code)))
        return out

    def get_replica_list_by_regex(
        self, regex: str, now: float
    ) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of every readable key matching ``regex`` (``re.search``); leases them.

        Runs the pattern over every key in the caller's thread: the server does not call this
        (it matches in a worker thread within a time budget, :mod:`mooncake._store.keyscan`,
        then calls :meth:`replica_lists_of`).
        """
        pattern = _compile(regex)
        return self.replica_lists_of([k for k in self.readable_keys() if pattern.search(k)], now)

    def replica_lists_of(
        self, keys: Iterable[str], now: float
    ) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of those of ``keys`` still readable (leasing them, as ``GetReplicaList``)."""
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key in keys:
            obj = self._objects.get(key)
            if obj is not None and obj.readable is not None:
                out[key] = self.get_replica_list(key, now).replicas
        return out

    def _unreachable(self, key: str) -> bool:
        """Whether ``key`` has a complete version whose every memory replica is on a
        quarantined segment and which has no disk copy: :meth:`get_replica_list` answers
        ``REPLICA_NOT_FOUND`` for it, so it does not exist either. Only asked while a segment
        is quarantined."""
        objects = self._objects
        h = objects.table.find(key)
        if h < 0:
            return False
        if h not in objects.hot:  # a cold row: one replica, no disk copy
            sn = objects.table.cold_row(h)[0]
            return objects.segs[sn].segment.name in self.quarantine
        ver = objects.by_handle(h).readable
        if ver is None or not ver.replicas or ver.disk:
            return False
        return all(r.seg.segment.name in self.quarantine for r in ver.replicas)

    def exist_key(self, key: str, now: float) -> bool:
        """Whether ``key`` is readable: it has a complete version with a replica on a segment
        that is not quarantined, or a disk copy -- exactly when :meth:`get_replica_list` would
        answer replicas. A true answer extends its lease (as Mooncake does); a key whose every
        holder is quarantined answers False and is not leased."""
        if self.quarantine and self._unreachable(key):
            return False
        deadline = now + self.config.default_kv_lease_ttl
        objects = self._objects
        (h,) = objects.table.lease_keys([key], deadline)
        if h == -2:  # cold: readable, in no group, leased by the table
            return True
        if h < 0:
            return False
        obj = objects.by_handle(h)
        if obj.readable is None:
            return False
        self._extend_lease(obj, deadline)
        return True

    def _extend_lease(self, obj: _Object, deadline: float) -> None:
        """Lease ``obj`` until ``deadline`` -- and every current member of its group."""
        obj.lease_deadline = max(obj.lease_deadline, deadline)
        if not obj.group:
            return
        members = self._groups.get(obj.group, KeySet())
        for key in list(members):
            other = self._objects.get(key)
            if other is None or other.group != obj.group or other.readable is None:
                members.discard(key)
                continue
            other.lease_deadline = max(other.lease_deadline, deadline)

    def _set_group(self, obj: _Object, group: str) -> None:
        if obj.group and obj.group != group:
            self._groups.get(obj.group, KeySet()).discard(obj.key)
        obj.group = group
        if group:
            self._groups.setdefault(group, KeySet()).add(obj.key)

    def batch_exist_key(self, keys: list[str], now: float) -> list[int]:
        """:meth:`exist_key` per key (1 / 0): the cold ones leased by the table in one call,
        the hot ones here (while a segment is quarantined, each key as :meth:`exist_key`)."""
        if self.quarantine:
            return [int(self.exist_key(k, now)) for k in keys]
        deadline = now + self.config.default_kv_lease_ttl
        found = self._objects.table.lease_keys(keys, deadline)
        hot = self._objects.hot
        out: list[int] = []
        add = out.append
        for h in found:
            if h == -2:
                add(1)
                continue
            obj = hot.get(h) if h >= 0 else None
            if obj is None or obj.readable is None:
                add(0)
                continue
            if obj.group:
                self._extend_lease(obj, deadline)
            elif obj.lease_deadline < deadline:
                obj.lease_deadline = deadline
            add(1)
        return out

    def _pin_soft(self, key: str, deadline: float) -> None:
        """``key`` is soft-pinned until ``deadline`` (expired by :meth:`_expire_soft_pins`).

        The heap keeps entries of keys unpinned since (checked when they come up); when they
        outnumber the live pins it is rebuilt from those, so it stays O(live pins).
        """
        self._soft_pinned.add(key)
        heap = self._pin_heap
        heapq.heappush(heap, (deadline, key))
        if len(heap) > 2 * len(self._soft_pinned) + 1024:
            live = []
            for k in self._soft_pinned:
                o = self._objects.get(k)
                if o is not None and o.soft_pin_deadline is not None:
                    live.append((o.soft_pin_deadline, k))
            heapq.heapify(live)
            self._pin_heap = live

    def _expire_soft_pins(self, now: float) -> None:
        """Unpin soft pins past their deadline: the deadline heap's expired head only."""
        heap = self._pin_heap
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            if key not in self._soft_pinned:
                continue  # unpinned, removed or replaced since
            obj = self._objects.get(key)
            if obj is None or obj.soft_pin_deadline is None:
                self._soft_pinned.discard(key)
            elif obj.soft_pin_deadline <= now:
                obj.soft_pin_deadline = None
                self._soft_pinned.discard(key)
                if obj.h in self.policy:
                    self.policy.set_pin(obj.h, Pin.NONE)

    def evict(self, now: float, need: int = 0, *, limit: int | None = None) -> int:
        """Evict objects (policy order) to bring usage under the watermark, or to free ``need``
        bytes; returns the bytes freed. Never evicts leased, pinned-hard, or written objects.

        An eviction *run* frees ``max(eviction_ratio, used_ratio - watermark +
        eviction_ratio)`` of the capacity, in rounds: one call evicts at most ``limit`` objects
        (default ``eviction_round_objects``), and the rest of the run's goal is left to the
        next calls (every :meth:`sweep` makes one; a PutStart over the watermark a smaller
        one), so no call does unbounded work however many objects a run has to go.
        """
        cap = self._capacity
        if cap == 0:
            return 0
        wm = self.config.eviction_high_watermark_ratio
        ratio = self.config.eviction_ratio
        # Bytes being demoted come back when their owners confirm: count them as freed, or
        # every put would push another victim into demotion.
        pending = self._demoting_bytes
        used = self._used - pending - self._held_bytes()  # held bytes come back by themselves
        if self._evict_goal <= 0:  # a new run
            self._evict_goal = max(int(ratio * cap), int(used - wm * cap + ratio * cap)) - pending
        target = max(self._evict_goal, need - pending)
        if target <= 0:
            self._evict_goal = 0
            return 0
        if limit is None:
            limit = self.config.eviction_round_objects
        # Ask the policy for about ``limit`` objects' worth (by the mean tracked size), so it
        # neither walks nor returns more than one round needs.
        n = len(self.policy)
        ask = min(target, max(need - pending, limit * (self.policy.total_bytes // n))) if n else 0
        allow_soft = self.config.allow_evict_soft_pinned_objects
        objects = self._objects
        hot = objects.hot
        cold_lease = objects.cold_lease

        def can_evict(h: object) -> bool:
            obj = hot.get(h)  # type: ignore[call-overload]
            if obj is None:  # a cold row: readable, one replica, nothing in flight, no pin
                return cold_lease(h) <= now  # type: ignore[arg-type]
            return (
                obj.readable is not None
                and obj.pending is None
                and obj.demoting is None
                and obj.promoting is None
                and obj.task is None
                and not obj.hard_pinned
                and obj.lease_deadline <= now
                and (allow_soft or obj.soft_pin_deadline is None)
            )

        self.stats.eviction_runs += 1
        freed = 0
        policy = self.policy.name
        victims = self.policy.victims(ask, can_evict)
        truncated = len(victims) > limit
        del victims[limit:]  # the policy keeps tracking those left for the next round
        for h in victims:
            obj = objects.by_handle(h)  # type: ignore[arg-type]
            key = obj.key
            ver = obj.readable
            assert ver is not None
            freed += ver.size * len(ver.replicas)
            self.stats.evicted_bytes += ver.size
            self.stats.evicted_objects += 1
            self.tiers["dram"].evictions += 1
            if ver.disk:
                # Already on an SSD: dropping the memory replicas is the whole demotion.
                self._to_disk_only(obj, now)
                continue
            owner = self._demotion_owner(ver)
            if owner is not None:
                self._start_demotion(obj, owner, now)
                continue
            self._drop_object(obj, now)
            self.misses.record_eviction(key, policy=policy, tier="dram", now=now)
        # The run goes on next round while there is more to free and the policy had enough
        # candidates (it proposes every evictable object when they cover less than asked).
        more = truncated or (ask < target and freed >= ask)
        self._evict_goal = max(0, self._evict_goal - freed) if more else 0
        return freed

    @property
    def evicting(self) -> bool:
        """An eviction run is in progress (the next :meth:`sweep` continues it)."""
        return self._evict_goal > 0
