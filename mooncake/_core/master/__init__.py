"""The master's state machine (sans-I/O): objects, replicas, segments, clients, leases, eviction.

:class:`MasterState` holds all metadata of a Mooncake Store master and implements one method per
RPC (:mod:`mooncake._core.rpc`). Methods are synchronous, never block and take ``now`` (seconds
on the caller's clock; the server passes the event loop's clock, tests a ``MockClock``). They
return the RPC result or raise a :class:`~mooncake.errors.StoreError` subclass carrying the
Mooncake error code. The master never touches object bytes; it hands out address ranges.
``now`` never decreases from one call to the next (the loop clock, or the replicated log's
clock, which never goes below the last applied ``now``): time-driven work
(:meth:`MasterState.sweep`) looks only at the expired heads of deadline-ordered queues, never at
every object.

Model
-----
* **Segment**: ``[base, base+size)`` of a client's memory, named by its transfer-engine segment
  name, with an :class:`~mooncake._core.allocator.OffsetAllocator`. A segment id is mounted by one
  client; ranges of segments with the same name must not overlap.
* **Object** ``key``: at most one *readable* version (size + replicas, every replica COMPLETE)
  and at most one *pending* write (PutStart/UpsertStart .. PutEnd/UpsertEnd or Revoke). Each
  replica of a version is one contiguous extent on a distinct segment. Readers only ever see the
  readable version: a half-written object is never returned.
* **Lease**: ``GetReplicaList``/``ExistKey`` (and their batch/regex forms) extend the object's
  lease to ``now + default_kv_lease_ttl``. A leased object is not evicted, and ``Remove`` /
  ``RemoveAll`` / ``RemoveByRegex`` refuse it (``OBJECT_HAS_LEASE``) unless ``force``.
* **Read window**: a ``GetReplicaList`` for reading also opens a short window (``read_fence_ttl``
  plus ``read_fence_s_per_mib`` per MiB, at most the lease) during which the space of that
  version is not reused, even if the object is force-removed or replaced; the client fails a
  read that finishes after the window (``read_ttl_ms``). So bytes a reader copies are never
  handed to another object while it copies them, without holding space for a whole lease.
* **Pins**: ``with_hard_pin`` objects are never evicted. A soft pin (``with_soft_pin`` or
  ``soft_pin_action=ENABLE``) lasts ``soft_pin_ttl_ms`` (default ``default_kv_soft_pin_ttl``,
  capped at ``max_kv_soft_pin_ttl``) from PutEnd; soft-pinned objects are evicted only after every
  unpinned candidate, and not at all if ``allow_evict_soft_pinned_objects`` is false.
* **Eviction** runs when the used ratio exceeds ``eviction_high_watermark_ratio`` (at PutStart
  and in :meth:`MasterState.sweep`) or when an allocation fails. It frees
  ``max(eviction_ratio, used_ratio - watermark + eviction_ratio)`` of the capacity, asking the
  policy (:mod:`mooncake._core.policies`, LRU by default) for victims among objects that are
  readable, have no pending write, no lease and no hard pin. A run proceeds in rounds of at
  most ``eviction_round_objects`` victims (each sweep makes one until the run's goal is met;
  a PutStart over the watermark makes a smaller one), so no call does unbounded work.
* **Zombie writes**: a pending write older than ``put_start_discard_timeout`` may be pre-empted
  by a new PutStart of the same key; its space is released ``put_start_release_timeout`` after
  its PutStart (the writer might still be writing into it until then). :meth:`sweep` also
  releases un-pre-empted zombies at that point.
* **Clients**: ``Ping``, ``MountSegment`` and ``ReMountSegment`` keep a client alive until
  ``now + client_ttl``. :meth:`sweep` drops clients past their deadline: their segments are
  unmounted, replicas on them dropped, objects left without replicas removed. ``Ping`` from an
  unknown (new or expired) client answers ``NEED_REMOUNT``. Time the master itself was
  unresponsive is credited to every client (:meth:`credit_stall`), so a stall of the master
  never reads as silence of its clients.

* **Quarantine**: ``ReportSegmentFailure`` from a known client takes a segment name out of
  allocation and out of replica lists (objects with no other replica answer
  ``REPLICA_NOT_FOUND``) until its holder's next heartbeat after ``quarantine_grace`` or its
  expiry (:mod:`mooncake._core.quarantine`).
* **SSD tier identity**: ``MountLocalDisk`` with the ``tier_id`` of a previous (dead) client
  hands that client's SSD copies to the new one; its ``PutLocal`` of them re-adopts them.

Upsert: ``UpsertStart`` on a readable key allocates a new version (fresh extents) beside the old
one; readers keep getting the old version until ``UpsertEnd`` swaps them. A write takes effect
at its End: reads meanwhile get the last complete version (a key with none is not found), a
remove removes the readable version and leaves the write in flight, which lands at its End.
"""

from __future__ import annotations

from mooncake._core.master.config import (
    ALLOCATION_STRATEGIES,
    MasterConfig,
    MasterStats,
    format_miss,
    parse_miss,
)
from mooncake._core.master.state import MasterState
from mooncake._core.store_types import MAX_KEY_LENGTH

__all__ = [
    "ALLOCATION_STRATEGIES",
    "MAX_KEY_LENGTH",
    "MasterConfig",
    "MasterState",
    "MasterStats",
    "format_miss",
    "parse_miss",
]
