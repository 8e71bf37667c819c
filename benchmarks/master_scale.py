"""The master's state machine at scale, in process: memory and call times from 10 k to 10 M objects.

For each size N (``--objects``, default 10k,1M): a fresh :class:`MasterState` with one segment
sized so that the N objects of ``--size`` bytes (4 KiB) fill it to just under the eviction
watermark, then

* PutStart+PutEnd of the N objects (keys ~40 characters, as a KV-cache block hash): the rate,
  and the RSS growth per object (process RSS from ``/proc``, after a collection);
* ``get_replica_list`` and ``exist_key`` of random existing keys: rate, p50 and p99 of single
  calls (``--probes`` each);
* eviction of ``eviction_ratio`` (5 %) of the capacity: puts past the watermark, then sweeps
  until the run is done; the longest single call (put or sweep) is the "max stall";
* ``snapshot()`` size and time, ``restore()`` time (and that the restored state answers the
  same for a few keys).

The state is driven as the master process drives it: each call is followed by ``settle()``
(the objects a call touched fold back into the compact object table), and automatic full
collections are off once the segment is mounted (``--default-gc`` leaves them on).

Prints progress to stderr and a table to stdout; ``--json PATH`` writes the rows. The numbers are
of one Python process (the compiled build: ``build_ext --inplace`` first); the machine's load
average is printed beside them.

    python benchmarks/master_scale.py --objects 10k,1M,10M --json master_scale.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mooncake._cli.master import _no_full_collections  # noqa: E402
from mooncake._core.master import MasterConfig, MasterState  # noqa: E402
from mooncake._core.store_types import ReplicateConfig, Segment  # noqa: E402

CFG = ReplicateConfig()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def key(i: int) -> str:
    return f"kvcache/llama-70b/blk/{i:018d}"  # 40 characters


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def progress(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def out_table(m: MasterState, n: int) -> str:
    from mooncake._fast import OBJTABLE_COMPILED

    if not OBJTABLE_COMPILED:
        return "pure-Python twin (build the extension for the compact table)"
    return f"{m._objects.table.memory_bytes() / n:,.0f} B/object"


def run(n: int, size: int, probes: int, server_gc: bool) -> dict[str, Any]:
    wm = 0.9
    cap = int(n * size / (wm - 0.0005)) // 4096 * 4096 + 4096
    m = MasterState(MasterConfig(seed=1, offload_on_evict=False))
    m.mount_segment("bench", Segment(id="s", name="127.0.0.1:9", base=1 << 40, size=cap), 0.0)
    gc.collect()
    if server_gc:  # as the master process runs: no automatic full collections
        _no_full_collections()
    r0 = rss()
    t0 = time.perf_counter()
    step = max(1, n // 10)
    for i in range(n):
        k = key(i)
        m.put_start("bench", k, size, CFG, 1.0)
        m.settle()
        m.put_end("bench", k, 1.0)
        m.settle()
        if (i + 1) % step == 0:
            el = time.perf_counter() - t0
            progress(
                f"{n:,}: {i + 1:,} objects put, {(i + 1) / el:,.0f}/s, "
                f"RSS +{(rss() - r0) / (i + 1):,.0f} B/object"
            )
    put_s = time.perf_counter() - t0
    gc.collect()
    per_obj = (rss() - r0) / n
    out: dict[str, Any] = {
        "objects": n,
        "rss_mib": rss() / (1 << 20),
        "bytes_per_object": per_obj,
        "put_pairs_per_s": n / put_s,
        "hot_records": len(m._objects.hot),
        "table_bytes_per_object": m._objects.table.memory_bytes() / n,
    }
    progress(
        f"{n:,}: {per_obj:,.0f} B/object RSS, object table {out_table(m, n)}, "
        f"{len(m._objects.hot):,} hot records"
    )
    rng = random.Random(2)
    sample = [key(rng.randrange(n)) for _ in range(probes)]
    for name, call in (
        ("get_replica_list", lambda k: (m.get_replica_list(k, 2.0), m.settle())),
        ("exist_key", lambda k: (m.exist_key(k, 2.0), m.settle())),
    ):
        lat = []
        t0 = time.perf_counter()
        for k in sample:
            t = time.perf_counter()
            call(k)
            lat.append(time.perf_counter() - t)
        total = time.perf_counter() - t0
        out[f"{name}_per_s"] = probes / total
        out[f"{name}_p50_us"] = pct(lat, 0.5) * 1e6
        out[f"{name}_p99_us"] = pct(lat, 0.99) * 1e6
    progress(f"{n:,}: lookups done")
    # eviction: puts past the watermark start a run of eviction_ratio of the capacity; the
    # sweeps finish it (the leases the lookups above granted end at 12 s)
    now = 20.0
    worst = 0.0
    before = m.stats.evicted_objects
    i = n
    t_ev = time.perf_counter()
    while not m.evicting and i < n + n // 10 + 10:
        k = key(i)
        t = time.perf_counter()
        m.put_start("bench", k, size, CFG, now)
        m.settle()
        m.put_end("bench", k, now)
        m.settle()
        worst = max(worst, time.perf_counter() - t)
        i += 1
    rounds = 0
    while m.evicting:
        now += 0.05
        m.ping("bench", now)
        t = time.perf_counter()
        m.sweep(now)
        worst = max(worst, time.perf_counter() - t)
        rounds += 1
    out["evicted"] = m.stats.evicted_objects - before
    out["evict_rounds"] = rounds
    out["evict_total_s"] = time.perf_counter() - t_ev
    out["evict_max_stall_ms"] = worst * 1e3
    progress(f"{n:,}: evicted {out['evicted']:,} in {rounds} rounds")
    gc.collect()
    t0 = time.perf_counter()
    data = m.snapshot()
    out["snapshot_s"] = time.perf_counter() - t0
    out["snapshot_mib"] = len(data) / (1 << 20)
    out["snapshot_bytes_per_object"] = len(data) / max(1, len(m._objects))
    progress(f"{n:,}: snapshot {out['snapshot_mib']:.0f} MiB")
    t0 = time.perf_counter()
    r = MasterState.restore(data)
    out["restore_s"] = time.perf_counter() - t0
    for k in sample[:100]:
        assert r.exist_key(k, now) == m.exist_key(k, now)
    progress(f"{n:,}: restored in {out['restore_s']:.1f} s")
    return out


COLUMNS = [
    ("objects", "{:,}"),
    ("rss_mib", "{:,.0f}"),
    ("bytes_per_object", "{:,.0f}"),
    ("put_pairs_per_s", "{:,.0f}"),
    ("get_replica_list_per_s", "{:,.0f}"),
    ("get_replica_list_p50_us", "{:.1f}"),
    ("get_replica_list_p99_us", "{:.1f}"),
    ("exist_key_per_s", "{:,.0f}"),
    ("exist_key_p50_us", "{:.1f}"),
    ("exist_key_p99_us", "{:.1f}"),
    ("evicted", "{:,}"),
    ("evict_max_stall_ms", "{:.1f}"),
    ("snapshot_mib", "{:,.0f}"),
    ("snapshot_s", "{:.2f}"),
    ("restore_s", "{:.2f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", default="10k,1M", help="sizes, e.g. 10k,1M,10M")
    ap.add_argument("--size", type=int, default=4096, help="object size in bytes")
    ap.add_argument("--probes", type=int, default=20000, help="lookups timed per size")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--default-gc",
        action="store_true",
        help="leave Python's automatic full collections on (the master process turns them off)",
    )
    args = ap.parse_args()
    rows = []
    for s in args.objects.split(","):
        n = parse_count(s)
        progress(f"{n:,} objects (load average {os.getloadavg()[0]:.1f})")
        rows.append(run(n, args.size, args.probes, not args.default_gc))
        rows[-1]["load_average"] = os.getloadavg()[0]
    print("| " + " | ".join(c for c, _ in COLUMNS) + " | load |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for row in rows:
        cells = [fmt.format(row[c]) for c, fmt in COLUMNS]
        print("| " + " | ".join(cells) + f" | {row['load_average']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
