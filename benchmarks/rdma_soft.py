"""RDMA transport over the software verbs provider vs TCP loopback vs memcpy, in one run.

    python benchmarks/rdma_soft.py [--size-mib 64] [--rounds 5] [--json]

Starts a target engine in a child process per transport (``rdma`` over ``libmcsoftverbs.so``
with two fake NICs, then ``tcp``), writes and reads ``size`` bytes ``rounds`` times from an
engine in this process, and reports the best round's GB/s next to a single-threaded memcpy of
the same size. The soft provider moves bytes with process_vm_writev/readv inside
ibv_post_send, so its number is *our* per-slice overhead plus a kernel copy, not a NIC's.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


async def peer_main(size: int, transport: str) -> None:
    import mooncake

    async with mooncake.open_engine("127.0.0.1", transports=[transport]) as engine:
        buf = await engine.allocate(size)
        print(json.dumps({"segment": engine.segment_name, "addr": buf.addr}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


def memcpy_gbps(size: int, rounds: int) -> float:
    from mooncake import _fast

    a = mmap.mmap(-1, size)
    b = mmap.mmap(-1, size)
    pa = int(np.frombuffer(a, dtype=np.uint8).ctypes.data)
    pb = int(np.frombuffer(b, dtype=np.uint8).ctypes.data)
    _fast.prefault(pa, size)
    _fast.prefault(pb, size)
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        _fast.memcpy_at(pb, pa, size)
        best = max(best, size / (time.perf_counter() - t) / 1e9)
    return best


def start_peer(
    transport: str, size: int, env: dict[str, str]
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", transport, "--size-mib", str(size >> 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, **env),
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def stop_peer(proc: subprocess.Popen[str]) -> None:
    if proc.stdin:
        proc.stdin.close()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


async def run_transport(
    transport: str, info: dict[str, Any], size: int, rounds: int
) -> dict[str, float]:
    import mooncake
    from mooncake._core.transfer import TransferRequest as R

    async with mooncake.open_engine(transports=[transport]) as engine:
        buf = await engine.allocate(size)
        out: dict[str, float] = {}
        for name, req in (
            ("write", R.write(buf.addr, info["addr"], size)),
            ("read", R.read(buf.addr, info["addr"], size)),
        ):
            (res,) = await engine.transfer(info["segment"], [req])  # warm: connect, fault in
            assert res.ok, res
            best = 0.0
            for _ in range(rounds):
                t = time.perf_counter()
                (res,) = await engine.transfer(info["segment"], [req])
                dt = time.perf_counter() - t
                assert res.ok, res
                best = max(best, size / dt / 1e9)
            out[name] = best
        if transport == "rdma":
            st = engine.transports[0].stats  # type: ignore[attr-defined]
            out["wrs_posted"] = float(st["posted"])
        return out


def measure(transport: str, size: int, rounds: int, env: dict[str, str]) -> dict[str, float]:
    proc, info = start_peer(transport, size, env)
    try:
        return anyio.run(run_transport, transport, info, size, rounds, backend="trio")
    finally:
        stop_peer(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = args.size_mib << 20
    if args.peer:
        anyio.run(peer_main, size, args.peer, backend="trio")
        return
    with tempfile.TemporaryDirectory() as tmp:
        soft = {
            "MOONCAKE_IBVERBS": "soft",
            "MC_SOFTVERBS_FABRIC": os.path.join(tmp, "fabric"),
            "MC_SOFTVERBS_DEVICES": "soft0,soft1",
        }
        os.environ.update(soft)
        results = {
            "size_bytes": size,
            "memcpy_gbps": memcpy_gbps(size, args.rounds),
            "rdma_soft": measure("rdma", size, args.rounds, soft),
            "tcp_loopback": measure("tcp", size, args.rounds, {}),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"size {args.size_mib} MiB, best of {args.rounds} rounds (GB/s)")
    print(f"  memcpy (1 thread)        {results['memcpy_gbps']:.2f}")
    for k in ("rdma_soft", "tcp_loopback"):
        r = results[k]
        assert isinstance(r, dict)
        print(f"  {k:<24} write {r['write']:.2f}   read {r['read']:.2f}")


if __name__ == "__main__":
    main()
