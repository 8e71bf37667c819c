"""The master's compact object map: cold rows, hot records, and the table's LRU/FIFO policy."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.master.tablepolicy import TableFIFOPolicy, TablePolicy
from mooncake._core.policies import FIFOPolicy, LRUPolicy, Pin
from mooncake._core.store_types import ReplicateConfig, Segment, SoftPinAction
from mooncake._fast import ObjectTable
from mooncake.errors import ObjectHasLeaseError

KiB = 1 << 10
SEG = Segment(id="s", name="127.0.0.1:9", base=1 << 30, size=8 << 20)


def _master(**kw: Any) -> MasterState:
    m = MasterState(MasterConfig(seed=0, **kw))
    m.mount_segment("a", SEG, 0.0)
    return m


def test_settled_objects_are_cold_rows_and_answer_as_records() -> None:
    m = _master()
    for i in range(20):
        m.put_start("a", f"k{i}", 4 * KiB, ReplicateConfig(), 0.0)
        m.put_end("a", f"k{i}", 0.0)
    m.settle()
    t = m._objects.table
    assert t.cold_count == 20 and not m._objects.hot
    r = m.get_replica_list("k3", 1.0)  # answered from the row: stays cold
    assert t.cold_count == 20 and r.size == 4 * KiB and r.replicas[0].segment_name == SEG.name
    obj = m._objects.get("k3")  # a rule's lookup inflates it...
    assert obj is not None and obj.lease_deadline == 1.0 + m.config.default_kv_lease_ttl
    assert t.cold_count == 19 and m._objects.hot
    m.settle()
    assert t.cold_count == 20  # ...and it folds back between commands, its lease kept
    with pytest.raises(ObjectHasLeaseError):
        m.remove("k3", False, 2.0)
    m.check_invariants()
    assert m.exist_key("k5", 2.0) and not m.exist_key("nope", 2.0)
    assert m.batch_exist_key(["k1", "nope", "k2"], 2.0) == [1, 0, 1]


def test_objects_out_of_the_common_shape_stay_hot() -> None:
    m = _master()
    pin = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=5000)
    m.put_start("a", "pinned", KiB, pin, 0.0)
    m.put_end("a", "pinned", 0.0)
    m.put_start("a", "hard", KiB, ReplicateConfig(with_hard_pin=True), 0.0)
    m.put_end("a", "hard", 0.0)
    m.put_start("a", "writing", KiB, ReplicateConfig(), 0.0)
    m.put_start("a", "plain", KiB, ReplicateConfig(), 0.0)
    m.put_end("a", "plain", 0.0)
    m.settle()
    t, objects = m._objects.table, m._objects
    hot = {o.key for o in objects.hot.values()}
    assert hot == {"pinned", "hard", "writing"} and t.cold_count == 1
    m.sweep(6.0)  # the soft pin ends: the object is plain now
    m.settle()
    assert "pinned" not in {o.key for o in objects.hot.values()}
    m.check_invariants()


def test_unmounting_a_segment_drops_its_cold_objects_in_order() -> None:
    m = _master()
    other = Segment(id="t", name="127.0.0.1:10", base=1 << 32, size=8 << 20)
    m.mount_segment("b", other, 0.0)
    for i in range(10):
        cfg = ReplicateConfig(preferred_segments=[(SEG if i % 2 else other).name])
        m.put_start("a", f"k{i}", KiB, cfg, 0.0)
        m.put_end("a", f"k{i}", 0.0)
    m.settle()
    assert m._objects.keys_on(m._segments["s"]) == [f"k{i}" for i in range(1, 10, 2)]
    m.unmount_segment("a", "s", 1.0)
    m.settle()
    assert m.all_keys() == [f"k{i}" for i in range(0, 10, 2)]
    m.check_invariants()


def test_a_snapshot_keeps_handles_rows_and_order() -> None:
    m = _master()
    for i in range(30):
        m.put_start("a", f"k{i}", KiB, ReplicateConfig(), 0.0)
        m.put_end("a", f"k{i}", 0.0)
    m.remove("k4", True, 0.0)
    m.put_start("a", "k4", KiB, ReplicateConfig(), 0.5)  # a reused handle, a new seq
    m.put_end("a", "k4", 0.5)
    m.get_replica_list("k7", 1.0)
    m.settle()
    r = MasterState.restore(m.snapshot())
    r.check_invariants()
    assert list(r._objects) == list(m._objects)
    assert [r._objects.handle(k) for k in r._objects] == [m._objects.handle(k) for k in m._objects]
    assert r.policy.victims(1 << 40, lambda h: True) == m.policy.victims(1 << 40, lambda h: True)
    assert r._objects.table.cold_row(r._objects.handle("k7")) == m._objects.table.cold_row(
        m._objects.handle("k7")
    )


def test_promote_extends_cold_leases_too() -> None:
    m = _master()
    m.put_start("a", "k", KiB, ReplicateConfig(), 0.0)
    m.put_end("a", "k", 0.0)
    m.settle()
    m.promote(100.0)
    assert m.query_key("k").lease_deadline == 100.0 + m.config.default_kv_lease_ttl


# -- the table policy against the reference LRU/FIFO ------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "pin", "victims"]),
        st.integers(0, 11),
        st.integers(0, 5000),
        st.sampled_from([Pin.NONE, Pin.SOFT, Pin.HARD]),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, fifo=st.booleans())
def test_table_policy_matches_the_reference(ops: list[Any], fifo: bool) -> None:
    t = ObjectTable()
    handles = [t.add(f"key-{i}") for i in range(12)]
    ours = TableFIFOPolicy(t) if fifo else TablePolicy(t)
    ref = FIFOPolicy() if fifo else LRUPolicy()
    assert ours.name == ref.name
    for op, i, n, pin in ops:
        h = handles[i]
        results = []
        for p in (ours, ref):
            try:
                if op == "insert":
                    p.on_insert(h, n)
                    out: Any = None
                elif op == "access":
                    p.on_access(h)
                    out = None
                elif op == "remove":
                    p.on_remove(h)
                    out = None
                elif op == "pin":
                    p.set_pin(h, pin)
                    out = None
                else:
                    out = p.victims(n, lambda k: k % 3 != 0)
            except KeyError:
                out = "KeyError"
            results.append(out)
        assert results[0] == results[1], (op, h)
        assert len(ours) == len(ref) and ours.total_bytes == ref.total_bytes
        assert (h in ours) == (h in ref)
        ours.self_check()
