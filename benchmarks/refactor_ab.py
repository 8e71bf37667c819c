#!/usr/bin/env python3
"""Two source trees side by side on the paths a refactor of the engine and the store's
caller-thread path touches: the same operations timed in tree A and tree B, interleaved round by
round (each round runs A then B, or B then A, in fresh processes), so load drifts hit both.

Cases (all in-process, loopback, ``MC_FORCE_TCP=1``):

* ``engine tcp 4KiB x1`` / ``engine tcp 4KiB x64``: ``await engine.transfer`` between two
  engines (validate, peer, pin, route, execute);
* ``engine local 4KiB x1``: a transfer to the engine's own segment (the local copy path);
* ``store put/get 4KiB``: the sync facade's ``put`` + ``get`` (the caller-thread fast path);
* ``store multi put/get/remove``: ``batch_put_from_multi_buffers`` +
  ``batch_get_into_multi_buffers`` + ``batch_remove`` of 8 keys of 4 x 1 KiB parts (the fast
  path's multi-part batches);
* ``tensor upsert/get 64KiB`` (the staged route) and ``tensor put/get/remove 64KiB`` (the
  direct route): a float32 tensor.

Printed per case: the median over rounds of each tree's median microseconds per operation, wall
clock and process CPU time (all threads of the client process; not the master's, and not the
time spent waiting for a core), Python function calls per operation (``sys.setprofile``: a
count the host's load does not change), and B against A in percent. Run ``--b`` equal to ``--a`` to see
the noise floor of the host.

    python benchmarks/refactor_ab.py --a /work/main --b . --rounds 5 --seconds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


_CALLS = [0]


def _count(frame: Any, event: str, arg: Any) -> None:
    if event == "call":
        _CALLS[0] += 1


def _calls_per_op(run: Callable[[], Any], n: int = 200) -> float:
    """Python-level function calls (``sys.setprofile`` "call" events, every thread started
    after this) per operation: a count that load does not change."""
    import threading

    _CALLS[0] = 0
    threading.setprofile(_count)
    sys.setprofile(_count)
    try:
        for _ in range(n):
            run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return _CALLS[0] / n


def _timed(fn: Callable[[], Any], seconds: float) -> tuple[float, float, float]:
    """Median wall and process-CPU microseconds per call of ``fn`` (batches of 20 calls, for
    ``seconds``). CPU time counts every thread of this process (the store's loop thread too)
    and not the time spent waiting for a core, so it is the steadier number on a loaded host."""
    for _ in range(20):
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(20):
            fn()
        wall.append((time.perf_counter() - t0) / 20 * 1e6)
        cpu.append((time.process_time() - c0) / 20 * 1e6)
    return statistics.median(wall), statistics.median(cpu), _calls_per_op(fn)


async def _async_timed(fn: Callable[[], Any], seconds: float) -> tuple[float, float, float]:
    for _ in range(20):
        await fn()
    wall: list[float] = []
    cpu: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(20):
            await fn()
        wall.append((time.perf_counter() - t0) / 20 * 1e6)
        cpu.append((time.process_time() - c0) / 20 * 1e6)
    _CALLS[0] = 0
    sys.setprofile(_count)
    try:
        for _ in range(200):
            await fn()
    finally:
        sys.setprofile(None)
    return statistics.median(wall), statistics.median(cpu), _CALLS[0] / 200


def _engine_cases(seconds: float) -> dict[str, tuple[float, float, float]]:
    import anyio

    from mooncake._core.transfer import Opcode, TransferRequest
    from mooncake._engine.engine import open_engine

    out: dict[str, tuple[float, float, float]] = {}

    async def main() -> None:
        async with (
            open_engine("127.0.0.1", transports=["tcp"]) as a,
            open_engine("127.0.0.1", transports=["tcp"]) as b,
        ):
            la = await a.allocate(1 << 20)
            lb = await b.allocate(1 << 20)
            one = [TransferRequest(Opcode.WRITE, la.addr, lb.addr, 4096)]
            many = [
                TransferRequest(Opcode.WRITE, la.addr + i * 4096, lb.addr + i * 4096, 4096)
                for i in range(64)
            ]
            own = [TransferRequest(Opcode.WRITE, la.addr, la.addr + (512 << 10), 4096)]
            seg = b.segment_name
            out["engine tcp 4KiB x1"] = await _async_timed(lambda: a.transfer(seg, one), seconds)
            out["engine tcp 4KiB x64"] = await _async_timed(lambda: a.transfer(seg, many), seconds)
            out["engine local 4KiB x1"] = await _async_timed(
                lambda: a.transfer(a.segment_name, own), seconds
            )

    anyio.run(main)
    return out


def _store_cases(master: str, seconds: float) -> dict[str, tuple[float, float, float]]:
    import numpy as np

    from mooncake.store import MooncakeDistributedStore

    out: dict[str, tuple[float, float, float]] = {}
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    try:
        tag = f"{os.getpid()}"
        value = b"x" * 4096

        def put_get() -> None:
            s.put(f"ab-{tag}", value)
            s.get(f"ab-{tag}")

        s.put(f"ab-{tag}", value)
        out["store put/get 4KiB"] = _timed(put_get, seconds)

        buf = np.zeros(1 << 20, dtype=np.uint8)
        assert s.register_buffer(int(buf.ctypes.data), buf.nbytes) == 0
        base = int(buf.ctypes.data)
        keys = [f"abm-{tag}-{i}" for i in range(8)]
        ptrs = [[base + (i * 4 + j) * 1024 for j in range(4)] for i in range(8)]
        sizes = [[1024] * 4 for _ in range(8)]
        dst = [[base + (512 << 10) + (i * 4 + j) * 1024 for j in range(4)] for i in range(8)]
        n = [0]

        def multi() -> None:
            n[0] += 1
            ks = [f"{k}-{n[0]}" for k in keys]
            codes = s.batch_put_from_multi_buffers(ks, ptrs, sizes)
            assert codes == [0] * 8, codes
            got = s.batch_get_into_multi_buffers(ks, dst, sizes)
            assert got == [4096] * 8, got
            s.batch_remove(ks, force=True)

        out["store multi put/get/remove 8 x 4x1KiB"] = _timed(multi, seconds)
        try:
            import torch
        except ImportError:
            return out
        t2 = torch.arange(16384, dtype=torch.float32)
        m = [0]

        def tensor_put() -> None:
            m[0] += 1
            rc = s.put_tensor(f"abp-{tag}-{m[0]}", t2)
            assert rc == 0, rc
            assert s.get_tensor(f"abp-{tag}-{m[0]}") is not None
            s.remove(f"abp-{tag}-{m[0]}", force=True)

        out["tensor put/get/remove 64KiB (direct)"] = _timed(tensor_put, seconds)
        t = torch.arange(16384, dtype=torch.float32)

        def tensor() -> None:
            assert s.upsert_tensor(f"abt-{tag}", t) == 0
            assert s.get_tensor(f"abt-{tag}") is not None

        out["tensor upsert/get 64KiB"] = _timed(tensor, seconds)
        # last: each upsert leaves the old version until its read lease ends
    finally:
        s.close()
    return out


def _worker(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    os.environ["MC_FORCE_TCP"] = "1"
    out = _engine_cases(args.seconds)
    out.update(_store_cases(args.master, args.seconds))
    print(json.dumps(out))


def _run_tree(tree: Path, master: str, seconds: float) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(tree), MC_FORCE_TCP="1")
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--master",
            master,
            "--seconds",
            str(seconds),
        ],
        cwd=str(tree),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise SystemExit(
            f"the worker in {tree} failed (rc={res.returncode}):\n{res.stderr[-3000:]}"
        )
    data: dict[str, list[float]] = json.loads(res.stdout.strip().splitlines()[-1])
    return data


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--a", type=Path, default=Path("/work/main"), help="tree A (before)")
    ap.add_argument("--b", type=Path, default=ROOT, help="tree B (after)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    sys.path.insert(0, str(ROOT))
    from tests.helpers.store_procs import Master

    a_runs: list[dict[str, list[float]]] = []
    b_runs: list[dict[str, list[float]]] = []
    for r in range(args.rounds):
        order = [("a", args.a), ("b", args.b)]
        if r % 2:
            order.reverse()
        for name, tree in order:
            master = Master()  # a fresh master per run: no state carried between runs
            try:
                got = _run_tree(tree.resolve(), master.address, args.seconds)
            finally:
                master.stop()
            (a_runs if name == "a" else b_runs).append(got)
    print(f"load average: {os.getloadavg()}")
    head = [f"{'A ' + k:>8s} {'B ' + k:>8s} {'B/A':>7s}" for k in ("wall", "cpu", "calls")]
    print(f"{'case':40s} " + " ".join(head))
    for case in a_runs[0]:
        row = [f"{case:40s}"]
        for k in (0, 1, 2):
            a = statistics.median(x[case][k] for x in a_runs)
            b = statistics.median(x[case][k] for x in b_runs)
            row.append(f"{a:8.1f} {b:8.1f} {100 * (b / a - 1):+6.1f}%")
        print(" ".join(row))


if __name__ == "__main__":
    main()
