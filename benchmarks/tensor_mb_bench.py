#!/usr/bin/env python3
"""Tensor and multi-buffer store throughput: this package vs the published wheel, same run.

Each side runs in a child process of its own (the published one in the anchor venv with its own
``mooncake_master`` binary, ours with ``python -m mooncake master``) and measures, with one
store client holding a 512 MiB segment and a 512 MiB local buffer, on loopback TCP:

* ``tensor``: ``put_tensor`` / ``get_tensor`` of a 4 MiB fp16 tensor (distinct keys), and
  ``batch_put_tensor`` / ``batch_get_tensor`` of 8 of them;
* ``multi``: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of 32 keys,
  each 61 layers x 2 buffers x 16 KiB (a vLLM-style KV block: 1.9 MiB per key), from and into
  registered, pre-faulted buffers.

Sides alternate for ``--runs`` rounds; the table shows medians (GB/s = 1e9 B/s) and the ratio.

    python benchmarks/tensor_mb_bench.py --runs 3
    python benchmarks/tensor_mb_bench.py --only ours --cases tensor
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
MIB = 1 << 20
VENVS = [
    Path(os.environ.get("MOONCAKE_ANCHOR_VENV", Path.home() / ".cache/mooncake-anchor-venv")),
    Path("/opt/anchor-venv"),
]


def timed(fn: Any, nbytes: int, seconds: float, warm: int = 0) -> float:
    """GB/s of repeated ``fn(i)`` calls for about ``seconds``, after ``warm`` untimed calls
    (the first writes into a segment touch fresh pages: both sides are measured warm)."""
    for i in range(warm):
        fn(i)
    n, t0 = 0, time.perf_counter()
    while True:
        fn(warm + n)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= 3:
            return n * nbytes / dt / 1e9


def worker(side: str, cases: list[str], seconds: float) -> dict[str, float]:
    import numpy as np

    published = side == "published"
    if published:
        from mooncake.store import MooncakeDistributedStore as Store
    else:
        from mooncake.store import MooncakeDistributedStore

        Store = MooncakeDistributedStore
    master, rpc = start_master(published)
    out: dict[str, float] = {}
    try:
        s = Store()
        rc = s.setup(
            "127.0.0.1", "P2PHANDSHAKE", 512 * MIB, 512 * MIB, "tcp", "", f"127.0.0.1:{rpc}"
        )
        assert rc == 0, rc
        if "tensor" in cases:
            import torch

            t = torch.randn(2 * MIB).to(torch.float16)  # 4 MiB
            nb = t.numel() * 2
            keep = 48  # keys in flight: 192 MiB, then reuse (removed first)

            def put(i: int) -> None:
                k = f"t{i % keep}"
                if i >= keep:
                    s.remove(k, True)
                assert s.put_tensor(k, t) == 0

            out["put_tensor"] = timed(
                put, nb, seconds, warm=160
            )  # 640 MiB: every segment page touched
            n_put = min(keep, 10**9)
            got = s.get_tensor("t0")
            assert got is not None and torch.equal(got, t)
            out["get_tensor"] = timed(lambda i: s.get_tensor(f"t{i % n_put}"), nb, seconds)
            s.remove_all(True)
            keys8 = [[f"b{j}_{i}" for i in range(8)] for j in range(6)]

            def bput(i: int) -> None:
                ks = keys8[i % 6]
                if i >= 6:
                    for k in ks:
                        s.remove(k, True)
                assert s.batch_put_tensor(ks, [t] * 8) == [0] * 8

            out["batch_put_tensor x8"] = timed(bput, 8 * nb, seconds, warm=20)
            out["batch_get_tensor x8"] = timed(
                lambda i: s.batch_get_tensor(keys8[i % 6]), 8 * nb, seconds
            )
            s.remove_all(True)
        if "multi" in cases:
            layers, per, batch = 61, 16 * 1024, 32
            per_key = layers * 2 * per
            src = np.empty(batch * per_key, dtype=np.uint8)
            src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)
            dst = np.empty_like(src)
            dst.fill(0)
            assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
            assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            ptrs = [
                [src.ctypes.data + k * per_key + j * per for j in range(2 * layers)]
                for k in range(batch)
            ]
            dptrs = [
                [dst.ctypes.data + k * per_key + j * per for j in range(2 * layers)]
                for k in range(batch)
            ]
            sizes = [[per] * (2 * layers) for _ in range(batch)]
            rounds = 3

            def mput(i: int) -> None:
                ks = [f"m{i % rounds}_{k}" for k in range(batch)]
                if i >= rounds:
                    for k in ks:
                        s.remove(k, True)
                rc = s.batch_put_from_multi_buffers(ks, ptrs, sizes)
                assert rc == [0] * batch, rc[:3]

            try:
                out["multi put x32"] = timed(mput, batch * per_key, seconds, warm=rounds)
                out["multi get x32"] = timed(
                    lambda i: s.batch_get_into_multi_buffers(
                        [f"m{i % rounds}_{k}" for k in range(batch)], dptrs, sizes
                    ),
                    batch * per_key,
                    seconds,
                )
                assert (dst == src).all()
            except AssertionError as e:
                print(f"[{side}] multi-buffer: {e}", file=sys.stderr)
        s.close()
    finally:
        master.terminate()
        master.wait(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="per case")
    ap.add_argument("--cases", default="tensor,multi")
    ap.add_argument("--only", choices=("ours", "published"))
    ap.add_argument("--worker", choices=("ours", "published"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the raw runs here")
    a = ap.parse_args()
    cases = a.cases.split(",")
    if a.worker:
        print(json.dumps(worker(a.worker, cases, a.seconds)), flush=True)
        return 0
    anchor = next((str(v / "bin/python") for v in VENVS if (v / "bin/python").exists()), None)
    sides = [a.only] if a.only else ["published", "ours"]
    if "published" in sides and anchor is None:
        print("published venv not found (scripts/setup-anchor.sh): ours only", file=sys.stderr)
        sides = ["ours"]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for _ in range(a.runs):
        for side in sides:
            if side == "published":
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                env["MC_LOG_LEVEL"] = "ERROR"
                cmd, cwd = [str(anchor), str(Path(__file__).resolve())], "/"
            else:
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                cmd, cwd = [sys.executable, str(Path(__file__).resolve())], str(ROOT)
            cmd += ["--worker", side, "--cases", a.cases, "--seconds", str(a.seconds)]
            r = subprocess.run(
                cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, text=True, timeout=600
            )
            if r.returncode == 0:
                runs[side].append(json.loads(r.stdout.strip().splitlines()[-1]))
            else:
                print(f"[{side}] run failed (rc {r.returncode})", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    names = sorted({n for rs in runs.values() for r in rs for n in r})
    print(
        f"{'case':24} "
        + " ".join(f"{s + ' GB/s':>16}" for s in sides)
        + ("   ours/published" if len(sides) == 2 else "")
    )
    for n in names:
        meds = [
            statistics.median([r[n] for r in runs[s] if n in r])
            if any(n in r for r in runs[s])
            else float("nan")
            for s in sides
        ]
        ratio = (
            f"   {meds[1] / meds[0]:.2f}x"
            if len(sides) == 2 and meds[0] == meds[0] and meds[0] > 0
            else ""
        )
        print(f"{n:24} " + " ".join(f"{m:16.3f}" for m in meds) + ratio)
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
