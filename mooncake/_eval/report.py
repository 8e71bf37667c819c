"""From scenario results to numbers and a Markdown report (pure: dicts in, dicts/str out).

A scenario result is the dict :func:`mooncake._eval.scenarios.run_scenario` returns. Hit rates
come from vLLM's own counters (``vllm:prefix_cache_*`` for the local prefix cache,
``vllm:external_prefix_cache_*`` for tokens a connector loaded), as the difference between the
last and the first sample of each instance, summed over instances; store counters from our
master's ``/metrics`` the same way; bytes moved from the engine's transfer telemetry of each
vLLM instance (``READ`` = loaded from the store or pulled; ``WRITE`` = saved to the store or
pushed to the decoder).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake._eval.records import RequestRecord, compare_outputs, summarize

__all__ = [
    "client_counters",
    "gate",
    "hit_rates",
    "master_deltas",
    "records_of",
    "render_markdown",
    "scenario_summary",
]

_MASTER_COUNTERS = (
    "master_put_end_total",
    "master_put_no_space_total",
    "master_get_replica_list_total",
    "master_get_miss_total",
    "master_evicted_keys_total",
    "master_evicted_bytes_total",
    "master_clients_expired_total",
    "master_key_count",
    "master_allocated_bytes",
)


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    """The :class:`RequestRecord` objects of a scenario result."""
    fields = RequestRecord.__slots__
    return [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in result["records"]]


def _deltas(
    samples: Sequence[dict[str, Any]], names: Sequence[str], sources: set[str] | None
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    first: dict[str, dict[str, float]] = {}
    last: dict[str, dict[str, float]] = {}
    for s in samples:
        if sources is not None and s["source"] not in sources:
            continue
        first.setdefault(s["source"], s["values"])
        last[s["source"]] = s["values"]
    out = dict.fromkeys(names, 0.0)
    for src, end in last.items():
        for n in names:
            out[n] += end.get(n, 0.0) - first[src].get(n, 0.0)
    return out, last


def hit_rates(result: dict[str, Any]) -> dict[str, Any]:
    """Token hit rates from vLLM's counters (see the module docstring)."""
    names = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
    )
    d, _ = _deltas(result["samples"], names, {s for s in result["startup_s"]})
    q = d["vllm:prefix_cache_queries_total"]
    local = d["vllm:prefix_cache_hits_total"]
    ext = d["vllm:external_prefix_cache_hits_total"]
    return {
        "queried_tokens": q,
        "local_hit_tokens": local,
        "external_queried_tokens": d["vllm:external_prefix_cache_queries_total"],
        "external_hit_tokens": ext,
        "local_hit_rate": local / q if q else None,
        "external_hit_rate": ext / q if q else None,
        "total_hit_rate": (local + ext) / q if q else None,
    }


def master_deltas(result: dict[str, Any]) -> dict[str, Any]:
    """The master's counters at the end of the run (a fresh master per scenario counts from
    0); empty without a master. Keys without the ``master_`` prefix and ``_total`` suffix."""
    last = [s["values"] for s in result["samples"] if s["source"] == "master"]
    if not last:
        return {}
    return {
        n.removeprefix("master_").removesuffix("_total"): last[-1].get(n, 0.0)
        for n in _MASTER_COUNTERS
    }


def _bytes(result: dict[str, Any]) -> dict[str, Any]:
    out = {"read_bytes": 0, "write_bytes": 0, "read_xfer_s": 0.0, "write_xfer_s": 0.0, "failed": 0}
    for per_op in result["telemetry"].values():
        for op, s in per_op.items():
            key = "read" if op.lower().startswith("r") else "write"
            out[f"{key}_bytes"] += s["bytes"]
            out[f"{key}_xfer_s"] += s["xfer_s"]
            out["failed"] += s["failed"]
    return out


