"""Properties of the replay on small generated traces, for every shipped eviction policy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core.policies import POLICIES, make_policy
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.sim import STRATEGIES, HitRateSim, MaxHitSim, ScheduleSim
from mooncake.replay.trace import TraceRequest, iter_trace

# runs no code that has a compiled twin: the pure-Python pass leaves it out (docs/testing.md)
pytestmark = pytest.mark.twin_independent

KV = KVModel()
MODEL = PrefillModel()


@st.composite
def prefix_closed_traces(draw: st.DrawFn, max_requests: int = 40) -> list[TraceRequest]:
    """Requests whose ids are root paths of one tree: each extends a prefix of an earlier one."""
    n = draw(st.integers(1, max_requests))
    paths: list[list[int]] = [[]]
    nxt = 0
    ts = 0
    lines = []
    for _ in range(n):
        base = draw(st.sampled_from(paths))
        ids = base[: draw(st.integers(0, len(base)))]
        fresh = draw(st.integers(0 if ids else 1, 5))
        ids = ids + list(range(nxt, nxt + fresh))
        nxt += fresh
        paths.append(ids)
        ts += draw(st.integers(0, 2000))
        length = 512 * len(ids) - draw(st.integers(0, 511))
        lines.append(
            json.dumps(
                {"timestamp": ts, "input_length": length, "output_length": 1, "hash_ids": ids}
            )
        )
    return list(iter_trace(lines))  # the reader agrees they are well formed


def _run(sim: HitRateSim | MaxHitSim | ScheduleSim, reqs: list[TraceRequest]) -> list[int]:
    for r in reqs:
        sim.feed(r)
    return sim.hits


def _sim(policy: str, cap: int, **kw: object) -> HitRateSim:
    return HitRateSim(policy, lambda: make_policy(policy), cap, kv=KV, model=MODEL, **kw)  # type: ignore[arg-type]


POLICY_NAMES = sorted(POLICIES)


@settings(max_examples=150, deadline=None)
@given(
    prefix_closed_traces(),
    st.sampled_from(POLICY_NAMES),
    st.integers(0, 60),
    st.sampled_from(["global", "local"]),
)
def test_hit_never_exceeds_the_theoretical_maximum(
    reqs: list[TraceRequest], policy: str, cap: int, scope: str
) -> None:
    best = _run(MaxHitSim(kv=KV, model=MODEL), reqs)
    got = _run(_sim(policy, cap, scope=scope, instances=3), reqs)
    assert all(g <= b for g, b in zip(got, best, strict=True))
    assert sum(got) <= sum(best)


@settings(max_examples=60, deadline=None)
@given(prefix_closed_traces(), st.sampled_from(STRATEGIES), st.integers(0, 30))
def test_scheduled_hit_never_exceeds_the_theoretical_maximum(
    reqs: list[TraceRequest], strategy: str, cap: int
) -> None:
    best = _run(MaxHitSim(kv=KV, model=MODEL), reqs)
    sim = ScheduleSim(
        strategy, lambda: make_policy("lru"), instances=3, capacity=cap, kv=KV, model=MODEL
    )
    got = _run(sim, reqs)
    assert all(g <= b for g, b in zip(got, best, strict=True))
    assert all(q >= 0 for q in sim.queue_s)
    assert all(
        t >= p - 1e-9 for t, p in zip(sim.ttft_s, sim.prefill_s, strict=True)
    )  # float rounding


@settings(max_examples=150, deadline=None)
@given(prefix_closed_traces(), st.integers(0, 40), st.integers(0, 40))
def test_lru_hit_grows_with_capacity(reqs: list[TraceRequest], a: int, b: int) -> None:
    small, big = sorted((a, b))
    k_small = _run(_sim("lru", small), reqs)
    k_big = _run(_sim("lru", big), reqs)
    # LRU is a stack algorithm: the small cache's content is always inside the big one's,
    # so every request's prefix hit (not only the total) is at least as long
    assert all(s <= g for s, g in zip(k_small, k_big, strict=True))


@settings(max_examples=150, deadline=None)
@given(prefix_closed_traces(), st.sampled_from(POLICY_NAMES))
def test_a_cache_holding_every_block_reaches_the_maximum(
    reqs: list[TraceRequest], policy: str
) -> None:
    best = MaxHitSim(kv=KV, model=MODEL)
    _run(best, reqs)
    sim = _sim(policy, best.unique_blocks)
    assert _run(sim, reqs) == best.hits
    assert sim.totals.hit_tokens == best.totals.hit_tokens
    assert sim.summary()["evicted_blocks"] == 0
