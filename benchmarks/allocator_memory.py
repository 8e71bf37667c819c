"""Bytes and nanoseconds per live allocation of the master's segment allocator.

For each count N (default 1 M and 10 M) a fresh child process fills one ``OffsetAllocator`` with
N extents of ``--size`` bytes, then frees them all (in address order), and reports:

* RSS growth per allocation (``/proc/self/statm`` before and after filling, the returned
  addresses not kept), and what the allocated-extent map says it holds (``memory_bytes()``
  when it is an ``IntMap``; for a dict, ``sys.getsizeof`` of the dict plus its key ints);
* ns per ``allocate`` and per ``free`` (wall clock over the whole loop, one thread), and per
  set / pop of the extent map alone (a fresh one, the same keys; loop overhead included).

Runs against whatever ``mooncake`` is importable (set ``PYTHONPATH`` to compare checkouts;
``MOONCAKE_NO_EXTENSIONS=1`` for the pure twin). Progress goes to stderr, one result line per
run to stdout.

    python benchmarks/allocator_memory.py [--counts 1000000 10000000] [--size 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(n: int, size: int) -> dict[str, float | int | str]:
    from mooncake._core.allocator import OffsetAllocator

    gc.disable()
    length = size  # one int object for every call, as a caller passing a constant does
    a = OffsetAllocator(0, n * size, alignment=64)
    rss0 = _rss()
    alloc = a.allocate
    t0 = time.perf_counter_ns()
    for _ in range(n):
        alloc(length)
    t1 = time.perf_counter_ns()
    rss1 = _rss()
    m = a._allocated
    if hasattr(m, "memory_bytes"):
        held = m.memory_bytes()
        kind = type(m).__module__ + "." + type(m).__name__
    else:  # the dict the allocator used before: table + one key int per entry
        held = sys.getsizeof(m) + sum(sys.getsizeof(k) for k in m)
        kind = "dict"
    print(f"  filled {n:,}: {(rss1 - rss0) / n:.1f} B/alloc RSS", file=sys.stderr, flush=True)
    free = a.free
    t2 = time.perf_counter_ns()
    for addr in range(0, n * size, size):
        free(addr)
    t3 = time.perf_counter_ns()
    assert a.allocations == 0 and a.free_blocks() == [(0, n * size)]
    # the map alone, same keys: what the extent map adds to each allocate / free
    mm = type(m)()
    t4 = time.perf_counter_ns()
    for addr in range(0, n * size, size):
        mm[addr] = length
    t5 = time.perf_counter_ns()
    pop = mm.pop
    for addr in range(0, n * size, size):
        pop(addr, None)
    t6 = time.perf_counter_ns()
    return {
        "n": n,
        "map": kind,
        "rss_bytes_per_alloc": round((rss1 - rss0) / n, 2),
        "held_bytes_per_alloc": round(held / n, 2),
        "allocate_ns": round((t1 - t0) / n, 1),
        "free_ns": round((t3 - t2) / n, 1),
        "map_set_ns": round((t5 - t4) / n, 1),
        "map_pop_ns": round((t6 - t5) / n, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3, help="runs per count (medians reported)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.size)))
        return
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    for n in args.counts:
        runs = []
        for r in range(args.repeat):
            print(f"N={n:,} run {r + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(n), "--size", str(args.size)],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            ).stdout
            runs.append(json.loads(out))
        med = {
            k: (statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else v)
            for k, v in runs[0].items()
        }
        print(json.dumps(med), flush=True)
    print(f"load average: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
