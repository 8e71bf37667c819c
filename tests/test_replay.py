"""Trace reading, the policy-driven block cache, the simulators and the ``mooncake replay`` CLI
on small hand-made traces."""

from __future__ import annotations

import csv
import json
import math
from collections import OrderedDict
from pathlib import Path

import pytest

from mooncake._cli import main
from mooncake._core.policies import make_policy
from mooncake.errors import InvalidArgumentError, TraceFormatError
from mooncake.replay.cache import BlockCache, InfiniteCache
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.run import ReplayConfig, replay
from mooncake.replay.sim import HitRateSim, ScheduleSim
from mooncake.replay.trace import TraceRequest, TraceStats, iter_trace

# runs no code that has a compiled twin: the pure-Python pass leaves it out (docs/testing.md)
pytestmark = pytest.mark.twin_independent


def _line(ts: float, n: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})


GOOD = [
    _line(0, 1000, [0, 1]),
    _line(5, 1100, [0, 2, 3]),
    _line(5, 600, [0, 1]),
    _line(9, 512, [4]),
]


# -- trace reading ----------------------------------------------------------------------------


def test_iter_trace_yields_validated_requests() -> None:
    reqs = list(iter_trace(GOOD))
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    assert [r.line_no for r in reqs] == [1, 2, 3, 4]
    assert reqs[1] == TraceRequest(1, 2, 5.0, 1100, 10, (0, 2, 3))
    assert reqs[3].time_s == pytest.approx(0.009)


def test_iter_trace_accepts_bytes_blank_lines_and_extra_keys() -> None:
    lines = [
        b'{"timestamp": 1, "input_length": 3, "output_length": 0, "hash_ids": [7], "x": 1}\n',
        b"\n",
        b"   \n",
    ]
    stats = TraceStats()
    reqs = list(iter_trace(lines, stats=stats))
    assert [r.hash_ids for r in reqs] == [(7,)]
    assert stats.blank == 2 and stats.requests == 1 and stats.skipped == 0


BAD = [
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [9]}', "output_length"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": [9]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    (_line(0, -1, []), "input_length must be >= 0"),
    (_line(0, 10, [9], out=-2), "output_length must be >= 0"),
    (_line(-5, 10, [9]), "timestamp must be"),
    (_line(0, 1025, [9, 10]), "needs ceil(1025/512) = 3"),
    (_line(0, 100, [9, 10]), "hash_ids has 2 ids"),
    (_line(0, 1024, [9, 9]), "repeats an id"),
    ('{"timestamp": 0, "input_length": "ten", "output_length": 1, "hash_ids": [9]}', "int"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}', "int"),
    ("[1, 2, 3]", "object"),
    ("{not json", "not a JSON object"),
]


@pytest.mark.parametrize(("bad", "why"), BAD)
def test_bad_line_raises_with_its_line_number(bad: str, why: str) -> None:
    lines = [*GOOD[:2], bad, *GOOD[2:]]
    with pytest.raises(TraceFormatError) as info:
        list(iter_trace(lines, source="t.jsonl"))
    assert info.value.line_no == 3
    assert why in info.value.reason
    assert str(info.value).startswith("t.jsonl:3: ")
    assert isinstance(info.value, InvalidArgumentError)


def test_time_going_back_and_prefix_tree_violation_are_bad_lines() -> None:
    with pytest.raises(TraceFormatError, match=r":3: timestamp 4 ms is earlier than .* 5 ms"):
        list(iter_trace([GOOD[0], GOOD[1], _line(4, 10, [8])]))
    # id 2 followed 0 on line 2; on line 3 it follows 1
    with pytest.raises(
        TraceFormatError, match=r":3: hash_ids\[2\] = 2 follows 1 here but followed 0"
    ):
        list(iter_trace([GOOD[0], GOOD[1], _line(6, 1500, [0, 1, 2])]))


