"""Objects and their versions: writes (put/upsert start, end, revoke), removal, queries."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from mooncake._core import kv_events as _kv
from mooncake._core.master.base import _StateBase
from mooncake._core.master.config import (
    _EVICT_RETRIES,
    _check_client_id,
    _check_key,
    _codes,
    _compile,
)
from mooncake._core.master.records import _Object, _Pending, _Version
from mooncake._core.master.tenants import tenant_of
from mooncake._core.policies import Pin
from mooncake._core.rpc_types import Item
from mooncake._core.store_types import (
    ObjectInfo,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    InvalidWriteError,
    MooncakeError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectHasLeaseError,
    ObjectHasReplicationTaskError,
    ObjectNotFoundError,
    ReplicaNotReadyError,
)


class _Objects(_StateBase):
    """Writes, zombie writes, removal and per-key queries of objects."""

    # -- writes ----------------------------------------------------------------------------

    def put_start(
        self, client_id: str, key: str, size: int, config: ReplicateConfig, now: float
    ) -> list[ReplicaDescriptor]:
        """Allocate replicas for a new object; it becomes readable at :meth:`put_end`.

        ``OBJECT_ALREADY_EXISTS`` if ``key`` is readable (Mooncake's idempotent put: what is
        stored is an acknowledged put's bytes). ``REPLICA_IS_NOT_READY`` if its only version
        is being written by another put (unless that write is a zombie older than
        ``put_start_discard_timeout``, which is pre-empted): that write may still fail, so
        "exists" would be a success with nothing stored; the client waits and retries.
        ``NO_AVAILABLE_HANDLE`` if not even one replica fits after eviction.
        """
        _check_client_id(client_id)
        _check_key(key)
        self._check_put(size, config)
        obj = self._objects.get(key)
        if obj is not None:
            if obj.readable is not None:
                raise ObjectAlreadyExistsError(f"object {key!r} already exists")
            self._preempt_pending(obj, now)
        return self._start_write(client_id, key, size, config, now, obj)

    def upsert_start(
        self, client_id: str, key: str, size: int, config: ReplicateConfig, now: float
    ) -> list[ReplicaDescriptor]:
        """Like :meth:`put_start`, but a readable ``key`` gets a new version at :meth:`put_end`.

        ``REPLICA_IS_NOT_READY`` while another (non-zombie) write of ``key`` is in progress,
        ``OBJECT_HAS_REPLICATION_TASK`` while a copy/move of it is.
        """
        _check_client_id(client_id)
        _check_key(key)
        self._check_put(size, config)
        obj = self._objects.get(key)
        if obj is not None:
            if obj.task is not None:
                raise ObjectHasReplicationTaskError(
                    f"object {key!r} has task {obj.task.id} in flight"
                )
            self._preempt_pending(obj, now, upsert=True)
        return self._start_write(client_id, key, size, config, now, obj)

    def _check_put(self, size: int, config: ReplicateConfig) -> None:
        if size <= 0:
            raise InvalidArgumentError(f"object size must be positive, got {size}")
        if config.replica_num < 1:
            raise InvalidArgumentError(f"replica_num must be >= 1, got {config.replica_num}")
        if config.group_ids is not None and len(config.group_ids) != 1:
            raise InvalidArgumentError(
                f"a put of one key takes one group id, got {len(config.group_ids)}"
            )
        if config.soft_pin_ttl_ms is not None:
            if config.soft_pin_action != SoftPinAction.ENABLE:
                raise InvalidArgumentError(
                    "soft_pin_ttl_ms is only valid with soft_pin_action=ENABLE"
                )
            if config.soft_pin_ttl_ms < 0:
                raise InvalidArgumentError(
                    f"soft_pin_ttl_ms must be >= 0, got {config.soft_pin_ttl_ms}"
                )

    def _preempt_pending(self, obj: _Object, now: float, *, upsert: bool = False) -> None:
        pending = obj.pending
        if pending is None:
            return
        if now - pending.started < self.config.put_start_discard_timeout:
            # not "exists": that write may still fail, and the caller must not assume its
            # own happened (put or upsert)
            raise ReplicaNotReadyError(f"object {obj.key!r} is being written; retry later")
        # zombie: the writer may still be writing, so its space waits for the release timeout
        obj.pending = None
        self._writing.pop(obj.key, None)
        self._defer(
            pending.started + self.config.put_start_release_timeout, pending.version.replicas
        )
        self.stats.zombies_discarded += 1

    def _start_write(
        self,
        client_id: str,
        key: str,
        size: int,
        config: ReplicateConfig,
        now: float,
        obj: _Object | None,
    ) -> list[ReplicaDescriptor]:
        tenant = tenant_of(key)
        if tenant:  # the tenant's quota first: nothing is evicted for a write it cannot hold
            try:
                self.tenants.admit(tenant, size, obj is None)
            except MooncakeError:
                self._forget_if_empty(key, obj)
                raise
        # Objects are not striped: one larger than every segment can never fit, and evicting
        # for it would only empty the cache.
        if not any(seg.alloc.size >= size for seg in self._seg_list):
            self.stats.put_failures_no_space += 1
            self._forget_if_empty(key, obj)
            raise NoAvailableHandleError(
                f"object {key!r} of {size} bytes is larger than every mounted segment "
                f"({len(self._seg_list)} segments)"
            )
        if (
            self._used - self._demoting_bytes - self._held_bytes() + size
            > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now, need=size, limit=self._put_round)
        replicas = self._allocate(size, config)
        # Eviction frees bytes anywhere, but the object needs one contiguous extent: retry with
        # growing targets while eviction makes progress (the retries together: one round).
        need = max(size, int(self.config.eviction_ratio * self._capacity))
        retry_round = max(1, self.config.eviction_round_objects // _EVICT_RETRIES)
        for _ in range(_EVICT_RETRIES):
            if replicas or not self.evict(now, need=need, limit=retry_round):
                break
            replicas = self._allocate(size, config)
            need *= 2
        if not replicas:
            self.stats.put_failures_no_space += 1
            self._forget_if_empty(key, obj)
            back = self._held_back_at(size)
            if back > 0:
                # The space comes back by itself: the eviction run this refusal began must not
                # go on in the sweeps and evict the very object the retried put then writes.
                self._evict_goal = 0
                self.space_held_until = max(self.space_held_until, back)
            raise NoAvailableHandleError(
                f"no mounted segment has {size} free bytes for {key!r} "
                f"({len(self._seg_list)} segments, {self._used}/{self._capacity} bytes used, "
                f"{self._demoting_bytes} being demoted to SSD{self._held_note(now)})"
            )
        if obj is not None and self._objects.get(key) is not obj:
            obj = None  # the eviction above dropped the very object being upserted
        if obj is None:
            obj = self._objects[key] = _Object(key)
        self._next_vid += 1
        version = _Version(size, replicas, self._next_vid)
        obj.pending = _Pending(client_id, version, now, config)
        self._writing.pop(key, None)  # (re)queued last: the queue stays in PutStart order
        self._writing[key] = obj.pending
        self.stats.puts_started += 1
        return [r.descriptor(ReplicaStatus.PROCESSING) for r in replicas]

    def _held_back_at(self, size: int) -> float:
        """When enough held bytes (deferred frees: read windows, revoked or replaced writes)
        have come back for an object of ``size`` bytes to have a chance to fit, counting
        only extents on segments that could hold it; 0.0 if what is held is not enough.

        The server waits for that time before answering a refused PutStart
        (:mod:`mooncake._store.heldwait`): Mooncake frees a force-removed object at once, so a
        put right after a remove must not fail only because of a read window."""
        big = {id(seg) for seg in self._seg_list if seg.alloc.size >= size}
        held = 0
        for until, _, reps in sorted(self._deferred):
            held += sum(r.length for r in reps if id(r.seg) in big)
            if held >= size:
                return until
        return 0.0

    def _held_bytes(self) -> int:
        """Bytes of the deferred frees (they come back by themselves: eviction does not count
        them as used). Recounted only when the deferred heap changed since the last call."""
        stamp = (self._defer_seq, len(self._deferred))
        if self._held_cache[0] == stamp:
            return self._held_cache[1]
        held = sum(r.length for _, _, reps in self._deferred for r in reps)
        self._held_cache = (stamp, held)
        return held

    def _held_note(self, now: float) -> str:
        """What of the used bytes is only *held* (a deferred free: space of revoked, cancelled,
        abandoned or replaced writes, or of versions inside a read window), and when the last
        of it comes back: for a ``NO_AVAILABLE_HANDLE`` message, so a full answer from a nearly
        empty store says why."""
        held, last = 0, now
        for until, _, reps in self._deferred:
            held += sum(r.length for r in reps)
            last = max(last, until)
        if not held:
            return ""
        return (
            f"; {held} of the used bytes are held after revoked, cancelled or replaced writes "
            f"and read windows, all free again within {last - now:.1f} s"
        )

    def _forget_if_empty(self, key: str, obj: _Object | None) -> None:
        """A failed PutStart that pre-empted a zombie write leaves no empty record behind."""
        if (
            obj is not None
            and obj.readable is None
            and obj.pending is None
            and self._objects.get(key) is obj
        ):
            del self._objects[key]

    def put_end(self, client_id: str, key: str, now: float) -> None:
        """Make the pending write of ``key`` readable (replaces an older version, if any)."""
        obj, pending = self._pending_of(client_id, key)
        old = obj.readable
        if old is not None:
            self._release_after_lease(obj, old, now)
            self._untrack(obj)
            self._end_tier_moves(obj)
            if old.disk:
                _kv.removed(self, key, _kv.MEDIUM_DISK)
            self._forget_disk(key, old)
        obj.readable = pending.version
        obj.pending = None
        self._writing.pop(key, None)
        obj.writer = client_id
        cfg = pending.config
        self._set_group(obj, cfg.group_ids[0] if cfg.group_ids else "")
        obj.hard_pinned = cfg.with_hard_pin
        kept = obj.soft_pin_deadline if old is not None else None
        obj.soft_pin_deadline = None
        if not cfg.soft_pinned() and cfg.soft_pin_action == SoftPinAction.PRESERVE:
            # an upsert keeps the soft pin its key had (Mooncake's PRESERVE)
            if kept is not None and kept > now:
                obj.soft_pin_deadline = kept
        elif cfg.soft_pinned():
            ttl = (
                cfg.soft_pin_ttl_ms / 1000.0
                if cfg.soft_pin_ttl_ms is not None
                else self.config.default_kv_soft_pin_ttl
            )
            ttl = min(ttl, self.config.max_kv_soft_pin_ttl)
            if ttl > 0:
                obj.soft_pin_deadline = now + ttl
        self.policy.on_insert(obj.h, pending.version.size, now=now)
        if obj.hard_pinned:
            self.policy.set_pin(obj.h, Pin.HARD)
        elif obj.soft_pin_deadline is not None:
            self.policy.set_pin(obj.h, Pin.SOFT)
            self._pin_soft(key, obj.soft_pin_deadline)
        self.misses.record_stored(key)
        _kv.stored(self, key)
        self.stats.puts_ended += 1

    upsert_end = put_end

    def put_revoke(self, client_id: str, key: str, now: float) -> None:
        """Abandon the pending write of ``key``; its space is freed after ``put_revoke_hold``
        (an older version stays)."""
        obj, pending = self._pending_of(client_id, key)
        obj.pending = None
        self._writing.pop(key, None)
        self._hold_written(pending.version.replicas, now)
        if obj.readable is None:
            del self._objects[key]
        self.stats.puts_revoked += 1

    upsert_revoke = put_revoke

    def discard_writes_of(self, client_id: str, now: float) -> int:
        """Abandon every write in flight of ``client_id`` (its writer is gone: its connection
        closed or it expired), as a ``PutRevoke`` would: nothing of them becomes readable, a
        later put of those keys starts at once, and their space is reused after
        ``put_revoke_hold`` (a transfer may still be landing). The number discarded."""
        mine = [(k, p) for k, p in self._writing.items() if p.client_id == client_id]
        for key, p in mine:
            del self._writing[key]
            obj = self._objects.get(key)
            if obj is None or obj.pending is not p:
                continue
            obj.pending = None
            self._hold_written(p.version.replicas, now)
            if obj.readable is None:
                del self._objects[key]
            self.stats.zombies_discarded += 1
        return len(mine)

    def _pending_of(self, client_id: str, key: str) -> tuple[_Object, _Pending]:
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        pending = obj.pending
        if pending is None:
            raise InvalidWriteError(f"object {key!r} has no write in progress")
        if pending.client_id != client_id:
            raise IllegalClientError(
                f"object {key!r} is being written by client {pending.client_id}, not {client_id}"
            )
        return obj, pending

    def batch_put_start(
        self,
        client_id: str,
        keys: list[str],
        sizes: list[int],
        config: ReplicateConfig,
        now: float,
        *,
        upsert: bool = False,
    ) -> list[Item[list[ReplicaDescriptor]]]:
        """PutStart (or UpsertStart) per key; per-key codes, never one failure for all."""
        if len(keys) != len(sizes):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
        groups = config.group_ids
        if groups is not None and len(groups) != len(keys):
            raise InvalidArgumentError(f"{len(groups)} group_ids for {len(keys)} keys")
        start = self.upsert_start if upsert else self.put_start
        out: list[Item[list[ReplicaDescriptor]]] = []
        held_before = self.space_held_until
        self.space_held_until = 0.0
        for n, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            cfg = (
                config if groups is None else msgspec.structs.replace(config, group_ids=[groups[n]])
            )
            try:
                out.append(Item(code=0, value=start(client_id, key, size, cfg, now)))
            except MooncakeError as e:
                out.append(Item(code=int(e.code)))
        if self.held_waits and 0 < self.space_held_until <= now + self.config.default_kv_lease_ttl:
            # Some keys wait for held space: the whole batch is answered again once it is
            # back, so the writes started here are undone (never handed out: freed at once).
            for key, item in zip(keys, out, strict=True):
                if item.code == 0:
                    self._undo_start(key)
            out = [Item(code=int(NoAvailableHandleError.code)) for _ in keys]
        self.space_held_until = max(held_before, self.space_held_until)
        return out

    def _undo_start(self, key: str) -> None:
        """Take back the write of ``key`` this call just started (its extents were never
        handed out, so they are free again at once)."""
        obj = self._objects.get(key)
        if obj is None or obj.pending is None:
            return
        pending = obj.pending
        obj.pending = None
        self._writing.pop(key, None)
        self._free_replicas(pending.version.replicas)
        if obj.readable is None:
            del self._objects[key]
        self.stats.puts_started -= 1

    def batch_put_end(self, client_id: str, keys: list[str], now: float) -> list[int]:
        return _codes(lambda k: self.put_end(client_id, k, now), keys)

    def batch_put_revoke(self, client_id: str, keys: list[str], now: float) -> list[int]:
        return _codes(lambda k: self.put_revoke(client_id, k, now), keys)

    def readable_keys(self) -> list[str]:
        """A snapshot of the keys with a readable version (for matching outside the state)."""
        return self._objects.readable_keys()

    # -- removal ---------------------------------------------------------------------------

    def remove(self, key: str, force: bool, now: float) -> None:
        """Remove the readable version of ``key``.

        ``OBJECT_HAS_LEASE`` while leased unless ``force`` (then its space waits for the lease
        to end). A write of ``key`` still in progress is ordered after the removal: it is not
        touched and becomes readable at its End; a key with nothing readable (only such a
        write) is ``OBJECT_NOT_FOUND``.
        """
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.task is not None:
            raise ObjectHasReplicationTaskError(f"object {key!r} has task {obj.task.id} in flight")
        if obj.lease_deadline > now and not force:
            self.stats.lease_refusals += 1
            raise ObjectHasLeaseError(
                f"object {key!r} is leased for another {obj.lease_deadline - now:.3f} s"
            )
        self._drop_object(obj, now)
        self.misses.record_removal(key, now=now)
        self.stats.removes += 1

    def batch_remove(self, keys: list[str], force: bool, now: float) -> list[int]:
        return _codes(lambda k: self.remove(k, force, now), keys)

    def remove_by_regex(self, regex: str, force: bool, now: float) -> int:
        """Remove every removable readable key matching ``regex``; returns how many."""
        pattern = _compile(regex)
        return self.remove_keys([k for k in self.readable_keys() if pattern.search(k)], force, now)

    def remove_keys(self, keys: Iterable[str], force: bool, now: float) -> int:
        """``RemoveAll``'s rules applied to ``keys`` only (each re-checked now); how many went."""
        objs = (self._objects.get(k) for k in dict.fromkeys(keys))
        return self._remove_objects([o for o in objs if o is not None], force, now)

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every removable readable object; returns how many (leased ones stay unless ``force``)."""
        return self._remove_matching(lambda k: True, force, now)

    def _remove_matching(self, match: Callable[[str], bool], force: bool, now: float) -> int:
        objects = self._objects
        return self._remove_objects(
            # one record at a time (a cold row is inflated only as it is removed)
            (o for k in objects.readable_keys() if match(k) and (o := objects.get(k)) is not None),
            force,
            now,
        )

    def _remove_objects(self, objs: Iterable[_Object], force: bool, now: float) -> int:
        n = 0
        for obj in objs:
            key = obj.key
            if obj.readable is None or obj.task:
                continue
            if obj.lease_deadline > now and not force:
                self.stats.lease_refusals += 1
                continue
            self._drop_object(obj, now)
            self.misses.record_removal(key, now=now)
            n += 1
        self.stats.removes += n
        return n

    def _drop_object(self, obj: _Object, now: float) -> None:
        """Drop the readable version of ``obj``; the object goes with it unless a write of it
        is in progress (that write stays, and becomes the readable version at its End)."""
        ver = obj.readable
        if obj.group:
            members = self._groups.get(obj.group)
            if members is not None:
                members.discard(obj.key)
                if not members:
                    del self._groups[obj.group]
        if ver is not None:
            if ver.replicas:
                _kv.removed(self, obj.key)
            if ver.disk:
                _kv.removed(self, obj.key, _kv.MEDIUM_DISK)
            self._release_after_lease(obj, ver, now)
            self._untrack(obj)
            self._end_tier_moves(obj)
            self._forget_disk(obj.key, ver)
            obj.readable = None
        if obj.pending is None:
            del self._objects[obj.key]
        else:  # the record stays for the write: nothing of the old one
            obj.group = ""
            obj.lease_deadline = 0.0
            obj.hard_pinned = False
            obj.soft_pin_deadline = None

    def batch_replica_clear(
        self, client_id: str, keys: list[str], segment_name: str, now: float
    ) -> list[str]:
        """Clear the replicas of ``client_id``'s objects among ``keys`` whose lease has ended.

        With ``segment_name`` empty every cleared object is removed; otherwise only its
        replicas on that segment are dropped (the object goes when none is left). Objects
        written by another client, leased, being written, or with a task in flight are left
        alone. Returns the keys cleared, in order.
        """
        out: list[str] = []
        for key in dict.fromkeys(keys):
            obj = self._objects.get(key)
            if (
                obj is None
                or obj.readable is None
                or obj.pending is not None
                or obj.task is not None
                or obj.writer != client_id
                or obj.lease_deadline > now
            ):
                continue
            ver = obj.readable
            if segment_name:
                gone = [r for r in ver.replicas if r.seg.segment.name == segment_name]
                if not gone:
                    continue
                if len(gone) < len(ver.replicas):
                    ver.replicas = [r for r in ver.replicas if r not in gone]
                    if obj.read_deadline > now:
                        self._defer(obj.read_deadline, gone)
                    else:
                        self._free_replicas(gone)
                    out.append(key)
                    continue
            self._drop_object(obj, now)
            self.misses.record_removal(key, now=now)
            self.stats.removes += 1
            out.append(key)
        return out

    # -- admin -----------------------------------------------------------------------------

    def query_key(self, key: str) -> ObjectInfo:
        """Everything the master knows about ``key`` (no lease granted)."""
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.readable is not None:
            ver, status, complete = obj.readable, ReplicaStatus.COMPLETE, True
        else:
            assert obj.pending is not None
            ver, status, complete = obj.pending.version, ReplicaStatus.PROCESSING, False
        return ObjectInfo(
            key=key,
            size=ver.size,
            complete=complete,
            replicas=[r.descriptor(status) for r in ver.replicas],
            client_id=obj.writer or (obj.pending.client_id if obj.pending else ""),
            lease_deadline=obj.lease_deadline,
            hard_pinned=obj.hard_pinned,
            soft_pin_deadline=obj.soft_pin_deadline,
        )

    def all_keys(self) -> list[str]:
        """Keys with a readable version."""
        return self._objects.readable_keys()

    def _release_zombies(self, now: float) -> None:
        """Release writes older than ``put_start_release_timeout``: only the oldest entries of
        the PutStart-ordered queue are looked at (``now`` never decreases), never every write."""
        limit = self.config.put_start_release_timeout
        writing = self._writing
        while writing:
            key, p = next(iter(writing.items()))
            if now - p.started < limit:
                break
            del writing[key]
            obj = self._objects.get(key)
            if obj is None or obj.pending is not p:
                continue  # ended, revoked or dropped since
            obj.pending = None
            self._free_version(p.version)
            if obj.readable is None:
                del self._objects[key]
            self.stats.zombies_released += 1

    def _untrack(self, obj: _Object) -> None:
        if obj.h in self.policy:
            self.policy.on_remove(obj.h)
        self._soft_pinned.discard(obj.key)