def client_counters(result: dict[str, Any]) -> dict[str, Any]:
    """The vLLM workers' own store-client and engine counters (``MC_METRICS_PORT`` of each
    instance, sources ``NAME.mooncake``), last sample of each (fresh processes count from 0),
    summed over instances: store bytes read (get families) and written (put/upsert families),
    store calls and failed keys, misses by reason, engine bytes by op."""
    last: dict[str, dict[str, float]] = {}
    for smp in result["samples"]:
        if smp["source"].endswith(".mooncake"):
            last[smp["source"]] = smp["values"]
    out: dict[str, Any] = {
        "store_read_bytes": 0.0,
        "store_written_bytes": 0.0,
        "store_get_calls": 0.0,
        "store_get_failed": 0.0,
        "store_put_calls": 0.0,
        "engine_read_bytes": 0.0,
        "engine_write_bytes": 0.0,
        "store_get_s": 0.0,
        "store_put_s": 0.0,
        "engine_read_s": 0.0,
        "engine_write_s": 0.0,
        "misses": {},
    }
    for values in last.values():
        for key, v in values.items():
            name, _, label = key.partition(":")
            if not label:
                continue
            is_get = "get" in label
            if name == "mooncake_store_bytes_total":
                out["store_read_bytes" if is_get else "store_written_bytes"] += v
            elif name == "mooncake_store_calls_total":
                out["store_get_calls" if is_get else "store_put_calls"] += v
            elif name == "mooncake_store_failed_items_total" and is_get:
                out["store_get_failed"] += v
            elif name == "mooncake_store_misses_total":
                out["misses"][label] = out["misses"].get(label, 0.0) + v
            elif name == "mooncake_engine_transfer_bytes_total" and label in ("read", "write"):
                out[f"engine_{label}_bytes"] += v
            elif name == "mooncake_store_call_latency_seconds_sum":
                out["store_get_s" if is_get else "store_put_s"] += v
            elif name == "mooncake_engine_batch_latency_seconds_sum" and label in ("read", "write"):
                out[f"engine_{label}_s"] += v
    out["instances"] = len(last)
    return out


