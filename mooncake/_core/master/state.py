"""The master's state machine: one :class:`MasterState` over its parts (the rules are in
:mod:`mooncake._core.master`)."""

from __future__ import annotations

import itertools
import random
from array import array
from collections import OrderedDict, deque

from mooncake._core.dedup import DedupLedger
from mooncake._core.master import snapshot
from mooncake._core.master.config import MasterConfig, MasterStats, parse_tenant_quotas
from mooncake._core.master.drain import _Drain
from mooncake._core.master.leases import _Leases
from mooncake._core.master.listing import _Listing
from mooncake._core.master.objects import _Objects
from mooncake._core.master.objmap import ObjectMap
from mooncake._core.master.records import (
    KeySet,
    _Client,
    _Deferred,
    _Demote,
    _InUse,
    _Pending,
    _Promote,
    _Seg,
    _Task,
)
from mooncake._core.master.segments import _Segments
from mooncake._core.master.tablepolicy import TABLE_POLICIES, make_table_policy
from mooncake._core.master.tasks import _Tasks
from mooncake._core.master.tenants import TenantLedger
from mooncake._core.master.tiers import _Tiers
from mooncake._core.master.verify import _Verify
from mooncake._core.misses import MissLedger
from mooncake._core.policies import EvictionPolicy, make_policy
from mooncake._core.quarantine import Quarantine
from mooncake._core.store_types import Segment
from mooncake._core.tiers import TierCounters