def test_skip_bad_counts_and_leaves_no_state_behind() -> None:
    lines = [GOOD[0], _line(3, -1, []), _line(1, 1024, [0, 5]), BAD[0][0], GOOD[1]]
    stats = TraceStats()
    reqs = list(iter_trace(lines, skip_bad=True, stats=stats))
    # the skipped line 2 (ts 3) did not move the clock, so line 3 (ts 1) is good
    assert [r.line_no for r in reqs] == [1, 3, 5]
    assert [r.index for r in reqs] == [0, 1, 2]
    assert stats.skipped == 2 and stats.requests == 3
    assert [n for n, _ in stats.skip_reasons] == [2, 4]


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError):
        list(iter_trace(GOOD, block_tokens=0))


# -- cost models ------------------------------------------------------------------------------


def test_prefill_model_is_the_fitted_quadratic() -> None:
    m = PrefillModel()
    assert m.seconds(10_000) == pytest.approx(1.16e-4 * 10_000 + 7.1e-10 * 10_000**2)
    assert m.seconds(10_000, 4_000) == pytest.approx(
        1.16e-4 * 6_000 + 7.1e-10 * (10_000**2 - 4_000**2)
    )
    assert m.seconds(100, 512) == 0.0  # a cached prefix longer than the prompt is clamped
    with pytest.raises(InvalidArgumentError):
        PrefillModel(linear=-1.0)


def test_kv_model_block_bytes_and_transfer_time() -> None:
    kv = KVModel()
    assert kv.bytes_per_token == 327_680
    assert kv.block_bytes == 160 * 2**20
    assert kv.transfer_seconds(10) == pytest.approx(10 * 160 * 2**20 / 87e9)
    with pytest.raises(InvalidArgumentError):
        KVModel(bandwidth_bytes_per_s=0)


# -- the block cache drives the production policy ---------------------------------------------


class _RecordingPolicy:
    """Wraps a production policy and records the calls the cache makes."""

    def __init__(self) -> None:
        self.inner = make_policy("lru")
        self.calls: list[tuple[object, ...]] = []

    def on_insert(
        self, key: int, size: int, *, parent: int | None = None, now: float = 0.0
    ) -> None:
        self.calls.append(("insert", key, size, parent, now))
        self.inner.on_insert(key, size, parent=parent, now=now)

    def on_access(self, key: int, now: float = 0.0) -> None:
        self.calls.append(("access", key, now))
        self.inner.on_access(key, now)

    def on_remove(self, key: int) -> None:
        self.calls.append(("remove", key))
        self.inner.on_remove(key)

    def victims(self, nbytes: int, can_evict: object) -> list[int]:
        self.calls.append(("victims", nbytes))
        return self.inner.victims(nbytes, can_evict)  # type: ignore[arg-type, return-value]


def test_block_cache_reports_inserts_hits_and_evictions_to_the_policy() -> None:
    pol = _RecordingPolicy()
    cache = BlockCache(pol, 3)  # type: ignore[arg-type]
    cache.admit((1, 2), 0.5)
    assert cache.prefix_hit((1, 2, 3)) == 2
    cache.admit((1, 2, 3, 4), 1.0)
    assert pol.calls == [
        ("insert", 1, 1, None, 0.5),
        ("insert", 2, 1, 1, 0.5),
        ("access", 1, 1.0),
        ("access", 2, 1.0),
        ("insert", 3, 1, 2, 1.0),
        ("insert", 4, 1, 3, 1.0),
        ("victims", 1),
        ("remove", 1),
    ]
    assert len(cache) == 3 and 1 not in cache and 4 in cache
    assert cache.inserted == 4 and cache.evicted == 1
    assert len(pol.inner) == 3  # policy and cache agree on what is resident


def test_block_cache_rejects_a_policy_that_proposes_a_stranger() -> None:
    class Liar(_RecordingPolicy):
        def victims(self, nbytes: int, can_evict: object) -> list[int]:
            return [999]

    cache = BlockCache(Liar(), 1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="999, which is not resident"):
        cache.admit((1, 2), 0.0)


