"""The master at scale: time-driven work looks only at what is due, never at every object."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.master.objmap import ObjectMap
from mooncake._core.store_types import ReplicateConfig, Segment, SoftPinAction
from mooncake.errors import ObjectNotFoundError

KiB = 1 << 10
SEG = Segment(id="seg-a", name="127.0.0.1:1000", base=1 << 30, size=64 << 20)


class _NoScan(ObjectMap):
    """An object map that fails any walk over all of it (lookups by key still work)."""

    __slots__ = ("armed",)

    def __init__(self, base: ObjectMap) -> None:
        super().__init__(base.table)
        self.hot, self.segs, self.writers = base.hot, base.segs, base.writers
        self._writer_num, self._dirty = base._writer_num, base._dirty
        self.armed = True

    def _walk(name: str) -> Any:  # type: ignore[misc]
        def walk(self: _NoScan, *args: Any) -> Any:
            if self.armed:
                raise AssertionError(f"walked every object ({name})")
            return getattr(ObjectMap, name)(self, *args)

        return walk

    __iter__ = _walk("__iter__")
    items = _walk("items")  # type: ignore[assignment]
    values = _walk("values")  # type: ignore[assignment]
    readable_keys = _walk("readable_keys")  # type: ignore[assignment]
    handles_on = _walk("handles_on")  # type: ignore[assignment]
    extend_deadlines = _walk("extend_deadlines")  # type: ignore[assignment]


def _state(**kw: Any) -> MasterState:
    kw.setdefault("seed", 0)
    m = MasterState(MasterConfig(**kw))
    m.mount_segment("a", SEG, 0.0)
    m.mount_local_disk("a", 1 << 30, 0.0)
    return m


def test_sweep_never_walks_every_object() -> None:
    """Zombie writes, soft pins, demotions and deferred frees all expire on time while the
    object table refuses to be walked: the sweep reads only deadline-ordered queues."""
    m = _state(
        put_start_discard_timeout=5.0,
        put_start_release_timeout=20.0,
        demote_timeout=3.0,
        eviction_high_watermark_ratio=0.5,
        put_revoke_hold=1.0,
    )
    pin = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=2000)
    for i in range(200):
        m.put_start("a", f"k{i}", 4 * KiB, pin if i % 2 else ReplicateConfig(), 0.0)
        m.put_end("a", f"k{i}", 0.0)
    m.put_start("a", "zombie", 4 * KiB, ReplicateConfig(), 0.0)
    m.put_start("a", "revoked", 4 * KiB, ReplicateConfig(), 0.0)
    m.put_revoke("a", "revoked", 0.0)
    # fill past the watermark: eviction demotes to a's SSD (demotions nobody ends)
    big = 0
    while m.used_bytes < 0.6 * m.capacity_bytes:
        m.put_start("a", f"big{big}", 1 << 20, ReplicateConfig(), 0.5)
        m.put_end("a", f"big{big}", 0.5)
        big += 1
    assert len(m._soft_pinned) == 100
    table = _NoScan(m._objects)
    m._objects = table
    used_before = m.used_bytes
    for t in (1.5, 2.5, 4.0, 12.0, 25.0):
        m.ping("a", t)
        m.sweep(t)
    assert m._objects is table
    table.armed = False
    m.check_invariants()
    assert not m._soft_pinned  # every 2 s soft pin expired
    assert all(m.query_key(k).soft_pin_deadline is None for k in m.all_keys())
    with pytest.raises(ObjectNotFoundError):
        m.query_key("zombie")  # released at 20 s
    assert m.used_bytes < used_before  # the revoked write's hold and demotions freed space
    assert m.stats.zombies_released == 1


def test_an_eviction_run_is_spread_over_bounded_rounds() -> None:
    """A run that must free many objects evicts at most ``eviction_round_objects`` per call;
    the sweeps that follow finish it (down to ``eviction_ratio`` under the watermark), and a
    PutStart over the watermark evicts only a small round of its own."""
    m = MasterState(
        MasterConfig(
            seed=0,
            eviction_round_objects=16,
            eviction_high_watermark_ratio=0.9,
            eviction_ratio=0.25,
            offload_on_evict=False,
        )
    )
    m.mount_segment("a", Segment(id="s", name="n", base=0, size=1000 * 4 * KiB), 0.0)
    for i in range(900):
        m.put_start("a", f"k{i}", 4 * KiB, ReplicateConfig(), 0.0)
        m.put_end("a", f"k{i}", 0.0)
    assert m.stats.evicted_objects == 0
    m.put_start("a", "over", 4 * KiB, ReplicateConfig(), 1.0)  # crosses the watermark
    assert 0 < m.stats.evicted_objects <= 1  # its own round: 16 // 16 objects
    assert m.evicting
    rounds = 0
    while m.evicting:
        before = m.stats.evicted_objects
        m.ping("a", 2.0)
        m.sweep(2.0)
        assert m.stats.evicted_objects - before <= 16
        rounds += 1
        m.check_invariants()
    # the whole run: a quarter of the capacity (250 objects), over many rounds
    assert 240 <= m.stats.evicted_objects <= 260
    assert rounds >= 240 // 16
    assert m.used_bytes <= 0.66 * m.capacity_bytes
    survivors = sorted(int(k[1:]) for k in m.all_keys() if k[0] == "k")
    assert survivors == list(range(survivors[0], 900))  # oldest first, as in one run
