#!/usr/bin/env python3
"""DataProto bundles: this package's ``structured_object_store`` vs the published one, same run.

Each side runs in its own process with its own master and one store client (ours: this
interpreter, the repository on ``PYTHONPATH``, ``python -m mooncake master``; published: the
anchor venv's python and its ``mooncake_master``). The client builds the same DataProto-like
bundle of ``--size`` bytes (tensors of mixed dtypes and shapes: int64 ids and positions, a bool
mask, float32 log-probs and advantages, bfloat16 reference log-probs, float16 values; plus
non-tensor columns: uid and data-source strings, reward-model dicts, ragged prompt-id lists,
float scores, and ``meta_info``), then ``--warmup`` (default 1, untimed: the first touch of
fresh memory costs either side far more than the copy on a VM) plus ``--iters`` times: ``put_dataproto`` (timed), export +
import of the handle, ``get_dataproto`` of every field (timed), ``cleanup_dataproto``. The first
get is checked field by field against what was put.

Rounds alternate which side goes first; each side reports the median of its iterations per
round, and the table shows the median over rounds (GB/s = bundle bytes / seconds) and the ratio
ours / published, with the load average before and after::

    python benchmarks/structured_vs_published.py                    # 256 MiB, 3 rounds x 3 iters
    python benchmarks/structured_vs_published.py --size 1G --rounds 3
    python benchmarks/structured_vs_published.py --only ours --size 64M
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))
from sidemaster import start_master

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_VENV = Path(
    os.environ.get("MOONCAKE_ANCHOR_VENV", str(Path.home() / ".cache/mooncake-anchor-venv"))
)
MIB = 1 << 20


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


# -- one side (runs in that side's interpreter) ------------------------------------------------


def build(size: int) -> tuple[dict[str, Any], int]:
    """A DataProto-like bundle of about ``size`` bytes and its exact byte count."""
    import numpy as np
    import torch

    # per token: ids 8 + positions 8 + mask 1 + log-probs 4 + advantages 4 + ref 2 + values 2 = 29 B
    def column(values: list[Any]) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    seq = 4096
    rows = max(2, size // (29 * seq))
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 150_000, (rows, seq), generator=g),
        "position_ids": torch.arange(seq).repeat(rows, 1),
        "attention_mask": torch.rand(rows, seq, generator=g) > 0.1,
        "old_log_probs": torch.randn(rows, seq, generator=g),
        "advantages": torch.randn(rows, seq, generator=g),
        "ref_log_prob": torch.randn(rows, seq, generator=g).to(torch.bfloat16),
        "values": torch.randn(rows, seq, generator=g).to(torch.float16),
    }
    non_tensor = {
        "uid": np.array([f"uid-{i:08d}" for i in range(rows)], dtype=object),
        "data_source": np.array(
            ["openai/gsm8k" if i % 2 else "math" for i in range(rows)], dtype=object
        ),
        "reward_model": np.array(
            [{"style": "rule", "ground_truth": str(i * 7)} for i in range(rows)], dtype=object
        ),
        "raw_prompt_ids": column([list(range(i % 97, i % 97 + 32 + i % 64)) for i in range(rows)]),
        "score": np.array([float(i % 5) for i in range(rows)], dtype=object),
    }
    nbytes = sum(t.numel() * t.element_size() for t in batch.values())
    nbytes += sum(8 * 64 + 32 for _ in range(rows))  # approximate non-tensor payload
    meta = {"global_step": 3, "temperature": 1.0}
    return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta}, nbytes


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    import torch

    for k, v in want["batch"].items():
        assert torch.equal(got["batch"][k], v), f"batch field {k} differs"
    for k, v in want["non_tensor_batch"].items():
        a, b = list(got["non_tensor_batch"][k]), list(v)
        assert [x.tolist() if hasattr(x, "tolist") else x for x in a] == b, (
            f"non-tensor field {k} differs"
        )
    assert got["meta_info"] == want["meta_info"]


def side(args: argparse.Namespace) -> None:
    published = os.environ.get("MC_BENCH_PUBLISHED") == "1"
    master, rpc = start_master(published)
    try:
        from mooncake.store import MooncakeDistributedStore
        from mooncake.structured_object_store import MooncakeBundleTransfer, export_ref, import_ref

        data, nbytes = build(args.size)
        segment = (
            int(nbytes * 3.2) + 64 * MIB
        )  # a removed object frees its space after its read fence
        local = int(nbytes * 1.1) + 64 * MIB
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, local, "tcp", "", f"127.0.0.1:{rpc}")
        assert rc == 0, f"setup rc={rc}"
        transfer = MooncakeBundleTransfer(store)
        puts, gets = [], []
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            ref = transfer.put_dataproto(data)
            t1 = time.perf_counter()
            handle = json.loads(json.dumps(export_ref(ref)))
            t2 = time.perf_counter()
            got = transfer.get_dataproto(import_ref(handle))
            t3 = time.perf_counter()
            if i == 0:
                check(got, data)
            del got
            transfer.cleanup_dataproto(ref)
            if i >= args.warmup:
                puts.append(t1 - t0)
                gets.append(t3 - t2)
        store.close()
        print(json.dumps({"bytes": nbytes, "put_s": puts, "get_s": gets}), flush=True)
    finally:
        master.terminate()
        master.wait(30)


# -- the driver -----------------------------------------------------------------------------


def run_side(name: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        __file__,
        "--role",
        "side",
        "--size",
        str(args.size),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
    ]
    if name == "ours":
        py, env, cwd = sys.executable, dict(os.environ, PYTHONPATH=str(ROOT)), str(ROOT)
    else:
        py = str(ANCHOR_VENV / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(MC_BENCH_PUBLISHED="1", MC_LOG_LEVEL="ERROR")
        cwd = "/"
    res = subprocess.run(
        [py, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=1800
    )
    if res.returncode:
        raise SystemExit(f"{name} side failed:\n{res.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", default="driver", choices=["driver", "side"])
    ap.add_argument("--size", type=parse_size, default=256 * MIB, help="bundle bytes (256M; 1G)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3, help="put+get cycles per side per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed put+get cycles first")
    ap.add_argument("--only", choices=["ours", "published"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.role == "side":
        side(args)
        return
    names = [args.only] if args.only else ["ours", "published"]
    load_before = os.getloadavg()
    per: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in names}
    nbytes = 0
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            out = run_side(name, args)
            nbytes = out["bytes"]
            per[name]["put"].append(statistics.median(out["put_s"]))
            per[name]["get"].append(statistics.median(out["get_s"]))
            log(
                f"round {r + 1} {name}: put {per[name]['put'][-1]:.3f}s get {per[name]['get'][-1]:.3f}s"
            )
    load_after = os.getloadavg()
    summary: dict[str, Any] = {
        "bytes": nbytes,
        "rounds": args.rounds,
        "iters": args.iters,
        "load_before": load_before,
        "load_after": load_after,
        "sides": {},
    }
    print(
        f"bundle {nbytes / MIB:.0f} MiB, {args.rounds} rounds x {args.iters} iters, "
        f"load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    print(f"{'side':<10} {'put GB/s':>9} {'get GB/s':>9} {'put s':>7} {'get s':>7}")
    for name in names:
        p, g = statistics.median(per[name]["put"]), statistics.median(per[name]["get"])
        summary["sides"][name] = {
            "put_s": per[name]["put"],
            "get_s": per[name]["get"],
            "put_gbps": nbytes / p / 1e9,
            "get_gbps": nbytes / g / 1e9,
        }
        print(f"{name:<10} {nbytes / p / 1e9:9.2f} {nbytes / g / 1e9:9.2f} {p:7.3f} {g:7.3f}")
    if len(names) == 2:
        o, q = summary["sides"]["ours"], summary["sides"]["published"]
        summary["ratio_put"] = o["put_gbps"] / q["put_gbps"]
        summary["ratio_get"] = o["get_gbps"] / q["get_gbps"]
        print(f"ours/published: put x{summary['ratio_put']:.2f}, get x{summary['ratio_get']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
