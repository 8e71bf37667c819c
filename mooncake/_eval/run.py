"""One evaluation run: models, workload, scenarios, gate, replay, report, plots.

:func:`run_eval` writes everything into its own run directory (``--out``, default
``./eval-runs/<UTC stamp>-<pid>``): ``run.json`` (every record, metric sample, telemetry sum,
summary and the gate), ``report.md``, the PNG plots, ``scaled_trace.jsonl`` (the workload as a
trace, which ``mooncake replay`` reads), ``replay.json``, the models and each scenario's
process logs. Exit status 0 when every scenario ran and the gate held, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mooncake._eval.cluster import EvalError, check_hot_path
from mooncake._eval.report import gate, render_markdown, scenario_summary
from mooncake._eval.scenarios import ScenarioConfig, run_scenario
from mooncake._eval.weights import kv_bytes_per_token
from mooncake._eval.workload import ScaledRequest, WorkloadConfig, control_prompt, scale, select

__all__ = ["EvalConfig", "rerender", "run_eval", "scaled_trace_lines"]


@dataclass
class EvalConfig:
    """The whole run (the CLI's flags)."""

    trace: str
    out: Path
    python: str
    models: tuple[str, ...] = ("llama",)
    scenarios: tuple[str, ...] = ("local", "store", "pd")
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    store_segment: str = "64MB"
    block_sizes: dict[str, int] = field(default_factory=lambda: {"llama": 32, "qwen2": 64})
    max_model_len: int = 1024
    fault_at: float = 0.5
    client_ttl: str = "2s"
    on_load_failure: str = "recompute"
    replay: bool = True
    plots: bool = True
    model_dir: Path | None = None
    extra_vllm_args: tuple[str, ...] = ()


def _say(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def scaled_trace_lines(requests: list[ScaledRequest]) -> list[str]:
    """The workload as FAST'25 trace lines (arrival in ms, prompt/output tokens, block ids)."""
    return [
        json.dumps(
            {
                "timestamp": round(r.arrival_s * 1000.0, 3),
                "input_length": len(r.prompt),
                "output_length": r.max_tokens,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in requests
    ]


def _size_bytes(text: str) -> int:
    t = text.strip().lower().rstrip("b").rstrip("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def _control(requests: list[ScaledRequest], wl: WorkloadConfig) -> Any:
    import httpx

    req = requests[0]

    def run(url: str) -> dict[str, Any]:
        try:
            return _run(url)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            return {"reference": [], "control": [], "diverges": False, "error": repr(exc)}

    def _run(url: str) -> dict[str, Any]:
        out = []
        for prompt in (list(req.prompt), control_prompt(req.prompt, wl)):
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": req.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            resp = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
            out.append([int(t) for t in resp["choices"][0]["token_ids"]])
        return {"reference": out[0], "control": out[1], "diverges": out[0] != out[1]}

    return run


def _replay(cfg: EvalConfig, trace: Path, model: str, measured: dict[str, Any]) -> dict[str, Any]:
    mdir = (cfg.model_dir or cfg.out / "models") / model
    kvpt = kv_bytes_per_token(json.loads((mdir / "config.json").read_text()))
    capacity = _size_bytes(cfg.store_segment) // (cfg.workload.block_tokens * kvpt)
    argv = [
        sys.executable, "-m", "mooncake", "replay", str(trace),
        "--block-tokens", str(cfg.workload.block_tokens),
        "--capacities", str(capacity), "--policies", "lru", "--local-policies", "lru",
        "--instances", "2", "--strategies", "none", "--no-belady", "--json", "--no-progress",
        "--kv-bytes-per-token", str(kvpt),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "text": f"replay failed: {proc.stderr[-500:]}"}
    doc = json.loads(proc.stdout)
    (cfg.out / f"replay-{model}.json").write_text(proc.stdout)
    glob = next(c for c in doc["caches"] if c["scope"] == "global")
    local = next((c for c in doc["caches"] if c["scope"] == "local"), None)
    pred = {
        "capacity_blocks": capacity,
        "max_token_hit": doc["max"]["token_hit_rate"],
        "global_lru_token_hit": glob["token_hit_rate"],
        "local2_lru_token_hit": local["token_hit_rate"] if local else None,
        "modelled_prefill_s_nocache": glob["prefill_nocache_s_per_request"],
        "modelled_prefill_s_cached": glob["prefill_s_per_request"],
    }
    rows = [
        f"- simulator (`mooncake replay`, {capacity} blocks of {cfg.workload.block_tokens} "
        f"tokens = the pool's {cfg.store_segment}, LRU): token hit rate "
        f"{100 * pred['global_lru_token_hit']:.1f}% with one global pool, "
        f"{100 * (pred['local2_lru_token_hit'] or 0):.1f}% with 2 local caches (round robin), "
        f"{100 * pred['max_token_hit']:.1f}% at most; modelled prefill per request "
        f"{pred['modelled_prefill_s_nocache']:.4f} s uncached vs "
        f"{pred['modelled_prefill_s_cached']:.4f} s (its GPU prefill model, not this CPU)",
    ]
    for scen, s in measured.items():
        if scen.startswith("pd"):
            rows.append(
                f"- measured {model}/{scen}: the decoder loads every prompt token from the "
                f"prefiller by design (its cached share is 100%); the prefiller's own prefix "
                f"cache saved {100 * (s['hits']['local_hit_rate'] or 0):.1f}% of the tokens "
                "queried on both instances"
            )
            continue
        rows.append(
            f"- measured {model}/{scen}: {100 * (s['cached_share'] or 0):.1f}% of prompt tokens "
            f"not computed (vLLM's cached_tokens); TTFT p50 {s['ttft_s']['p50']:.3f} s"
        )
    rows.append(
        "\nWhy they differ: the simulator counts every trace block already seen as a hit the "
        "instant its request arrives; vLLM matches only whole vLLM blocks, never the last "
        "prompt token (a full match still computes one token, so the last block of a "
        "block-aligned prompt is recomputed), and a request that arrives while the request "
        "sharing its prefix is still prefilling finds nothing stored yet (the store connector "
        "saves after the forward pass, asynchronously). The local scenario hits as the global "
        "pool does, because one instance sees every request; the store scenario's hits are "
        "local (same instance) plus external (the other instance's KV loaded from the pool)."
    )
    return {"prediction": pred, "text": "\n".join(rows)}


def _fault_text(results: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The fault scenario against the ``store`` scenario, request by request (same requests):
    TTFT and cached tokens of the requests sent after the kill, the prompt tokens recomputed
    because of it, and when a request first got back the no-fault scenario's hits."""
    rows = []
    for res, s in zip(results, summaries, strict=True):
        if res["scenario"] != "store_fault" or not res["events"]:
            continue
        kill = next(e["t"] for e in res["events"] if e["event"] == "pool_killed")
        restart = next((e["t"] for e in res["events"] if e["event"] == "pool_restarted"), None)
        base_res = next(
            (x for x in results if x["model"] == res["model"] and x["scenario"] == "store"), None
        )
        recs = [r for r in res["records"] if not r["error"] and r["ttft"] is not None]
        after = [r for r in recs if r["sent_s"] >= kill]
        line = (
            f"- {s['model']}: pool SIGKILLed at t={kill:.1f} s (before request "
            f"{min((r['index'] for r in after), default='-')}), fresh pool up "
            f"{(restart - kill) if restart is not None else float('nan'):.1f} s later; "
            f"{len(after)} requests sent after the kill, {s['failed']} failed in the run"
        )
        if base_res is not None and after:
            base = {r["index"]: r for r in base_res["records"]}
            pairs = [(r, base[r["index"]]) for r in after if r["index"] in base]
            lost = sum(
                max(0, (b["cached_tokens"] or 0) - (r["cached_tokens"] or 0)) for r, b in pairs
            )
            back = next(
                (r for r, b in pairs if (r["cached_tokens"] or 0) >= (b["cached_tokens"] or 0)
                 and (b["cached_tokens"] or 0) > (b["prompt_tokens"] or 0) // 2),
                None,
            )  # fmt: skip

            def mean(xs: list[float]) -> float:
                return sum(xs) / len(xs) if xs else float("nan")

            line += (
                f"; those requests: mean TTFT {mean([r['ttft'] for r, _ in pairs]):.3f} s vs "
                f"{mean([b['ttft'] or 0.0 for _, b in pairs]):.3f} s without the fault, cached "
                f"tokens {sum(r['cached_tokens'] or 0 for r, _ in pairs)} vs "
                f"{sum(b['cached_tokens'] or 0 for _, b in pairs)}: {lost} prompt tokens "
                f"recomputed because of the fault; first request with the no-fault hits again: "
                + (
                    f"request {back['index']}, {back['sent_s'] - kill:.1f} s after the kill"
                    if back is not None
                    else "none in this run"
                )
            )
        rows.append(line)
    return {"text": "\n".join(rows)} if rows else {}


def rerender(run_dir: Path) -> str:
    """Recomputes the summaries, the fault section and the report of a finished run from its
    ``run.json`` (the replay's prediction is kept, the plots redrawn when matplotlib is there);
    writes ``report.md`` and returns it."""
    doc = json.loads((run_dir / "run.json").read_text())
    results = doc["results"]
    doc["summaries"] = [scenario_summary(r) for r in results]
    doc["gate"] = gate(results)
    doc["fault"] = _fault_text(results, doc["summaries"])
    why = next((f for f in doc.get("failures") or [] if "/pd_store" in f), None)
    if why is not None:
        doc["pd_store_note"] = {"text": f"PD + store did not run: {_why(why)}"}
    try:
        from mooncake._eval.plots import write_plots

        doc["plots"] = write_plots(results, run_dir)
    except ImportError:
        pass
    (run_dir / "run.json").write_text(json.dumps(doc, indent=1, default=str))
    md = render_markdown(doc) + _failures_md(doc.get("failures") or [])
    (run_dir / "report.md").write_text(md)
    return md


def _failures_md(failures: list[str]) -> str:
    if not failures:
        return ""
    return "\n## Scenarios that failed\n\n" + "\n".join(f"- {_why(f)}" for f in failures) + "\n"


def _why(failure: str) -> str:
    """The first line of a failure and its last ``...Error: ...`` line (the root cause that
    vLLM's traceback ends with)."""
    lines = failure.splitlines()
    errs = [ln.strip() for ln in lines[1:] if "Error:" in ln]
    head = lines[0][:600] if lines else ""
    return head + (f" (last error in the log: `{errs[-1][:400]}`)" if errs else "")


def run_eval(cfg: EvalConfig) -> int:
    """Runs everything (see the module docstring); returns the exit status."""
    from mooncake.replay.trace import load_trace

    cfg.out.mkdir(parents=True, exist_ok=True)
    run_id = cfg.out.name
    _say(f"run directory {cfg.out}")
    flags = check_hot_path(cfg.python)
    vllm_version = subprocess.run(
        [cfg.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    _say(f"vLLM {vllm_version} in {cfg.python}; compiled hot path: {flags}")
    requests = scale(select(load_trace(cfg.trace), cfg.workload), cfg.workload)
    if not requests:
        raise EvalError(f"no requests selected from {cfg.trace}")
    trace_path = cfg.out / "scaled_trace.jsonl"
    trace_path.write_text("\n".join(scaled_trace_lines(requests)) + "\n")
    lens = [len(r.prompt) for r in requests]
    first = requests[0].arrival_s
    span = requests[-1].arrival_s - first
    _say(f"{len(requests)} requests over {span:.1f} s, prompts {min(lens)}-{max(lens)} tokens")
    model_root = cfg.model_dir or cfg.out / "models"
    results: list[dict[str, Any]] = []
    control: dict[str, Any] = {}
    failures: list[str] = []
    for model in cfg.models:
        mdir = model_root / model
        if not (mdir / "model.safetensors").exists():
            subprocess.run(
                [cfg.python, "-m", "mooncake._eval.weights", model, str(mdir)],
                check=True,
                env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
            )
        scfg = ScenarioConfig(
            python=cfg.python,
            run_dir=cfg.out,
            store_segment=cfg.store_segment,
            block_size=cfg.block_sizes.get(model, 32),
            max_model_len=cfg.max_model_len,
            fault_at=cfg.fault_at,
            client_ttl=cfg.client_ttl,
            on_load_failure=cfg.on_load_failure,
            extra_vllm_args=cfg.extra_vllm_args,
        )
        for scen in cfg.scenarios:
            _say(f"{model}/{scen}: starting")
            t0 = time.monotonic()
            try:
                res = run_scenario(
                    scen,
                    mdir,
                    model,
                    requests,
                    scfg,
                    control=_control(requests, cfg.workload) if scen == "local" else None,
                )
            except Exception as exc:  # one scenario's failure is reported, the run goes on
                _say(f"{model}/{scen}: FAILED: {exc}")
                failures.append(f"{model}/{scen}: {exc}")
                continue
            if res.get("control"):
                control[model] = res["control"]
            results.append(res)
            _say(f"{model}/{scen}: done in {time.monotonic() - t0:.0f} s")
    summaries = [scenario_summary(r) for r in results]
    doc: dict[str, Any] = {
        "run_id": run_id,
        "env": {"vllm": vllm_version, "hot_path": flags, "python": cfg.python},
        "config": {**asdict(cfg), "out": str(cfg.out), "model_dir": str(cfg.model_dir)},
        "workload": {
            "trace": os.path.basename(cfg.trace),
            "requests": len(requests),
            "mode": cfg.workload.mode,
            "span_s": span,
            "time_scale": cfg.workload.time_scale or 0.0,
            "block_tokens": cfg.workload.block_tokens,
            "prompt_min": min(lens),
            "prompt_max": max(lens),
            "prompt_mean": sum(lens) / len(lens),
            "max_tokens": cfg.workload.max_tokens,
        },
        "gate": gate(results),
        "control": control,
        "failures": failures,
        "summaries": summaries,
        "results": results,
    }
    if cfg.workload.time_scale is None:
        from mooncake._eval.workload import time_scale_for

        sel = select(load_trace(cfg.trace), cfg.workload)
        doc["workload"]["time_scale"] = time_scale_for(sel, cfg.workload.duration_s or 0.0)
    if cfg.replay:
        for model in cfg.models:
            measured = {s["scenario"]: s for s in summaries if s["model"] == model}
            if measured:
                doc["replay"] = _replay(cfg, trace_path, model, measured)
    doc["fault"] = _fault_text(results, summaries)
    if "pd_store" in cfg.scenarios and not any(r["scenario"] == "pd_store" for r in results):
        why = next((f for f in failures if "/pd_store" in f), "not run")
        doc["pd_store_note"] = {"text": f"PD + store did not run: {_why(why)}"}
    if cfg.plots:
        try:
            from mooncake._eval.plots import write_plots

            doc["plots"] = write_plots(results, cfg.out)
        except ImportError as exc:
            _say(f"no plots: {exc}")
    (cfg.out / "run.json").write_text(json.dumps(doc, indent=1, default=str))
    md = render_markdown(doc) + _failures_md(failures)
    (cfg.out / "report.md").write_text(md)
    _say(f"report: {cfg.out / 'report.md'}")
    print(md)
    bad = any(v for g in doc["gate"].values() for k, v in g.items() if k != "baseline")
    diverge_ok = all(c["diverges"] for c in control.values())
    return 0 if not failures and not bad and diverge_ok else 1
