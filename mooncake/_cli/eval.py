"""``mooncake eval``: a FAST'25 trace served by real vLLM instances, scenario by scenario.

Scenarios (same requests in each): ``local`` (one instance, its prefix cache only),
``store`` (two instances sharing our store through vLLM's ``MooncakeStoreConnector``),
``pd`` (prefill/decode over our engine through ``MooncakeConnector``), ``pd_store`` (both
through ``MultiConnector``) and ``store_fault`` (``store`` with the pool process killed
midway and replaced). Requests are sent at their (compressed) trace timestamps to vLLM's
OpenAI server, streamed; TTFT/TPOT/E2E are taken at the client. Output: a run directory with
``run.json`` (every record), ``report.md``, PNG plots, the scaled trace and ``mooncake replay``'s
prediction on it. Progress on stderr. vLLM runs in child processes of ``--vllm-python``
(a venv with vLLM: ``scripts/integration-vllm.sh`` builds one); nothing of vLLM is imported
here. Exit status: 0 when every scenario ran, greedy outputs matched the baseline and the
control prompt diverged; 1 otherwise; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

_DEFAULT_VENV = Path.home() / ".cache" / "mooncake-vllm-venv" / "bin" / "python"


def _default_trace() -> str | None:
    root = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces"
    path = root / "conversation_trace.jsonl.gz"
    return str(path) if path.exists() else None


def _default_python() -> str:
    env = os.environ.get("MOONCAKE_VLLM_PYTHON")
    if env:
        return env
    return str(_DEFAULT_VENV) if _DEFAULT_VENV.exists() else sys.executable


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval",
        help="serving evaluation on real vLLM: local / store / PD scenarios, report and plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=_default_trace(), help="FAST'25 JSONL trace (.gz read too)")
    p.add_argument("--out", type=Path, help="run directory (default ./eval-runs/STAMP-PID)")
    p.add_argument("--vllm-python", default=_default_python(), help="python of a vLLM venv")
    p.add_argument("--models", type=_names, default=("llama",), help="llama,qwen2 (default llama)")
    p.add_argument(
        "--model-path",
        type=Path,
        help="serve this model directory instead of the generated tiny ones (one model; set "
        "--vocab to its vocabulary size)",
    )
    p.add_argument(
        "--scenarios",
        type=_names,
        default=("local", "store", "pd"),
        help="comma-separated: local,store,pd,pd_store,store_fault (default local,store,pd; "
        "the first is the gate's baseline)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=32, help="requests (default 32)")
    w.add_argument("--mode", choices=("sessions", "window"), default="sessions")
    w.add_argument("--start", type=int, default=0, help="first trace request considered")
    w.add_argument("--min-turns", type=int, default=3, help="sessions mode: turns per session")
    w.add_argument("--block-tokens", type=int, default=32, help="tokens per trace block (512)")
    w.add_argument("--max-prompt", type=int, default=768, help="prompt tokens at most")
    w.add_argument("--max-tokens", type=int, default=12, help="output tokens at most")
    w.add_argument("--min-tokens", type=int, default=2, help="output tokens at least")
    w.add_argument(
        "--duration", type=float, default=60.0, help="compress arrivals to this span (s)"
    )
    w.add_argument("--time-scale", type=float, help="compress by this factor instead")
    w.add_argument("--vocab", type=int, default=1024, help="token ids drawn below this")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("serving")
    s.add_argument("--store-segment", default="64MB", help="the pool's size (default 64MB)")
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument(
        "--fault-at",
        type=float,
        default=0.5,
        help="store_fault: kill before this share of the requests",
    )
    s.add_argument(
        "--client-ttl", default="2s", help="master's client TTL (a dead pool unmounted after it)"
    )
    s.add_argument(
        "--on-load-failure",
        choices=("recompute", "fail"),
        default="recompute",
        help="the store connector's kv_load_failure_policy (vLLM's own default is fail)",
    )
    s.add_argument(
        "--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeat)"
    )
    p.add_argument("--no-replay", action="store_true", help="skip the simulator's prediction")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--report-only",
        type=Path,
        metavar="RUN_DIR",
        help="only rewrite RUN_DIR's report.md and plots from its run.json (no vLLM needed)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mooncake._eval.cluster import EvalError
    from mooncake._eval.run import EvalConfig, run_eval
    from mooncake._eval.scenarios import SCENARIOS
    from mooncake._eval.weights import SHAPES
    from mooncake._eval.workload import WorkloadConfig
    from mooncake.errors import MooncakeError

    if args.report_only:
        from mooncake._eval.run import rerender

        print(rerender(args.report_only))
        return 0
    if not args.trace:
        print("error: --trace is required (no shipped trace found)", file=sys.stderr)
        return 2
    bad = [s for s in args.scenarios if s not in SCENARIOS] + [
        m for m in args.models if m not in SHAPES
    ]
    if bad:
        print(f"error: unknown scenario/model {bad}", file=sys.stderr)
        return 2
    out = (
        args.out
        or Path("eval-runs") / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    )
    try:
        wl = WorkloadConfig(
            requests=args.requests,
            mode=args.mode,
            start=args.start,
            min_turns=args.min_turns,
            block_tokens=args.block_tokens,
            max_prompt=args.max_prompt,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            duration_s=None if args.time_scale else args.duration,
            time_scale=args.time_scale,
            vocab=args.vocab,
            seed=args.seed,
        )
        models = args.models
        model_dir = None
        if args.model_path:
            models, model_dir = (args.model_path.name,), args.model_path.parent
        cfg = EvalConfig(
            trace=args.trace,
            out=out.resolve(),
            python=args.vllm_python,
            models=models,
            scenarios=args.scenarios,
            workload=wl,
            store_segment=args.store_segment,
            max_model_len=args.max_model_len,
            fault_at=args.fault_at,
            client_ttl=args.client_ttl,
            on_load_failure=args.on_load_failure,
            replay=not args.no_replay,
            plots=not args.no_plots,
            model_dir=model_dir,
            extra_vllm_args=tuple(args.vllm_arg),
        )
        return run_eval(cfg)
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
