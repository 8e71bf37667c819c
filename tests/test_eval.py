"""``mooncake eval``'s pure parts: trace selection and scaling, prompts, records, the report.

No vLLM here (the serving runs are ``mooncake eval`` itself, outside the default suite).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._eval.client import parse_prometheus
from mooncake._eval.records import RequestRecord, compare_outputs, percentile, summarize
from mooncake._eval.report import gate, render_markdown, scenario_summary
from mooncake._eval.run import scaled_trace_lines
from mooncake._eval.workload import (
    WorkloadConfig,
    build_prompt,
    control_prompt,
    scale,
    select,
    time_scale_for,
)
from mooncake.errors import InvalidArgumentError
from mooncake.replay.trace import TraceRequest, iter_trace
from tests.conftest import ROOT


def _req(i: int, t: float, ids: list[int], n_in: int | None = None, n_out: int = 100):
    return TraceRequest(
        i, i + 1, t, n_in if n_in is not None else 512 * len(ids), n_out, tuple(ids)
    )


def test_sessions_mode_takes_whole_multi_turn_sessions_in_time_order() -> None:
    # id 0 is in every request (a system prompt): not a session key
    trace = [
        _req(0, 0, [0, 1]),
        _req(1, 10, [0, 5]),
        _req(2, 20, [0, 1, 2]),
        _req(3, 30, [0, 9]),
        _req(4, 40, [0, 1, 2, 3]),
        _req(5, 50, [0, 5, 6]),
    ]
    got = select(trace, WorkloadConfig(requests=10, min_turns=2))
    assert [r.index for r in got] == [0, 1, 2, 4, 5]
    got = select(trace, WorkloadConfig(requests=10, min_turns=3))
    assert [r.index for r in got] == [0, 2, 4]
    assert [r.index for r in select(trace, WorkloadConfig(requests=2, mode="window", start=3))] == [
        3,
        4,
    ]


def test_scale_lengths_arrivals_and_output_clamp() -> None:
    trace = [_req(0, 1000, [7, 8], n_in=700, n_out=1), _req(1, 3000, [7, 8, 9], 1500, 5000)]
    cfg = WorkloadConfig(block_tokens=32, max_prompt=64, max_tokens=12, duration_s=None,
                         time_scale=2.0)  # fmt: skip
    a, b = scale(trace, cfg)
    assert len(a.prompt) == math.ceil(700 * 32 / 512) == 44
    assert len(b.prompt) == 64  # capped
    assert b.hash_ids == (7, 8)  # only the blocks the capped prompt covers
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.0)
    assert (a.max_tokens, b.max_tokens) == (2, 12)
    assert b.prompt[:44] == a.prompt  # shared blocks, shared tokens
    assert time_scale_for(trace, 4.0) == 0.5


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True),
    st.lists(st.integers(51, 99), min_size=0, max_size=4, unique=True),
    st.lists(st.integers(100, 150), min_size=1, max_size=4, unique=True),
    st.integers(4, 40),  # 4+ tokens: two blocks collide with odds ~1e-11
)
def test_shared_hash_prefix_means_shared_token_prefix(
    common: list[int], tail_a: list[int], tail_b: list[int], block: int
) -> None:
    cfg = WorkloadConfig(block_tokens=block, vocab=500)
    a = build_prompt(common + tail_a, block * len(common + tail_a), cfg)
    b = build_prompt(common + tail_b, block * len(common + tail_b), cfg)
    k = block * len(common)
    assert a[:k] == b[:k]
    assert a[k : k + block] != b[k : k + block] or not tail_a  # different next block
    assert all(cfg.first_token <= t < cfg.vocab for t in a + b)
    c = control_prompt(a, cfg)
    assert c[0] != a[0] and c[1:] == a[1:] and cfg.first_token <= c[0] < cfg.vocab


def test_config_rejects_nonsense() -> None:
    with pytest.raises(InvalidArgumentError):
        WorkloadConfig(min_tokens=5, max_tokens=2)
    with pytest.raises(InvalidArgumentError):
        WorkloadConfig(mode="random")


def test_scaled_trace_is_a_valid_trace_for_the_replay() -> None:
    from mooncake.replay.trace import load_trace

    trace = ROOT / "tests" / "data" / "traces" / "conversation_trace.jsonl.gz"
    cfg = WorkloadConfig(requests=20)
    reqs = scale(select(load_trace(str(trace)), cfg), cfg)
    assert len(reqs) == 20
    back = list(iter_trace(scaled_trace_lines(reqs), block_tokens=cfg.block_tokens))
    assert [len(r.prompt) for r in reqs] == [b.input_length for b in back]
    assert back[-1].timestamp_ms == pytest.approx(60_000, abs=1)
    # sessions: most requests share more than the system prompt block with an earlier one
    seen: set[int] = set()
    reused = 0
    for r in reqs:
        reused += len(r.hash_ids) > 1 and r.hash_ids[1] in seen
        seen.update(r.hash_ids)
    assert reused >= len(reqs) // 2


def _rec(i: int, tokens: list[int], sent: float = 0.0, cached: int = 0) -> RequestRecord:
    return RequestRecord(i, "A", sent, sent, sent + 0.5, sent + 0.5 + 0.1 * (len(tokens) - 1),
                         100, cached, len(tokens), tokens)  # fmt: skip


def test_records_times_and_summary() -> None:
    r = _rec(0, [1, 2, 3], sent=1.0, cached=40)
    assert r.ttft == pytest.approx(0.5) and r.tpot == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.7)
    assert _rec(1, [1]).tpot is None
    s = summarize([r, _rec(1, [4, 5], cached=60)])
    assert s["cached_share"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 50) is None
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_compare_outputs_names_the_requests_that_differ() -> None:
    base = [_rec(0, [1, 2]), _rec(1, [3, 4]), _rec(2, [5])]
    other = [_rec(0, [1, 2]), _rec(1, [3, 9])]
    assert compare_outputs(base, other) == [1, 2]
    failed = [_rec(0, [1, 2]), _rec(1, [3, 4]), _rec(2, [5])]
    failed[2].error = "HTTP 500"
    assert compare_outputs(base, failed) == [2]


def test_parse_prometheus_sums_label_sets() -> None:
    text = (
        '# HELP x\nvllm:prefix_cache_hits_total{engine="0"} 5.0\n'
        'vllm:prefix_cache_hits_total{engine="1"} 7\nother 1\nmaster_put_end 3\n'
    )
    got = parse_prometheus(text, ("vllm:prefix", "master_"))
    assert got == {"vllm:prefix_cache_hits_total": 12.0, "master_put_end": 3.0}


def _result(scenario: str, tokens: list[list[int]]) -> dict:
    recs = [_rec(i, t, cached=10 * i).as_dict() for i, t in enumerate(tokens)]
    samples = [
        {"t": 0, "source": "A", "values": {"vllm:prefix_cache_queries_total": 0.0,
                                            "vllm:prefix_cache_hits_total": 0.0}},
        {"t": 9, "source": "A", "values": {"vllm:prefix_cache_queries_total": 200.0,
                                            "vllm:prefix_cache_hits_total": 50.0,
                                            "vllm:external_prefix_cache_hits_total": 30.0}},
    ]  # fmt: skip
    return {
        "scenario": scenario, "model": "llama", "startup_s": {"A": 1.0}, "records": recs,
        "samples": samples, "events": [],
        "telemetry": {"telemetry-A.jsonl": {"read": {"batches": 2, "bytes": 2048, "xfer_s": 0.1,
                                                     "failed": 0}}},
    }  # fmt: skip


def test_report_hit_rates_gate_and_markdown() -> None:
    a = _result("local", [[1, 2], [3, 4]])
    b = _result("store", [[1, 2], [3, 5]])
    s = scenario_summary(b)
    assert s["hits"]["local_hit_rate"] == pytest.approx(0.25)
    assert s["hits"]["external_hit_rate"] == pytest.approx(0.15)
    assert s["moved"]["read_bytes"] == 2048
    g = gate([a, b])
    assert g["llama"] == {"baseline": "local", "store": [1]}
    doc = {
        "run_id": "t", "env": {}, "gate": g, "control": {}, "summaries": [scenario_summary(a), s],
        "workload": {"trace": "x", "requests": 2, "mode": "sessions", "span_s": 1.0,
                     "time_scale": 2.0, "block_tokens": 32, "prompt_min": 1, "prompt_max": 2,
                     "prompt_mean": 1.5, "max_tokens": 2},
    }  # fmt: skip
    md = render_markdown(doc)
    assert "**1 differ**: requests [1]" in md
    assert "| llama | store | 2/2 |" in md


def test_cli_refuses_unknown_scenarios_and_models_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mooncake._cli import main

    assert main(["eval", "--scenarios", "local,nonsense", "--out", "/nonexistent/x"]) == 2
    assert main(["eval", "--models", "gpt5"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_model_shapes_kv_bytes() -> None:
    from mooncake._eval.weights import config_for, kv_bytes_per_token

    assert kv_bytes_per_token(config_for("llama")) == 2 * 2 * 2 * 32 * 4
    qwen = config_for("qwen2")
    assert qwen["num_key_value_heads"] < qwen["num_attention_heads"]  # GQA
    assert kv_bytes_per_token(qwen) == 2 * 2 * 2 * 32 * 4  # head_dim 256 / 8


def test_rerender_reports_the_fault_against_the_store_scenario(tmp_path) -> None:
    import json

    from mooncake._eval.run import rerender

    store = _result("store", [[1, 2], [3, 4], [5, 6]])
    fault = _result("store_fault", [[1, 2], [3, 4], [5, 6]])
    for i, r in enumerate(fault["records"]):
        r["sent_s"] = r["arrival_s"] = float(i)
    fault["records"][1]["cached_tokens"] = 0  # the store scenario had 10 here
    fault["events"] = [{"event": "pool_killed", "t": 0.5}, {"event": "pool_restarted", "t": 1.5}]
    doc = {
        "run_id": "t", "env": {}, "control": {}, "failures": ["llama/pd_store: P exited (rc=1): "
        "TypeError: boom\nTraceback\nTypeError: boom"], "results": [store, fault],
        "workload": {"trace": "x", "requests": 3, "mode": "sessions", "span_s": 1.0,
                     "time_scale": 2.0, "block_tokens": 32, "prompt_min": 1, "prompt_max": 2,
                     "prompt_mean": 1.5, "max_tokens": 2},
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(doc))
    md = rerender(tmp_path)
    assert "2 requests sent after the kill" in md
    assert "10 prompt tokens recomputed because of the fault" in md
    assert "first request with the no-fault hits again: none in this run" in md
    assert "store_fault vs store: all equal" in md
    assert "last error in the log: `TypeError: boom`" in md
    assert (tmp_path / "report.md").read_text() == md


def test_plots_are_drawn_per_model(tmp_path) -> None:
    """Each model gets a TTFT CDF and a hit-rate figure, real PNGs, with PD results and fault
    events among the inputs."""
    pytest.importorskip("matplotlib")
    from mooncake._eval.plots import write_plots

    store = _result("store", [[1, 2], [3, 4], [5, 6]])
    pd = _result("pd", [[1, 2], [3, 4]])
    for i, r in enumerate(store["records"]):
        r["arrival_s"] = float(i)
    store["events"] = [{"event": "pool_killed", "t": 0.5}]
    qwen = _result("local", [[1, 2]])
    qwen["model"] = "qwen2"
    names = write_plots([store, pd, qwen], tmp_path)
    assert sorted(names) == sorted(
        f"{kind}_{m}.png" for kind in ("ttft_cdf", "hit_rate") for m in ("llama", "qwen2")
    )
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name
