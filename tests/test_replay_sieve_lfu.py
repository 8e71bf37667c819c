"""Why SIEVE and LFU give identical hit rates on the FAST'25 traces, and where they part.

With nothing pinned, SIEVE's visited bit of an object ahead of the hand says "hit since its
insert", exactly LFU's "frequency >= 2", and everything behind the hand was hit; so while the
hand has never wrapped (``SIEVEPolicy.laps == 0``) SIEVE's first unvisited object ahead of the
hand is the oldest object never hit, LFU's victim (least recently used among frequency 1).
The block cache inserts a request's blocks *before* it trims, and a trim never asks for more
blocks than that request inserted, so fresh unvisited blocks always lie ahead of the hand: it
can only wrap if it has to take the very newest block, i.e. if every older block ahead of it
was hit. Prefix traces in which most blocks are never read again never get there.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mooncake._core.policies import LFUPolicy, SIEVEPolicy
from mooncake.replay.cache import BlockCache
from tests.test_replay_belady import prefix_traces

# runs no code that has a compiled twin: the pure-Python pass leaves it out (docs/testing.md)
pytestmark = pytest.mark.twin_independent

flat_traces = st.lists(
    st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True), min_size=1, max_size=60
)


def lockstep(traces: list[list[int]], capacity: int) -> tuple[int, int, SIEVEPolicy]:
    """Feed both caches; return (requests before SIEVE's first lap, requests that agreed on
    hit and resident set, the SIEVE policy)."""
    sieve, lfu = SIEVEPolicy(), LFUPolicy()
    a, b = BlockCache(sieve, capacity), BlockCache(lfu, capacity)
    before_lap = agreed = 0
    for i, ids in enumerate(traces):
        lapped = sieve.laps > 0
        same = a.admit(ids, float(i)) == b.admit(ids, float(i))
        same = same and all((k in a) == (k in b) for k in range(-1, 64)) and len(a) == len(b)
        if not lapped:
            assert same, f"SIEVE and LFU differ at request {i} before the hand ever wrapped"
            before_lap += 1
        agreed += same
    return before_lap, agreed, sieve


@settings(max_examples=300, deadline=None)
@given(
    traces=st.one_of(prefix_traces(max_nodes=30, max_requests=60), flat_traces),
    capacity=st.integers(1, 12),
)
def test_sieve_is_lfu_until_the_hand_wraps(traces: list[list[int]], capacity: int) -> None:
    lockstep(traces, capacity)


def test_they_part_once_every_cached_block_was_hit() -> None:
    # Capacity 3: a, b, c are each read twice, so all three are visited when d arrives.
    trace = [[0], [0], [1], [1], [2], [2], [3], [4], [0]]
    before_lap, _, sieve = lockstep(trace, 3)
    # d: the hand clears a, b, c and has to take d, the newest block: it wraps.
    assert sieve.laps == 1 and before_lap == 7
    # e: SIEVE's hand restarts at a, whose bit it cleared: a goes. LFU keeps a (2 uses) and
    # drops e, the only block used once. The last request, a again, hits only under LFU.
    s, f = BlockCache(SIEVEPolicy(), 3), BlockCache(LFUPolicy(), 3)
    hits = [(s.admit(ids, 0.0), f.admit(ids, 0.0)) for ids in trace]
    assert hits[-1] == (0, 1)


def hot_set_then_burst(hot: int, rereads: int, burst: int) -> list[list[int]]:
    """``hot`` two-block prompts (a system prompt and its first turn) read ``rereads`` times
    each, a burst of ``burst`` one-off single-block prompts, then the hot prompts again."""
    prompts = [[2 * i, 2 * i + 1] for i in range(hot)]
    cold = [[1000 + j] for j in range(burst)]
    return [*(p for _ in range(rereads) for p in prompts), *cold, *prompts]


def test_hot_set_then_a_burst_parts_sieve_from_lfu() -> None:
    """The shape where they part: a cache holding only blocks that were read again, then new
    one-off prompts. SIEVE's hand clears every bit, takes the newest block and wraps; from
    then on each one-off evicts a hot block (bit cleared, not read during the burst), while
    LFU keeps every block read twice and evicts the one-offs."""
    trace = hot_set_then_burst(hot=4, rereads=2, burst=6)
    sieve, lfu = SIEVEPolicy(), LFUPolicy()
    a, b = BlockCache(sieve, 8), BlockCache(lfu, 8)
    hits = [(a.admit(ids, float(i)), b.admit(ids, float(i))) for i, ids in enumerate(trace)]
    assert sieve.laps >= 1
    back = hits[-4:]  # the hot prompts return
    assert sum(h[1] for h in back) == 8  # LFU: every hot block is still there
    assert sum(h[0] for h in back) < 8
    before, _, _ = lockstep(trace, 8)
    assert before < len(trace)
