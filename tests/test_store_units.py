"""Pieces of the store client that need no master: staging allocator, loop bridge, config."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from mooncake._core import store_types as st
from mooncake._core.staging import RangeAllocator
from mooncake._store.config import ReplicateConfig, parse_size, to_wire
from mooncake._sync import LoopThread
from mooncake.errors import ClosedError, InvalidArgumentError
from mooncake.store import MooncakeDistributedStore, SoftPinAction


@settings(max_examples=200, deadline=None)
@given(
    cap=hs.integers(0, 1 << 16),
    ops=hs.lists(hs.tuples(hs.booleans(), hs.integers(1, 5000)), max_size=80),
)
def test_range_allocator_never_overlaps_and_coalesces(
    cap: int, ops: list[tuple[bool, int]]
) -> None:
    a = RangeAllocator(cap, align=64)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            if off is None:
                continue
            end = off + ((n + 63) & ~63)
            assert off % 64 == 0 and off >= 0 and end <= a.capacity
            assert all(end <= o or o + m <= off for o, m in live.items())
            live[off] = end - off
        else:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        assert a.used == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.free_ranges() == ([(0, a.capacity)] if a.capacity else [])
    with pytest.raises(InvalidArgumentError):
        a.free(12345)


def test_range_allocator_first_fit_reuses_holes() -> None:
    a = RangeAllocator(1024, align=64)
    x, y, z = a.alloc(64), a.alloc(128), a.alloc(64)
    assert (x, y, z) == (0, 64, 192)
    a.free(y)
    assert a.alloc(100) == 64  # the hole, not the tail
    assert a.alloc(2000) is None and not a.fits(2000) and a.fits(1024)


def test_loop_thread_calls_submits_raises_and_closes() -> None:
    lt = LoopThread()
    try:

        async def add(x: int, y: int) -> int:
            return x + y

        async def boom() -> None:
            raise InvalidArgumentError("bad")

        assert lt.call(add, 2, 3) == 5
        assert lt.submit(add, 4, 5).result(timeout=10) == 9
        with pytest.raises(InvalidArgumentError, match="bad"):
            lt.call(boom)
        # many threads at once
        out: list[int] = []
        ts = [
            threading.Thread(target=lambda i=i: out.append(lt.call(add, i, 0))) for i in range(16)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert sorted(out) == list(range(16))

        async def reenter() -> int:
            return lt.call(add, 1, 1)

        with pytest.raises(RuntimeError, match="deadlock"):
            lt.call(reenter)
    finally:
        lt.close()
    with pytest.raises(ClosedError):
        lt.call(add, 1, 2)
    lt.close()  # idempotent


def test_parse_size_accepts_the_published_spellings() -> None:
    assert parse_size(123, "x") == 123
    assert parse_size("16MB", "x") == 16 << 20
    assert parse_size("16 MB", "x") == 16 << 20
    assert parse_size("1GiB", "x") == 1 << 30
    assert parse_size("512", "x") == 512
    for bad in ("50%", "", "MB", "1.2.3MB", "12XB", -1, True, None):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad, "global_segment_size")


def test_replicate_config_matches_the_published_shape() -> None:
    c = ReplicateConfig()
    assert str(c) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
        "preferred_segments: [], preferred_nof_segments: [], prefer_alloc_in_same_node: 0, "
        "data_type: UNKNOWN }"
    )
    c.replica_num = 2
    c.with_hard_pin = True
    c.preferred_segment = "h:1"
    c.soft_pin_action = SoftPinAction.ENABLE
    w = to_wire(c)
    assert isinstance(w, st.ReplicateConfig)
    assert (w.replica_num, w.with_hard_pin, w.preferred(), w.soft_pinned()) == (
        2,
        True,
        ["h:1"],
        True,
    )
    c.replica_num = 0
    with pytest.raises(InvalidArgumentError, match="replica_num"):
        to_wire(c)
    c.replica_num = 1
    c.nof_replica_num = 1
    with pytest.raises(InvalidArgumentError, match="NoF"):
        to_wire(c)
    with pytest.raises(AttributeError):
        c.no_such_field = 1  # type: ignore[attr-defined]


def test_facade_before_setup_and_with_bad_setup_arguments() -> None:
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.put("k", b"v") < 0
    assert s.get("k") == b""
    assert s.batch_is_exist(["a", "b"]) == [s.is_exist("a")] * 2
    assert s.setup({"local_hostname": "127.0.0.1"}) == -600  # metadata_server missing
    assert (
        s.setup(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "10%",
            }
        )
        == -600
    )
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "nonsense") == -600
    assert getattr(s, "batch_get_session_of_nothing", None) is None  # no catch-all stubs
    assert s.close() == 0
