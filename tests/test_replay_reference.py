"""The FAST'25 traces end to end: the figures of ``shared/traces/REFERENCE.md`` (conversation
trace) and our own recorded figures for the synthetic trace (``docs/replay.md``).

The traces are in the repository, gzip-compressed (``tests/data/traces``, 1.1 MB); a directory
holding the plain ``conversation_trace.jsonl`` and ``synthetic_trace.jsonl`` can be named with
``MOONCAKE_TRACES`` instead. Each module-level replay takes a few seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake._core.policies import make_policy
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.sim import HitRateSim, MaxHitSim, ScheduleSim
from mooncake.replay.trace import TraceRequest, load_trace

_BUNDLED = Path(__file__).resolve().parent / "data" / "traces"


def _trace_dir() -> Path | None:
    candidates = [os.environ.get("MOONCAKE_TRACES"), str(_BUNDLED)]
    for c in candidates:
        if c and any((Path(c) / f"conversation_trace.jsonl{z}").is_file() for z in ("", ".gz")):
            return Path(c)
    return None


def _trace(name: str) -> str:
    """Path of trace ``name`` (``conversation`` or ``synthetic``): plain or gzip."""
    assert TRACES is not None
    plain = TRACES / f"{name}_trace.jsonl"
    return str(plain if plain.is_file() else plain.with_name(plain.name + ".gz"))


TRACES = _trace_dir()
pytestmark = pytest.mark.skipif(
    TRACES is None,
    reason="FAST'25 traces not found: set MOONCAKE_TRACES to the directory holding "
    "conversation_trace.jsonl and synthetic_trace.jsonl",
)

KV = KVModel()
MODEL = PrefillModel()
LRU_SWEEP = (1000, 2000, 5000, 10000, 20000, 50000)
TOKENS_3M = 5859  # 3,000,000 / 512 tokens, rounded down
TOKENS_50M = 97656


def _global(cap: int) -> HitRateSim:
    return HitRateSim("lru", lambda: make_policy("lru"), cap, kv=KV, model=MODEL)


def _local(cap: int, n: int) -> HitRateSim:
    return HitRateSim(
        "lru", lambda: make_policy("lru"), cap, scope="local", instances=n, kv=KV, model=MODEL
    )


class Run:
    """One pass over a trace feeding the simulators the figures need."""

    def __init__(self, requests: list[TraceRequest]) -> None:
        self.requests = requests
        self.max = MaxHitSim(kv=KV, model=MODEL)
        self.glob = {c: _global(c) for c in (*LRU_SWEEP, TOKENS_3M, 10 * TOKENS_3M, TOKENS_50M)}
        self.local10 = _local(10 * TOKENS_3M, 10)
        self.local8 = _local(10000, 8)
        sims: list[HitRateSim | MaxHitSim] = [
            self.max,
            *self.glob.values(),
            self.local10,
            self.local8,
        ]
        for r in requests:
            for s in sims:
                s.feed(r)


@pytest.fixture(scope="module")
def conversation() -> Iterator[Run]:
    assert TRACES is not None
    yield Run(load_trace(_trace("conversation")))


@pytest.fixture(scope="module")
def synthetic() -> Iterator[Run]:
    assert TRACES is not None
    yield Run(load_trace(_trace("synthetic")))


def _pct(x: float, nd: int = 2) -> float:
    return round(100 * x, nd)


# -- conversation trace: REFERENCE.md, exact figures ------------------------------------------


def test_conversation_trace_shape(conversation: Run) -> None:
    reqs = conversation.requests
    assert len(reqs) == 12031
    assert round(sum(r.input_length for r in reqs) / len(reqs), 2) == 12035.06
    assert round(sum(r.output_length for r in reqs) / len(reqs), 2) == 342.62
    assert conversation.max.unique_blocks == 182_790
    assert sum(len(r.hash_ids) for r in reqs) == 288_500
    assert max(len(r.hash_ids) for r in reqs) == 247


def test_conversation_theoretical_maximum(conversation: Run) -> None:
    t = conversation.max.totals
    assert _pct(t.block_hit_rate) == 36.64
    assert _pct(t.token_hit_rate) == 37.36


def test_conversation_global_lru_sweep_block_weighted(conversation: Run) -> None:
    got = [_pct(conversation.glob[c].totals.block_hit_rate) for c in LRU_SWEEP]
    assert got == [4.45, 5.37, 11.04, 21.12, 28.75, 35.46]


def test_conversation_global_lru_3m_and_50m_tokens(conversation: Run) -> None:
    best = conversation.max.totals.token_hit_rate
    t3 = conversation.glob[TOKENS_3M].totals.token_hit_rate
    # REFERENCE: 13.9 %, "37 % of the maximum". Ours: 13.82 % (see docs/replay.md: the
    # reference's 13.9 is what a trim deferred to the next request gives); 37 % exactly.
    assert _pct(t3) == 13.82
    assert abs(100 * t3 - 13.9) <= 0.1
    assert round(100 * t3 / best) == 37
    t50 = conversation.glob[TOKENS_50M].totals
    assert round(100 * t50.token_hit_rate / best) == 99
    assert round(100 * t50.block_hit_rate / conversation.max.totals.block_hit_rate) == 99


def test_conversation_ten_instances_global_pool_vs_local(conversation: Run) -> None:
    pool = conversation.glob[10 * TOKENS_3M].totals
    assert 36.2 <= 100 * pool.token_hit_rate <= 36.6
    local = conversation.local10.totals
    assert round(pool.token_hit_rate / local.token_hit_rate, 2) == 3.44


def test_conversation_eight_instances_global_vs_local(conversation: Run) -> None:
    glob = conversation.glob[10000].totals.token_hit_rate
    local = conversation.local8.totals.token_hit_rate
    # REFERENCE: 21.6 % / 6.9 %. Ours (exact, the definitions as written): 21.53 % / 6.67 %;
    # the gaps are explained in docs/replay.md. Asserted: ours exactly, the reference within
    # 0.1 and 0.25 points.
    assert (_pct(glob), _pct(local)) == (21.53, 6.67)
    assert abs(100 * glob - 21.6) <= 0.1
    assert abs(100 * local - 6.9) <= 0.25


def test_conversation_prefill_time(conversation: Run) -> None:
    n = len(conversation.requests)
    pool = conversation.glob[10 * TOKENS_3M].totals
    assert round(pool.prefill_nocache_s / n, 2) == 1.68
    assert round(pool.prefill_s / n, 2) in (1.08, 1.09)


def test_conversation_scheduling_order_matches_the_paper() -> None:
    """Fig. 5: global cache-aware < local cache-aware < load balance < random (mean TTFT)."""
    assert TRACES is not None
    reqs = load_trace(_trace("conversation"))
    order = ("global_cache_aware", "local_cache_aware", "load_balance", "random")
    sims = {
        s: ScheduleSim(
            s, lambda: make_policy("lru"), instances=10, capacity=TOKENS_3M, kv=KV, model=MODEL
        )
        for s in order
    }
    for r in reqs:
        for sim in sims.values():
            sim.feed(r)
    ttft = {s: sum(sim.ttft_s) / len(sim.ttft_s) for s, sim in sims.items()}
    assert (
        ttft["global_cache_aware"]
        < ttft["local_cache_aware"]
        < ttft["load_balance"]
        < (ttft["random"])
    )
    # the cache-aware strategies win by hitting more, not by luck of the queue
    hit = {s: sim.totals.token_hit_rate for s, sim in sims.items()}
    assert hit["global_cache_aware"] > hit["local_cache_aware"] > hit["load_balance"]
    assert sims["global_cache_aware"].transferred_blocks > 0


# -- synthetic trace: our figures, same definitions (recorded in docs/replay.md) --------------


def test_synthetic_trace_figures(synthetic: Run) -> None:
    reqs = synthetic.requests
    n = len(reqs)
    assert n == 3993
    assert round(sum(r.input_length for r in reqs) / n, 2) == 15325.48
    assert round(sum(r.output_length for r in reqs) / n, 2) == 149.12
    assert synthetic.max.unique_blocks == 43_924
    assert sum(len(r.hash_ids) for r in reqs) == 121_877
    assert max(len(r.hash_ids) for r in reqs) == 374
    best = synthetic.max.totals
    assert (_pct(best.block_hit_rate), _pct(best.token_hit_rate)) == (63.96, 65.12)
    got = [_pct(synthetic.glob[c].totals.block_hit_rate) for c in LRU_SWEEP]
    assert got == [8.25, 14.39, 27.91, 42.35, 57.15, 63.96]
    t3 = synthetic.glob[TOKENS_3M].totals.token_hit_rate
    assert _pct(t3) == 31.51
    pool = synthetic.glob[10 * TOKENS_3M].totals
    assert _pct(pool.token_hit_rate) == 65.12
    assert _pct(synthetic.local10.totals.token_hit_rate) == 17.08
    assert _pct(synthetic.glob[10000].totals.token_hit_rate) == 43.13
    assert _pct(synthetic.local8.totals.token_hit_rate) == 7.46
    assert round(pool.prefill_nocache_s / n, 3) == 2.184
    assert round(pool.prefill_s / n, 3) == 0.742


@pytest.mark.slow
@pytest.mark.timeout(1200)  # CPU-bound: 120 s beside other tests, over 300 s beside a CPU hog
@pytest.mark.parametrize("name", ["conversation", "synthetic"])  # one per worker under xdist
def test_cli_end_to_end_on_both_traces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``mooncake replay --json`` with every policy: the numbers the docs quote (~45 s CPU)."""
    import json

    from mooncake._cli import main

    assert TRACES is not None
    assert main(["replay", _trace(name), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["max"]
    for c in doc["caches"]:
        assert c["hit_blocks"] <= best["hit_blocks"], c["name"]
        assert c["token_hit_rate"] <= best["token_hit_rate"], c["name"]
    lru = {
        c["capacity_blocks"]: c["block_hit_rate"]
        for c in doc["caches"]
        if c["scope"] == "global" and c["policy"] == "lru"
    }
    assert list(lru.values()) == sorted(lru.values())  # grows with capacity
    ttft = {s["strategy"]: s["ttft_mean_s"] for s in doc["schedules"]}
    assert ttft["global_cache_aware"] < ttft["local_cache_aware"] < ttft["load_balance"]
    assert ttft["load_balance"] < ttft["random"]
    if name == "conversation":
        assert [round(100 * lru[c], 2) for c in LRU_SWEEP] == [
            4.45, 5.37, 11.04, 21.12, 28.75, 35.46,
        ]  # fmt: skip


@pytest.mark.slow
def test_sieve_never_laps_and_equals_lfu_on_both_traces() -> None:
    """SIEVE's hand never wraps at any capacity of the sweep on either trace, which is why
    SIEVE and LFU give the same hit for every request there (docs/replay.md)."""
    from mooncake._core.policies import LFUPolicy, SIEVEPolicy
    from mooncake.replay.cache import BlockCache
    from mooncake.replay.run import DEFAULT_CAPACITIES

    assert TRACES is not None
    for name in ("conversation", "synthetic"):
        reqs = load_trace(_trace(name))
        for cap in DEFAULT_CAPACITIES:
            sieve = SIEVEPolicy()
            a, b = BlockCache(sieve, cap), BlockCache(LFUPolicy(), cap)
            for r in reqs:
                assert a.admit(r.hash_ids, r.time_s) == b.admit(r.hash_ids, r.time_s)
            assert sieve.laps == 0, (name, cap)


def test_conversation_belady_reaches_the_maximum_by_10000_blocks(conversation: Run) -> None:
    from mooncake.replay.belady import belady_hits

    traces = [r.hash_ids for r in conversation.requests]
    refs = sum(map(len, traces))
    got = [round(100 * sum(belady_hits(traces, c)) / refs, 2) for c in (1000, 5000, 10000)]
    assert got == [19.07, 34.12, 36.64]
    assert got[-1] == _pct(conversation.max.totals.block_hit_rate)