def test_zero_capacity_cache_never_hits() -> None:
    cache = BlockCache(make_policy("lru"), 0)
    for _ in range(3):
        assert cache.prefix_hit((1, 2)) == 0
        cache.admit((1, 2), 0.0)
    assert len(cache) == 0
    with pytest.raises(InvalidArgumentError):
        BlockCache(make_policy("lru"), -1)


def test_infinite_cache_keeps_everything() -> None:
    cache = InfiniteCache()
    cache.admit((1, 2, 3), 0.0)
    assert cache.prefix_hit((1, 2, 5)) == 2 and len(cache) == 3


# -- simulators -------------------------------------------------------------------------------


def _reqs(lines: list[str]) -> list[TraceRequest]:
    return list(iter_trace(lines))


def test_hit_rate_sim_matches_an_ordered_dict_lru() -> None:
    """The replay's LRU numbers equal a textbook OrderedDict LRU with the REFERENCE semantics."""
    import random

    rng = random.Random(7)
    lines: list[str] = []
    paths: list[list[int]] = [[]]
    nxt = 0
    for i in range(400):
        base = rng.choice(paths)[: rng.randint(0, 6)]
        ids = base + list(range(nxt, nxt + rng.randint(1, 4)))
        nxt += len(ids) - len(base)
        paths.append(ids)
        lines.append(_line(i, 512 * len(ids) - rng.randint(0, 511), ids))
    reqs = _reqs(lines)
    kv, model = KVModel(), PrefillModel()
    for cap in (0, 3, 10, 40, 10_000):
        sim = HitRateSim("lru", lambda: make_policy("lru"), cap, kv=kv, model=model)
        oracle: OrderedDict[int, None] = OrderedDict()
        want: list[int] = []
        for r in reqs:
            sim.feed(r)
            k = 0
            for key in r.hash_ids:
                if key not in oracle:
                    break
                k += 1
            want.append(k)
            for key in r.hash_ids:
                oracle[key] = None
                oracle.move_to_end(key)
            while len(oracle) > cap:
                oracle.popitem(last=False)
        assert sim.hits == want
        t = sim.totals
        assert t.hit_blocks == sum(want)
        assert t.hit_tokens == sum(
            min(512 * k, r.input_length) for k, r in zip(want, reqs, strict=True)
        )


def test_local_caches_split_the_capacity_and_route_round_robin() -> None:
    # the same prompt three times: with 2 local caches round-robin, the third request is the
    # first to find it (on cache 0); a global pool hits on the second already
    reqs = _reqs([_line(0, 1024, [1, 2]), _line(1, 1024, [1, 2]), _line(2, 1024, [1, 2])])
    kv, model = KVModel(), PrefillModel()
    glob = HitRateSim("lru", lambda: make_policy("lru"), 4, kv=kv, model=model)
    loc = HitRateSim(
        "lru", lambda: make_policy("lru"), 4, scope="local", instances=2, kv=kv, model=model
    )
    for r in reqs:
        glob.feed(r)
        loc.feed(r)
    assert glob.hits == [0, 2, 2]
    assert loc.hits == [0, 0, 2]
    assert loc.summary()["instances"] == 2
    assert glob.name == "global:lru:4" and loc.name == "local2:lru:4"


def _schedule(strategy: str, lines: list[str], **kw: object) -> ScheduleSim:
    sim = ScheduleSim(
        strategy,
        lambda: make_policy("lru"),
        instances=kw.pop("instances", 2),  # type: ignore[arg-type]
        capacity=kw.pop("capacity", 100),  # type: ignore[arg-type]
        kv=KVModel(),
        model=PrefillModel(),
        **kw,  # type: ignore[arg-type]
    )
    for r in _reqs(lines):
        sim.feed(r)
    return sim


