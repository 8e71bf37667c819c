"""Memory of an expired client that others may still touch is not handed out again at once.

A client expired by the master (it stopped pinging, e.g. a long pause) re-mounts its segment
when it comes back. Writers that were given extents of that segment before the expiry may still
be copying into them, and readers may still be reading them within their read windows: those
extents stay allocated (as deferred frees) until the writer's release timeout / the window.
Likewise a revoked write's extent is held for ``put_revoke_hold`` (a cancelled transfer's bytes
may still be in flight to the segment's owner).
"""

from __future__ import annotations

import pytest

from mooncake._core.allocator import OffsetAllocator
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import NoAvailableHandleError, ObjectNotFoundError

MiB = 1 << 20
SEG = Segment(id="seg-a", name="127.0.0.1:1000", base=1 << 30, size=MiB)
ON_A = ReplicateConfig(preferred_segments=[SEG.name])


def state(**kw: float) -> MasterState:
    kw.setdefault("client_ttl", 10.0)
    return MasterState(MasterConfig(seed=0, **kw))  # type: ignore[arg-type]


def test_a_pending_write_into_an_expired_clients_segment_keeps_its_extent() -> None:
    m = state(put_start_release_timeout=600.0)
    m.mount_segment("a", SEG, 0.0)
    m.ping("b", 0.0)
    (rep,) = m.put_start("b", "late", MiB, ON_A, 1.0)  # b is writing into a's segment ...
    for t in range(2, 30, 2):  # ... b keeps pinging, a does not
        m.ping("b", float(t))
        m.sweep(float(t))
    assert not m.has_client("a")
    m.ping("a", 30.0)  # NEED_REMOUNT
    m.remount_segments("a", [SEG], 30.0)
    m.check_invariants()
    with pytest.raises(NoAvailableHandleError):  # b may still be copying into [rep.addr, +1 MiB)
        m.put_start("a", "new", MiB, ON_A, 31.0)
    with pytest.raises(ObjectNotFoundError):
        m.put_end("b", "late", 31.0)  # its write died with the segment
    m.sweep(590.0)  # expires both (silent since 30 s): nothing is held twice
    m.remount_segments("a", [SEG], 590.0)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("a", "new", MiB, ON_A, 591.0)
    m.ping("a", 601.0)
    m.sweep(601.5)  # the writer's release timeout: the extent is free again
    (new,) = m.put_start("a", "new", MiB, ON_A, 601.6)
    assert new.addr == rep.addr
    m.check_invariants()


def test_an_open_read_window_on_an_expired_clients_segment_is_honoured() -> None:
    m = state(read_fence_ttl=50.0, default_kv_lease_ttl=60.0)
    m.mount_segment("a", SEG, 0.0)
    m.put_start("a", "k", MiB, ON_A, 0.0)
    m.put_end("a", "k", 0.0)
    got = m.get_replica_list("k", 5.0)  # a reader copies it until t = 5 + 50 (+ per MiB)
    m.ping("a", 5.0)
    m.sweep(16.0)
    assert not m.has_client("a")
    m.remount_segments("a", [SEG], 17.0)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("a", "other", MiB, ON_A, 18.0)
    m.ping("a", 50.0)
    m.sweep(60.0)
    m.ping("a", 60.0)
    (rep,) = m.put_start("a", "other", MiB, ON_A, 60.0)
    assert rep.addr == got.replicas[0].addr


def test_a_remount_of_a_different_range_holds_nothing() -> None:
    m = state()
    m.mount_segment("a", SEG, 0.0)
    m.ping("b", 0.0)
    m.put_start("b", "late", MiB, ON_A, 1.0)
    m.ping("b", 12.0)
    m.sweep(12.0)
    moved = Segment(id=SEG.id, name=SEG.name, base=SEG.base + 16 * MiB, size=MiB)
    m.remount_segments("a", [moved], 13.0)
    (rep,) = m.put_start("a", "new", MiB, ReplicateConfig(preferred_segments=[SEG.name]), 13.0)
    assert rep.addr == moved.base


def test_allocator_reserve_takes_exactly_a_free_extent() -> None:
    a = OffsetAllocator(4096, 1 << 16)
    assert a.reserve(4096 + 128, 100)
    assert a.extent(4096 + 128) == 128
    assert not a.reserve(4096 + 192, 64)  # overlaps
    assert not a.reserve(4096 + 130, 10)  # misaligned
    assert not a.reserve(4096 + (1 << 16) - 64, 128)  # runs past the end
    a.self_check()
    x = a.allocate(64)
    assert x == 4096
    a.free(4096 + 128)
    a.free(x)
    a.self_check()
    assert a.free_blocks() == [(4096, 1 << 16)]


def test_a_revoked_writes_extent_is_held_before_reuse() -> None:
    m = state(put_revoke_hold=5.0)
    m.mount_segment("a", SEG, 0.0)
    (rep,) = m.put_start("a", "k", MiB, ON_A, 1.0)
    m.put_revoke("a", "k", 1.5)  # e.g. its transfer was cancelled mid-way
    assert m.used_bytes == MiB
    with pytest.raises(NoAvailableHandleError):
        m.put_start("a", "k2", MiB, ON_A, 2.0)
    m.ping("a", 6.4)
    m.sweep(6.4)
    with pytest.raises(NoAvailableHandleError):
        m.put_start("a", "k2", MiB, ON_A, 6.4)
    m.sweep(6.5)
    (again,) = m.put_start("a", "k2", MiB, ON_A, 6.5)
    assert again.addr == rep.addr
    m.check_invariants()
    # hold 0 frees at once (as before)
    m0 = state(put_revoke_hold=0.0)
    m0.mount_segment("a", SEG, 0.0)
    m0.put_start("a", "k", MiB, ON_A, 1.0)
    m0.put_revoke("a", "k", 1.5)
    assert m0.used_bytes == 0