def scenario_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Everything the report prints for one scenario."""
    recs = records_of(result)
    s = summarize(recs)
    moved = _bytes(result)
    ttft_sum = sum(r.ttft or 0.0 for r in recs if not r.error)
    client = client_counters(result)
    # time on the TTFT path moving KV: store loads (get calls), or the engine's batches
    # (PD: the prefiller's pushes), from the processes' own counters
    xfer = (
        client["store_get_s"]
        or (
            client["engine_write_s"]
            if result["scenario"].startswith("pd")
            else client["engine_read_s"]
        )
        or (moved["write_xfer_s"] if result["scenario"].startswith("pd") else moved["read_xfer_s"])
    )
    kv_read = client["store_read_bytes"] or client["engine_read_bytes"] or moved["read_bytes"]
    kv_written = (
        client["store_written_bytes"] or client["engine_write_bytes"] or moved["write_bytes"]
    )
    s.update(
        scenario=result["scenario"],
        model=result["model"],
        hits=hit_rates(result),
        master=master_deltas(result),
        moved=moved,
        client=client,
        kv_read_bytes=kv_read,
        kv_written_bytes=kv_written,
        transfer_share_of_ttft=(xfer / ttft_sum) if ttft_sum > 0 and xfer > 0 else None,
        startup_s=result["startup_s"],
        events=result["events"],
    )
    return s


def _f(v: Any, unit: str = "", scale: float = 1.0, nd: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v * scale:.{nd}f}{unit}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _mb(v: Any) -> str:
    return "-" if not v else f"{v / 2**20:.2f} MiB"


def gate(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Correctness gate per model: every scenario's outputs against the first (baseline)."""
    out: dict[str, Any] = {}
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for model, rs in by_model.items():
        base = records_of(rs[0])
        out[model] = {r["scenario"]: compare_outputs(base, records_of(r)) for r in rs[1:]} | {
            "baseline": rs[0]["scenario"]
        }
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    """The report of a run document (what ``mooncake eval`` writes as ``report.md``)."""
    lines = [f"# Serving evaluation {doc['run_id']}", ""]
    w = doc["workload"]
    lines += [
        f"Trace `{w['trace']}`: {w['requests']} requests ({w['mode']}), arrivals over "
        f"{w['span_s']:.1f} s (time compressed {w['time_scale']:.1f}x), {w['block_tokens']} "
        f"tokens per trace block, prompts {w['prompt_min']}-{w['prompt_max']} tokens "
        f"(mean {w['prompt_mean']:.0f}), {w['max_tokens']} output tokens at most. "
        f"vLLM {doc['env'].get('vllm', '?')}, hot path compiled: {doc['env'].get('hot_path')}.",
        "",
        "| model | scenario | ok/n | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | "
        "E2E p50 / p90 / p99 (s) | out tok/s | cached share | local hit | store/PD hit | "
        "KV read | KV written | transfer share of TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["summaries"]:
        t, p, e, h, m = s["ttft_s"], s["tpot_s"], s["e2e_s"], s["hits"], s["moved"]
        lines.append(
            f"| {s['model']} | {s['scenario']} | {s['requests'] - s['failed']}/{s['requests']} "
            f"| {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} "
            f"| {_f(p['p50'], '', 1e3, 1)} / {_f(p['p90'], '', 1e3, 1)} / "
            f"{_f(p['p99'], '', 1e3, 1)} "
            f"| {_f(e['p50'])} / {_f(e['p90'])} / {_f(e['p99'])} "
            f"| {_f(s['output_tokens_per_s'], '', 1, 1)} | {_pct(s['cached_share'])} "
            f"| {_pct(h['local_hit_rate'])} | {_pct(h['external_hit_rate'])} "
            f"| {_mb(s['kv_read_bytes'])} | {_mb(s['kv_written_bytes'])} "
            f"| {_pct(s['transfer_share_of_ttft'])} |"
        )
    lines += ["", "## Correctness gate (greedy outputs against the baseline)", ""]
    for model, g in doc["gate"].items():
        for scen, bad in g.items():
            if scen == "baseline":
                continue
            verdict = "all equal" if not bad else f"**{len(bad)} differ**: requests {bad}"
            lines.append(f"- {model}: {scen} vs {g['baseline']}: {verdict}")
    for model, c in doc.get("control", {}).items():
        if c.get("error"):
            lines.append(f"- {model}: control prompt **not checked**: {c['error'][:300]}")
            continue
        lines.append(
            f"- {model}: control prompt (request 0, first token changed) "
            f"{'diverges' if c['diverges'] else '**does not diverge**'}: "
            f"{c['reference'][:6]}... vs {c['control'][:6]}..."
        )
    lines += ["", "## Store and engine counters", ""]
    for s in doc["summaries"]:
        if s["master"]:
            mm = s["master"]
            lines.append(
                f"- {s['model']}/{s['scenario']}: master put_end {mm['put_end']:.0f}, "
                f"get_replica_list {mm['get_replica_list']:.0f}, get_miss "
                f"{mm['get_miss']:.0f}, no-space {mm['put_no_space']:.0f}, "
                f"evicted {mm['evicted_keys']:.0f} keys ({_mb(mm['evicted_bytes'])}), "
                f"clients expired {mm['clients_expired']:.0f}, keys at end "
                f"{mm['key_count']:.0f} ({_mb(mm['allocated_bytes'])})"
            )
        c = s.get("client") or {}
        if c.get("instances"):
            misses = ", ".join(f"{k} {v:.0f}" for k, v in sorted(c["misses"].items())) or "none"
            lines.append(
                f"- {s['model']}/{s['scenario']}: vLLM workers' store clients: read "
                f"{_mb(c['store_read_bytes'])}, wrote {_mb(c['store_written_bytes'])}, get calls "
                f"{c['store_get_calls']:.0f} (failed keys {c['store_get_failed']:.0f}), put calls "
                f"{c['store_put_calls']:.0f}, misses by reason: {misses}; their engines moved "
                f"{_mb(c['engine_read_bytes'])} read / {_mb(c['engine_write_bytes'])} written"
            )
        m = s["moved"]
        if m["read_bytes"] or m["write_bytes"]:
            lines.append(
                f"- {s['model']}/{s['scenario']}: engine telemetry: read {_mb(m['read_bytes'])} "
                f"in {m['read_xfer_s']:.3f} s, written {_mb(m['write_bytes'])} in "
                f"{m['write_xfer_s']:.3f} s, failed batches {m['failed']}"
            )
        lines.append(
            f"- {s['model']}/{s['scenario']}: vLLM tokens queried {s['hits']['queried_tokens']:.0f}"
            f", local hits {s['hits']['local_hit_tokens']:.0f}, external hits "
            f"{s['hits']['external_hit_tokens']:.0f}; start-up {s['startup_s']}"
        )
    for extra in ("fault", "replay", "pd_store_note"):
        if doc.get(extra):
            lines += ["", f"## {extra.replace('_', ' ').capitalize()}", "", doc[extra]["text"]]
    if doc.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in doc["plots"]]
    return "\n".join(lines) + "\n"
