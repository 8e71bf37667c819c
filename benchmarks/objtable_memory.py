#!/usr/bin/env python3
"""Memory and speed of the master's object table (``mooncake._fast.ObjectTable``).

Fills a table with ``--keys`` keys of ``--key-bytes`` bytes, each with a cold row and a place
in the recency list (the common shape of a stored object), and prints, per million keys and
at the end: the table's own buffers per key (``memory_bytes() / len``) and the growth of the
process's resident set per key. Then the median nanoseconds per ``find``, ``add``, ``cold_row``
and ``lru_touch`` called from Python (over ``--repeats`` runs of ``--ops`` calls), and the time
of ``state()`` and ``from_state()`` of the whole table.

Usage: ``python benchmarks/objtable_memory.py [--keys 1000000] [--pure] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def key(i: int, width: int) -> str:
    s = f"obj/{i}/"
    return s + "k" * (width - len(s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--key-bytes", type=int, default=40)
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pure", action="store_true", help="the pure-Python twin")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.pure:
        from mooncake._fast._objtable_pure import COMPILED, ObjectTable
    else:
        from mooncake._fast import OBJTABLE_COMPILED as COMPILED
        from mooncake._fast import ObjectTable

    gc.collect()
    base = rss()
    t = ObjectTable()
    t0 = time.perf_counter()
    w = a.key_bytes
    for i in range(a.keys):
        h = t.add(key(i, w))
        t.set_cold(h, i & 63, i << 12, 4096, i, 1e9, 1e9, i & 1023)
        t.lru_push(h, 4096)
        if (i + 1) % 1_000_000 == 0:
            n = i + 1
            print(
                f"{n:>11,} keys: table {t.memory_bytes() / n:6.1f} B/key, "
                f"RSS +{(rss() - base) / n:6.1f} B/key, {time.perf_counter() - t0:6.1f} s",
                flush=True,
            )
    gc.collect()
    n = len(t)
    out: dict[str, Any] = {
        "compiled": COMPILED,
        "keys": n,
        "key_bytes": w,
        "table_bytes_per_key": t.memory_bytes() / n,
        "rss_bytes_per_key": (rss() - base) / n,
        "fill_s": time.perf_counter() - t0,
    }
    print(
        f"{n:,} keys of {w} B (compiled={COMPILED}): table {out['table_bytes_per_key']:.1f} "
        f"B/key, RSS +{out['rss_bytes_per_key']:.1f} B/key"
    )

    m = min(a.ops, n)
    probe = [key(i * (n // m), w) for i in range(m)]
    hs = [t.find(k) for k in probe]
    fresh = [key(n + i, w) for i in range(m)]
    runs: dict[str, list[float]] = {"find": [], "add": [], "cold_row": [], "lru_touch": []}
    for _ in range(a.repeats):
        find, cold_row, touch = t.find, t.cold_row, t.lru_touch
        s = time.perf_counter_ns()
        for k in probe:
            find(k)
        runs["find"].append((time.perf_counter_ns() - s) / m)
        s = time.perf_counter_ns()
        for h in hs:
            cold_row(h)
        runs["cold_row"].append((time.perf_counter_ns() - s) / m)
        s = time.perf_counter_ns()
        for h in hs:
            touch(h)
        runs["lru_touch"].append((time.perf_counter_ns() - s) / m)
        add = t.add
        s = time.perf_counter_ns()
        added = [add(k) for k in fresh]
        runs["add"].append((time.perf_counter_ns() - s) / m)
        for h in added:
            t.remove(h)
    for op, xs in runs.items():
        out[f"{op}_ns"] = statistics.median(xs)
        print(f"{op:>10}: {out[f'{op}_ns']:7.0f} ns (median of {a.repeats} x {m:,})")
    del probe, fresh, hs
    s = time.perf_counter_ns()
    st = t.state()
    out["state_s"] = (time.perf_counter_ns() - s) / 1e9
    del t
    gc.collect()
    s = time.perf_counter_ns()
    t = ObjectTable.from_state(st)
    assert len(t) == n
    out["from_state_s"] = (time.perf_counter_ns() - s) / 1e9
    print(f"state(): {out['state_s']:.2f} s, from_state(): {out['from_state_s']:.2f} s")
    out["loadavg"] = os.getloadavg()[0]
    print(f"load average {out['loadavg']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
