#!/usr/bin/env python3
"""Per-completion cost of delivering worker-thread work to the event loop.

Compares, on trio, for tiny (64 B) copy jobs so that only the delivery is measured:

* ``copier, one at a time``: ``Copier.copy`` awaited in a loop (CopyQueue worker -> eventfd ->
  one wake-up -> drain): the full round trip of one completion;
* ``copier, burst of N``: N tasks each awaiting one copy; the eventfd wake-ups are drained in
  bursts, so the cost per completion is amortized;
* ``queue, burst of N``: N jobs submitted straight to a ``CopyQueue``, the loop draining the
  eventfd until all N are in: the cost per completion of the mechanism itself;
* ``to_thread, one at a time`` / ``burst``: ``anyio.to_thread.run_sync`` of the same copy, the
  generic alternative.

Prints median microseconds per completion over ``--repeats`` runs, and the completions per
wake-up of the burst case. Usage: ``python benchmarks/completion_cost.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

from mooncake import _fast
from mooncake._engine._copier import Copier


async def measure(n_seq: int, n_burst: int) -> dict[str, Any]:
    src = ctypes.create_string_buffer(64)
    dst = ctypes.create_string_buffer(64 * n_burst)
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    out: dict[str, Any] = {}
    c = Copier()
    async with anyio.create_task_group() as tg:
        await tg.start(c.run)
        t0 = time.perf_counter()
        for _ in range(n_seq):
            await c.copy([d], [s], [64])
        out["copier_seq_us"] = (time.perf_counter() - t0) / n_seq * 1e6

        w0, c0 = c.wakeups, c.completions
        t0 = time.perf_counter()
        async with anyio.create_task_group() as burst:
            for k in range(n_burst):
                burst.start_soon(c.copy, [d + 64 * k], [s], [64])
        out["copier_burst_us"] = (time.perf_counter() - t0) / n_burst * 1e6
        out["copier_burst_completions_per_wakeup"] = (c.completions - c0) / max(1, c.wakeups - w0)
        tg.cancel_scope.cancel()
    c.close()

    # the raw queue: N jobs submitted at once, completions drained as the eventfd fires
    q = _fast.CopyQueue(1)
    t0 = time.perf_counter()
    for k in range(n_burst):
        q.submit(k, [d + 64 * k], [s], [64])
    got = wakeups = 0
    while got < n_burst:
        await anyio.wait_readable(q.fileno())
        got += len(q.drain())
        wakeups += 1
    out["queue_burst_us"] = (time.perf_counter() - t0) / n_burst * 1e6
    out["queue_burst_completions_per_wakeup"] = n_burst / wakeups
    q.close()

    t0 = time.perf_counter()
    for _ in range(n_seq):
        await anyio.to_thread.run_sync(_fast.memcpy_at, d, s, 64)
    out["to_thread_seq_us"] = (time.perf_counter() - t0) / n_seq * 1e6
    t0 = time.perf_counter()
    async with anyio.create_task_group() as burst:
        for k in range(n_burst):
            burst.start_soon(anyio.to_thread.run_sync, _fast.memcpy_at, d + 64 * k, s, 64)
    out["to_thread_burst_us"] = (time.perf_counter() - t0) / n_burst * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=2000)
    ap.add_argument("--burst", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = [anyio.run(measure, args.seq, args.burst, backend="trio") for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["compiled"] = _fast.COMPILED
    for k, v in med.items():
        print(f"{k:40s} {v:10.2f}" if isinstance(v, float) else f"{k:40s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
