"""Metrics overhead: 4 KiB x 1 p50 with the engine's metrics on and off, in the same run.

A peer engine runs in a child process; this process writes (and reads) 4 KiB to it through the
sync facade (``TransferEngine.transfer_sync_write``, which takes the caller-thread path after
the first call) and through the async engine (``Engine.transfer`` on the loop). Blocks of 50 ops
alternate metrics on (``engine.metrics`` set) and off (``engine.metrics = None``) so both see
the same machine load; the result is the median over rounds of each round's p50 per state, and
the on/off ratio.

    .venv/bin/python benchmarks/metrics_overhead.py --rounds 7 --ops 3000 [--transport tcp|shm]
        [--store]  # also MooncakeDistributedStore.get of 4 KiB (the store client's metrics)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PEER = r"""
import anyio, json, sys
from mooncake._engine.engine import open_engine
async def main():
    async with open_engine("127.0.0.1", transports=sys.argv[1].split(",")) as e:
        b = await e.allocate(1 << 20)
        print(json.dumps({"segment": e.segment_name, "addr": b.addr}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)
anyio.run(main)
"""


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def store_rounds(a: argparse.Namespace, block: int) -> dict[str, list[float]]:
    """4 KiB ``MooncakeDistributedStore.get`` (the caller-thread fast path, own-segment
    replica) with the store client's metrics on and off."""
    from mooncake.store import MooncakeDistributedStore

    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--no-metrics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert master.stdout is not None
    addr = master.stdout.readline().split("rpc=", 1)[1].split()[0]
    s = MooncakeDistributedStore()
    out: dict[str, list[float]] = {"on": [], "off": []}
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
        assert s.put("bench", b"x" * 4096) == 0
        assert s._store is not None
        saved = s._store.metrics
        for _ in range(a.rounds):
            lat: dict[str, list[float]] = {"on": [], "off": []}
            for b in range(a.ops // block):
                state = "on" if b % 2 == 0 else "off"
                s._store.metrics = saved if state == "on" else None
                for _ in range(block):
                    t0 = time.perf_counter()
                    s.get("bench")
                    lat[state].append(time.perf_counter() - t0)
            for state in ("on", "off"):
                out[state].append(p50(lat[state]))
        s._store.metrics = saved
    finally:
        s.close()
        master.terminate()
        master.wait(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--store", action="store_true", help="also 4 KiB store gets (fast path)")
    a = ap.parse_args()
    os.environ["MOONCAKE_TRANSPORTS"] = a.transport
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, a.transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert peer.stdout is not None and peer.stdin is not None
    info = json.loads(peer.stdout.readline())
    from mooncake._core.transfer import Opcode, TransferRequest
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    loop, eng = te._e()
    saved = eng.metrics
    local = te.allocate_managed_buffer(1 << 20)
    seg, remote = info["segment"], info["addr"]
    reqs = [TransferRequest(Opcode.WRITE, local, remote, 4096)]

    block = 50  # ops per block; blocks alternate on/off so both see the same load drift

    def sync_round() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"on": [], "off": []}
        for b in range(a.ops // block):
            state = "on" if b % 2 == 0 else "off"
            eng.metrics = saved if state == "on" else None
            lat = out[state]
            for _ in range(block):
                t0 = time.perf_counter()
                te.transfer_sync_write(seg, local, remote, 4096)
                lat.append(time.perf_counter() - t0)
        return out

    async def loop_round() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"on": [], "off": []}
        for b in range(a.ops // block):
            state = "on" if b % 2 == 0 else "off"
            eng.metrics = saved if state == "on" else None
            lat = out[state]
            for _ in range(block):
                t0 = time.perf_counter()
                await eng.transfer(seg, reqs)
                lat.append(time.perf_counter() - t0)
        return out

    res: dict[str, dict[str, list[float]]] = {
        "sync": {"on": [], "off": []},
        "loop": {"on": [], "off": []},
    }
    try:
        sync_round()  # connect, warm up
        for _ in range(a.rounds):
            for path, got in (("sync", sync_round()), ("loop", loop.call(loop_round))):
                for state in ("on", "off"):
                    res[path][state].append(p50(got[state]))
    finally:
        eng.metrics = saved
        te.close()
        peer.stdin.close()
        peer.wait(10)
    if a.store:
        res["store_get"] = store_rounds(a, block)
    summary = {
        path: {
            "on_p50_us": statistics.median(v["on"]),
            "off_p50_us": statistics.median(v["off"]),
            "ratio": statistics.median(v["on"]) / statistics.median(v["off"]),
        }
        for path, v in res.items()
    }
    summary["load"] = {"loadavg": os.getloadavg()[0]}  # type: ignore[dict-item]
    if a.json:
        print(json.dumps(summary))
    else:
        for path in res:
            s = summary[path]
            print(
                f"{a.transport if path != 'store_get' else 'memcpy'} {path}: 4 KiB p50 on {s['on_p50_us']:.1f} us, "
                f"off {s['off_p50_us']:.1f} us, on/off {s['ratio']:.3f}"
            )
        print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
