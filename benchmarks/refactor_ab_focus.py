#!/usr/bin/env python3
"""Tree A against tree B, the steadier way on a loaded host: process CPU time per operation
(every thread of the client process; not the master's, not time spent waiting for a core),
short runs, many rounds alternating A and B, a fresh master per store run.

Engine (``MC_FORCE_TCP=1``, two in-process engines): ``await transfer`` of 64 x 4 KiB and
1 x 4 KiB to the peer, 1 x 4 KiB to the engine's own segment. Store (sync facade): ``put`` +
``get`` of 4 KiB, ``put_tensor`` + ``get_tensor`` + ``remove`` of a 64 KiB float32 tensor,
and ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` / ``batch_remove`` of
8 keys of 4 x 1 KiB, each phase timed on its own. Printed: the median over rounds per tree.

    python benchmarks/refactor_ab_focus.py --a /path/to/before --b . --rounds 10
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

ROOT = Path(__file__).resolve().parent.parent


def _engine(seconds: float) -> dict[str, float]:
    import anyio

    from mooncake._core.transfer import Opcode, TransferRequest
    from mooncake._engine.engine import open_engine

    res: dict[str, float] = {}

    async def main() -> None:
        async with (
            open_engine("127.0.0.1", transports=["tcp"]) as a,
            open_engine("127.0.0.1", transports=["tcp"]) as b,
        ):
            la, lb = await a.allocate(1 << 20), await b.allocate(1 << 20)
            many = [
                TransferRequest(Opcode.WRITE, la.addr + i * 4096, lb.addr + i * 4096, 4096)
                for i in range(64)
            ]
            own = [TransferRequest(Opcode.WRITE, la.addr, la.addr + (512 << 10), 4096)]
            cases: list[tuple[str, list[TransferRequest], str]] = [
                ("engine tcp 64 x 4KiB", many, b.segment_name),
                ("engine tcp 1 x 4KiB", many[:1], b.segment_name),
                ("engine local 1 x 4KiB", own, a.segment_name),
            ]
            for name, reqs, seg in cases:
                for _ in range(50):
                    await a.transfer(seg, reqs)
                cpu: list[float] = []
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    c0 = time.process_time()
                    for _ in range(20):
                        await a.transfer(seg, reqs)
                    cpu.append((time.process_time() - c0) / 20 * 1e6)
                res[name] = statistics.median(cpu)

    anyio.run(main)
    return res


def _store(master: str, seconds: float) -> dict[str, float]:
    import numpy as np

    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", master) == 0
    res: dict[str, float] = {}
    tag = os.getpid()
    try:
        val = b"x" * 4096
        s.put(f"pg{tag}", val)
        pg: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            c0 = time.process_time()
            for _ in range(20):
                s.put(f"pg{tag}", val)
                s.get(f"pg{tag}")
            pg.append((time.process_time() - c0) / 20 * 1e6)
        res["store put+get 4KiB"] = statistics.median(pg)
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            t = torch.arange(16384, dtype=torch.float32)
            tp: list[float] = []
            j = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                j += 1
                c0 = time.process_time()
                assert s.put_tensor(f"tp{tag}-{j}", t) == 0
                assert s.get_tensor(f"tp{tag}-{j}") is not None
                assert s.remove(f"tp{tag}-{j}", force=True) == 0
                tp.append((time.process_time() - c0) * 1e6)
            res["tensor put+get+remove 64KiB"] = statistics.median(tp)
        buf = np.zeros(1 << 20, dtype=np.uint8)
        assert s.register_buffer(int(buf.ctypes.data), buf.nbytes) == 0
        base = int(buf.ctypes.data)
        ptrs = [[base + (i * 4 + k) * 1024 for k in range(4)] for i in range(8)]
        sizes = [[1024] * 4 for _ in range(8)]
        dst = [[base + (512 << 10) + (i * 4 + k) * 1024 for k in range(4)] for i in range(8)]
        phases: dict[str, list[float]] = {"put": [], "get": [], "remove": []}
        n = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
            ks = [f"m{tag}-{n}-{i}" for i in range(8)]
            c0 = time.process_time()
            assert s.batch_put_from_multi_buffers(ks, ptrs, sizes) == [0] * 8
            c1 = time.process_time()
            assert s.batch_get_into_multi_buffers(ks, dst, sizes) == [4096] * 8
            c2 = time.process_time()
            assert s.batch_remove(ks, force=True) == [0] * 8
            c3 = time.process_time()
            phases["put"].append((c1 - c0) * 1e6)
            phases["get"].append((c2 - c1) * 1e6)
            phases["remove"].append((c3 - c2) * 1e6)
        for k, v in phases.items():
            res[f"multi batch {k} 8 x 4x1KiB"] = statistics.mean(v)
    finally:
        s.close()
    return res


def _worker(args: argparse.Namespace) -> None:
    os.environ["MC_FORCE_TCP"] = "1"
    res = _engine(args.seconds) if args.worker == "engine" else _store(args.master, args.seconds)
    print(json.dumps(res))


def _run(tree: Path, what: str, seconds: float, master: str = "") -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), MC_FORCE_TCP="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", what, "--seconds"]
    cmd += [str(seconds), "--master", master]
    res = subprocess.run(cmd, cwd=str(tree), env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"the {what} worker in {tree} failed:\n{res.stderr[-3000:]}")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--a", type=Path, required=False, default=Path("/work/main"))
    ap.add_argument("--b", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--worker", choices=["engine", "store"], help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    sys.path.insert(0, str(ROOT))
    from tests.helpers.store_procs import Master

    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order: list[tuple[str, Path]] = [("A", args.a), ("B", args.b)]
        for name, tree in order if r % 2 == 0 else order[::-1]:
            got: dict[str, Any] = _run(tree.resolve(), "engine", args.seconds)
            master = Master()
            try:
                got.update(_run(tree.resolve(), "store", args.seconds, master.address))
            finally:
                master.stop()
            runs[name].append(got)
    print(f"load average: {os.getloadavg()}")
    print(f"{'case (CPU us per op)':34s} {'A':>9s} {'B':>9s} {'B/A':>7s}")
    for case in runs["A"][0]:
        a = statistics.median(x[case] for x in runs["A"])
        b = statistics.median(x[case] for x in runs["B"])
        print(f"{case:34s} {a:9.1f} {b:9.1f} {100 * (b / a - 1):+6.1f}%")


if __name__ == "__main__":
    main()
