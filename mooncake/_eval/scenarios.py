"""The scenarios of a serving evaluation, each run on the same requests.

* ``local``: one vLLM instance, its own prefix cache only (the baseline; also runs the
  control prompt: request 0 with its first token changed must give other tokens);
* ``store``: our master, one pool process holding the store, two vLLM instances with
  ``MooncakeStoreConnector`` (``kv_both``, standalone-store mode), requests alternating
  between them (request ``i`` to instance ``i % 2``);
* ``pd``: a prefill instance (``MooncakeConnector`` ``kv_producer``) and a decode instance
  (``kv_consumer``); every request prefills on P, its KV crosses over our engine, D decodes;
* ``pd_store``: ``pd`` with the prefill instance also on the store through vLLM's
  ``MultiConnector`` ([MooncakeConnector producer, MooncakeStoreConnector kv_both]): it loads
  the prefixes the store has and saves what it computes; the decoder as in ``pd``;
* ``store_fault``: ``store`` with the pool process SIGKILLed just before request
  ``int(n * fault_at)`` arrives and a fresh pool started ``restart_after_s`` later (the store's holder crashes and is
  replaced; the KV it held is gone).

:func:`run_scenario` starts the processes, waits for them, drives the requests, polls the
instances' and the master's ``/metrics`` every second, stops everything it started, and returns
a JSON-ready dict (records, metric samples, the engine's transfer telemetry summed per
instance, fault events, start-up times).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from mooncake._eval.client import Disagg, Route, Single, drive, poll_metrics
from mooncake._eval.cluster import Cluster, EvalError, Proc, free_port
from mooncake._eval.records import RequestRecord
from mooncake._eval.workload import ScaledRequest

__all__ = ["SCENARIOS", "ScenarioConfig", "run_scenario", "telemetry_summary"]

SCENARIOS = ("local", "store", "pd", "pd_store", "store_fault")

METRIC_PREFIXES = (
    "vllm:prefix_cache",
    "vllm:external_prefix_cache",
    "vllm:num_requests",
    "vllm:kv_cache_usage",
    "master_",
    "mooncake_store_bytes_total",
    "mooncake_store_calls_total",
    "mooncake_store_failed_items_total",
    "mooncake_store_misses_total",
    "mooncake_engine_transfer_bytes_total",
    "mooncake_engine_batches_total",
    "mooncake_engine_transfer_failed_requests_total",
    "mooncake_store_call_latency_seconds_sum",
    "mooncake_engine_batch_latency_seconds_sum",
)


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    """What every scenario shares."""

    python: str
    run_dir: Path
    store_segment: str = "64MB"
    block_size: int = 32
    max_model_len: int = 1024
    fault_at: float = 0.5
    restart_after_s: float = 1.0
    client_ttl: str = "2s"
    on_load_failure: str = "recompute"
    extra_vllm_args: tuple[str, ...] = ()


def _store_kv(role: str = "kv_both", on_load_failure: str = "recompute") -> dict[str, Any]:
    # vLLM's default policy for a KV load that fails is "fail" (the request ends with an
    # error); a store that can lose a holder wants "recompute"
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": role,
        "kv_load_failure_policy": on_load_failure,
    }


def _pd_kv(role: str, engine_id: str) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 4},
    }


def _multi_kv(role: str, engine_id: str) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            # children inherit the parent's engine_id (MultiConnector passes it itself and
            # refuses a child config that names one too)
            "connectors": [
                {k: v for k, v in _pd_kv(role, engine_id).items() if k != "engine_id"},
                _store_kv("kv_both"),
            ],
        },
    }


def telemetry_summary(path: Path) -> dict[str, Any]:
    """Per opcode: batches, bytes, summed ``xfer_duration`` (seconds), failed batches, and the
    first/last batch start (wall clock) from one engine telemetry JSONL file."""
    out: dict[str, Any] = {}
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        op = str(rec.get("opcode", "?"))
        s = out.setdefault(
            op, {"batches": 0, "bytes": 0, "xfer_s": 0.0, "failed": 0, "first": None, "last": None}
        )
        s["batches"] += 1
        s["bytes"] += int(rec.get("total_bytes") or 0)
        s["xfer_s"] += float(rec.get("xfer_duration") or rec.get("completed_s") or 0.0)
        if rec.get("verdict") not in (None, "completed"):
            s["failed"] += 1
        start = rec.get("start_time")
        if start is not None:
            s["first"] = start if s["first"] is None else min(s["first"], start)
            s["last"] = start if s["last"] is None else max(s["last"], start)
    return out


def _say(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


class _Run:
    """One scenario's processes and routes (built by :meth:`start`)."""

    def __init__(self, name: str, model: Path, cfg: ScenarioConfig, tag: str) -> None:
        self.name, self.model, self.cfg, self.tag = name, model, cfg, tag
        self.cluster = Cluster(cfg.run_dir / f"{tag}-{name}", cfg.python)
        self.metrics: dict[str, str] = {}
        self.routes: list[Route] = []
        self.startup: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []
        self.pool: Proc | None = None
        self.master_rpc = ""
        self._next = 0

    def _vllm(
        self, name: str, kv: dict[str, Any] | None, env: dict[str, str], extra: Sequence[str] = ()
    ) -> Any:
        # vLLM's CPU backend binds its OpenMP threads to core 0 unless told: give each
        # instance of a scenario its own core where there are enough (ignored on GPUs)
        cores = os.cpu_count() or 1
        if cores > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(self._next % cores)}
        self._next += 1
        # the worker's store client and engine export their own counters (one registry)
        port = free_port()
        env = {**env, "MC_METRICS_PORT": str(port)}
        self.metrics[f"{name}.mooncake"] = f"http://127.0.0.1:{port}/metrics"
        return self.cluster.vllm(
            name,
            self.model,
            kv_config=kv,
            env=env,
            extra=[*extra, *self.cfg.extra_vllm_args],
            block_size=self.cfg.block_size,
            max_model_len=self.cfg.max_model_len,
        )

    def _store(self) -> dict[str, str]:
        _, rpc, murl = self.cluster.master(client_ttl=self.cfg.client_ttl)
        self.master_rpc = rpc
        self.metrics["master"] = murl
        self.pool = self.cluster.pool(rpc, self.cfg.store_segment)
        return {"MOONCAKE_CONFIG_PATH": str(self.cluster.store_config(rpc))}

    def start(self) -> None:
        name = self.name
        t0 = time.monotonic()
        servers: list[tuple[Proc, str]] = []
        if name == "local":
            servers.append(self._vllm("A", None, {}))
        elif name in ("store", "store_fault"):
            env = self._store()
            kv = _store_kv(on_load_failure=self.cfg.on_load_failure)
            servers += [self._vllm("A", kv, env), self._vllm("B", kv, env)]
        elif name in ("pd", "pd_store"):
            env = self._store() if name == "pd_store" else {}
            port = free_port()
            env = {**env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}
            # pd_store: the prefiller also reads and writes the store (MultiConnector), so a
            # prefix another request prefilled is loaded, not computed; the decoder gets
            # every prompt token's KV from the prefiller either way
            pkv = _multi_kv if name == "pd_store" else _pd_kv
            # vLLM 0.32's MultiConnector Prometheus observer asserts that every child
            # reporting transfer stats registered Prometheus metrics; MooncakeConnector
            # reports stats but registers none, so with stats logging on the prefiller's API
            # server dies at its first stats interval after a transfer (AssertionError:
            # "MooncakeConnector is not contained in the list of registered connectors with
            # Prometheus metrics support"). The prefiller of pd_store runs without stats.
            no_stats = ["--disable-log-stats"] if name == "pd_store" else []
            servers += [
                self._vllm("P", pkv("kv_producer", "eval-P"), env, no_stats),
                self._vllm("D", _pd_kv("kv_consumer", "eval-D"), env),
            ]
        else:
            raise EvalError(f"unknown scenario {name!r}")
        for proc, url in servers:
            self.startup[proc.name] = round(self.cluster.wait_ready(proc, url), 1)
            self.metrics[proc.name] = url + "/metrics"
        _say(f"{self.tag}/{name}: ready in {time.monotonic() - t0:.0f} s {self.startup}")
        urls = {p.name: u for p, u in servers}
        if name in ("pd", "pd_store"):
            self.routes = [
                Disagg("P>D", urls["P"], urls["D"], "eval-P", f"http://127.0.0.1:{port}")
            ]
        else:
            self.routes = [Single(n, u) for n, u in urls.items()]

    def route_of(self, req: ScaledRequest) -> Route:
        return self.routes[req.index % len(self.routes)]

    def fault(self) -> None:
        """SIGKILL the pool, then start a fresh one on the same master."""
        assert self.pool is not None
        t = time.time()
        self.pool.kill()
        self.events.append({"event": "pool_killed", "wall": t})
        _say(f"{self.tag}/{self.name}: pool SIGKILLed")
        time.sleep(self.cfg.restart_after_s)
        self.pool = self.cluster.pool(self.master_rpc, self.cfg.store_segment, name="pool2")
        self.events.append({"event": "pool_restarted", "wall": time.time()})
        _say(f"{self.tag}/{self.name}: fresh pool up")


