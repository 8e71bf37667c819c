#!/usr/bin/env python3
"""Writes through the C ABI (``libtransfer_engine.so``) beside the Python facade and the async
API, in one run, against one target engine.

Each round starts, in rotating order, three initiator processes against the same target (a
facade engine in its own process serving a buffer): ``benchmarks/c_abi_bench.c`` (TensorRT-LLM's
per-op sequence: allocateBatchID, submitTransfer of one request, getTransferStatus polled,
freeBatchID), the facade (``transfer_sync_write``) and the async API (``await engine.write``).
Each writes one request at a time for ``--seconds`` per size and reports p50/p99 latency and
ops/s. The table holds medians over the rounds.

Usage (from the repository root, extensions and the C ABI library built)::

    .venv/bin/python benchmarks/c_abi.py --rounds 5 --seconds 2 [--transports "tcp;shm,tcp"]

Every side runs with the same ``MOONCAKE_TRANSPORTS`` (one table per transport list).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mooncake._cli import c_abi  # noqa: E402

TARGET = """
import sys, numpy as np
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(int(sys.argv[1]), dtype=np.uint8); buf.fill(1)
assert te.register_memory(int(buf.ctypes.data), buf.nbytes) == 0
print("READY", f"127.0.0.1:{te.get_rpc_port()}", int(buf.ctypes.data), flush=True)
sys.stdin.read()
te.close()
"""

FACADE = """
import json, sys, time, numpy as np
from mooncake.engine import TransferEngine
seg, raddr, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sizes = [int(s) for s in sys.argv[4:]]
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.full(max(sizes), 0x5A, dtype=np.uint8)
addr = int(buf.ctypes.data)
assert te.register_memory(addr, buf.nbytes) == 0
for size in sizes:
    lat, errors = [], 0
    t = time.perf_counter
    start = t(); end = start + seconds
    while len(lat) < 20 or t() < end:
        t0 = t()
        errors += te.transfer_sync_write(seg, addr, raddr, size) != 0
        lat.append(t() - t0)
    total = t() - start
    lat.sort()
    print(json.dumps({"size": size, "ops": len(lat), "seconds": total,
        "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        "errors": errors}), flush=True)
te.close()
"""

ASYNC = """
import json, sys, time, anyio, numpy as np
from mooncake import open_engine
seg, raddr, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sizes = [int(s) for s in sys.argv[4:]]
async def main():
    async with open_engine("127.0.0.1", "P2PHANDSHAKE") as engine:
        buf = np.full(max(sizes), 0x5A, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        await engine.register(buf)
        for size in sizes:
            lat = []
            t = time.perf_counter
            start = t(); end = start + seconds
            while len(lat) < 20 or t() < end:
                t0 = t()
                await engine.write(seg, addr, raddr, size)
                lat.append(t() - t0)
            total = t() - start
            lat.sort()
            print(json.dumps({"size": size, "ops": len(lat), "seconds": total,
                "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
                "errors": 0}), flush=True)
        await engine.unregister(buf)
anyio.run(main)
"""


def build(out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler")
    if not c_abi.LIBRARY.exists():
        raise SystemExit("libtransfer_engine.so not built: run setup.py build_ext --inplace")
    exe = out / "c_abi_bench"
    src = ROOT / "benchmarks" / "c_abi_bench.c"
    cmd = [cc, "-O2", "-std=gnu11", *c_abi.cflags().split(), str(src), "-o", str(exe)]
    subprocess.run([*cmd, *c_abi.libs().split()], check=True)
    return exe


def run_side(argv: list[str], env: dict[str, str]) -> list[dict[str, Any]]:
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{argv[:2]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="per size and side")
    ap.add_argument("--sizes", default="4096,1048576")
    ap.add_argument(
        "--transports", default="tcp;shm,tcp", help="MOONCAKE_TRANSPORTS values, ';'-separated"
    )
    ap.add_argument("--json", type=Path, help="write the raw runs here")
    args = ap.parse_args()
    sizes = [str(int(s)) for s in args.sizes.split(",")]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    out: dict[str, Any] = {}
    before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for transports in args.transports.split(";"):
            env["MOONCAKE_TRANSPORTS"] = transports
            out[transports] = measure(exe, env, sizes, args.rounds, args.seconds)
    load = os.getloadavg()
    print(
        f"load average {before[0]:.2f} before, {load[0]:.2f} after; rounds {args.rounds}, "
        f"{args.seconds} s per size and side"
    )
    for transports, runs in out.items():
        print(f"\nMOONCAKE_TRANSPORTS={transports}\n")
        table(runs, sizes)
    if args.json:
        args.json.write_text(json.dumps({"runs": out, "load": [before, load]}, indent=1))


def measure(
    exe: Path, env: dict[str, str], sizes: list[str], rounds: int, seconds: float
) -> dict[str, list[list[dict[str, Any]]]]:
    target = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(max(int(s) for s in sizes))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert target.stdout is not None and target.stdin is not None
    _, seg, raddr = target.stdout.readline().split()
    common = [seg, raddr, str(seconds), *sizes]
    sides = {
        "c_abi": [str(exe), *common],
        "facade": [sys.executable, "-c", FACADE, *common],
        "async": [sys.executable, "-c", ASYNC, *common],
    }
    runs: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in sides}
    try:
        for rnd in range(rounds):
            order = list(sides)[rnd % 3 :] + list(sides)[: rnd % 3]
            for name in order:
                runs[name].append(run_side(sides[name], env))
    finally:
        target.stdin.close()
        target.wait(timeout=60)
    return runs


def table(runs: dict[str, list[list[dict[str, Any]]]], sizes: list[str]) -> None:
    print("| size | side | p50 us | p99 us | ops/s | errors |")
    print("|---|---|---|---|---|---|")
    for i, size in enumerate(sizes):
        for name, rs in runs.items():
            p50 = statistics.median(r[i]["p50_us"] for r in rs)
            p99 = statistics.median(r[i]["p99_us"] for r in rs)
            ops = statistics.median(r[i]["ops"] / r[i]["seconds"] for r in rs)
            errs = sum(r[i]["errors"] for r in rs)
            print(
                f"| {int(size) // 1024} KiB | {name} | {p50:.1f} | {p99:.1f} | {ops:.0f} | {errs} |"
            )


if __name__ == "__main__":
    main()
