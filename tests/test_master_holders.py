"""MasterState: quarantine of unreachable holders, and reads/removes ordered with writes.

Sans-I/O, explicit time. Quarantine: a client's report of a transfer failure takes the
segment out of allocation and out of replica lists until its holder's next heartbeat (after
a short grace) or its expiry; a false or hostile report costs a live holder about one
heartbeat. Ordering: a read gets the last complete version while a write is in flight (never
``REPLICA_IS_NOT_READY``); a remove removes the readable version and the write in flight
becomes readable at its End.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import (
    ClientNotFoundError,
    InvalidArgumentError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ReplicaNotFoundError,
    SegmentNotFoundError,
)

MiB = 1 << 20
DEF = ReplicateConfig()


def seg(i: int, size: int = MiB) -> Segment:
    return Segment(id=f"seg{i}", name=f"127.0.0.1:{1000 + i}", base=1 << 30, size=size)


def master(**kw: object) -> MasterState:
    return MasterState(MasterConfig(seed=0, **kw))  # type: ignore[arg-type]


def on(i: int) -> ReplicateConfig:
    return ReplicateConfig(preferred_segments=[seg(i).name])


def two_holders() -> MasterState:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    return m


def put(m: MasterState, client: str, key: str, now: float, cfg: ReplicateConfig = DEF) -> None:
    m.put_start(client, key, 100, cfg, now)
    m.put_end(client, key, now)


def names(m: MasterState, key: str, now: float) -> list[str]:
    return [r.segment_name for r in m.get_replica_list(key, now).replicas]


# -- reads and removes ordered with writes -----------------------------------------------------


def test_read_during_an_upsert_gets_the_last_complete_version() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    old = m.get_replica_list("k", 0).replicas
    new = m.upsert_start("b", "k", 200, on(1), 1)
    for now in (1, 2, 3):
        got = m.get_replica_list("k", now)
        assert (got.size, got.replicas) == (100, old)
        assert m.exist_key("k", now)
    m.upsert_end("b", "k", 4)
    got = m.get_replica_list("k", 4)
    assert got.size == 200 and [(r.addr, r.segment_name) for r in got.replicas] == [
        (r.addr, r.segment_name) for r in new
    ]


def test_read_of_a_key_only_being_written_is_not_found() -> None:
    m = two_holders()
    m.put_start("a", "k", 100, DEF, 0)
    with pytest.raises(ObjectNotFoundError):
        m.get_replica_list("k", 0)
    (item,) = m.batch_get_replica_list(["k"], 0)
    assert item.code == int(ObjectNotFoundError.code)


def test_remove_during_an_upsert_removes_the_readable_version_and_the_write_lands() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    m.upsert_start("b", "k", 200, on(1), 1)
    m.remove("k", False, 11)  # the lease of the put is over
    with pytest.raises(ObjectNotFoundError):
        m.get_replica_list("k", 11)
    assert not m.exist_key("k", 11)
    with pytest.raises(ObjectNotFoundError):
        m.remove("k", False, 11)  # nothing readable is left to remove
    m.upsert_end("b", "k", 12)
    assert m.get_replica_list("k", 12).size == 200
    assert names(m, "k", 12) == [seg(1).name]
    m.check_invariants()


def test_remove_of_a_leased_key_during_an_upsert_answers_the_lease() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    m.get_replica_list("k", 0)
    m.upsert_start("b", "k", 200, on(1), 1)
    with pytest.raises(ObjectHasLeaseError):
        m.remove("k", False, 1)
    m.remove("k", True, 1)
    m.upsert_end("b", "k", 2)
    assert m.get_replica_list("k", 2).size == 200
    m.check_invariants()


def test_remove_during_a_first_put_is_not_found_and_the_put_lands() -> None:
    m = two_holders()
    m.put_start("a", "k", 100, DEF, 0)
    with pytest.raises(ObjectNotFoundError):
        m.remove("k", True, 0)
    assert m.remove_all(True, 0) == 0
    m.put_end("a", "k", 1)
    assert m.get_replica_list("k", 1).size == 100


def test_remove_all_skips_no_key_with_a_write_in_flight() -> None:
    m = two_holders()
    put(m, "a", "k", 0)
    put(m, "a", "j", 0)
    m.upsert_start("b", "k", 300, DEF, 1)
    assert m.remove_all(True, 1) == 2
    assert m.all_keys() == []
    m.upsert_end("b", "k", 2)
    assert m.all_keys() == ["k"]
    m.check_invariants()


def test_removed_versions_space_waits_for_its_read_window_while_a_write_is_in_flight() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    old = m.get_replica_list("k", 0).replicas[0]
    m.upsert_start("b", "k", 100, on(1), 0.1)
    m.remove("k", True, 0.1)  # inside the read window the old extent stays allocated
    reps = m.put_start("a", "x", 100, on(0), 0.1)
    assert all(not (r.segment_name == old.segment_name and r.addr == old.addr) for r in reps)
    m.check_invariants()


# -- quarantine --------------------------------------------------------------------------------


def test_report_quarantines_the_segment_until_its_holders_heartbeat() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    assert m.report_segment_failure("b", seg(0).name, "refused", 1.0) is True
    # its only replica is unreachable: a clear code at once, no lease granted
    with pytest.raises(ReplicaNotFoundError, match="no reachable replica"):
        m.get_replica_list("k", 1.0)
    # exist agrees with get: no readable replica, so it does not exist (and is not leased)
    assert not m.exist_key("k", 1.0)
    assert m.batch_exist_key(["k", "absent"], 1.0) == [0, 0]
    assert len(m.query_key("k").replicas) == 1  # the object is not lost
    # no new allocation there, even when asked for
    assert [r.segment_name for r in m.put_start("b", "new", 100, on(0), 1.0)] == [seg(1).name]
    m.ping("a", 1.05)  # inside the grace: a heartbeat sent before the report
    with pytest.raises(ReplicaNotFoundError):
        m.get_replica_list("k", 1.05)
    m.ping("a", 1.2)
    assert names(m, "k", 1.2) == [seg(0).name]
    assert m.exist_key("k", 1.2) and m.batch_exist_key(["k"], 1.2) == [1]
    assert m.quarantine.stats.lifted == 1
    m.check_invariants()


def test_reads_skip_a_quarantined_replica_and_use_the_others() -> None:
    m = two_holders()
    m.mount_segment("c", seg(2), 0)
    cfg = ReplicateConfig(replica_num=2, preferred_segments=[seg(0).name, seg(1).name])
    put(m, "c", "k", 0, cfg)
    assert sorted(names(m, "k", 0)) == [seg(0).name, seg(1).name]
    m.report_segment_failure("c", seg(0).name, "", 1)
    assert names(m, "k", 1) == [seg(1).name]
    assert m.exist_key("k", 1) and m.batch_exist_key(["k"], 1) == [1]  # one is readable
    assert len(m.query_key("k").replicas) == 2  # both still belong to the object


def test_only_a_known_client_may_report_and_not_its_own_segment() -> None:
    m = two_holders()
    with pytest.raises(ClientNotFoundError):
        m.report_segment_failure("stranger", seg(0).name, "", 0)
    with pytest.raises(InvalidArgumentError):
        m.report_segment_failure("a", seg(0).name, "", 0)
    with pytest.raises(SegmentNotFoundError):
        m.report_segment_failure("a", "10.0.0.1:1", "", 0)
    assert not m.quarantine


def test_a_dead_holders_quarantine_ends_with_its_expiry() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    m.report_segment_failure("b", seg(0).name, "", 0.5)
    for t in range(1, 12):  # b pings, a does not
        m.ping("b", t)
        m.sweep(t)
        if m.has_client("a"):
            with pytest.raises(ReplicaNotFoundError):
                m.get_replica_list("k", t)
    assert not m.has_client("a")
    assert not m.quarantine and m.quarantine.stats.ended == 1
    with pytest.raises(ObjectNotFoundError):
        m.get_replica_list("k", 12)


def test_a_refuted_reporter_is_not_heard_on_that_segment_for_a_while() -> None:
    m = two_holders()
    m.mount_segment("c", seg(2), 0)
    put(m, "a", "k", 0, on(0))
    m.report_segment_failure("b", seg(0).name, "", 1)
    m.ping("a", 2)  # refutes b
    assert m.report_segment_failure("b", seg(0).name, "", 3) is False
    assert names(m, "k", 3) == [seg(0).name]
    assert m.report_segment_failure("c", seg(0).name, "", 3) is True  # another reporter is
    m.ping("a", 4)
    assert m.report_segment_failure("b", seg(0).name, "", 12.5) is True  # hold over
    assert m.quarantine.stats.ignored == 1


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=200),
    beat=st.floats(0.2, 1.0),
)
def test_a_hostile_reporter_costs_a_live_holder_about_one_heartbeat_per_hold(
    gaps: list[float], beat: float
) -> None:
    """Reports at arbitrary times against a holder that heartbeats every ``beat`` s: the time
    its segment spends quarantined is at most (beat + grace) per refute_hold (plus one)."""
    m = two_holders()
    cfg = m.config
    now, next_beat, out_since, out_total = 0.0, beat, None, 0.0
    for gap in gaps:
        end = now + gap
        while next_beat <= end:  # heartbeats due before the next report
            m.ping("a", next_beat)
            m.ping("b", next_beat)
            if out_since is not None and seg(0).name not in m.quarantine:
                out_total += next_beat - out_since
                out_since = None
            next_beat += beat
        now = end
        m.report_segment_failure("b", seg(0).name, "hostile", now)
        if out_since is None and seg(0).name in m.quarantine:
            out_since = now
    if out_since is not None:
        out_total += next_beat - out_since  # lifted by the next heartbeat at the latest
    holds = now / cfg.quarantine_refute_hold + 1
    assert out_total <= holds * (beat + cfg.quarantine_grace) + 1e-9


# -- re-adoption of an SSD tier by a restarted client -----------------------------------------


def test_a_client_restarted_on_its_ssd_directory_readopts_its_copies() -> None:
    m = master(client_ttl=10.0)
    m.mount_local_disk("old", 1 << 30, 0, tier_id="dir-1")
    vid = m.put_local("old", "k", 100, 0)
    m.put_local("old", "gone", 100, 0)
    m.remove("gone", True, 0)  # the old instance was told to delete that copy, and died
    m.mount_local_disk("new", 1 << 30, 1, tier_id="dir-1")  # the same directory, new process
    assert m.put_local("new", "k", 100, 1) == vid  # re-adopted, not refused
    with pytest.raises(ObjectAlreadyExistsError):  # a deleted copy is not resurrected
        m.put_local("new", "gone", 100, 1)
    assert [d.key for d in m.fetch_tier_tasks("new", 1).drop] == ["gone"]
    for t in (5, 11, 12):  # the old instance expires: it takes nothing with it
        m.ping("new", t)
        m.sweep(t)
    assert not m.has_client("old")
    assert m.get_replica_list("k", 12).disk_clients == ["new"]
    m.check_invariants()


def test_another_directory_does_not_take_over_a_live_clients_copies() -> None:
    m = master()
    m.mount_local_disk("a", 1 << 30, 0, tier_id="dir-1")
    m.put_local("a", "k", 100, 0)
    m.mount_local_disk("b", 1 << 30, 0, tier_id="dir-2")
    with pytest.raises(ObjectAlreadyExistsError):
        m.put_local("b", "k", 100, 0)
    assert m.get_replica_list("k", 0).disk_clients == ["a"]


# -- space held after a revoke -------------------------------------------------------------------


def test_a_full_answer_from_held_space_says_so_and_the_space_returns() -> None:
    m = master(put_revoke_hold=10.0)
    m.mount_segment("a", Segment(id="s", name="127.0.0.1:1000", base=1 << 30, size=MiB), 0)
    m.put_start("a", "big", MiB, DEF, 0)
    m.put_revoke("a", "big", 0)  # a cancelled put: its bytes may still land for 10 s
    with pytest.raises(NoAvailableHandleError, match=r"1048576 of the used bytes are held"):
        m.put_start("a", "next", MiB, DEF, 1)
    m.ping("a", 11)
    m.sweep(11)
    assert m.put_start("a", "next", MiB, DEF, 11)  # held only for put_revoke_hold
    m.check_invariants()


def test_a_discarded_write_of_a_lost_client_is_revoked_and_its_keys_free() -> None:
    m = two_holders()
    put(m, "a", "k", 0, on(0))
    m.put_start("b", "w", 100, on(0), 0)
    m.connection_lost("a", 1)  # the holder's heartbeat connection closed
    assert not m.exist_key("k", 1) and m.batch_exist_key(["k"], 1) == [0]
    with pytest.raises(ReplicaNotFoundError):
        m.get_replica_list("k", 1)
    m.connection_lost("b", 1)  # the writer's: its write in flight is discarded at once
    m.ping("a", 2)  # the holder was alive after all: its next heartbeat lifts the quarantine
    assert m.exist_key("k", 2) and names(m, "k", 2) == [seg(0).name]
    assert m.put_start("a", "w", 100, on(0), 2)  # not "being written" any more
    m.connection_lost("stranger", 2)  # unknown: nothing happens
    m.connection_lost("a", 3)
    m.ping("a", 3)  # a heartbeat after the close came on a new connection: no grace needed
    assert m.exist_key("k", 3) and m.quarantine.stats.reports == 0  # nobody was refuted
    m.check_invariants()