def run_scenario(
    name: str,
    model: Path,
    tag: str,
    requests: Sequence[ScaledRequest],
    cfg: ScenarioConfig,
    control: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Runs one scenario (see the module docstring); ``control(url)`` runs on the first
    instance after the requests (the ``local`` scenario's control prompt)."""
    run = _Run(name, model, cfg, tag)
    samples: list[tuple[float, str, dict[str, float]]] = []
    try:
        run.start()
        done = [0]

        def on_done(rec: RequestRecord) -> None:
            done[0] += 1
            ttft = f"{rec.ttft:.2f} s" if rec.ttft is not None else "-"
            cached = f"{rec.cached_tokens}/{rec.prompt_tokens}"
            status = f"ERROR {rec.error[:120]}" if rec.error else f"{len(rec.tokens)} tokens"
            _say(
                f"{tag}/{name}: {done[0]:>3}/{len(requests)} req {rec.index:>3} on "
                f"{rec.instance:<3} ttft {ttft:>7} cached {cached:>9} {status}"
            )

        at: list[tuple[float, Callable[[], Any]]] = []
        if name == "store_fault" and requests:
            # midway by requests, not by time (a session trace's arrivals come in bursts)
            k = min(len(requests) - 1, int(len(requests) * cfg.fault_at))
            at.append((max(0.0, requests[k].arrival_s - 0.05), run.fault))

        async def main() -> tuple[list[RequestRecord], float]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(poll_metrics, run.metrics, samples, METRIC_PREFIXES)
                out = await drive(requests, run.route_of, on_done=on_done, at_time=at)
                await anyio.sleep(1.5)  # one more sample after the last request
                tg.cancel_scope.cancel()
            return out

        records, wall0 = anyio.run(main)
        extra = (
            control(run.routes[0].url) if control and isinstance(run.routes[0], Single) else None
        )
    finally:
        run.cluster.close()
    telemetry = {
        p.name: telemetry_summary(p) for p in sorted(run.cluster.run_dir.glob("telemetry-*.jsonl"))
    }
    return {
        "scenario": name,
        "model": tag,
        "startup_s": run.startup,
        "wall0": wall0,
        "records": [r.as_dict() for r in records],
        "samples": [{"t": t - wall0, "source": s, "values": v} for t, s, v in samples],
        "telemetry": telemetry,
        "events": [{**e, "t": e["wall"] - wall0} for e in run.events],
        "control": extra,
        "logs": str(run.cluster.run_dir / "logs"),
    }
