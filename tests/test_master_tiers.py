"""MasterState tiers: demotion to a client's SSD on eviction, promotion, SSD eviction, restart
re-announce, and miss attribution (the sans-I/O rules; the store-level tests drive real files)."""

from __future__ import annotations

import pytest

from mooncake._core.master import MasterConfig, MasterState, format_miss, parse_miss
from mooncake._core.misses import Miss, MissReason
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
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
    with pytest.raises(IllegalClientError):
        m.demote_end("c", t.key, t.vid, 4)


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
    assert key in m.policy and m.tiers["ssd"].promotions == 1
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
    with pytest.raises(ObjectAlreadyExistsError):
        m.put_local("c", "x", 10, 1)
    m.check_invariants()