def test_schedule_queue_model_is_fifo_per_instance() -> None:
    m = PrefillModel()
    # round robin over 2 instances: requests 0 and 2 share instance 0, request 2 waits
    lines = [_line(0, 5120, list(range(10))), _line(0, 512, [100]), _line(100, 512, [200])]
    sim = _schedule("round_robin", lines)
    assert sim.instance == [0, 1, 0]
    t0 = m.seconds(5120)
    assert sim.queue_s[0] == 0.0 and sim.ttft_s[0] == pytest.approx(t0)
    assert sim.queue_s[2] == pytest.approx(t0 - 0.1)
    assert sim.ttft_s[2] == pytest.approx(t0 - 0.1 + m.seconds(512))


def test_load_balance_takes_the_shortest_queue() -> None:
    lines = [_line(0, 51200, list(range(100))), _line(1, 512, [500]), _line(200, 512, [501])]
    sim = _schedule("load_balance", lines)
    assert sim.instance[1] != sim.instance[0]
    assert sim.instance[2] == sim.instance[1]  # the first instance is still busy
    assert sim.queue_s == [0.0, 0.0, 0.0]


def test_local_cache_aware_follows_its_prefix() -> None:
    ids = list(range(20))
    lines = [_line(0, 10240, ids), _line(20_000, 10240 + 512, [*ids, 99])]
    sim = _schedule("local_cache_aware", lines, instances=4)
    assert sim.instance[1] == sim.instance[0]
    assert sim.hits == [0, 20]


def test_global_cache_aware_transfers_when_the_holder_is_busy() -> None:
    """Algorithm 1: the instance with the prefix is busy, so an idle one fetches the prefix."""
    kv, m = KVModel(), PrefillModel()
    big = list(range(100, 200))
    prefix = list(range(40))
    lines = [
        _line(0, 40 * 512, prefix),  # instance 0 computes the prefix
        _line(1, 100 * 512, big),  # instance 1 gets a long job
        _line(
            3000, 200 * 512, list(range(1000, 1200))
        ),  # instance 0 (idle again) gets a longer one
        _line(10_000, 41 * 512, [*prefix, 7777]),  # the prefix holder is busy, instance 1 is not
    ]
    glob = _schedule("global_cache_aware", lines, instances=2, capacity=1000)
    local = _schedule("local_cache_aware", lines, instances=2, capacity=1000)
    assert glob.instance[:3] == [0, 1, 0]
    assert glob.instance[3] == 1
    assert glob.hits[3] == 40
    assert glob.transfer_s[3] == pytest.approx(kv.transfer_seconds(40))
    assert glob.transferred_blocks == 40
    assert glob.ttft_s[3] == pytest.approx(kv.transfer_seconds(40) + m.seconds(41 * 512, 40 * 512))
    # without transfers the best choice recomputes the prefix or waits for the holder
    assert local.transfer_s[3] == 0.0
    assert glob.ttft_s[3] < local.ttft_s[3]


def test_balance_threshold_can_forbid_transfers() -> None:
    """Algorithm 1 transfers when best_len / own prefix > threshold (always when own is 0)."""
    lines = [
        _line(0, 5120, list(range(10))),  # -> instance 0
        _line(0, 5120, [0, 1, *range(50, 58)]),  # -> instance 1, fetching 2 blocks (own 0)
        _line(4000, 51200, list(range(200, 300))),  # -> instance 0, busy for ~10 s
        _line(5000, 5632, [*range(10), 99]),  # instance 1 holds 2, instance 0 (busy) 10
    ]
    eager = _schedule("global_cache_aware", lines, capacity=1000)
    assert eager.instance == [0, 1, 0, 1]
    assert eager.transfer_s[1] > 0 and eager.hits[3] == 10
    assert eager.transferred_blocks == 2 + 8
    strict = _schedule("global_cache_aware", lines, capacity=1000, balance_threshold=1e9)
    assert strict.instance == [0, 1, 0, 1]
    assert strict.hits[3] == 2 and strict.transfer_s[3] == 0.0
    assert strict.transferred_blocks == 2
    with pytest.raises(InvalidArgumentError):
        _schedule("global_cache_aware", lines, balance_threshold=0.5)
    assert eager.summary()["kv_bytes_transferred"] == 10 * KVModel().block_bytes
    with pytest.raises(InvalidArgumentError, match="unknown strategy"):
        _schedule("fastest", lines)


