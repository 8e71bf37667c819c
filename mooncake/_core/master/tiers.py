"""The SSD tier: demotion on eviction, promotion back to memory, SSD-only objects."""

from __future__ import annotations

from mooncake._core import kv_events as _kv
from mooncake._core.master.base import _StateBase
from mooncake._core.master.config import _check_client_id, _check_key
from mooncake._core.master.records import (
    KeySet,
    _Client,
    _Demote,
    _Object,
    _Promote,
    _Replica,
    _Version,
)
from mooncake._core.misses import Miss
from mooncake._core.policies import Pin
from mooncake._core.store_types import (
    DemoteTask,
    DiskDrop,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    TierTasks,
)
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    ReplicaNotReadyError,
)


class _Tiers(_StateBase):
    """SSD copies, demotions and promotions of objects."""

    # -- tiers: SSD copies, demotion, promotion ---------------------------------------------

    def mount_local_disk(
        self, client_id: str, capacity: int, now: float, *, tier_id: str = ""
    ) -> None:
        """``client_id`` has an SSD tier of ``capacity`` bytes: evictions from its segments may
        be demoted to it (``offload_on_evict``). Capacity 0 unmounts it for new demotions.

        ``tier_id`` names the tier's directory. A directory is open in one process at a time
        (it is locked), so another known client with the same ``tier_id`` is a previous
        instance that died: its SSD copies (and the deletions it was told to do) pass to
        ``client_id``, whose ``PutLocal`` of them then re-adopts them instead of dropping them."""
        _check_client_id(client_id)
        if capacity < 0:
            raise InvalidArgumentError(f"SSD capacity must be >= 0, got {capacity}")
        client = self._touch_client(client_id, now)
        client.ssd_capacity = capacity
        if not tier_id:
            return
        for cid, old in self._clients.items():
            if cid != client_id and old.ssd_tier_id == tier_id:
                self._adopt_disk(cid, old, client_id, client)
        client.ssd_tier_id = tier_id[:128]

    def _adopt_disk(self, old_id: str, old: _Client, new_id: str, new: _Client) -> None:
        for key in old.ssd_keys:
            obj = self._objects.get(key)
            ver = obj.readable if obj is not None else None
            if ver is None or old_id not in ver.disk:
                continue
            ver.disk = (*(c for c in ver.disk if c not in (old_id, new_id)), new_id)
            new.ssd_keys.add(key)
        new.stale_ssd.update(d.key for d in old.disk_drops)
        new.disk_drops += old.disk_drops
        old.ssd_keys, old.disk_drops, old.demote_tasks = KeySet(), [], []
        old.ssd_capacity, old.ssd_tier_id = 0, ""

    def fetch_tier_tasks(self, client_id: str, now: float) -> TierTasks:
        """Take ``client_id``'s queued demotions and SSD copies to delete (none for a client
        the master does not know: polling does not make it known, mounting does)."""
        _check_client_id(client_id)
        client = self._renew_known(client_id, now)
        if client is None:
            return TierTasks(demote=[], drop=[])
        out = TierTasks(demote=client.demote_tasks, drop=client.disk_drops)
        client.demote_tasks, client.disk_drops = [], []
        return out

    def _demotion_owner(self, ver: _Version) -> _Replica | None:
        if not self.config.offload_on_evict:
            return None
        for r in ver.replicas:
            c = self._clients.get(r.seg.client_id)
            if c is not None and c.ssd_capacity >= ver.size:
                return r
        return None

    def _start_demotion(self, obj: _Object, source: _Replica, now: float) -> None:
        ver = obj.readable
        assert ver is not None
        cid = source.seg.client_id
        obj.demoting = _Demote(cid, now + self.config.demote_timeout, ver.size)
        self._demotions.pop(obj.key, None)
        self._demotions[obj.key] = obj.demoting
        self._demoting_bytes += ver.size
        self._untrack(obj)
        self._clients[cid].demote_tasks.append(
            DemoteTask(
                key=obj.key,
                vid=ver.vid,
                segment_name=source.seg.segment.name,
                addr=source.addr,
                size=ver.size,
            )
        )

    def _to_disk_only(self, obj: _Object, now: float) -> None:
        ver = obj.readable
        assert ver is not None and ver.disk
        self._release_after_lease(obj, ver, now)
        if ver.replicas:
            _kv.removed(self, obj.key)
        ver.replicas = []
        self._untrack(obj)

    def _tier_object(self, client_id: str, key: str, vid: int) -> tuple[_Object, _Version]:
        _check_client_id(client_id)
        obj = self._objects.get(key)
        if obj is None or obj.readable is None or obj.readable.vid != vid:
            raise ObjectNotFoundError(f"object {key!r} version {vid} is gone (removed or replaced)")
        return obj, obj.readable

    def demote_end(self, client_id: str, key: str, vid: int, now: float) -> None:
        """``client_id`` holds version ``vid`` of ``key`` on its SSD: free the memory replicas.

        ``OBJECT_NOT_FOUND`` if that version is gone (the client must delete its copy);
        ``ILLEGAL_CLIENT`` if no demotion of it to this client is in progress. Idempotent: a
        repeat after it was applied (the client lost the first answer) succeeds.
        """
        obj, ver = self._tier_object(client_id, key, vid)
        if obj.demoting is None and client_id in ver.disk:
            self._touch_client(client_id, now)
            return
        if obj.demoting is None or obj.demoting.client_id != client_id:
            raise IllegalClientError(f"no demotion of {key!r} to client {client_id} is in progress")
        self._clear_demoting(obj)
        client = self._touch_client(client_id, now)
        if not ver.disk:
            _kv.stored(self, key, _kv.MEDIUM_DISK)
        ver.disk = (*ver.disk, client_id)
        client.ssd_keys.add(key)
        self._to_disk_only(obj, now)
        self.tiers["ssd"].demotions += 1

    def demote_revoke(self, client_id: str, key: str, vid: int, now: float) -> None:
        """The demotion of ``key`` failed: the object is dropped (evicted from DRAM)."""
        obj, _ = self._tier_object(client_id, key, vid)
        if obj.demoting is None or obj.demoting.client_id != client_id:
            raise IllegalClientError(f"no demotion of {key!r} to client {client_id} is in progress")
        self._drop_object(obj, now)
        self.misses.record_eviction(key, policy=self.policy.name, tier="dram", now=now)

    def promote_start(
        self, client_id: str, key: str, vid: int, now: float
    ) -> list[ReplicaDescriptor]:
        """Allocate a memory replica for the SSD-only version ``vid`` of ``key`` (on the
        client's own segments first); the client writes it and calls :meth:`promote_end`.

        ``OBJECT_ALREADY_EXISTS`` if it has memory replicas already, ``REPLICA_IS_NOT_READY``
        if a promotion is in progress, ``NO_AVAILABLE_HANDLE`` if no space (after eviction).
        """
        obj, ver = self._tier_object(client_id, key, vid)
        if ver.replicas:
            raise ObjectAlreadyExistsError(f"object {key!r} is already in memory")
        if obj.promoting is not None or obj.pending is not None:
            raise ReplicaNotReadyError(f"object {key!r} is being promoted or written")
        client = self._touch_client(client_id, now)
        mine = [self._segments[s].segment.name for s in client.segments if s in self._segments]
        config = ReplicateConfig(replica_num=1, preferred_segments=mine)
        if self._capacity and (
            self._used + ver.size > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now, need=ver.size, limit=self._put_round)
        replicas = self._allocate(ver.size, config)
        if not replicas:
            raise NoAvailableHandleError(f"no segment has {ver.size} free bytes to promote {key!r}")
        obj.promoting = _Promote(client_id, replicas, now)
        self._promotions.pop(key, None)
        self._promotions[key] = obj.promoting
        return [r.descriptor(ReplicaStatus.PROCESSING) for r in replicas]

    def promote_end(self, client_id: str, key: str, vid: int, now: float) -> None:
        """The promoted replica is written: the object is in DRAM again."""
        obj, ver = self._tier_object(client_id, key, vid)
        p = obj.promoting
        if p is None or p.client_id != client_id:
            raise IllegalClientError(f"no promotion of {key!r} by client {client_id}")
        obj.promoting = None
        self._promotions.pop(key, None)
        live = [r for r in p.replicas if r.seg.mounted]
        if not live:
            raise ObjectNotFoundError(f"the segment receiving {key!r} was unmounted")
        ver.replicas = live
        _kv.stored(self, key)
        self.policy.on_insert(obj.h, ver.size, now=now)
        if obj.hard_pinned:
            self.policy.set_pin(obj.h, Pin.HARD)
        elif obj.soft_pin_deadline is not None:
            self.policy.set_pin(obj.h, Pin.SOFT)
        self.tiers["ssd"].promotions += 1

    def promote_revoke(self, client_id: str, key: str, vid: int, now: float) -> None:
        obj, _ = self._tier_object(client_id, key, vid)
        p = obj.promoting
        if p is None or p.client_id != client_id:
            raise IllegalClientError(f"no promotion of {key!r} by client {client_id}")
        obj.promoting = None
        self._promotions.pop(key, None)
        self._hold_written(p.replicas, now)

    def evict_disk_replica(
        self, client_id: str, key: str, vid: int, policy: str, now: float
    ) -> None:
        """``client_id`` evicted (by ``policy``) or lost its SSD copy of ``key`` version ``vid``.

        The object is dropped if that was its last replica. A version already gone is a no-op.
        """
        _check_client_id(client_id)
        client = self._renew_known(client_id, now)
        obj = self._objects.get(key)
        if client is None or obj is None or obj.readable is None or obj.readable.vid != vid:
            return
        ver = obj.readable
        if client_id not in ver.disk:
            return
        ver.disk = tuple(c for c in ver.disk if c != client_id)
        client.ssd_keys.discard(key)
        if not ver.disk:
            _kv.removed(self, key, _kv.MEDIUM_DISK)
        self.tiers["ssd"].evictions += 1
        if not ver.replicas and not ver.disk:
            # its last copy: gone (a promotion in flight fails at PromoteEnd)
            self._drop_object(obj, now)
            self.misses.record_eviction(key, policy=policy, tier="ssd", now=now)

    def put_local(self, client_id: str, key: str, size: int, now: float) -> int:
        """Announce an SSD copy ``client_id`` kept across a restart as a new object held only on
        its SSD; returns its version id. ``OBJECT_ALREADY_EXISTS`` if ``key`` exists (the client
        must drop its copy: the key has a newer life)."""
        _check_client_id(client_id)
        _check_key(key)
        if size <= 0:
            raise InvalidArgumentError(f"object size must be positive, got {size}")
        client = self._touch_client(client_id, now)
        if client.ssd_capacity <= 0:
            raise InvalidArgumentError(f"client {client_id} has no SSD tier mounted")
        if key in client.stale_ssd:
            client.stale_ssd.discard(key)
            raise ObjectAlreadyExistsError(f"the SSD copy of {key!r} was to be deleted")
        obj = self._objects.get(key)
        if obj is not None:
            ver = obj.readable
            if ver is not None and client_id in ver.disk:  # adopted from a previous instance
                if ver.size == size:
                    return ver.vid
                ver.disk = tuple(c for c in ver.disk if c != client_id)
                client.ssd_keys.discard(key)
                if not ver.replicas and not ver.disk:
                    self._drop_object(obj, now)
            raise ObjectAlreadyExistsError(f"object {key!r} already exists")
        self._next_vid += 1
        obj = self._objects[key] = _Object(key, writer=client_id)
        obj.readable = _Version(size, [], self._next_vid, (client_id,))
        client.ssd_keys.add(key)
        self.misses.record_stored(key)
        _kv.stored(self, key, _kv.MEDIUM_DISK)
        return self._next_vid

    def explain_miss(self, key: str) -> Miss:
        """Why ``key`` is not readable (without counting a miss)."""
        return self.misses.explain(key)

    def _end_tier_moves(self, obj: _Object) -> None:
        """The readable version goes away: cancel its demotion, park its promotion's space."""
        self._clear_demoting(obj)
        p = obj.promoting
        if p is not None:
            obj.promoting = None
            self._promotions.pop(obj.key, None)
            # the promoter may still be writing: reuse only after the zombie release timeout
            self._defer(p.started + self.config.put_start_release_timeout, p.replicas)

    def _clear_demoting(self, obj: _Object) -> None:
        if obj.demoting is not None:
            self._demoting_bytes -= obj.demoting.size
            obj.demoting = None
            self._demotions.pop(obj.key, None)

    def _forget_disk(self, key: str, ver: _Version) -> None:
        for cid in ver.disk:
            c = self._clients.get(cid)
            if c is None:
                continue
            c.ssd_keys.discard(key)
            c.disk_drops.append(DiskDrop(key=key, vid=ver.vid))
            if len(c.disk_drops) > self.config.max_disk_drops:
                del c.disk_drops[0]
        ver.disk = ()

    def _expire_tier_moves(self, now: float) -> None:
        """Drop objects whose demotion outlived ``demote_timeout``; park promotions older than
        ``put_start_discard_timeout``. Both queues are in start order (``now`` never
        decreases), so only their expired heads are looked at."""
        demotions = self._demotions
        while demotions:
            key, d = next(iter(demotions.items()))
            if d.deadline > now:
                break
            del demotions[key]
            obj = self._objects.get(key)
            if obj is not None and obj.demoting is d:
                self._drop_object(obj, now)
                self.misses.record_eviction(key, policy=self.policy.name, tier="dram", now=now)
        stale = self.config.put_start_discard_timeout
        promotions = self._promotions
        while promotions:
            key, p = next(iter(promotions.items()))
            if now - p.started < stale:
                break
            del promotions[key]
            obj = self._objects.get(key)
            if obj is not None and obj.promoting is p:
                self._end_tier_moves(obj)

    # -- helpers ---------------------------------------------------------------------------