class MasterState(_Objects, _Leases, _Segments, _Tiers, _Tasks, _Verify, _Drain, _Listing):
    """All master metadata; one method per RPC (see the module docstring for the rules)."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or MasterConfig()
        self.config.validate()
        self.rng = rng or random.Random(self.config.seed)
        self.stats = MasterStats()
        # From the rng, not uuid/time: the state is a function of its seed and commands.
        self.view_version_id = self.rng.getrandbits(63)
        self._next_task = 0
        self._objects = ObjectMap()
        self._next_seg_num = 0
        if policy is None and self.config.eviction_policy.lower() in TABLE_POLICIES:
            policy = make_table_policy(self.config.eviction_policy.lower(), self._objects.table)
        self.policy = policy if policy is not None else make_policy(self.config.eviction_policy)
        """The DRAM eviction policy; it tracks object handles (``_Object.h``), not keys."""
        self._segments: dict[str, _Seg] = {}
        self._seg_list: list[_Seg] = []
        self._clients: dict[str, _Client] = {}
        self._deferred: list[_Deferred] = []  # a heap (see _defer)
        self._defer_seq = 0
        self.space_held_until = 0.0  # see _held_back_at
        #: whether the server waits out a put refused for held space and runs it again
        #: (:mod:`mooncake._store.heldwait`): only then is a batch refused in part for held
        #: space undone whole; off for a state not served, and on a replicated master
        self.held_waits = False
        self._held_cache = ((-1, -1), 0)  # see _held_bytes
        # segment id -> (segment as mounted, extents still in use when its owner expired)
        self._in_use: dict[str, tuple[Segment, _InUse]] = {}
        self._soft_pinned = KeySet()
        # Time-ordered queues (``now`` never decreases, so each is in deadline order): pending
        # writes by PutStart, demotions and promotions by start; soft pins in a deadline heap.
        # The sweep looks only at their expired heads, never at every object.
        self._writing: OrderedDict[str, _Pending] = OrderedDict()
        self._demotions: OrderedDict[str, _Demote] = OrderedDict()
        self._promotions: OrderedDict[str, _Promote] = OrderedDict()
        self._pin_heap: list[tuple[float, str]] = []
        self._tasks: dict[str, _Task] = {}
        self._groups: dict[str, KeySet] = {}  # group id -> keys of its readable members
        self._active_tasks: dict[str, _Task] = {}
        self._finished_tasks: deque[str] = deque()
        self._used = 0
        self._capacity = 0
        self._next_vid = 0
        self._crcs = array("Q")  # per handle: the readable version's CRC32C (master/verify.py)
        self._demoting_bytes = 0
        self._evict_goal = 0  # bytes the eviction run in progress still has to free
        # PutStart and PromoteStart over the watermark evict a small round of their own
        self._put_round = max(1, self.config.eviction_round_objects // 16)
        self.misses = MissLedger()
        """How lost keys were lost; classifies every GetReplicaList miss."""
        self.dedup = DedupLedger()
        """Replies of mutating calls by request id (:mod:`mooncake._core.dedup`): replicated
        state, so a retry across a failover is answered, not applied twice."""
        self.tiers = {"dram": TierCounters(), "ssd": TierCounters()}
        """Per-tier counters as the master sees them (SSD reads themselves are counted by the
        owning client)."""
        self.tenants = TenantLedger()
        """Per-tenant usage and quotas (:mod:`mooncake._core.master.tenants`)."""
        for name, (qb, qo) in parse_tenant_quotas(self.config.tenant_quotas).items():
            self.tenants.set_quota(name, qb, qo)
        self.quarantine = Quarantine(
            self.config.quarantine_grace, self.config.quarantine_refute_hold
        )
        """Segments reported unreachable (:mod:`mooncake._core.quarantine`)."""

    # -- introspection ---------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes allocated over all mounted segments (readable, pending and deferred extents)."""
        return self._used

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all mounted segments."""
        return self._capacity

    def segment_tiers(self) -> dict[str, dict[str, int]]:
        """Mounted segments by memory tier: ``gpu`` for ``cuda:N`` segments, ``dram`` for host
        ones; for each, ``segments``, ``capacity`` and ``used`` bytes."""
        out = {t: {"segments": 0, "capacity": 0, "used": 0} for t in ("dram", "gpu")}
        for seg in self._segments.values():
            t = out["gpu" if seg.segment.location.startswith("cuda:") else "dram"]
            t["segments"] += 1
            t["capacity"] += seg.alloc.capacity
            t["used"] += seg.alloc.used
        return out

    @property
    def object_count(self) -> int:
        """Objects with a readable version."""
        return len(self.policy)  # the policy tracks exactly the readable objects

    @property
    def client_count(self) -> int:
        return len(self._clients)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def has_client(self, client_id: str) -> bool:
        return client_id in self._clients

    # -- time-driven work ------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Everything that happens because time passed: client expiry, zombie release, deferred
        frees, soft-pin expiry, watermark eviction. Call it periodically (the server does)."""
        self.expire_clients(now)
        self._release_zombies(now)
        self._expire_tasks(now)
        self._release_deferred(now)
        if self._in_use:
            self._in_use = {
                sid: (sg, kept)
                for sid, (sg, held) in self._in_use.items()
                if (kept := [h for h in held if h[0] > now])
            }
        self._expire_soft_pins(now)
        self._expire_tier_moves(now)
        if self._evict_goal > 0 or (
            self._capacity
            and self._used - self._demoting_bytes - self._held_bytes()
            > self.config.eviction_high_watermark_ratio * self._capacity
        ):
            self.evict(now)  # one round of the run (at most eviction_round_objects objects)
        self.settle()

    def settle(self) -> None:
        """Between commands: settle the tenants' usage of what the last one touched
        (:class:`TenantLedger`), and fold those objects back into the compact table where
        they fit (:meth:`ObjectMap.settle`: representation only)."""
        self.tenants.settle(self._objects.tenant_deltas())
        self._objects.settle()

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as bytes, compact (objects as columns; see
        :mod:`mooncake._core.master.snapshot`); :meth:`restore` reads it back."""
        return snapshot.snapshot(self)

    @classmethod
    def restore(cls, data: bytes, config: MasterConfig | None = None) -> MasterState:
        """A state indistinguishable from the one :meth:`snapshot` serialized (allocators,
        policy order, queues, rng included); ``config`` replaces the saved one when given.
        Nothing in ``data`` is executed; bytes that are not a whole, intact snapshot of this
        format raise :class:`~mooncake.errors.InvalidArgumentError`."""
        return snapshot.restore(cls, data, config)

    # -- replication ------------------------------------------------------------------------

    def promote(self, now: float) -> None:
        """A new leader takes over at ``now``: effects of unlogged lease-only calls (read
        leases, read windows, pings) may be lost, so every lease and read window is extended
        to ``now + default_kv_lease_ttl`` and every client deadline to
        ``max(deadline, now + client_ttl)``."""
        self._objects.extend_deadlines(now + self.config.default_kv_lease_ttl)
        for client in self._clients.values():
            client.deadline = max(client.deadline, now + self.config.client_ttl)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if bookkeeping is inconsistent (tests)."""
        self._objects.self_check()
        self.tenants.check(self._objects.tenant_usage())
        assert {id(s) for s in self._objects.segs.values()} == {id(s) for s in self._seg_list}
        assert self._demoting_bytes == sum(
            o.demoting.size for o in self._objects.values() if o.demoting is not None
        ), "demoting bytes"
        assert self._capacity == sum(s.segment.size for s in self._seg_list)
        assert self._used == sum(s.alloc.used for s in self._seg_list)
        extents: dict[int, list[tuple[int, int]]] = {}
        pins = set(self._pin_heap)
        holders: dict[int, set[str]] = {}  # segment -> keys with a replica on it
        for obj in self._objects.values():
            assert obj.readable is not None or obj.pending is not None
            assert obj.pending is None or self._writing.get(obj.key) is obj.pending, (
                "unqueued write"
            )
            assert obj.demoting is None or self._demotions.get(obj.key) is obj.demoting
            assert obj.promoting is None or self._promotions.get(obj.key) is obj.promoting
            if obj.key in self._soft_pinned and obj.soft_pin_deadline is not None:
                assert (obj.soft_pin_deadline, obj.key) in pins, f"soft pin of {obj.key!r} unqueued"
            for ver in (obj.readable, obj.pending.version if obj.pending else None):
                if ver is None:
                    continue
                segs = [id(r.seg) for r in ver.replicas]
                assert len(segs) == len(set(segs)), "two replicas on one segment"
                for r in ver.replicas:
                    assert r.seg.mounted and self._objects.segs.get(r.seg.num) is r.seg
                    holders.setdefault(id(r.seg), set()).add(obj.key)
                    extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
            in_dram = (
                obj.readable is not None and bool(obj.readable.replicas) and obj.demoting is None
            )
            assert in_dram == (obj.h in self.policy), f"policy tracking of {obj.key!r}"
            if obj.readable is not None:
                assert obj.readable.replicas or obj.readable.disk, f"{obj.key!r} has no replica"
                for cid in obj.readable.disk:
                    c = self._clients.get(cid)
                    assert c is None or obj.key in c.ssd_keys
            if obj.promoting is not None:
                for r in obj.promoting.replicas:
                    if r.seg.mounted:
                        extents.setdefault(id(r.seg), []).append(
                            (r.addr, r.seg.alloc.extent(r.addr))
                        )
        for task in self._active_tasks.values():
            assert self._objects[task.key].task is task
            for r in task.allocated:
                extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
        for _, _, reps in self._deferred:
            for r in reps:
                if r.seg.mounted:
                    extents.setdefault(id(r.seg), []).append((r.addr, r.seg.alloc.extent(r.addr)))
        for seg in self._seg_list:
            assert set(self._objects.keys_on(seg)) == holders.get(id(seg), set()), "segment keys"
            seg.alloc.self_check()
            spans = sorted(extents.get(id(seg), []))
            assert len(spans) == seg.alloc.allocations, "leaked or unaccounted extent"
            for (a, n), (b, _) in itertools.pairwise(spans):
                assert a + n <= b, "overlapping extents"