def test_replay_feeds_every_simulator_once() -> None:
    cfg = ReplayConfig(capacities=(1, 8), instances=2, instance_capacity=4)
    rep = replay(_reqs(GOOD), cfg)
    assert rep.trace.requests == 4 and rep.trace.block_refs == 8 and rep.trace.max_blocks == 3
    assert rep.max_hit.hits == [0, 1, 2, 0]
    assert rep.cache("global", "lru", 8).hits == [0, 1, 2, 0]
    assert len(rep.caches) == 4 and len(rep.schedules) == 5
    rows = list(rep.request_rows())
    assert len(rows) == 4 and all(len(r) == len(rep.columns()) for r in rows)
    doc = rep.to_dict(requests=True)
    json.dumps(doc)  # serialisable
    assert doc["trace"]["unique_blocks"] == 5
    assert doc["max"]["block_hit_rate"] == pytest.approx(3 / 8)
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        replay(_reqs(GOOD), ReplayConfig(policies=("nope",)))


# -- CLI --------------------------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(GOOD) + "\n")
    return p


def test_cli_json_and_csv(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_csv = tmp_path / "req.csv"
    rc = main(
        [
            "replay",
            str(trace_file),
            "--json",
            "--json-requests",
            "--capacities",
            "2,100",
            "--instances",
            "2",
            "--instance-capacity",
            "4",
            "--csv",
            str(out_csv),
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["requests"] == 4
    assert {c["capacity_blocks"] for c in doc["caches"]} == {2, 100}
    assert [s["strategy"] for s in doc["schedules"]][-1] == "global_cache_aware"
    assert len(doc["requests"]["rows"]) == 4
    with out_csv.open() as f:
        rows = list(csv.reader(f))
    assert rows[0][:7] == [
        "index",
        "line",
        "timestamp_ms",
        "input_length",
        "output_length",
        "blocks",
        "max_hit_blocks",
    ]
    assert len(rows) == 5
    assert [int(r[6]) for r in rows[1:]] == [0, 1, 2, 0]
    assert math.isfinite(float(rows[1][-1]))  # ttft of the last strategy


def test_cli_bad_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([GOOD[0], _line(1, 2000, [1])]) + "\n")
    assert main(["replay", str(p), "--no-progress", "--strategies", "none"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2:" in err and "needs ceil(2000/512) = 4" in err
    rc = main(
        ["replay", str(p), "--json", "--skip-bad", "--strategies", "none", "--capacities", "5"]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["skipped_lines"]["count"] == 1
    assert doc["skipped_lines"]["first"][0][0] == 2
    assert doc["trace"]["requests"] == 1
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text('{"x": 1}\n\n')
    assert main(["replay", str(only_bad), "--skip-bad", "--no-progress"]) == 2
    assert "no valid requests (1 bad line(s) skipped, 1 blank)" in capsys.readouterr().err


def test_cli_missing_file_and_bad_policy(
    tmp_path: Path, trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path / "nope.jsonl"), "--no-progress"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["replay", str(trace_file), "--no-progress", "--policies", "belady"]) == 2
    assert "unknown eviction policy 'belady'" in capsys.readouterr().err


def test_cli_tables_and_plots(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (extra 'plot')")
    rc = main(
        [
            "replay",
            str(trace_file),
            "--capacities",
            "2,100",
            "--instances",
            "2",
            "--instance-capacity",
            "4",
            "--plots",
            str(tmp_path / "img"),
        ]
    )
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "theoretical max hit (infinite cache): block-weighted 37.50%" in out
    assert "global_cache_aware" in out
    assert "Global pool vs 2 local caches of C/2" in out
    for name in ("t_hit_rate.png", "t_global_vs_local.png", "t_ttft.png"):
        png = tmp_path / "img" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_replay_drives_the_registry_policy_classes() -> None:
    """The sweep's caches hold the master's policy objects (``make_policy``), one per cache."""
    from mooncake._core.policies import POLICIES
    from mooncake.replay.run import policy_factory

    for name, cls in POLICIES.items():
        a, b = policy_factory(name)(), policy_factory(name)()
        assert type(a) is cls and a is not b
    cfg = ReplayConfig(policies=tuple(POLICIES), capacities=(3,), instances=2)
    rep = replay(_reqs(GOOD), cfg)
    assert {(s.scope, s.policy) for s in rep.caches} == {
        *(("global", p) for p in POLICIES),
        ("local", "lru"),
    }


def test_cli_piped_output_keeps_every_digit(trace_file: Path, tmp_path: Path) -> None:
    """Through a pipe (not a terminal, COLUMNS=40) the tables are plain text: no cell is cut
    ("36.3…") and every figure of the JSON report appears whole in the table output."""
    import os
    import subprocess
    import sys

    args = [
        sys.executable,
        "-m",
        "mooncake",
        "replay",
        str(trace_file),
        "--capacities",
        "2,3,100",
        "--policies",
        "all",
        "--instances",
        "2",
        "--instance-capacity",
        "4",
        "--no-progress",
    ]
    env = {**os.environ, "COLUMNS": "40", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
    out = run.stdout
    assert "…" not in out and "..." not in out
    doc = json.loads(
        subprocess.run(
            [*args, "--json"], capture_output=True, text=True, env=env, check=True
        ).stdout
    )
    lines = out.splitlines()
    for c in [*doc["caches"], *doc["belady"]]:
        scope = "global" if c["scope"] == "global" else f"{c['instances']}xlocal"
        cells = [
            scope,
            c["policy"],
            str(c["capacity_blocks"]),
            f"{100 * c['block_hit_rate']:.2f}%",
            f"{100 * c['token_hit_rate']:.2f}%",
            f"{c['prefill_s_per_request']:.3f}",
        ]
        assert any(line.split()[: len(cells) - 1] == cells[:-1] for line in lines), cells
    for s in doc["schedules"]:
        row = next(line.split() for line in lines if line.startswith(s["strategy"] + " "))
        assert row[1] == f"{s['ttft_mean_s']:.3f}" and row[2] == f"{s['ttft_p50_s']:.3f}"
    assert "Gap to Belady's optimum" in out
    assert max(map(len, lines)) > 40  # wider than COLUMNS: nothing was fitted to it


def test_replay_reports_belady_per_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    rep = replay(_reqs(GOOD), ReplayConfig(policies=("lru", "sieve"), capacities=(1, 3, 100)))
    assert [b.capacity for b in rep.belady] == [1, 3, 100]
    for b in rep.belady:
        for sim in rep.caches:
            if sim.capacity == b.capacity:
                assert sim.totals.hit_blocks <= b.totals.hit_blocks
                assert all(x <= y for x, y in zip(sim.hits, rep.max_hit.hits, strict=True))
        assert b.totals.hit_blocks <= rep.max_hit.totals.hit_blocks
    doc = rep.to_dict(requests=True)
    assert [b["policy"] for b in doc["belady"]] == ["belady"] * 3
    assert "hit_blocks[global:belady:3]" in doc["requests"]["columns"]
    off = replay(_reqs(GOOD), ReplayConfig(capacities=(3,), belady=False))
    assert off.belady == [] and off.to_dict()["belady"] == []


def test_cli_reads_a_gzip_trace(
    tmp_path: Path, trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(trace_file.read_bytes()))
    assert main(["replay", str(gz), "--json", "--capacities", "2", "--strategies", "none"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["requests"] == 4
    assert main(["replay", str(gz), "--capacities", "2", "--strategies", "none"]) == 0
    assert "Hit rate per policy" in capsys.readouterr().out
