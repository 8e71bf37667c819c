"""MasterState tiers: demotion to a client's SSD on eviction, promotion, SSD eviction, restart
re-announce, and miss attribution (the sans-I/O rules; the store-level tests drive real files)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake._core.master import MasterConfig, MasterState, format_miss, parse_miss
from mooncake._core.misses import Miss, MissReason
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    ReplicaNotReadyError,
)

KiB = 1 << 10
DEF = ReplicateConfig()


def seg(i: int, size: int = 64 * KiB) -> Segment:
    return Segment(id=f"seg{i}", name=f"127.0.0.1:{1000 + i}", base=1 << 30, size=size)


def master(**kw: object) -> MasterState:
    cfg = MasterConfig(seed=0, default_kv_lease_ttl=0.0, read_fence_ttl=0.0, **kw)  # type: ignore[arg-type]
    return MasterState(cfg)


def put(m: MasterState, client: str, key: str, size: int, now: float) -> None:
    m.put_start(client, key, size, DEF, now)
    m.put_end(client, key, now)


def fill(m: MasterState, n: int, size: int = 8 * KiB, now: float = 0.0) -> None:
    """Put n objects; when space runs out while demotions are pending, the test plays the
    owner: it confirms the demotions queued so far, and the put is retried (what the client's
    tier loop does concurrently)."""
    for i in range(n):
        try:
            put(m, "c", f"k{i}", size, now)
        except NoAvailableHandleError:
            tasks = m.fetch_tier_tasks("c", now).demote
            assert tasks, "out of space with nothing being demoted"
            for t in tasks:
                m.demote_end("c", t.key, t.vid, now)
            m.check_invariants()
            put(m, "c", f"k{i}", size, now)
        m.check_invariants()


def miss_of(m: MasterState, key: str, now: float = 100.0) -> Miss:
    with pytest.raises(ObjectNotFoundError) as ei:
        m.get_replica_list(key, now)
    miss = parse_miss(key, str(ei.value))
    assert miss is not None, str(ei.value)
    return miss


def test_miss_format_roundtrip() -> None:
    for miss in (
        Miss("k", MissReason.EVICTED, policy="s3fifo", tier="ssd"),
        Miss("k", MissReason.OWNER_DIED, owner="c-1"),
        Miss("k", MissReason.NEVER_STORED),
    ):
        got = parse_miss("k", f"object 'k' not found {format_miss(miss)}")
        assert got == Miss("k", miss.reason, policy=miss.policy, tier=miss.tier, owner=miss.owner)
    assert parse_miss("k", "object 'k' not found") is None
    assert parse_miss("k", "[miss reason=bogus]") is None


def test_eviction_without_ssd_drops_and_attributes() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    fill(m, 10)  # 80 KiB into 64 KiB: evictions
    gone = [f"k{i}" for i in range(10) if not m.exist_key(f"k{i}", 1)]
    assert gone
    for k in gone:
        miss = miss_of(m, k)
        assert (miss.reason, miss.policy, miss.tier) == (MissReason.EVICTED, "lru", "dram")
    assert miss_of(m, "never").reason is MissReason.NEVER_STORED
    assert m.explain_miss(gone[0]).reason is MissReason.EVICTED
    counts = m.misses.counts()
    assert counts[("evicted", "lru", "dram")] == len(gone)
    assert m.tiers["dram"].evictions == len(gone)


def demoting_master() -> MasterState:
    m = master()
    m.mount_segment("c", seg(0), 0)
    m.mount_local_disk("c", 1 << 30, 0)
    return m


def test_eviction_demotes_to_the_owners_ssd() -> None:
    m = demoting_master()
    fill(m, 10)
    m.evict(1, need=8 * KiB)
    tasks = m.fetch_tier_tasks("c", 1).demote
    assert tasks, "evictions must become demotion tasks"
    assert m.fetch_tier_tasks("c", 1).demote == []  # taken once
    t = tasks[0]
    assert t.segment_name == seg(0).name and t.size == 8 * KiB
    # until the client confirms, the object is still readable from memory
    r = m.get_replica_list(t.key, 1)
    assert [x.addr for x in r.replicas] == [t.addr] and r.vid == t.vid
    used = m.used_bytes
    before = m.tiers["ssd"].demotions
    m.demote_end("c", t.key, t.vid, 2)
    m.check_invariants()
    assert m.used_bytes == used - 8 * KiB
    r = m.get_replica_list(t.key, 3)
    assert r.replicas == [] and r.disk_clients == ["c"] and r.size == 8 * KiB
    assert m.tiers["ssd"].demotions == before + 1 and m.tiers["ssd"].hits == 1
    # a repeat (the client lost the first answer) succeeds and changes nothing
    m.demote_end("c", t.key, t.vid, 4)
    m.check_invariants()
    assert m.used_bytes == used - 8 * KiB and m.tiers["ssd"].demotions == before + 1
    with pytest.raises(IllegalClientError):
        m.demote_end("other", t.key, t.vid, 4)  # never demoting to that client


def test_demote_revoke_and_timeout_drop_the_object() -> None:
    m = demoting_master()
    fill(m, 10)
    m.evict(1, need=16 * KiB)
    t1, t2, *_ = m.fetch_tier_tasks("c", 1).demote
    m.demote_revoke("c", t1.key, t1.vid, 2)
    assert miss_of(m, t1.key).reason is MissReason.EVICTED
    m.ping("c", 1 + m.config.demote_timeout)  # the client lives; its demotion stalls
    m.sweep(2 + m.config.demote_timeout)
    m.check_invariants()
    miss = miss_of(m, t2.key, 3 + m.config.demote_timeout)
    assert (miss.reason, miss.tier) == (MissReason.EVICTED, "dram")
    with pytest.raises(ObjectNotFoundError):
        m.demote_end("c", t2.key, t2.vid, 3 + m.config.demote_timeout)


def test_replaced_during_demotion_fails_the_demotion() -> None:
    m = demoting_master()
    fill(m, 10)
    m.evict(1, need=8 * KiB)
    t = m.fetch_tier_tasks("c", 1).demote[0]
    # bytes being demoted count as freed: no further eviction until the owner confirms
    with pytest.raises(NoAvailableHandleError, match="being demoted"):
        m.upsert_start("c", t.key, 100, DEF, 2)
    other = next(k for k in m.all_keys() if k != t.key and m.query_key(k).replicas)
    m.remove(other, False, 2)
    m.upsert_start("c", t.key, 100, DEF, 2)
    m.upsert_end("c", t.key, 2)
    with pytest.raises(ObjectNotFoundError, match="gone"):
        m.demote_end("c", t.key, t.vid, 3)
    m.check_invariants()
    assert m.get_replica_list(t.key, 4).size == 100


def to_disk(m: MasterState) -> tuple[str, int]:
    fill(m, 10)
    m.evict(1, need=8 * KiB)
    t = m.fetch_tier_tasks("c", 1).demote[0]
    m.demote_end("c", t.key, t.vid, 2)
    return t.key, t.vid


def test_promotion_brings_it_back_and_later_eviction_is_metadata_only() -> None:
    m = demoting_master()
    key, vid = to_disk(m)
    for t in m.fetch_tier_tasks("c", 2).demote:
        m.demote_end("c", t.key, t.vid, 2)
    reps = m.promote_start("c", key, vid, 3)
    assert len(reps) == 1 and reps[0].segment_name == seg(0).name
    with pytest.raises(Exception, match="promoted"):
        m.promote_start("c", key, vid, 3)
    m.check_invariants()
    m.promote_end("c", key, vid, 4)
    m.check_invariants()
    r = m.get_replica_list(key, 5)
    assert [x.addr for x in r.replicas] == [reps[0].addr] and r.disk_clients == ["c"]
    assert m._objects.handle(key) in m.policy and m.tiers["ssd"].promotions == 1
    with pytest.raises(ObjectAlreadyExistsError):
        m.promote_start("c", key, vid, 6)
    # evict everything in DRAM: the promoted object still has its SSD copy, so no new task
    m.evict(10, need=1 << 30)
    m.check_invariants()
    assert key not in [t.key for t in m.fetch_tier_tasks("c", 10).demote]
    assert m.get_replica_list(key, 11).replicas == []


def test_promote_revoke_frees_and_promotion_needs_space() -> None:
    m = demoting_master()
    key, vid = to_disk(m)
    used = m.used_bytes
    m.promote_start("c", key, vid, 3)
    assert m.used_bytes == used + 8 * KiB
    m.promote_revoke("c", key, vid, 4)
    assert m.used_bytes == used + 8 * KiB  # held for put_revoke_hold: the write may be landing
    m.ping("c", 4 + m.config.put_revoke_hold)
    m.sweep(4 + m.config.put_revoke_hold)
    assert m.used_bytes == used
    m.check_invariants()
    m2 = master()
    m2.mount_segment("c", seg(0, size=4 * KiB), 0)
    m2.mount_local_disk("c", 1 << 30, 0)
    v = m2.put_local("c", "big", 8 * KiB, 0)
    with pytest.raises(NoAvailableHandleError):
        m2.promote_start("c", "big", v, 1)


def test_ssd_eviction_of_the_last_copy_drops_the_object() -> None:
    m = demoting_master()
    key, vid = to_disk(m)
    m.evict_disk_replica("c", key, vid + 1000, "s3fifo", 3)  # wrong version: no-op
    assert m.get_replica_list(key, 3).disk_clients == ["c"]
    m.evict_disk_replica("c", key, vid, "s3fifo", 4)
    m.check_invariants()
    miss = miss_of(m, key)
    assert (miss.reason, miss.policy, miss.tier) == (MissReason.EVICTED, "s3fifo", "ssd")
    assert m.tiers["ssd"].evictions == 1


def test_remove_of_an_ssd_object_tells_the_owner_to_delete() -> None:
    m = demoting_master()
    key, vid = to_disk(m)
    m.remove(key, False, 3)
    drops = m.fetch_tier_tasks("c", 4).drop
    assert [(d.key, d.vid) for d in drops] == [(key, vid)]
    assert miss_of(m, key).reason is MissReason.REMOVED
    m.check_invariants()


def test_owner_death_loses_its_ssd_objects() -> None:
    m = demoting_master()
    key, _ = to_disk(m)
    m.sweep(1000.0)  # client "c" stopped pinging
    miss = miss_of(m, key, 1001)
    assert (miss.reason, miss.owner) == (MissReason.OWNER_DIED, "c")
    m.check_invariants()


def test_ssd_copy_on_another_client_survives_the_segment_owner() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_local_disk("a", 1 << 30, 0)
    put(m, "a", "k", 100, 0)
    vid = m.get_replica_list("k", 0).vid
    m.mount_local_disk("b", 1 << 30, 0)
    m.evict(1, need=1 << 30)
    (t,) = m.fetch_tier_tasks("a", 1).demote
    assert t.key == "k"
    m.demote_end("a", "k", vid, 1)
    assert m.get_replica_list("k", 2).disk_clients == ["a"]
    m.unmount_segment("a", "seg0", 3)  # the DRAM segment goes; the SSD copy stays
    assert m.get_replica_list("k", 3).disk_clients == ["a"]
    m.check_invariants()


def test_put_local_reannounces_after_restart() -> None:
    m = demoting_master()
    with pytest.raises(InvalidArgumentError, match="no SSD tier"):
        m.put_local("other", "x", 10, 0)
    v = m.put_local("c", "x", 10, 0)
    r = m.get_replica_list("x", 1)
    assert r.vid == v and r.disk_clients == ["c"] and r.size == 10
    assert m.put_local("c", "x", 10, 1) == v  # the copy it already holds: the same version
    with pytest.raises(ObjectAlreadyExistsError):  # another copy of that key is not that one
        m.put_local("c", "x", 11, 1)
    with pytest.raises(ObjectNotFoundError):  # ... and it is dropped, being the last copy
        m.get_replica_list("x", 1)
    m.check_invariants()


# -- stateful: every interleaving keeps the bookkeeping consistent ------------------------------


KEYS = [f"k{i}" for i in range(8)]


class TierMachine(RuleBasedStateMachine):
    """Two clients with segments, one with an SSD tier; puts, gets, removes, evictions, the
    demotion/promotion protocol (done, revoked, stale), SSD evictions, restarts and deaths.
    After every step: the master's invariants, and every readable object has a replica."""

    def __init__(self) -> None:
        super().__init__()
        self.m = master(demote_timeout=5.0, client_ttl=100.0)
        self.now = 0.0
        for c, i in (("a", 0), ("b", 1)):
            self.m.mount_segment(c, seg(i, size=16 * KiB), 0)
        self.m.mount_local_disk("a", 1 << 20, 0)
        self.tasks: list[tuple[str, int]] = []
        self.promoting: list[tuple[str, int]] = []

    def _tick(self) -> None:
        self.now += 0.5
        self.m.ping("a", self.now)
        self.m.ping("b", self.now)

    @rule(
        key=hs.sampled_from(KEYS),
        size=hs.sampled_from([1 * KiB, 4 * KiB]),
        upsert=hs.booleans(),
        client=hs.sampled_from("aab"),
    )
    def put(self, key: str, size: int, upsert: bool, client: str) -> None:
        self._tick()
        start = self.m.upsert_start if upsert else self.m.put_start
        try:
            start(client, key, size, DEF, self.now)
        except (ObjectAlreadyExistsError, NoAvailableHandleError, ReplicaNotReadyError):
            return
        self.m.put_end(client, key, self.now)

    @rule(client=hs.sampled_from("ab"))
    def fill(self, client: str) -> None:
        for key in KEYS:
            self.put(key, 4 * KiB, False, client)

    @rule(key=hs.sampled_from(KEYS))
    def get(self, key: str) -> None:
        try:
            r = self.m.get_replica_list(key, self.now)
        except ObjectNotFoundError as e:
            assert parse_miss(key, str(e)) is not None
            return
        except Exception:
            return
        assert r.replicas or r.disk_clients

    @rule(key=hs.sampled_from(KEYS), force=hs.booleans())
    def remove(self, key: str, force: bool) -> None:
        try:
            self.m.remove(key, force, self.now)
        except Exception:
            pass

    @rule(need=hs.sampled_from([1, 8 * KiB, 64 * KiB]))
    def evict(self, need: int) -> None:
        self.m.evict(self.now, need=need)
        self.tasks += [(t.key, t.vid) for t in self.m.fetch_tier_tasks("a", self.now).demote]

    @rule(ok=hs.booleans())
    def finish_demotion(self, ok: bool) -> None:
        if not self.tasks:
            return
        key, vid = self.tasks.pop(0)
        try:
            if ok:
                self.m.demote_end("a", key, vid, self.now)
            else:
                self.m.demote_revoke("a", key, vid, self.now)
        except (ObjectNotFoundError, IllegalClientError):
            pass  # removed, replaced, timed out or the segment went: the copy is discarded

    def _on_ssd(self) -> list[tuple[str, int]]:
        out = []
        for key in self.m.all_keys():
            r = self.m.get_replica_list(key, self.now, for_read=False)
            if r.disk_clients:
                out.append((key, r.vid))
        return out

    @rule(pick=hs.integers(0, 7))
    def promote(self, pick: int) -> None:
        on_ssd = [kv for kv in self._on_ssd() if not self.m.query_key(kv[0]).replicas]
        if not on_ssd:
            return
        key, vid = on_ssd[pick % len(on_ssd)]
        try:
            self.m.promote_start("a", key, vid, self.now)
        except (NoAvailableHandleError, ReplicaNotReadyError):
            return
        self.promoting.append((key, vid))

    @rule(ok=hs.booleans())
    def finish_promotion(self, ok: bool) -> None:
        if not self.promoting:
            return
        key, vid = self.promoting.pop(0)
        try:
            if ok:
                self.m.promote_end("a", key, vid, self.now)
            else:
                self.m.promote_revoke("a", key, vid, self.now)
        except (ObjectNotFoundError, IllegalClientError):
            pass

    @rule(pick=hs.integers(0, 7))
    def ssd_evicts(self, pick: int) -> None:
        on_ssd = self._on_ssd()
        if on_ssd:
            key, vid = on_ssd[pick % len(on_ssd)]
            self.m.evict_disk_replica("a", key, vid, "lru", self.now)

    @rule()
    def time_passes(self) -> None:
        self.now += 6.0  # past demote_timeout: stalled demotions are revoked
        self.m.ping("a", self.now)
        self.m.ping("b", self.now)
        self.m.sweep(self.now)

    @rule()
    def b_unmounts_and_remounts(self) -> None:
        self._tick()
        self.m.unmount_segment("b", "seg1", self.now)
        self.m.mount_segment("b", seg(1, size=16 * KiB), self.now)

    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        for key in self.m.all_keys():
            info = self.m.query_key(key)
            r = self.m._objects[key].readable
            assert r is not None and (info.replicas or r.disk)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_master_flags_for_tiers() -> None:
    from mooncake._cli.master import parse_gflags

    p = parse_gflags(["--enable_offload=false", "--demote_timeout_sec=5"])
    assert (p.server.state.offload_on_evict, p.server.state.demote_timeout) == (False, 5.0)
    m = MasterState(p.server.state)
    m.mount_segment("c", seg(0), 0)
    m.mount_local_disk("c", 1 << 30, 0)
    fill(m, 10)  # offload off: evictions drop, nothing is demoted
    assert m.fetch_tier_tasks("c", 1).demote == []
    assert m.tiers["dram"].evictions > 0
