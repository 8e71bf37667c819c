"""Master snapshot and restore times at N objects (``--objects``, default 1M), repeated.

A :class:`MasterState` with one segment and N objects of 4 KiB put and ended (keys ~40
characters, as :mod:`benchmarks.master_scale` builds them), then ``--runs`` (5) rounds of
``snapshot()`` and ``restore()``; prints the size, the median, min and max of each wall time and
of each CPU time of the process (``time.process_time``: less sensitive to other load on the
machine), and the load average. Run with the tree to measure on ``PYTHONPATH`` (compiled build: ``build_ext
--inplace`` first):

    python benchmarks/snapshot_restore.py --objects 1M --runs 5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment


def parse_count(s: str) -> int:
    mult = {"k": 1_000, "M": 1_000_000}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def build(n: int, size: int) -> MasterState:
    m = MasterState(MasterConfig(seed=0))
    cap = n * size * 2
    m.mount_segment("bench", Segment(id="s", name="127.0.0.1:9", base=1 << 40, size=cap), 0.0)
    gc.disable()
    cfg = ReplicateConfig()
    for i in range(n):
        k = f"{i:016x}-blockhash-{i * 2654435761 % (1 << 32):08x}-kv"
        m.put_start("bench", k, size, cfg, 0.0)
        m.put_end("bench", k, 0.0)
        m.settle()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", default="1M")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    n = parse_count(a.objects)
    m = build(n, a.size)
    times: dict[str, list[float]] = {k: [] for k in ("snapshot", "restore")}
    cpu: dict[str, list[float]] = {k: [] for k in ("snapshot", "restore")}
    size = 0
    for _ in range(a.runs):
        t0, c0 = time.perf_counter(), time.process_time()
        data = m.snapshot()
        times["snapshot"].append(time.perf_counter() - t0)
        cpu["snapshot"].append(time.process_time() - c0)
        size = len(data)
        t0, c0 = time.perf_counter(), time.process_time()
        r = MasterState.restore(data)
        times["restore"].append(time.perf_counter() - t0)
        cpu["restore"].append(time.process_time() - c0)
        assert r.object_count == m.object_count
        del r, data
    load = os.getloadavg()
    print(f"objects {n:,}  snapshot {size / (1 << 20):.1f} MiB  load average {load[0]:.2f}")
    for name in times:
        for what, xs in (("wall", times[name]), ("cpu", cpu[name])):
            print(
                f"{name:9s} {what:4s} median {statistics.median(xs):.3f} s  "
                f"min {min(xs):.3f}  max {max(xs):.3f}  ({len(xs)} runs)"
            )


if __name__ == "__main__":
    main()
