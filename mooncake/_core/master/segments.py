"""Clients, segments and their allocators: liveness, mounts, allocation, deferred frees."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from mooncake._core import kv_events as _kv
from mooncake._core.allocator import OffsetAllocator
from mooncake._core.master.base import _StateBase
from mooncake._core.master.config import _check_client_id
from mooncake._core.master.records import (
    _Client,
    _InUse,
    _Object,
    _Replica,
    _Seg,
    _Version,
)
from mooncake._core.store_types import (
    ClientStatus,
    PingResponse,
    ReplicateConfig,
    Segment,
    SegmentInfo,
)
from mooncake.errors import (
    ClientNotFoundError,
    IllegalClientError,
    InvalidArgumentError,
    SegmentAlreadyExistsError,
    SegmentNotFoundError,
)


class _Segments(_StateBase):
    """Clients and segments: liveness, mounts, expiry, allocation and deferred frees."""

    # -- liveness and segments -------------------------------------------------------------

    def ping(self, client_id: str, now: float) -> PingResponse:
        """Keep ``client_id`` alive; ``NEED_REMOUNT`` if the master did not know it."""
        _check_client_id(client_id)
        client = self._clients.get(client_id)
        if client is None:
            self._clients[client_id] = _Client(now + self.config.client_ttl)
            return PingResponse(
                view_version_id=self.view_version_id, client_status=ClientStatus.NEED_REMOUNT
            )
        client.deadline = now + self.config.client_ttl
        if self.quarantine:
            self._holder_alive(client, now)
        return PingResponse(view_version_id=self.view_version_id, client_status=ClientStatus.OK)

    def _holder_alive(self, client: _Client, now: float) -> None:
        """``client`` was heard from: lift the quarantine of its segments (see
        :class:`~mooncake._core.quarantine.Quarantine` for the grace)."""
        names = dict.fromkeys(
            seg.segment.name for sid in client.segments if (seg := self._segments.get(sid))
        )
        self.quarantine.alive(names, now)

    def connection_lost(self, client_id: str, now: float) -> None:
        """The last master connection on which ``client_id`` sent heartbeats closed: its
        segments are quarantined until its next heartbeat (after the grace), as if a peer had
        reported them, and its writes in flight are discarded (:meth:`discard_writes_of`).
        A client the master does not know: nothing happens."""
        client = self._clients.get(client_id)
        if client is None:
            return
        for sid in client.segments:
            seg = self._segments.get(sid)
            if seg is not None:
                self.quarantine.suspect(seg.segment.name, now, "its master connection closed")
        self.discard_writes_of(client_id, now)

    def report_segment_failure(
        self, client_id: str, segment_name: str, reason: str, now: float
    ) -> bool:
        """``client_id`` failed a transfer to ``segment_name``: quarantine it (no new
        allocations there; reads are not given its replicas) until its holder's next heartbeat
        or the holder's expiry. Whether it is quarantined now (False: this reporter was refuted
        on that segment within ``quarantine_refute_hold``).

        ``CLIENT_NOT_FOUND`` from a client the master does not know, ``SEGMENT_NOT_FOUND`` for
        a name no mounted segment has, ``INVALID_PARAMS`` for a client's own segment."""
        _check_client_id(client_id)
        if client_id not in self._clients:
            raise ClientNotFoundError(f"client {client_id} is not known to this master")
        owners = {s.client_id for s in self._seg_list if s.segment.name == segment_name}
        if not owners:
            raise SegmentNotFoundError(f"no mounted segment is named {segment_name!r}")
        if client_id in owners:
            raise InvalidArgumentError(f"client {client_id} cannot report its own segment")
        return self.quarantine.report(client_id, segment_name, now, reason)

    def _touch_client(self, client_id: str, now: float) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(now + self.config.client_ttl)
        else:
            client.deadline = now + self.config.client_ttl
        return client

    def _renew_known(self, client_id: str, now: float) -> _Client | None:
        """Renew ``client_id`` if the master knows it; None (and no record made) if not, so
        that its next ``Ping`` still answers ``NEED_REMOUNT``."""
        client = self._clients.get(client_id)
        if client is not None:
            client.deadline = now + self.config.client_ttl
        return client

    def mount_segment(self, client_id: str, segment: Segment, now: float) -> None:
        """Mount ``segment`` for ``client_id`` (idempotent for the same client and range)."""
        _check_client_id(client_id)
        if not segment.id or not segment.name:
            raise InvalidArgumentError("segment id and name must be non-empty")
        if segment.base < 0 or segment.size <= 0:
            raise InvalidArgumentError(
                f"segment {segment.name!r} range must have base >= 0 and size > 0, "
                f"got base={segment.base} size={segment.size}"
            )
        existing = self._segments.get(segment.id)
        if existing is not None:
            if existing.client_id != client_id or existing.segment != segment:
                raise SegmentAlreadyExistsError(
                    f"segment id {segment.id} is already mounted by client {existing.client_id}"
                )
            self._touch_client(client_id, now)
            return
        for other in self._seg_list:
            o = other.segment
            if (
                o.name == segment.name
                and segment.base < o.base + o.size
                and o.base < segment.base + segment.size
            ):
                raise SegmentAlreadyExistsError(
                    f"segment {segment.name!r} range {segment.base:#x}+{segment.size} overlaps "
                    f"mounted segment {o.id} ({o.base:#x}+{o.size})"
                )
        client = self._touch_client(client_id, now)
        seg = _Seg(
            segment,
            client_id,
            OffsetAllocator(segment.base, segment.size, alignment=self.config.alignment),
            self._next_seg_num,
        )
        self._next_seg_num += 1
        self._objects.segs[seg.num] = seg
        self._segments[segment.id] = seg
        self._seg_list.append(seg)
        client.segments.add(segment.id)
        self._capacity += segment.size
        self._hold_in_use(seg, now)

    def _remember_in_use(self, seg: _Seg, now: float) -> None:
        """Before an expired client's segment is dropped: note the extents that other clients
        may still write (pending writes, replica tasks, promotions) or read (open read
        windows), and until when, so that a re-mount of the same segment does not hand them
        out while they do (:meth:`_hold_in_use`)."""
        held: _InUse = []
        cfg = self.config

        def note(until: float, reps: list[_Replica]) -> None:
            if until > now:
                held.extend((until, r.addr, r.length) for r in reps if r.seg is seg)

        objects = self._objects
        table = objects.table
        for h in objects.handles_on(seg):
            if table.is_cold(h):  # read from the row: no record for each object of the segment
                _, addr, size, _, _, read, _ = table.cold_row(h)
                if read > now:
                    held.append((read, addr, size))
                continue
            obj = objects.by_handle(h)
            if obj.pending is not None:
                note(
                    obj.pending.started + cfg.put_start_release_timeout,
                    obj.pending.version.replicas,
                )
            if obj.readable is not None:
                note(obj.read_deadline, obj.readable.replicas)
            if obj.promoting is not None:
                note(obj.promoting.started + cfg.put_start_release_timeout, obj.promoting.replicas)
        for task in self._active_tasks.values():
            note(task.started + cfg.processing_task_timeout, task.allocated)
        for until, _, reps in self._deferred:
            note(until, reps)
        if held:
            self._in_use[seg.segment.id] = (seg.segment, held)

    def _hold_in_use(self, seg: _Seg, now: float) -> None:
        """A re-mounted segment: keep what was in use when its owner expired allocated (as
        deferred frees) until then."""
        entry = self._in_use.pop(seg.segment.id, None)
        if entry is None or entry[0] != seg.segment:
            return
        for until, addr, length in entry[1]:
            if until > now and seg.alloc.reserve(addr, length):
                self._used += seg.alloc.extent(addr)
                self._defer(until, [_Replica(seg, addr, length)])

    def remount_segments(self, client_id: str, segments: Iterable[Segment], now: float) -> None:
        """Mount each of ``segments`` not mounted yet (after ``NEED_REMOUNT``)."""
        _check_client_id(client_id)
        known = client_id in self._clients
        client = self._touch_client(client_id, now)
        for seg in segments:
            if not known and seg.id not in self._segments:
                # a client this master never saw remounts: it was mounted at an earlier master
                # (a restart without state), so absent keys may have been stored then
                self.misses.forget_earlier(now)
            self.mount_segment(client_id, seg, now)
        if self.quarantine:
            self._holder_alive(client, now)

    def unmount_segment(self, client_id: str, segment_id: str, now: float) -> None:
        """Unmount a segment of ``client_id``: its replicas vanish at once."""
        seg = self._segments.get(segment_id)
        if seg is None:
            raise SegmentNotFoundError(f"segment id {segment_id!r} is not mounted")
        if seg.client_id != client_id:
            raise IllegalClientError(
                f"segment {segment_id} belongs to client {seg.client_id}, not {client_id}"
            )
        self._touch_client(client_id, now)
        self._drop_segment(seg)

    def _drop_segment(self, seg: _Seg, *, owner_died: bool = False) -> None:
        for task in list(self._active_tasks.values()):
            if task.source.seg is seg or seg in task.targets:
                self._fail_task(task, f"segment {seg.segment.name!r} was unmounted")
        seg.mounted = False
        del self._segments[seg.segment.id]
        self._seg_list.remove(seg)
        client = self._clients.get(seg.client_id)
        if client is not None:
            client.segments.discard(seg.segment.id)
        self._capacity -= seg.segment.size
        self._used -= seg.alloc.used
        name = seg.segment.name
        if name in self.quarantine and not any(s.segment.name == name for s in self._seg_list):
            self.quarantine.end(name)
        objects = self._objects
        table = objects.table
        policy = self.policy
        gone: list[str] = []  # cold objects: their one replica was there
        for h in objects.handles_on(seg):
            key = table.key(h)
            if table.is_cold(h):
                if h in policy:
                    policy.on_remove(h)
                objects.remove_handle(h)
                gone.append(key)
                _kv.removed(self, key)
                continue
            obj = objects.by_handle(h)
            had_memory = obj.readable is not None and bool(obj.readable.replicas)
            for ver in (obj.readable, obj.pending.version if obj.pending else None):
                if ver is not None:
                    ver.replicas = [r for r in ver.replicas if r.seg is not seg]
            ver = obj.readable
            if obj.demoting is not None and obj.demoting.client_id == seg.client_id:
                self._clear_demoting(obj)  # its source extent went with the segment
                if ver is not None and ver.replicas and obj.promoting is None:
                    self.policy.on_insert(obj.h, ver.size)  # back under the DRAM policy
            if ver is not None and not ver.replicas:
                if had_memory:
                    _kv.removed(self, key)
                self._untrack(obj)
                if not ver.disk:  # else it is still on an SSD
                    obj.readable = None
                    self._end_tier_moves(obj)
                    if owner_died:
                        self.misses.record_owner_death([key], owner=seg.client_id)
                    else:
                        self.misses.record_removal(
                            key, detail=f"segment {seg.segment.id} unmounted"
                        )
            if obj.pending is not None and not obj.pending.version.replicas:
                obj.pending = None
                self._writing.pop(key, None)
            if obj.readable is None and obj.pending is None:
                del self._objects[key]
        if owner_died:
            self.misses.record_owner_death(gone, owner=seg.client_id)
        else:
            detail = f"segment {seg.segment.id} unmounted"
            for key in gone:
                self.misses.record_removal(key, detail=detail)
        self._objects.segs.pop(seg.num, None)
        # deferred extents on this segment went with it (their bytes were counted in alloc.used)
        self._deferred = [
            (t, n, kept)
            for t, n, reps in self._deferred
            if (kept := [r for r in reps if r.seg is not seg])
        ]
        heapq.heapify(self._deferred)

    def credit_stall(self, seconds: float) -> None:
        """The master itself could not serve requests for ``seconds`` (its loop was busy or
        the process was stopped): that time does not count toward any client's silence, so
        every client deadline moves by it. A client is expired only after ``client_ttl`` of
        time during which the master was responsive and heard nothing from it."""
        if seconds > 0:
            for client in self._clients.values():
                client.deadline += seconds
            self.stats.stall_seconds += seconds

    def expire_clients(self, now: float) -> list[str]:
        """Drop clients whose deadline passed (their segments and replicas); returns their ids."""
        dead = [cid for cid, c in self._clients.items() if c.deadline < now]
        for cid in dead:
            client = self._clients.pop(cid)
            for sid in list(client.segments):
                seg = self._segments.get(sid)
                if seg is not None:
                    self._remember_in_use(seg, now)
                    self._drop_segment(seg, owner_died=True)
            lost = []
            for key in client.ssd_keys:
                obj = self._objects.get(key)
                if obj is None or obj.readable is None or cid not in obj.readable.disk:
                    continue
                obj.readable.disk = tuple(c for c in obj.readable.disk if c != cid)
                if not obj.readable.disk:
                    _kv.removed(self, key, _kv.MEDIUM_DISK)
                if not obj.readable.replicas and not obj.readable.disk:
                    self._drop_object(obj, now)
                    lost.append(key)
            self.misses.record_owner_death(lost, owner=cid, now=now)
        self.stats.clients_expired += len(dead)
        return dead

    def _allocate(self, size: int, config: ReplicateConfig) -> list[_Replica]:
        want = config.replica_num
        out: list[_Replica] = []
        used_segs: set[int] = set()
        quarantined = self.quarantine
        for seg in self._candidates(config):
            if id(seg) in used_segs or seg.draining:
                continue
            if quarantined and seg.segment.name in quarantined:
                continue
            addr = seg.alloc.allocate(size)
            if addr is None:
                continue
            used_segs.add(id(seg))
            self._used += seg.alloc.extent(addr)
            out.append(_Replica(seg, addr, size))
            if len(out) == want:
                break
        return out

    def _candidates(self, config: ReplicateConfig) -> Iterable[_Seg]:
        preferred = config.preferred()
        if preferred:
            for name in preferred:
                for seg in self._seg_list:
                    if seg.segment.name == name:
                        yield seg
        segs = self._seg_list
        n = len(segs)
        if n == 0:
            return
        if self.config.allocation_strategy == "free_ratio_first":
            yield from sorted(segs, key=lambda s: s.alloc.used / s.alloc.capacity)
            return
        start = self.rng.randrange(n)
        for i in range(n):
            yield segs[(start + i) % n]

    def all_segments(self) -> list[SegmentInfo]:
        return [
            SegmentInfo(
                segment=s.segment,
                client_id=s.client_id,
                used=s.alloc.used,
                capacity=s.alloc.capacity,
                status="DRAINING" if s.draining else "OK",
            )
            for s in self._seg_list
        ]

    def _defer(self, until: float, reps: list[_Replica]) -> None:
        """Free ``reps`` once ``until`` has passed (:meth:`_release_deferred`)."""
        self._defer_seq += 1
        heapq.heappush(self._deferred, (until, self._defer_seq, reps))

    def _release_deferred(self, now: float) -> None:
        """Free the deferred extents whose time has come (earliest first; O(log n) each)."""
        heap = self._deferred
        while heap and heap[0][0] <= now:
            self._free_replicas(heapq.heappop(heap)[2])

    def _release_after_lease(self, obj: _Object, ver: _Version, now: float) -> None:
        # Only a read window (not the policy lease) can have a reader copying these bytes.
        if obj.read_deadline > now:
            self._defer(obj.read_deadline, ver.replicas)
        else:
            self._free_version(ver)

    def _hold_written(self, reps: list[_Replica], now: float) -> None:
        """Free extents a writer gave up on, after ``put_revoke_hold`` (bytes of its cancelled
        transfer may still land in them until then)."""
        if not reps:
            return
        if self.config.put_revoke_hold > 0:
            self._defer(now + self.config.put_revoke_hold, reps)
        else:
            self._free_replicas(reps)

    def _free_version(self, ver: _Version) -> None:
        self._free_replicas(ver.replicas)

    def _free_replicas(self, reps: list[_Replica]) -> None:
        for r in reps:
            if r.seg.mounted:
                self._used -= r.seg.alloc.extent(r.addr)
                r.seg.alloc.free(r.addr)
