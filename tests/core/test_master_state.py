"""MasterState: examples per RPC rule, and a hypothesis stateful test against a simple model.

The stateful machine drives put/get/remove/upsert/evict/expire/kill with explicit time (the
sans-I/O master takes ``now``) and checks the safety properties after every step:
never a readable half-written object, never two live extents sharing bytes, leases and hard
pins respected, readers get exactly the extents the writer was given.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import (
    ClientStatus,
    ReplicaStatus,
    ReplicateConfig,
    Segment,
    SoftPinAction,
    TaskStatus,
    TaskType,
)
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    InvalidWriteError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectHasLeaseError,
    ObjectHasReplicationTaskError,
    ObjectNotFoundError,
    ReplicaNotFoundError,
    ReplicaNotReadyError,
    SegmentAlreadyExistsError,
    SegmentNotFoundError,
)

MiB = 1 << 20
DEF = ReplicateConfig()


def seg(i: int, size: int = MiB, base: int = 1 << 30) -> Segment:
    return Segment(id=f"seg{i}", name=f"127.0.0.1:{1000 + i}", base=base, size=size)


def master(**kw: object) -> MasterState:
    m = MasterState(MasterConfig(seed=0, **kw))  # type: ignore[arg-type]
    return m


def put(
    m: MasterState, client: str, key: str, size: int, now: float, cfg: ReplicateConfig = DEF
) -> None:
    m.put_start(client, key, size, cfg, now)
    m.put_end(client, key, now)


def test_ping_unknown_client_needs_remount_then_ok() -> None:
    m = master()
    assert m.ping("c", 0).client_status == ClientStatus.NEED_REMOUNT
    assert m.ping("c", 1).client_status == ClientStatus.OK


def test_half_written_object_is_not_readable() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    reps = m.put_start("c", "k", 100, DEF, 0)
    assert [r.status for r in reps] == [ReplicaStatus.PROCESSING]
    with pytest.raises(ObjectNotFoundError):  # no complete version: not found, not "not ready"
        m.get_replica_list("k", 0)
    assert m.exist_key("k", 0) is False
    assert m.all_keys() == []
    m.put_end("c", "k", 1)
    got = m.get_replica_list("k", 1)
    assert [(r.addr, r.length, r.status) for r in got.replicas] == [
        (reps[0].addr, 100, ReplicaStatus.COMPLETE)
    ]


def test_second_put_is_refused_upsert_replaces_and_old_space_waits_for_lease() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=4096), 0)
    put(m, "c", "k", 1000, 0)
    with pytest.raises(ObjectAlreadyExistsError):
        m.put_start("c", "k", 1000, DEF, 0)
    old = m.get_replica_list("k", 1).replicas[0]  # lease until 11
    new = m.upsert_start("c", "k", 2000, DEF, 2)
    got = m.get_replica_list("k", 2)
    assert got.replicas[0].addr == old.addr  # old still served
    window = got.read_ttl_ms / 1000
    assert 0 < window <= got.lease_ttl_ms / 1000
    m.upsert_end("c", "k", 2 + window / 2)
    assert m.get_replica_list("k", 2 + window / 2, for_read=False).replicas[0].addr == new[0].addr
    # the old extent is still held: a reader may be copying it inside its read window
    assert m.used_bytes == 1024 + 2048
    m.sweep(2 + window * 0.9)
    assert m.used_bytes == 1024 + 2048
    m.sweep(2 + window * 1.1)  # window over; the policy lease (until 12) does not hold space
    assert m.used_bytes == 2048
    m.check_invariants()


def test_remove_refused_under_lease_unless_forced() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    put(m, "c", "k", 100, 0)
    m.get_replica_list("k", 1)
    with pytest.raises(ObjectHasLeaseError):
        m.remove("k", False, 2)
    assert m.stats.lease_refusals == 1
    m.remove("k", True, 2)
    with pytest.raises(ObjectNotFoundError):
        m.remove("k", False, 2)
    put(m, "c", "k2", 100, 20)
    m.get_replica_list("k2", 20)
    m.remove("k2", False, 30.5)  # lease over


def test_put_end_by_stranger_and_without_start() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    m.put_start("c", "k", 100, DEF, 0)
    with pytest.raises(IllegalClientError):
        m.put_end("d", "k", 0)
    m.put_end("c", "k", 0)
    with pytest.raises(InvalidWriteError):
        m.put_end("c", "k", 0)
    with pytest.raises(ObjectNotFoundError):
        m.put_revoke("c", "nope", 0)


def test_bad_put_arguments() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    with pytest.raises(InvalidArgumentError):
        m.put_start("c", "k", 0, DEF, 0)
    with pytest.raises(InvalidArgumentError):
        m.put_start("c", "", 10, DEF, 0)
    with pytest.raises(InvalidArgumentError):
        m.put_start("c", "k", 10, ReplicateConfig(soft_pin_ttl_ms=5), 0)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("c", "k", 2 * MiB, DEF, 0)


def test_replicas_on_distinct_segments_best_effort() -> None:
    m = master()
    for i in range(3):
        m.mount_segment("c", seg(i), 0)
    reps = m.put_start("c", "k", 100, ReplicateConfig(replica_num=5), 0)
    assert len(reps) == 3
    assert len({r.segment_name for r in reps}) == 3


def test_preferred_segment_first() -> None:
    m = master()
    for i in range(4):
        m.mount_segment("c", seg(i), 0)
    for j in range(10):
        reps = m.put_start("c", f"k{j}", 100, ReplicateConfig(preferred_segments=[seg(2).name]), 0)
        assert reps[0].segment_name == seg(2).name


def test_free_ratio_first_picks_emptiest() -> None:
    m = master(allocation_strategy="free_ratio_first")
    m.mount_segment("c", seg(0), 0)
    m.mount_segment("c", seg(1), 0)
    put(m, "c", "a", 4096, 0)
    first = m.query_key("a").replicas[0].segment_name
    put(m, "c", "b", 100, 0)
    assert m.query_key("b").replicas[0].segment_name != first


def test_mount_conflicts() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    m.mount_segment("c", seg(0), 0)  # idempotent
    with pytest.raises(SegmentAlreadyExistsError):
        m.mount_segment("d", seg(0), 0)
    overlapping = Segment(id="other", name=seg(0).name, base=seg(0).base + 10, size=100)
    with pytest.raises(SegmentAlreadyExistsError, match="overlaps"):
        m.mount_segment("c", overlapping, 0)


def test_eviction_keeps_under_watermark_oldest_first_and_skips_leased_and_pinned() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=64 * 4096), 0)
    put(m, "c", "hard", 4096, 0, ReplicateConfig(with_hard_pin=True))
    for i in range(200):
        put(m, "c", f"k{i}", 4096, i + 1)
        if i == 5:
            m.get_replica_list("k5", i + 1)  # lease until 16
        assert m.used_bytes <= 0.9 * m.capacity_bytes + 4096
        m.check_invariants()
    keys = set(m.all_keys())
    assert "hard" in keys
    assert "k199" in keys and "k0" not in keys
    survivors = sorted(int(k[1:]) for k in keys if k.startswith("k"))
    assert survivors == list(range(survivors[0], 200))  # LRU: oldest went first
    assert m.stats.evicted_objects > 0


def test_leased_object_survives_eviction() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=16 * 4096), 0)
    put(m, "c", "keep", 4096, 0)
    m.get_replica_list("keep", 0)
    for i in range(40):
        put(m, "c", f"k{i}", 4096, 1)
    assert m.exist_key("keep", 1)


def test_soft_pinned_evicted_last_and_pin_expires() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=16 * 4096), 0)
    put(
        m,
        "c",
        "soft",
        4096,
        0,
        ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=50_000),
    )
    for i in range(40):
        put(m, "c", f"k{i}", 4096, 1)
    assert "soft" in m.all_keys()
    m.ping("c", 100)
    m.sweep(100)
    for i in range(40, 80):
        put(m, "c", f"k{i}", 4096, 101)
    assert "soft" not in m.all_keys()


def test_object_larger_than_every_segment_refused_without_evicting() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=64 * 4096), 0)
    m.mount_segment("c", seg(1, size=64 * 4096), 0)
    for i in range(100):
        put(m, "c", f"k{i}", 4096, 0)
    before = set(m.all_keys())
    with pytest.raises(NoAvailableHandleError, match="larger than every mounted segment"):
        m.put_start("c", "huge", 64 * 4096 + 1, DEF, 1)
    assert set(m.all_keys()) == before


def test_upsert_preserves_or_disables_soft_pin() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    pin = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=100_000)
    put(m, "c", "k", 100, 0, pin)
    deadline = m.query_key("k").soft_pin_deadline
    assert deadline == 100.0
    m.upsert_start("c", "k", 200, DEF, 1)  # PRESERVE by default
    m.upsert_end("c", "k", 1)
    assert m.query_key("k").soft_pin_deadline == deadline
    m.upsert_start("c", "k", 300, ReplicateConfig(soft_pin_action=SoftPinAction.DISABLE), 2)
    m.upsert_end("c", "k", 2)
    assert m.query_key("k").soft_pin_deadline is None


def test_hard_pinned_fill_then_no_space() -> None:
    m = master()
    m.mount_segment("c", seg(0, size=8 * 4096), 0)
    cfg = ReplicateConfig(with_hard_pin=True)
    for i in range(8):
        put(m, "c", f"k{i}", 4096, 0, cfg)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("c", "x", 4096, cfg, 0)
    assert m.remove_all(True, 0) == 8
    put(m, "c", "x", 4096, 0)


def test_upsert_during_anothers_write_is_not_ready() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    m.put_start("c", "k", 100, DEF, 0)
    with pytest.raises(ReplicaNotReadyError):
        m.upsert_start("d", "k", 100, DEF, 1)
    m.upsert_start("d", "k", 100, DEF, 31)  # the first write is a zombie by now


def test_zombie_put_preempted_after_discard_timeout_and_released_later() -> None:
    m = master(put_start_discard_timeout=30, put_start_release_timeout=600)
    m.mount_segment("c", seg(0), 0)
    m.put_start("c", "k", 4096, DEF, 0)
    with pytest.raises(ReplicaNotReadyError):  # in flight, may fail: not "exists"
        m.put_start("d", "k", 4096, DEF, 10)
    m.put_start("d", "k", 4096, DEF, 31)
    m.put_end("d", "k", 31)
    with pytest.raises(InvalidWriteError):  # the zombie's writer finds its write gone
        m.put_end("c", "k", 32)
    assert m.used_bytes == 2 * 4096
    m.ping("c", 599)
    m.ping("d", 599)
    m.sweep(599)
    assert m.used_bytes == 2 * 4096
    m.ping("c", 600)
    m.ping("d", 600)
    m.sweep(600)
    assert m.used_bytes == 4096
    m.check_invariants()


def test_client_expiry_drops_its_segments_and_objects() -> None:
    m = master(client_ttl=10)
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    for i in range(10):
        put(m, "a", f"k{i}", 100, 0, ReplicateConfig(replica_num=2))
    put(m, "b", "only-b", 100, 0, ReplicateConfig(preferred_segments=[seg(1).name]))
    for t in range(1, 15):
        m.ping("a", t)
        m.sweep(t)
    assert not m.has_client("b")
    assert m.ping("b", 15).client_status == ClientStatus.NEED_REMOUNT
    keys = set(m.all_keys())
    assert "only-b" not in keys
    assert all(f"k{i}" in keys for i in range(10))  # second replica on a's segment survives
    assert all(len(m.get_replica_list(f"k{i}", 15).replicas) == 1 for i in range(10))
    m.check_invariants()


def test_remove_by_regex_and_batch_forms() -> None:
    m = master()
    m.mount_segment("c", seg(0), 0)
    items = m.batch_put_start("c", ["a1", "a2", "b1"], [10, 10, 0], DEF, 0)
    assert [i.code for i in items] == [0, 0, -600]
    assert m.batch_put_end("c", ["a1", "a2", "zz"], 0) == [0, 0, -704]
    assert m.batch_exist_key(["a1", "b1"], 100) == [1, 0]
    assert m.remove_by_regex("^a", False, 100) == 1  # a1 leased by exist_key, a2 not
    assert m.remove_by_regex("^a", False, 111) == 1
    assert m.batch_remove(["a1"], False, 111) == [-704]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "g1", "g2", "w", "none"]), max_size=12),
    st.floats(min_value=0, max_value=50),
)
def test_batch_exist_key_is_exist_key_per_key(keys: list[str], now: float) -> None:
    """The batch form answers and leases exactly as :meth:`exist_key` does key by key
    (grouped objects lease their whole group; a pending write does not exist)."""

    def build() -> MasterState:
        m = master()
        m.mount_segment("c", seg(0), 0)
        put(m, "c", "a", 10, 0)
        put(m, "c", "b", 10, 0)
        grouped = ReplicateConfig(group_ids=["grp"])
        put(m, "c", "g1", 10, 0, grouped)
        put(m, "c", "g2", 10, 0, grouped)
        m.put_start("c", "w", 10, DEF, 0)
        return m

    one, many = build(), build()
    expected = [1 if one.exist_key(k, now) else 0 for k in keys]
    assert many.batch_exist_key(keys, now) == expected
    for k in ("a", "b", "g1", "g2"):
        assert one.query_key(k) == many.query_key(k)
    many.check_invariants()


# -- stateful ---------------------------------------------------------------------------------

CLIENTS = ["c0", "c1", "c2"]
KEYS = [f"k{i}" for i in range(48)]
TTL = 10.0
LEASE = 5.0
RELEASE = 16.0  # > TTL: a write may outlive its segment owner's expiry


class MasterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = MasterState(
            MasterConfig(
                seed=1,
                client_ttl=TTL,
                default_kv_lease_ttl=LEASE,
                put_start_discard_timeout=3.0,
                put_start_release_timeout=RELEASE,
            )
        )
        self.now = 0.0
        self.alive = {c: False for c in CLIENTS}
        self.nseg = 0
        # model: key -> (size, descriptors given at start) for readable versions
        self.readable: dict[str, tuple[int, list[tuple[str, int]]]] = {}
        self.pending: dict[str, tuple[str, int, list[tuple[str, int]], float]] = {}
        self.lease: dict[str, float] = {}
        self.hard: set[str] = set()
        self.seg_owner: dict[str, str] = {}
        self.killed: set[str] = set()
        self.inflight: set[str] = set()  # keys with a replica task in flight
        self._cfg_hard: dict[str, bool] = {}
        self.segs: dict[str, Segment] = {}
        # extents handed to writers that did not end their write: (segment, addr) ->
        # (size, until, key); nothing may be allocated over them before `until` (the release
        # timeout), whatever the master did with the write meanwhile (expiry, revoke, zombie)
        self.given: dict[tuple[str, int], tuple[int, float, str]] = {}

    # -- actions ---------------------------------------------------------------------------

    @rule(client=st.sampled_from(CLIENTS), size=st.sampled_from([4096, 8192, 16384]))
    def mount(self, client: str, size: int) -> None:
        self.nseg += 1
        s = Segment(id=f"s{self.nseg}", name=f"h:{self.nseg}", base=self.nseg << 32, size=size)
        self.m.mount_segment(client, s, self.now)
        self.alive[client] = True
        self.killed.discard(client)
        self.seg_owner[s.name] = client
        self.segs[s.name] = s

    @rule(client=st.sampled_from(CLIENTS))
    def revive(self, client: str) -> None:
        """A client the master expired comes back and re-mounts the same segments."""
        if client not in self.killed or self.m.has_client(client):
            return
        self.killed.discard(client)
        assert self.m.ping(client, self.now).client_status == ClientStatus.NEED_REMOUNT
        mine = [self.segs[n] for n, c in sorted(self.seg_owner.items()) if c == client]
        self.m.remount_segments(client, mine, self.now)

    @rule(client=st.sampled_from(CLIENTS))
    def ping(self, client: str) -> None:
        known = self.m.has_client(client)
        st_ = self.m.ping(client, self.now).client_status
        assert (st_ == ClientStatus.OK) == known
        assert self.m.has_client(client)

    @rule(
        client=st.sampled_from(CLIENTS),
        key=st.sampled_from(KEYS),
        size=st.integers(1, 6000),
        n=st.integers(1, 3),
        hard=st.booleans(),
        upsert=st.booleans(),
    )
    def start(self, client: str, key: str, size: int, n: int, hard: bool, upsert: bool) -> None:
        cfg = ReplicateConfig(replica_num=n, with_hard_pin=hard)
        fn = self.m.upsert_start if upsert else self.m.put_start
        before = set(self.m.all_keys())
        try:
            reps = fn(client, key, size, cfg, self.now)
        except ObjectAlreadyExistsError:
            assert not upsert
            assert key in self.readable  # never for a write still in flight: it may fail
            return
        except ReplicaNotReadyError:
            assert key in self.pending and self.now - self.pending[key][3] < 3.0
            assert upsert or key not in self.readable
            return
        except NoAvailableHandleError:
            return
        except ObjectHasReplicationTaskError:
            assert upsert and key in self.inflight
            return
        finally:
            self._reconcile(before)
        assert 1 <= len(reps) <= n
        assert len({r.segment_name for r in reps}) == len(reps)
        assert all(r.length == size and r.status == ReplicaStatus.PROCESSING for r in reps)
        for r in reps:
            for (gs, ga), (gn, until, gk) in self.given.items():
                assert not (
                    gs == r.segment_name
                    and until > self.now
                    and ga < r.addr + size
                    and r.addr < ga + gn
                ), f"{key} got [{r.addr:#x}, +{size}) over {gk}'s unfinished write on {gs}"
        self.given = {g: v for g, v in self.given.items() if v[1] > self.now}
        for r in reps:
            self.given[(r.segment_name, r.addr)] = (size, self.now + RELEASE, key)
        self.pending[key] = (client, size, [(r.segment_name, r.addr) for r in reps], self.now)
        self.hard.discard(key) if not hard else None
        self._cfg_hard[key] = hard

    @rule(
        client=st.sampled_from(CLIENTS),
        batch=st.lists(
            st.tuples(st.sampled_from(KEYS), st.integers(1, 6000)), min_size=1, max_size=6
        ),
        hard=st.booleans(),
    )
    def put(self, client: str, batch: list[tuple[str, int]], hard: bool) -> None:
        """Whole puts (start + end), the common case that fills segments and forces eviction."""
        for key, size in batch:
            self.start(client, key, size, 1, hard and size < 1000, False)
            if key in self.pending and self.pending[key][0] == client:
                self._finish_key(key, revoke=False)

    @precondition(lambda self: self.readable)
    @rule(data=st.data())
    def get_existing(self, data: st.DataObject) -> None:
        self.get(data.draw(st.sampled_from(sorted(self.readable))))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), revoke=st.booleans())
    def finish(self, data: st.DataObject, revoke: bool) -> None:
        self._finish_key(data.draw(st.sampled_from(sorted(self.pending))), revoke)

    def _finish_key(self, key: str, revoke: bool) -> None:
        client, size, reps, _ = self.pending[key]
        # the master may have dropped dead segments' replicas: model that
        live_reps = [r for r in reps if self._seg_alive(r[0])]
        if revoke:
            self.m.put_revoke(client, key, self.now)
            hold = self.now + self.m.config.put_revoke_hold  # the writer said it stopped
            for r in reps:
                if r in self.given:
                    n, until, k = self.given[r]
                    self.given[r] = (n, min(until, hold), k)
        else:
            self.m.put_end(client, key, self.now)
            for r in reps:  # ended: its extents belong to the object now
                self.given.pop(r, None)
            self.readable[key] = (size, live_reps)
            if self._cfg_hard.get(key):
                self.hard.add(key)
            else:
                self.hard.discard(key)
        del self.pending[key]

    @precondition(lambda self: self.readable)
    @rule(
        data=st.data(),
        move=st.booleans(),
        outcome=st.sampled_from(["end", "revoke", "leave"]),
    )
    def replica_task(self, data: st.DataObject, move: bool, outcome: str) -> None:
        """Copy or move a replica; the executor ends, revokes or abandons the task."""
        key = data.draw(st.sampled_from(sorted(self.readable)))
        names = sorted({s.segment.name for s in self.m.all_segments()})
        target = data.draw(st.sampled_from(names))
        have = [r.segment_name for r in self.m.query_key(key).replicas]
        try:
            if move:
                tid = self.m.create_move_task(key, have[0], target, self.now)
            else:
                tid = self.m.create_copy_task(key, [target], self.now)
        except ObjectHasReplicationTaskError:
            assert key in self.inflight
            return
        except ReplicaNotReadyError:
            assert key in self.pending
            return
        except SegmentNotFoundError:
            assert target in have
            return
        if not move and target in have:
            # a copy onto a segment holding a replica already: done at once, as Mooncake answers
            assert self.m.query_task(tid).status == TaskStatus.SUCCESS
            assert key not in self.inflight
            return
        assert key not in self.inflight
        self.inflight.add(key)
        executor = self.m.query_task(tid).executor
        assert [t.id for t in self.m.fetch_tasks(executor, self.now)] == [tid]
        try:
            start = self.m.task_start(executor, tid, self.now)
        except NoAvailableHandleError:
            self.inflight.discard(key)
            assert self.m.query_task(tid).status == TaskStatus.FAILED
            return
        assert start.size == self.readable[key][0]
        assert start.targets[0].segment_name == target
        if outcome == "end":
            self.m.task_end(executor, tid, self.now)
            size, _ = self.readable[key]
            got = self.m.query_key(key).replicas
            self.readable[key] = (size, [(r.segment_name, r.addr) for r in got])
            assert (start.targets[0].segment_name, start.targets[0].addr) in self.readable[key][1]
            if move:
                assert start.source.segment_name not in [r.segment_name for r in got]
            self.inflight.discard(key)
        elif outcome == "revoke":
            self.m.task_revoke(executor, tid, "", self.now)
            self.inflight.discard(key)

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: str) -> None:
        try:
            got = self.m.get_replica_list(key, self.now)
        except (ObjectNotFoundError, ReplicaNotReadyError):
            assert key not in self.readable
            return
        assert key in self.readable, "readable object the model never completed"
        size, reps = self.readable[key]
        assert got.size == size
        assert [(r.segment_name, r.addr) for r in got.replicas] == [
            r for r in reps if self._seg_alive(r[0])
        ]
        self.lease[key] = self.now + LEASE

    @rule(key=st.sampled_from(KEYS), force=st.booleans())
    def remove(self, key: str, force: bool) -> None:
        try:
            self.m.remove(key, force, self.now)
        except ObjectHasLeaseError:
            assert not force and self.lease.get(key, 0) > self.now
            return
        except ObjectHasReplicationTaskError:
            assert key in self.inflight
            return
        except ObjectNotFoundError:
            assert key not in self.readable
            return
        # a write in progress is ordered after the removal: it stays pending (self.pending)
        assert key in self.readable
        assert key not in self.inflight
        assert force or self.lease.get(key, 0) <= self.now
        del self.readable[key]
        self.hard.discard(key)
        self.lease.pop(key, None)  # a later put of the key is a new object, unleased

    @initialize(sizes=st.lists(st.sampled_from([4096, 8192, 16384]), min_size=3, max_size=3))
    def mount_all(self, sizes: list[int]) -> None:
        for client, size in zip(CLIENTS, sizes, strict=True):
            self.mount(client, size)

    @rule(client=st.sampled_from(CLIENTS))
    def kill(self, client: str) -> None:
        """The client stops pinging (crashed); it expires client_ttl later."""
        self.killed.add(client)

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0, 11.0]))
    def advance(self, dt: float) -> None:
        """Time passes; live clients ping along the way, killed ones expire after client_ttl."""
        steps = 4
        for _ in range(steps):
            self.now += dt / steps
            for c in CLIENTS:
                if c not in self.killed and self.m.has_client(c):
                    self.m.ping(c, self.now)
            before = set(self.m.all_keys())
            self.m.sweep(self.now)
            self._reconcile(before)
        # zombies past release timeout are gone
        for key in [k for k, p in self.pending.items() if self.now - p[3] >= RELEASE]:
            del self.pending[key]

    # -- model upkeep ----------------------------------------------------------------------

    def _seg_alive(self, name: str) -> bool:
        return any(s.segment.name == name for s in self.m.all_segments())

    def _reconcile(self, before: set[str]) -> None:
        """Keys the master dropped on its own (eviction, client expiry) must be droppable."""
        for key in list(self.inflight):
            obj = self.m._objects.get(key)
            if obj is None or obj.task is None:  # failed on the master's side
                self.inflight.discard(key)
        after = set(self.m.all_keys())
        for key in before - after:
            if key not in self.readable:
                continue
            _, reps = self.readable[key]
            lost_all = not any(self._seg_alive(r[0]) for r in reps)
            if not lost_all:
                assert key not in self.hard, f"hard-pinned {key} evicted"
                assert self.lease.get(key, 0) <= self.now, f"leased {key} evicted"
            del self.readable[key]
            self.hard.discard(key)
        for key in list(self.readable):
            if key not in after:
                _, reps = self.readable[key]
                assert not any(self._seg_alive(r[0]) for r in reps)
                del self.readable[key]
            else:  # replicas on dropped segments are gone, also if the segment comes back
                size, reps = self.readable[key]
                self.readable[key] = (size, [r for r in reps if self._seg_alive(r[0])])
        for key in list(self.pending):
            if self.m._objects.get(key) is None or self.m._objects[key].pending is None:
                del self.pending[key]

    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        assert set(self.m.all_keys()) == set(self.readable)


TestMasterMachine = MasterMachine.TestCase
TestMasterMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


# -- replica tasks ----------------------------------------------------------------------------


def _two_segments() -> MasterState:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    put(m, "a", "k", 1000, 0, ReplicateConfig(preferred_segments=[seg(0).name]))
    return m


def test_copy_task_adds_a_replica() -> None:
    m = _two_segments()
    tid = m.create_copy_task("k", [seg(1).name], 1)
    assert m.query_task(tid).status == TaskStatus.PENDING
    assert m.fetch_tasks("b", 1) == []  # the source's owner executes
    (t,) = m.fetch_tasks("a", 1)
    assert t.id == tid and t.type == TaskType.REPLICA_COPY and t.status == TaskStatus.PROCESSING
    with pytest.raises(ObjectHasReplicationTaskError):
        m.remove("k", True, 1)
    start = m.task_start("a", tid, 1)
    assert start.size == 1000 and start.source.segment_name == seg(0).name
    assert [r.segment_name for r in start.targets] == [seg(1).name]
    assert len(m.get_replica_list("k", 2).replicas) == 1  # not readable there yet
    m.check_invariants()
    m.task_end("a", tid, 2)
    assert m.query_task(tid).status == TaskStatus.SUCCESS
    names = sorted(r.segment_name for r in m.get_replica_list("k", 2).replicas)
    assert names == sorted([seg(0).name, seg(1).name])
    m.check_invariants()
    m.remove("k", True, 3)
    assert m.used_bytes == 0


def test_move_task_moves_the_replica() -> None:
    m = _two_segments()
    tid = m.create_move_task("k", seg(0).name, seg(1).name, 1)
    m.fetch_tasks("a", 1)
    m.task_start("a", tid, 1)
    m.task_end("a", tid, 1)
    assert [r.segment_name for r in m.get_replica_list("k", 30).replicas] == [seg(1).name]
    m.ping("a", 30)
    m.ping("b", 30)
    m.sweep(30)
    assert m.used_bytes == 1024
    m.check_invariants()


def test_task_errors_and_failures() -> None:
    m = _two_segments()
    with pytest.raises(ObjectNotFoundError):
        m.create_copy_task("nope", [seg(1).name], 0)
    with pytest.raises(SegmentNotFoundError):
        m.create_copy_task("k", ["no-such-segment"], 0)
    done = m.create_copy_task("k", [seg(0).name], 0)  # already holds a replica: nothing to do
    assert m.query_task(done).status == TaskStatus.SUCCESS and m.fetch_tasks("a", 0) == []
    with pytest.raises(ReplicaNotFoundError):
        m.create_move_task("k", seg(1).name, seg(0).name, 0)
    tid = m.create_copy_task("k", [seg(1).name], 0)
    with pytest.raises(ObjectHasReplicationTaskError):
        m.create_copy_task("k", [seg(1).name], 0)
    with pytest.raises(IllegalClientError):
        m.task_start("b", tid, 0)
    m.task_start("a", tid, 0)
    m.task_revoke("a", tid, "transfer failed", 0)
    info = m.query_task(tid)
    assert info.status == TaskStatus.FAILED and info.message == "transfer failed"
    assert m.used_bytes == 2048  # the revoked target is held for put_revoke_hold
    m.sweep(m.config.put_revoke_hold)
    assert m.used_bytes == 1024
    m.ping("a", 0)
    m.ping("b", 0)
    with pytest.raises(InvalidWriteError):
        m.task_end("a", tid, 0)
    # the target's owner dies mid-task: the task fails, the object keeps its replica
    tid = m.create_copy_task("k", [seg(1).name], 0)
    m.task_start("a", tid, 0)
    for t in range(1, 13):
        m.ping("a", t)
        m.sweep(t)
    assert m.query_task(tid).status == TaskStatus.FAILED
    assert len(m.get_replica_list("k", 13).replicas) == 1
    m.check_invariants()
    # an executor that never fetches: the task times out
    m2 = _two_segments()
    tid = m2.create_copy_task("k", [seg(1).name], 0)
    for t in range(1, 302, 5):
        m2.ping("a", t)
        m2.ping("b", t)
        m2.sweep(t)
    assert m2.query_task(tid).status == TaskStatus.FAILED
    m2.remove("k", True, 302)
