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
        seg.draining = True
        out = DrainStatus()
        read_until = now
        objects = self._objects
        for h in objects.handles_on(seg):
            obj = objects.by_handle(h)
            ver = obj.readable
            if obj.pending is not None and any(r.seg is seg for r in obj.pending.version.replicas):
                out.writes += 1
            if ver is None:
                continue
            mine = next((r for r in ver.replicas if r.seg is seg), None)
            if mine is None:
                continue
            read_until = max(read_until, obj.read_deadline)
            if obj.task is not None or obj.pending is not None:
                out.tasks += 1
                continue
            if obj.demoting is not None or obj.promoting is not None:
                out.tasks += 1
                continue
            others = [r for r in ver.replicas if r.seg is not seg]
            target = self._drain_target(obj, ver.size)
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
            elif target is not None:
                self._new_task(obj, TaskType.REPLICA_MOVE, mine, [target], now)
                out.moves += 1
                out.tasks += 1
            else:
                out.stranded += 1
        out.read_wait_s = max(0.0, max(read_until, seg.reads_until) - now)
        return out

    def _drain_target(self, obj: _Object, size: int) -> str | None:
        """The name of the segment with the most free bytes (at least ``size``) that is not
        draining, not quarantined and holds no replica of ``obj``; None when there is none."""
        assert obj.readable is not None
        held = {id(r.seg) for r in obj.readable.replicas}
        best: _Seg | None = None
        best_free = size - 1
        quarantined = self.quarantine
        for s in self._seg_list:
            if s.draining or id(s) in held:
                continue
            if quarantined and s.segment.name in quarantined:
                continue
            free = s.alloc.capacity - s.alloc.used
            if free > best_free:
                best, best_free = s, free
        return None if best is None else best.segment.name
