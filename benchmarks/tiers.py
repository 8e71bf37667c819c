"""Tiers: get latency and throughput per tier, and policy hit rates on a trace through the store.

Part 1, ``latency``: ``--count`` gets of objects of each ``--sizes`` from

* ``dram-local``: a store client reading an object in its own segment (memcpy path);
* ``dram-remote``: a second client (no segment; ``MC_STORE_MEMCPY=0`` so it cannot map the
  first one's memory) reading over the transfer engine's TCP transport from the first;
* ``ssd-direct`` / ``ssd-buffered``: the SSD tier (:mod:`mooncake._store.ssd`) in ``--ssd-dir``
  with ``O_DIRECT`` (device reads) and with buffered I/O (page-cache reads once warm);
* ``ssd-store``: ``store.get`` of objects the master demoted to the client's SSD tier (RPC +
  verified SSD read; ``O_DIRECT`` where supported, no promotion).

One master (in-process, real sockets), both clients and the tier run in this process on trio.
Latency per get is wall time from call to verified bytes; throughput is size / mean latency
(one get in flight).

Part 2, ``trace``: replays the first ``--requests`` requests of a FAST'25 Mooncake trace
(``hash_ids`` are prefix blocks; each block a ``--block``-byte object) through the real store
for each policy and each segment capacity (fraction of the distinct blocks): per request a
``get_batch`` of its blocks; the blocks before the first miss are prefix hits, the missing ones
are put back with ``put_batch``. The master evicts with the policy under test above its high
watermark; leases are shortened to 50 ms so recently read blocks stay evictable. Reports the
prefix hit ratio (blocks hit / blocks requested). With ``--ssd-multiple M`` the client also has
an SSD tier of M times the DRAM capacity (same policy, no promotion): DRAM evictions are
demoted to it and prefix blocks found only there count as hits (``from ssd``).

    python benchmarks/tiers.py --json tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import trio  # noqa: E402

from mooncake._core.master import MasterConfig  # noqa: E402
from mooncake._store.client import Store, open_store  # noqa: E402
from mooncake._store.master import MasterServerConfig, serve_master  # noqa: E402
from mooncake._store.ssd import open_ssd_tier  # noqa: E402
from mooncake.errors import MooncakeError  # noqa: E402

MIB = 1 << 20


@asynccontextmanager
async def running_master(state: MasterConfig) -> AsyncIterator[str]:
    cfg = MasterServerConfig(rpc_port=0, enable_metric_reporting=False, state=state)
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield f"127.0.0.1:{server.rpc_port}"
        tg.cancel_scope.cancel()


def summarize(lat: list[float], size: int) -> dict[str, float]:
    lat.sort()
    mean = statistics.fmean(lat)
    return {
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "mean_us": mean * 1e6,
        "MBps": size / mean / 1e6,
    }


async def time_gets(get: Any, keys: list[str], expect: dict[str, bytes]) -> list[float]:
    lat = []
    for k in keys:
        t0 = time.perf_counter()
        got = await get(k)
        lat.append(time.perf_counter() - t0)
        if got != expect[k]:
            raise AssertionError(f"wrong bytes for {k}")
    return lat


async def bench_latency(sizes: list[int], count: int, ssd_dir: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    biggest = max(sizes)
    seg = max(64 * MIB, 4 * biggest * 16)
    async with (
        running_master(MasterConfig(seed=1)) as addr,
        open_store(addr, segment_size=seg, local_buffer_size=seg) as a,
    ):
        os.environ["MC_STORE_MEMCPY"] = "0"
        try:
            remote_cm = open_store(addr, segment_size=0, local_buffer_size=4 * biggest)
            b: Store = await remote_cm.__aenter__()
        finally:
            os.environ.pop("MC_STORE_MEMCPY", None)
        try:
            for size in sizes:
                nkeys = max(1, min(16, (seg // 2) // max(size, 1) // 2))
                values = {f"o{size}-{i}": os.urandom(size) for i in range(nkeys)}
                for k, v in values.items():
                    await a.put(k, v)
                keys = [f"o{size}-{i % nkeys}" for i in range(count)]
                await time_gets(a.get, keys[:nkeys], values)  # warm
                rows.append(
                    {"tier": "dram-local", "size": size}
                    | summarize(await time_gets(a.get, keys, values), size)
                )
                await time_gets(b.get, keys[:nkeys], values)
                rows.append(
                    {"tier": "dram-remote", "size": size}
                    | summarize(await time_gets(b.get, keys, values), size)
                )
                for k in values:
                    await a.remove(k, force=True)
                for direct in (True, False):
                    with tempfile.TemporaryDirectory(dir=ssd_dir) as d:
                        async with open_ssd_tier(d, 1 << 34, direct_io=direct) as tier:
                            for k, v in values.items():
                                await tier.put(k, v)
                            await time_gets(tier.get, keys[:nkeys], values)
                            rows.append(
                                {
                                    "tier": "ssd-direct" if direct else "ssd-buffered",
                                    "size": size,
                                }
                                | summarize(await time_gets(tier.get, keys, values), size)
                            )
                for r in rows[-4:]:
                    print(
                        f"{r['tier']:>13} {r['size']:>9} B  p50 {r['p50_us']:9.1f} us  "
                        f"p99 {r['p99_us']:9.1f} us  {r['MBps']:9.1f} MB/s",
                        flush=True,
                    )
        finally:
            await remote_cm.__aexit__(None, None, None)
    return rows


async def bench_ssd_store(sizes: list[int], count: int, ssd_dir: str) -> list[dict[str, Any]]:
    """Gets through the store of objects the master demoted to this client's SSD tier."""
    rows: list[dict[str, Any]] = []
    for size in sizes:
        seg = max(4 * MIB, 8 * size)
        with tempfile.TemporaryDirectory(dir=ssd_dir) as d:
            async with (
                running_master(MasterConfig(seed=1, default_kv_lease_ttl=0.01)) as addr,
                open_store(
                    addr,
                    segment_size=seg,
                    local_buffer_size=seg,
                    ssd_path=d,
                    ssd_capacity=1 << 34,
                    promotion="never",
                ) as s,
            ):
                n = 3 * seg // size  # three segments' worth: most end up on SSD
                values = {f"o{size}-{i}": os.urandom(size) for i in range(min(n, 64))}
                for i in range(n):
                    k = f"o{size}-{i % len(values)}" if i < len(values) else f"f{size}-{i}"
                    await s.put(k, values.get(k, values[f"o{size}-0"]))
                on_ssd = []
                for k in values:
                    resp, _ = await s._query(k, for_read=False)
                    if not resp.replicas and resp.disk_clients:
                        on_ssd.append(k)
                if not on_ssd:
                    print(f"  ssd-store {size}: nothing was demoted", flush=True)
                    continue
                keys = [on_ssd[i % len(on_ssd)] for i in range(count)]
                lat = await time_gets(s.get, keys, values)
                row = {"tier": "ssd-store", "size": size} | summarize(lat, size)
                assert s.ssd is not None
                row["direct_io"] = s.ssd.direct_io
                rows.append(row)
                print(
                    f"{row['tier']:>13} {size:>9} B  p50 {row['p50_us']:9.1f} us  "
                    f"p99 {row['p99_us']:9.1f} us  {row['MBps']:9.1f} MB/s",
                    flush=True,
                )
    return rows


