"""DrainSegment on the sans-I/O master: no allocation on a draining segment, replicated objects
re-replicated from their other copy, sole copies moved, in-flight work reported, idempotence."""

from __future__ import annotations

import pytest

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import IllegalClientError, NoAvailableHandleError, SegmentNotFoundError

MiB = 1 << 20


def seg(i: int, size: int = MiB) -> Segment:
    return Segment(id=f"seg{i}", name=f"127.0.0.1:{1000 + i}", base=1 << 30, size=size)


def master() -> MasterState:
    return MasterState(MasterConfig(seed=0))


def put(m: MasterState, client: str, key: str, size: int, now: float, n: int = 1) -> None:
    m.put_start(client, key, size, ReplicateConfig(replica_num=n), now)
    m.put_end(client, key, now)


def holders(m: MasterState, key: str, now: float) -> set[str]:
    return {r.segment_name for r in m.get_replica_list(key, now, for_read=False).replicas}


def run_tasks(m: MasterState, client: str, now: float) -> list[str]:
    done = []
    for t in m.fetch_tasks(client, now):
        m.task_start(client, t.id, now)
        m.task_end(client, t.id, now)
        done.append(t.key)
    return done


def test_nothing_is_allocated_on_a_draining_segment() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    status = m.drain_segment("a", "seg0", 0)
    assert status.settled
    for i in range(20):
        put(m, "b", f"k{i}", 1000, 1)
        assert holders(m, f"k{i}", 1) == {seg(1).name}
    assert [s.status for s in m.all_segments()] == ["DRAINING", "OK"]
    m.unmount_segment("b", "seg1", 2)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("b", "x", 10, ReplicateConfig(), 2)


def test_replicated_objects_leave_the_segment_and_are_re_replicated() -> None:
    m = master()
    for i, c in enumerate("abc"):
        m.mount_segment(c, seg(i), 0)
    cfg = ReplicateConfig(replica_num=2, preferred_segment=seg(0).name)
    m.put_start("a", "k", 4096, cfg, 0)
    m.put_end("a", "k", 0)
    before = holders(m, "k", 0)
    assert seg(0).name in before and len(before) == 2
    (other,) = before - {seg(0).name}
    status = m.drain_segment("a", "seg0", 10)
    assert (status.released, status.copies, status.moves) == (1, 1, 0)
    assert holders(m, "k", 10) == {other}  # readers are sent elsewhere at once
    executor = {seg(1).name: "b", seg(2).name: "c"}[other]
    assert run_tasks(m, executor, 10) == ["k"]
    after = holders(m, "k", 10)
    assert len(after) == 2 and seg(0).name not in after
    again = m.drain_segment("a", "seg0", 11)
    assert again.settled and again.released == 0 and again.copies == 0


def test_a_sole_copy_moves_to_the_segment_with_room() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    m.put_start("a", "k", 4096, ReplicateConfig(preferred_segment=seg(0).name), 0)
    m.put_end("a", "k", 0)
    assert holders(m, "k", 0) == {seg(0).name}
    status = m.drain_segment("a", "seg0", 20)
    assert (status.moves, status.tasks) == (1, 1) and not status.settled
    assert run_tasks(m, "a", 20) == ["k"]  # the draining client runs it: it owns the source
    assert holders(m, "k", 20) == {seg(1).name}
    assert m.drain_segment("a", "seg0", 21).settled


def test_a_sole_copy_with_no_room_elsewhere_is_stranded_and_goes_at_unmount() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    put(m, "a", "k", 4096, 0)
    status = m.drain_segment("a", "seg0", 20)
    assert status.stranded == 1 and status.settled
    m.unmount_segment("a", "seg0", 21)
    assert m.explain_miss("k") is not None


def test_read_leases_and_writes_in_flight_hold_the_drain() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    cfg = ReplicateConfig(replica_num=2)
    m.put_start("b", "k", 4096, cfg, 0)
    m.put_end("b", "k", 0)
    m.get_replica_list("k", 1.0)  # a reader holds a lease on both replicas
    m.put_start("b", "w", 4096, cfg, 1.0)  # a write into seg0 in flight
    status = m.drain_segment("a", "seg0", 1.0)
    assert status.read_wait_s > 0 and status.writes == 1 and not status.settled
    # the replica left the lists at the first call; the lease granted on it still holds
    assert m.drain_segment("a", "seg0", 1.1).read_wait_s > 0
    m.put_end("b", "w", 2.0)
    later = m.drain_segment("a", "seg0", 1000.0)
    assert later.released == 1 and later.writes == 0 and later.settled


def test_only_the_owner_drains_a_mounted_segment() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    with pytest.raises(IllegalClientError):
        m.drain_segment("b", "seg0", 0)
    with pytest.raises(SegmentNotFoundError):
        m.drain_segment("a", "nope", 0)


def test_a_move_task_never_targets_a_draining_segment() -> None:
    m = master()
    m.mount_segment("a", seg(0), 0)
    m.mount_segment("b", seg(1), 0)
    m.put_start("a", "k", 100, ReplicateConfig(preferred_segment=seg(0).name), 0)
    m.put_end("a", "k", 0)
    m.drain_segment("b", "seg1", 0)
    with pytest.raises(SegmentNotFoundError):
        m.create_move_task("k", seg(0).name, seg(1).name, 0)


def test_a_drain_job_step_keeps_to_its_targets_and_its_bound() -> None:
    from mooncake._core import commands

    m = master()
    for i, c in enumerate("abc"):
        m.mount_segment(c, seg(i, 8 * MiB), 0)
    for i in range(5):
        m.put_start("a", f"k{i}", 4096, ReplicateConfig(preferred_segment=seg(0).name), 0)
        m.put_end("a", f"k{i}", 0)
    step = commands.DrainStep(seg(0).name, [seg(2).name], 2, 1.0)
    replay = commands.decode_commands(commands.encode_commands([step]))[0]
    status = commands.apply(m, replay)  # through the log's encoding, as a standby applies it
    assert status.moves == 2 and status.tasks == 5  # two moves, three waiting for a slot
    units = m.drain_units(seg(0).name)
    assert units is not None and sorted(busy for _, _, busy in units) == [0, 0, 0, 1, 1]
    for _ in range(3):
        run_tasks(m, "a", 1.0)
        commands.apply(m, step)
    run_tasks(m, "a", 1.0)
    assert m.drain_units(seg(0).name) == []
    for i in range(5):  # every move went to the named target, none to the other segment
        assert holders(m, f"k{i}", 2) == {seg(2).name}
    assert m.segment_draining(seg(0).name) is True
    commands.apply(m, commands.Undrain(seg(0).name, 3.0))
    assert m.segment_draining(seg(0).name) is False
    assert m.drain_units("10.0.0.9:1") is None and m.segment_draining("10.0.0.9:1") is None
    assert commands.apply(m, commands.DrainStep("10.0.0.9:1", [], 0, 3.0)) is None
