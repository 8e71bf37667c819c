"""Draining a segment before its owner leaves (graceful shutdown, rolling restarts).

``DrainSegment(client_id, segment_id)`` marks the segment ``DRAINING`` (upstream Mooncake's
``SegmentStatus::DRAINING``: it stays readable but takes no new allocation: no put, upsert,
promotion or task target lands on it) and plans what each readable object with a replica on
it needs, by one rule:

* **another memory replica exists**: the replica on the draining segment leaves the object's
  replica list at once (new readers are sent elsewhere; the bytes stay where they are, since
  nothing is allocated there any more, for readers already holding it until the segment is
  unmounted) and a copy task from a remaining replica to a segment without one restores the
  replica count, when some segment has room for it (re-replication; executed by the owner of
  the remaining replica);
* **it is the only copy**: a move task to another segment with room (executed by the draining
  client, which still serves it); with no room anywhere the object stays until the unmount drops
  it (its miss reads "segment ... unmounted").

Objects with a write, a task or a tier move in flight are left for a later call. The call is
idempotent: the draining client repeats it until the answer says nothing is in flight
(:class:`~mooncake._core.store_types.DrainStatus`), then unmounts. A segment's draining mark is
not part of snapshots (the client's next call sets it again on a restored master).
"""

from __future__ import annotations

from mooncake._core.master.base import _StateBase
from mooncake._core.master.records import _Object, _Seg
from mooncake._core.store_types import DrainStatus, TaskType
from mooncake.errors import IllegalClientError, SegmentNotFoundError


class _Drain(_StateBase):
    """``DrainSegment``: stop allocating on a segment and move its objects elsewhere."""

    def drain_segment(self, client_id: str, segment_id: str, now: float) -> DrainStatus:
        """Mark ``segment_id`` of ``client_id`` draining and plan its objects (module doc)."""
        seg = self._segments.get(segment_id)
        if seg is None:
            raise SegmentNotFoundError(f"segment id {segment_id!r} is not mounted")
        if seg.client_id != client_id:
            raise IllegalClientError(
                f"segment {segment_id} belongs to client {seg.client_id}, not {client_id}"
            )
        self._touch_client(client_id, now)
        return self._drain_plan(seg, now, None, 0)

    def drain_job_step(
        self, segment_name: str, targets: list[str], limit: int, now: float
    ) -> DrainStatus | None:
        """One step of a master-run drain job on the segment named ``segment_name``: the
        :meth:`drain_segment` rules, with move and copy targets taken from ``targets`` only
        (empty: any segment) and at most ``limit`` objects of the segment under a task at once
        (0: no bound). The owner's liveness is not refreshed. None when no segment of that
        name is mounted (never raises: it is applied from the replicated log)."""
        seg = self._seg_named(segment_name)
        if seg is None:
            return None
        return self._drain_plan(seg, now, frozenset(targets) if targets else None, limit)

    def undrain_segment(self, segment_name: str) -> bool:
        """Clear the draining mark of the segment named ``segment_name`` (a cancelled drain
        job): it takes allocations again. Whether such a segment is mounted."""
        seg = self._seg_named(segment_name)
        if seg is None:
            return False
        seg.draining = False
        return True

    def drain_units(self, segment_name: str) -> list[tuple[str, int, bool]] | None:
        """``(key, size, busy)`` of every object whose readable version has a replica on the
        segment named ``segment_name`` (``busy``: a task, write or tier move is under way on
        it); None when no such segment is mounted. A read: changes nothing."""
        seg = self._seg_named(segment_name)
        if seg is None:
            return None
        out: list[tuple[str, int, bool]] = []
        objects = self._objects
        for h in objects.handles_on(seg):
            obj = objects.by_handle(h)
            ver = obj.readable
            if ver is None or not any(r.seg is seg for r in ver.replicas):
                continue
            busy = (
                obj.task is not None
                or obj.pending is not None
                or obj.demoting is not None
                or obj.promoting is not None
            )
            out.append((obj.key, ver.size, busy))
        self.settle()  # the records read are folded back (representation only)
        return out

    def segment_draining(self, segment_name: str) -> bool | None:
        """Whether the segment named ``segment_name`` is draining; None when not mounted."""
        seg = self._seg_named(segment_name)
        return None if seg is None else seg.draining

    def key_busy(self, key: str) -> bool | None:
        """Whether the object of ``key`` (the internal, tenant-prefixed key) has a task (a
        copy or move) under way; None when no object of that key exists. A read."""
        obj = self._objects.get(key)
        if obj is None:
            return None
        busy = obj.task is not None
        self.settle()
        return busy

    def _seg_named(self, name: str) -> _Seg | None:
        return next((s for s in self._seg_list if s.segment.name == name), None)

    def _drain_plan(
        self, seg: _Seg, now: float, targets: frozenset[str] | None, limit: int
    ) -> DrainStatus:
        """Mark ``seg`` draining and plan its objects (module doc); with ``limit`` > 0 at most
        that many of its objects are under a task afterwards (the rest wait for a later call)."""
        seg.draining = True
        out = DrainStatus()
        read_until = now
        objects = self._objects
        planned: list[_Object] = []
        busy = 0
        for h in objects.handles_on(seg):
            obj = objects.by_handle(h)
            ver = obj.readable
            if obj.pending is not None and any(r.seg is seg for r in obj.pending.version.replicas):
                out.writes += 1
            if ver is None:
                continue
            if not any(r.seg is seg for r in ver.replicas):
                continue
            read_until = max(read_until, obj.read_deadline)
            if (
                obj.task is not None
                or obj.pending is not None
                or obj.demoting is not None
                or obj.promoting is not None
            ):
                out.tasks += 1
                busy += 1
                continue
            planned.append(obj)
        for obj in planned:
            ver = obj.readable
            assert ver is not None
            mine = next(r for r in ver.replicas if r.seg is seg)
            others = [r for r in ver.replicas if r.seg is not seg]
            target = self._drain_target(obj, ver.size, targets)
            if limit > 0 and target is not None and busy >= limit:
                out.tasks += 1  # waits for a free slot: still in flight for the caller
                continue
            if others:
                ver.replicas = others
                seg.reads_until = max(seg.reads_until, obj.read_deadline)
                if obj.read_deadline > now:  # a reader may still be copying from it
                    self._defer(obj.read_deadline, [mine])
                else:
                    self._free_replicas([mine])
                out.released += 1
                if target is not None:
                    self._new_task(obj, TaskType.REPLICA_COPY, others[0], [target], now)
                    out.copies += 1
                    busy += 1
            elif target is not None:
                self._new_task(obj, TaskType.REPLICA_MOVE, mine, [target], now)
                out.moves += 1
                out.tasks += 1
                busy += 1
            else:
                out.stranded += 1
        out.read_wait_s = max(0.0, max(read_until, seg.reads_until) - now)
        return out

    def _drain_target(
        self, obj: _Object, size: int, among: frozenset[str] | None = None
    ) -> str | None:
        """The name of the segment with the most free bytes (at least ``size``) that is not
        draining, not quarantined, holds no replica of ``obj`` and is in ``among`` (None: any
        segment); None when there is none."""
        assert obj.readable is not None
        held = {id(r.seg) for r in obj.readable.replicas}
        best: _Seg | None = None
        best_free = size - 1
        quarantined = self.quarantine
        for s in self._seg_list:
            if s.draining or id(s) in held:
                continue
            if among is not None and s.segment.name not in among:
                continue
            if quarantined and s.segment.name in quarantined:
                continue
            free = s.alloc.capacity - s.alloc.used
            if free > best_free:
                best, best_free = s, free
        return None if best is None else best.segment.name