def load_trace(path: str, n: int) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["hash_ids"])
            if len(out) >= n:
                break
    return out


async def replay(
    trace: list[list[int]],
    policy: str,
    capacity_blocks: int,
    block: int,
    ssd_blocks: int = 0,
    ssd_dir: str = "",
) -> dict[str, Any]:
    state = MasterConfig(seed=1, eviction_policy=policy, default_kv_lease_ttl=0.05)
    # The segment is the DRAM capacity; the master keeps it under its high watermark.
    seg = capacity_blocks * block
    payload = bytes(block)
    hits = requested = put_fail = 0
    tmp = tempfile.TemporaryDirectory(dir=ssd_dir or None) if ssd_blocks else None
    ssd_kw: dict[str, Any] = {}
    if tmp is not None:
        # header block + one payload block per object on SSD
        ssd_kw = dict(
            ssd_path=tmp.name,
            ssd_capacity=ssd_blocks * (block + 4096),
            ssd_policy=policy,
            promotion="never",
            ssd_sync=False,
        )
    async with (
        running_master(state) as addr,
        open_store(addr, segment_size=seg, local_buffer_size=max(seg, 4 * MIB), **ssd_kw) as s,
    ):
        for blocks in trace:
            keys = [f"b{h}" for h in blocks]
            got = await s.get_batch(keys)
            prefix = 0
            for g in got:
                if isinstance(g, MooncakeError):
                    break
                prefix += 1
            hits += prefix
            requested += len(keys)
            missing = [k for k, g in zip(keys, got, strict=True) if isinstance(g, MooncakeError)]
            if missing:
                errs = await s.put_batch(missing, [payload] * len(missing))
                put_fail += sum(e is not None for e in errs)
        ssd_hits = s.ssd.counters.hits if s.ssd is not None else 0
    if tmp is not None:
        tmp.cleanup()
    return {
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "ssd_blocks": ssd_blocks,
        "ssd_hits": ssd_hits,
        "hit_ratio": hits / requested,
        "requested": requested,
        "put_failures": put_fail,
    }


async def bench_trace(
    path: str,
    n: int,
    block: int,
    policies: list[str],
    fractions: list[float],
    ssd_multiple: float = 0.0,
    ssd_dir: str = "",
) -> list[dict[str, Any]]:
    trace = load_trace(path, n)
    distinct = len({h for r in trace for h in r})
    rows = []
    for frac in fractions:
        cap = max(16, int(distinct * frac))
        for policy in policies:
            t0 = time.perf_counter()
            ssd_blocks = int(cap * ssd_multiple)
            r = await replay(trace, policy, cap, block, ssd_blocks, ssd_dir)
            r["fraction"] = frac
            r["distinct_blocks"] = distinct
            r["seconds"] = time.perf_counter() - t0
            rows.append(r)
            print(
                f"capacity {frac:5.0%} ({cap} blocks)  ssd {ssd_blocks:6d} blocks  {policy:>10}  "
                f"hit {r['hit_ratio']:.3f}  from ssd {r['ssd_hits'] / r['requested']:.3f}  "
                f"put failures {r['put_failures']}  ({r['seconds']:.1f} s)",
                flush=True,
            )
    return rows


async def main(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }
    if "latency" in args.parts:
        out["latency"] = await bench_latency(args.sizes, args.count, args.ssd_dir)
        out["latency"] += await bench_ssd_store(args.sizes, args.count, args.ssd_dir)
    if "trace" in args.parts:
        out["trace"] = await bench_trace(
            args.trace,
            args.requests,
            args.block,
            args.policies,
            args.fractions,
            args.ssd_multiple,
            args.ssd_dir,
        )
    if args.json:
        await anyio.Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["latency", "trace"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--ssd-dir", default=str(ROOT / "build"))
    ap.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--policies", nargs="+", default=["lru", "fifo", "lfu", "sieve", "s3fifo"])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument(
        "--ssd-multiple",
        type=float,
        default=0.0,
        help="give the client an SSD tier of this many times the DRAM capacity (0: none)",
    )
    ap.add_argument("--json", default="")
    trio.run(main, ap.parse_args())
