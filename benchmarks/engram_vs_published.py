#!/usr/bin/env python3
"""``EngramStore`` populate and lookup: this package's vs the published wheel's, same run.

Each side runs in its own process with its own master and one store client (ours: this
interpreter with the repository on ``PYTHONPATH`` and ``python -m mooncake master``; published:
the anchor venv's python and its ``mooncake_master``). The layer has ``--heads`` tables of
``--vocab`` rows of ``--dim`` float32; one ``populate`` is timed, then ``--iters`` lookups of
the same random ``[--batch, --seq, heads]`` row ids (the first is checked against the tables).
Rounds alternate which side goes first; the table shows the median over rounds of each side's
median lookup, rows/s, and the load average before and after::

    python benchmarks/engram_vs_published.py                       # 8 x 50000 x 128, [4, 512]
    python benchmarks/engram_vs_published.py --only ours --seq 4096
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

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
ANCHOR_PYTHON = (
    Path(os.environ.get("MOONCAKE_ANCHOR_VENV", str(Path.home() / ".cache/mooncake-anchor-venv")))
    / "bin"
    / "python"
)


def side(args: argparse.Namespace, published: bool) -> dict[str, Any]:
    """One side's run (in that side's interpreter)."""
    import numpy as np

    sys.path.insert(0, str(HELPERS))
    import sidemaster

    from mooncake.store import EngramStore, EngramStoreConfig, MooncakeDistributedStore

    proc, rpc = sidemaster.start_master(published)
    try:
        s = MooncakeDistributedStore()
        seg = args.heads * args.vocab * args.dim * 4 + (64 << 20)
        assert (
            s.setup("127.0.0.1", "P2PHANDSHAKE", seg, 64 << 20, "tcp", "", f"127.0.0.1:{rpc}") == 0
        )
        cfg = EngramStoreConfig()
        cfg.table_vocab_sizes = [args.vocab] * args.heads
        cfg.embedding_dim = args.dim
        e = EngramStore(1, cfg, s)
        rng = np.random.default_rng(0)
        tables = [
            rng.standard_normal((args.vocab, args.dim), dtype=np.float32) for _ in range(args.heads)
        ]
        t = time.perf_counter()
        e.populate(tables)
        populate_s = time.perf_counter() - t
        ids = rng.integers(0, args.vocab, (args.batch, args.seq, args.heads))
        times = []
        for i in range(args.iters):
            t = time.perf_counter()
            out = e.lookup(ids)
            times.append(time.perf_counter() - t)
            if i == 0:
                want = np.stack([tables[h][ids[..., h]] for h in range(args.heads)], axis=2)
                assert np.array_equal(out, want), "lookup returned wrong rows"
        e.remove_from_store(force=True)
        s.close()
        return {"populate_s": populate_s, "lookup_s": statistics.median(times)}
    finally:
        proc.kill()
        proc.wait()


def run_side(args: argparse.Namespace, published: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if published:
        env.pop("PYTHONPATH", None)
        env["MC_LOG_LEVEL"] = "ERROR"
        python, cwd = str(ANCHOR_PYTHON), "/"
    else:
        env["PYTHONPATH"] = str(ROOT)
        python, cwd = sys.executable, str(ROOT)
    argv = [python, __file__, "--side", "published" if published else "ours"]
    for k in ("heads", "vocab", "dim", "batch", "seq", "iters"):
        argv += [f"--{k}", str(getattr(args, k))]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{'published' if published else 'ours'} failed:\n{res.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=("ours", "published"))
    p.add_argument("--side", choices=("ours", "published"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        print(json.dumps(side(args, args.side == "published")))
        return
    sides = [args.only == "published"] if args.only else [False, True]
    load0 = os.getloadavg()
    results: dict[bool, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for published in sides if r % 2 == 0 else sides[::-1]:
            results[published].append(run_side(args, published))
    load1 = os.getloadavg()
    rows = args.batch * args.seq * args.heads
    print(
        f"heads={args.heads} vocab={args.vocab} dim={args.dim} ids=[{args.batch}, {args.seq}, "
        f"{args.heads}] ({rows} rows of {args.dim * 4} B); {args.rounds} rounds x {args.iters} lookups"
    )
    print("| side | populate (s) | lookup median (ms) | rows/s |")
    print("|---|---:|---:|---:|")
    med: dict[bool, float] = {}
    for published in sides:
        pop = statistics.median(x["populate_s"] for x in results[published])
        med[published] = statistics.median(x["lookup_s"] for x in results[published])
        name = "published" if published else "ours"
        print(f"| {name} | {pop:.3f} | {med[published] * 1e3:.1f} | {rows / med[published]:,.0f} |")
    if len(sides) == 2:
        print(f"lookup speed ours / published: {med[True] / med[False]:.1f}x")
    print(f"load average before {load0[0]:.2f} after {load1[0]:.2f}")


if __name__ == "__main__":
    main()
