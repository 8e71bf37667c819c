"""Miss-reason accounting: every miss is attributed, counted, and the ledger stays bounded."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from mooncake._core.misses import Miss, MissLedger, MissReason
from mooncake.errors import InvalidArgumentError


def test_never_stored_key() -> None:
    ledger = MissLedger()
    miss = ledger.classify("nope")
    assert miss == Miss("nope", MissReason.NEVER_STORED)
    assert ledger.by_reason()[MissReason.NEVER_STORED] == 1
    assert ledger.total == 1


def test_eviction_names_policy_and_tier() -> None:
    ledger = MissLedger()
    ledger.record_eviction("k", policy="s3fifo", tier="memory", now=12.5)
    miss = ledger.classify("k")
    assert miss.reason is MissReason.EVICTED
    assert (miss.policy, miss.tier, miss.at) == ("s3fifo", "memory", 12.5)
    assert ledger.counts() == {("evicted", "s3fifo", "memory"): 1}


def test_removal_and_owner_death() -> None:
    ledger = MissLedger()
    ledger.record_removal("r", detail="remove_by_regex")
    ledger.record_owner_death(["a", "b"], owner="client-7", now=3.0)
    assert ledger.classify("r").reason is MissReason.REMOVED
    dead = ledger.classify("b")
    assert (dead.reason, dead.owner, dead.at) == (MissReason.OWNER_DIED, "client-7", 3.0)
    assert ledger.by_reason()[MissReason.OWNER_DIED] == 1
    assert ledger.by_reason()[MissReason.REMOVED] == 1


def test_latest_loss_wins_and_store_clears_it() -> None:
    ledger = MissLedger()
    ledger.record_eviction("k", policy="lru", tier="ssd")
    ledger.record_stored("k")
    assert ledger.explain("k").reason is MissReason.NEVER_STORED
    ledger.record_eviction("k", policy="lru", tier="memory")
    ledger.record_removal("k")
    assert ledger.explain("k").reason is MissReason.REMOVED
    assert ledger.total == 0  # explain() does not count


def test_request_level_misses() -> None:
    ledger = MissLedger()
    lease = ledger.record_miss("k", MissReason.LEASE_EXPIRED, tier="memory", detail="read 12 ms")
    failed = ledger.record_miss("k", MissReason.TRANSFER_FAILED, tier="ssd")
    assert lease.reason is MissReason.LEASE_EXPIRED
    assert failed.tier == "ssd"
    assert ledger.counts() == {
        ("lease_expired", "", "memory"): 1,
        ("transfer_failed", "", "ssd"): 1,
    }
    with pytest.raises(InvalidArgumentError, match="EVICTED is a loss"):
        ledger.record_miss("k", MissReason.EVICTED)
    with pytest.raises(InvalidArgumentError, match="must be a MissReason"):
        ledger.record_miss("k", "evicted")  # type: ignore[arg-type]


def test_capacity_forgets_oldest_as_unknown_not_never_stored() -> None:
    ledger = MissLedger(capacity=2, filter_bits=1 << 16)
    for key in ("a", "b", "c"):
        ledger.record_eviction(key, policy="lru", tier="memory")
    assert len(ledger) == 2
    assert ledger.forgotten == 1
    assert ledger.classify("a").reason is MissReason.UNKNOWN
    assert ledger.classify("c").reason is MissReason.EVICTED


def test_bad_construction() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        MissLedger(0)
    with pytest.raises(InvalidArgumentError, match="filter_bits"):
        MissLedger(filter_bits=1000)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["evict", "remove", "die", "store", "miss"]),
            st.integers(0, 7),
        ),
        max_size=60,
    ),
    st.integers(1, 5),
)
def test_every_miss_is_attributed_and_counted(ops: list[tuple[str, int]], cap: int) -> None:
    ledger = MissLedger(capacity=cap, filter_bits=1 << 12)
    last: dict[int, MissReason] = {}  # the model: last loss per key still remembered
    order: list[int] = []
    ever_forgotten: set[int] = set()
    misses = 0
    for op, key in ops:
        if op == "miss":
            miss = ledger.classify(key)
            misses += 1
            if key in last:
                assert miss.reason is last[key]
            elif key in ever_forgotten:
                assert miss.reason is MissReason.UNKNOWN
            else:
                assert miss.reason in (MissReason.NEVER_STORED, MissReason.UNKNOWN)
            continue
        if op == "store":
            ledger.record_stored(key)
            last.pop(key, None)
            if key in order:
                order.remove(key)
            continue
        if op == "evict":
            ledger.record_eviction(key, policy="lru", tier="memory")
            reason = MissReason.EVICTED
        elif op == "remove":
            ledger.record_removal(key)
            reason = MissReason.REMOVED
        else:
            ledger.record_owner_death([key], owner="c")
            reason = MissReason.OWNER_DIED
        if key in order:
            order.remove(key)
        order.append(key)
        last[key] = reason
        if len(order) > cap:
            old = order.pop(0)
            del last[old]
            ever_forgotten.add(old)
        assert len(ledger) == len(order)
    assert ledger.total == misses == sum(ledger.by_reason().values())


def test_a_str_key_and_another_key_of_the_same_repr_are_distinct() -> None:
    ledger = MissLedger()
    ledger.record_eviction("1", policy="lru", tier="dram", now=2.0)
    ledger.record_removal(1, detail="by hand")
    assert ledger.explain("1").reason is MissReason.EVICTED
    assert ledger.explain("1").at == 2.0 and ledger.explain(1).detail == "by hand"
    assert ledger.explain("'1'").reason is MissReason.NEVER_STORED
    ledger.record_stored("1")
    assert ledger.explain("1").reason is MissReason.NEVER_STORED
    assert ledger.explain(1).reason is MissReason.REMOVED and len(ledger) == 1


def test_a_batch_of_losses_past_capacity_forgets_the_oldest_in_order() -> None:
    ledger = MissLedger(capacity=3, filter_bits=1 << 12)
    ledger.record_eviction("old", policy="lru", tier="dram", now=1.0)
    ledger.record_owner_death(["a", "b", "c"], owner="dead", now=2.0)
    assert len(ledger) == 3 and ledger.forgotten == 1
    assert ledger.explain("old").reason is MissReason.UNKNOWN  # forgotten, not "never stored"
    for k in "abc":
        m = ledger.explain(k)
        assert (m.reason, m.owner, m.at) == (MissReason.OWNER_DIED, "dead", 2.0)
    ledger.record_owner_death(["a"], owner="other")  # lost again: newest, its new cause
    ledger.record_removal("d")
    assert ledger.explain("b").reason is MissReason.UNKNOWN  # the oldest left first
    assert ledger.explain("a").owner == "other" and ledger.explain("a").at is None


def test_a_master_that_lost_its_state_never_says_never_stored() -> None:
    from mooncake._core.master import MasterConfig, MasterState
    from mooncake._core.master.config import parse_miss
    from mooncake._core.store_types import Segment
    from mooncake.errors import ObjectNotFoundError

    def lookup(m: MasterState, key: str) -> str:
        with pytest.raises(ObjectNotFoundError) as info:
            m.get_replica_list(key, 1.0)
        return str(info.value)

    seg = Segment(id="seg0", name="127.0.0.1:1000", base=1 << 30, size=1 << 20)
    fresh = MasterState(MasterConfig(seed=0))
    fresh.mount_segment("c", seg, 0)  # a first mount: nothing can predate it
    assert parse_miss("k", lookup(fresh, "k")).reason is MissReason.NEVER_STORED  # type: ignore[union-attr]

    restarted = MasterState(MasterConfig(seed=0))
    # a client mounted at an earlier master comes back after NEED_REMOUNT
    restarted.remount_segments("c", [seg], 0)
    msg = lookup(restarted, "k")
    miss = parse_miss("k", msg)
    assert miss is not None and miss.reason is MissReason.UNKNOWN
    assert "restarted without its state" in msg
    # a client the master knows remounting (its own segment, say) changes nothing
    fresh.remount_segments("c", [seg], 1)
    assert parse_miss("k", lookup(fresh, "k")).reason is MissReason.NEVER_STORED  # type: ignore[union-attr]
