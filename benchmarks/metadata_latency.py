"""Metadata backend latency: publish (register), lookup (refresh a peer), raw get.

    python benchmarks/metadata_latency.py --spawn            # starts http, etcd, redis itself
    python benchmarks/metadata_latency.py http://127.0.0.1:8080/metadata etcd://127.0.0.1:2379

Per backend: ``register`` of a 4 KiB region (engine-side work plus one descriptor PUT),
``peer(refresh=True)`` (two GETs plus validation), and a raw ``get`` of the descriptor key.
Prints p50/p99 in microseconds (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mooncake
from mooncake._engine.metadata import open_kv
from mooncake._engine.metadata.kv import KeyLayout


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def bench(conn: str, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"conn": conn}
    async with (
        mooncake.open_engine("127.0.0.1", conn, segment_name="bench-a") as a,
        mooncake.open_engine("127.0.0.1", conn, segment_name="bench-b") as b,
        open_kv(conn) as kv,
    ):
        import numpy as np

        arrays = [np.zeros(4096, dtype=np.uint8) for _ in range(n)]
        reg: list[float] = []
        for arr in arrays:
            t = time.perf_counter()
            await b.register(arr)
            reg.append(time.perf_counter() - t)
        look: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            await a.peer("bench-b", refresh=True)
            look.append(time.perf_counter() - t)
        key = KeyLayout().ram("bench-b")
        get: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            await kv.get(key)
            get.append(time.perf_counter() - t)
        for arr in arrays:
            await b.unregister(arr)
    for name, xs in (("register", reg), ("lookup", look), ("get", get)):
        out[name] = {
            "p50_us": round(statistics.median(xs) * 1e6, 1),
            "p99_us": round(pct(xs, 0.99) * 1e6, 1),
        }
    return out


@contextlib.contextmanager
def spawned() -> Iterator[list[str]]:
    from tests import services

    with (
        services.http_metadata_server() as url,
        services.etcd_cluster(1) as cluster,
        services.redis_server() as redis,
    ):
        yield [url, cluster.conn, redis]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("conns", nargs="*")
    ap.add_argument("--spawn", action="store_true", help="start http, etcd and redis servers")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with spawned() if args.spawn else contextlib.nullcontext(args.conns) as conns:
        results = [trio.run(bench, c, args.n) for c in conns]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'backend':<44} {'register p50/p99 us':>22} {'lookup p50/p99 us':>20} {'get p50/p99 us':>18}"
    )
    for r in results:
        cols = [f"{r[k]['p50_us']:.0f}/{r[k]['p99_us']:.0f}" for k in ("register", "lookup", "get")]
        print(f"{r['conn']:<44} {cols[0]:>22} {cols[1]:>20} {cols[2]:>18}")


if __name__ == "__main__":
    main()
