"""Belady's MIN for the prefix block cache: equal to an exhaustive optimum on small traces,
never below any online policy, never above the infinite cache, prefix-closed throughout."""

from __future__ import annotations

import functools
import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mooncake._core.policies import POLICIES, make_policy
from mooncake.errors import InvalidArgumentError
from mooncake.replay.belady import NEVER, BeladySim, belady_hits, next_references
from mooncake.replay.cache import BlockCache, InfiniteCache
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.trace import TraceRequest

# runs no code that has a compiled twin: the pure-Python pass leaves it out (docs/testing.md)
pytestmark = pytest.mark.twin_independent


@st.composite
def prefix_traces(draw: st.DrawFn, max_nodes: int = 7, max_requests: int = 7) -> list[list[int]]:
    """Requests that are root-to-node paths of one random forest (a valid trace)."""
    n = draw(st.integers(1, max_nodes))
    parent = [draw(st.integers(-1, j - 1)) for j in range(n)]

    def path(j: int) -> list[int]:
        out = []
        while j >= 0:
            out.append(j)
            j = parent[j]
        return out[::-1]

    ends = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_requests))
    return [path(j) for j in ends]


def exhaustive_optimum(traces: list[list[int]], capacity: int) -> int:
    """Most hit blocks any eviction schedule gets: every victim choice at every trim."""

    @functools.cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(traces):
            return 0
        ids = traces[i]
        k = 0
        for key in ids:
            if key not in resident:
                break
            k += 1
        full = resident | set(ids)
        over = len(full) - capacity
        if over <= 0:
            return k + best(i + 1, full)
        return k + max(
            best(i + 1, full - set(victims))
            for victims in itertools.combinations(sorted(full), over)
        )

    return best(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(traces=prefix_traces(), capacity=st.integers(0, 5))
def test_belady_equals_exhaustive_optimum(traces: list[list[int]], capacity: int) -> None:
    assert sum(belady_hits(traces, capacity)) == exhaustive_optimum(traces, capacity)


def _policy_hits(name: str, traces: list[list[int]], capacity: int) -> int:
    cache = BlockCache(make_policy(name), capacity)
    return sum(cache.admit(ids, float(i)) for i, ids in enumerate(traces))


@settings(max_examples=150, deadline=None)
@given(traces=prefix_traces(max_nodes=14, max_requests=25), capacity=st.integers(0, 10))
def test_belady_bounds_every_policy(traces: list[list[int]], capacity: int) -> None:
    got = sum(belady_hits(traces, capacity))
    infinite = InfiniteCache()
    ceiling = 0
    for i, ids in enumerate(traces):
        ceiling += infinite.prefix_hit(ids)
        infinite.admit(ids, float(i))
    assert got <= ceiling
    for name in POLICIES:
        assert _policy_hits(name, traces, capacity) <= got, name


def test_next_references() -> None:
    nx = next_references([[1, 2], [1, 3], [1, 2]])
    assert nx == [[1, 2], [2, NEVER], [NEVER, NEVER]]


def test_belady_keeps_the_block_read_next() -> None:
    # Capacity 2: after [a b] and [c], MIN drops c (never read again), not a or b.
    assert belady_hits([[0, 1], [2], [0, 1]], 2) == [0, 0, 2]
    # LRU drops a instead and gets no hit on the third request.
    assert _policy_hits("lru", [[0, 1], [2], [0, 1]], 2) == 0


def test_belady_sim_summary_matches_hits() -> None:
    reqs = [
        TraceRequest(0, 1, 0.0, 1024, 1, (0, 1)),
        TraceRequest(1, 2, 1.0, 512, 1, (2,)),
        TraceRequest(2, 3, 2.0, 700, 1, (0, 1)),
    ]
    sim = BeladySim(2, kv=KVModel(), model=PrefillModel())
    sim.run(reqs)
    s = sim.summary()
    assert sim.hits == [0, 0, 2]
    assert s["hit_blocks"] == 2
    assert s["block_hit_rate"] == pytest.approx(2 / 5)
    assert s["hit_tokens"] == 700  # min(512 * 2, 700)
    assert s["policy"] == "belady"
    assert s["capacity_blocks"] == 2
    with pytest.raises(InvalidArgumentError, match="capacity"):
        BeladySim(-1, kv=KVModel(), model=PrefillModel())
