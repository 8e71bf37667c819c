"""Replay speed: every shipped policy x 8 capacities + Belady on each trace, in CPU seconds.

Runs ``mooncake.replay.replay`` with the global-pool sweep only (no local caches, no routing
strategies) ``--runs`` times per trace and prints the median CPU seconds (``time.process_time``:
the machine is shared, wall time would measure the neighbours), the requests and block
references per CPU second, and the real-time factor (trace duration / CPU seconds).

    python benchmarks/replay_speed.py tests/data/traces/*.jsonl.gz --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from mooncake.replay.run import ReplayConfig, available_policies, replay
from mooncake.replay.trace import load_trace

CAPACITIES = (1000, 2000, 5000, 5859, 10000, 20000, 50000, 97656)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = ReplayConfig(
        policies=tuple(available_policies()),
        capacities=CAPACITIES,
        local_policies=(),
        instances=1,
        strategies=(),
        belady=True,
    )
    total = 0.0
    print(f"policies {','.join(cfg.policies)} x {len(CAPACITIES)} capacities + Belady")
    for path in args.traces:
        reqs = load_trace(path)
        refs = sum(len(r.hash_ids) for r in reqs)
        duration = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
        times = []
        for _ in range(args.runs):
            t0 = time.process_time()
            replay(reqs, cfg)
            times.append(time.process_time() - t0)
        med = statistics.median(times)
        total += med
        print(
            f"{os.path.basename(path)}: {len(reqs)} requests, {refs} block refs, "
            f"{duration:.0f} s of trace; CPU s per run {', '.join(f'{t:.2f}' for t in times)}; "
            f"median {med:.2f} s = {refs / med:,.0f} block refs/s, "
            f"{duration / med:.0f}x real time for the whole sweep "
            f"({duration * (len(cfg.policies) * len(CAPACITIES) + 1) / med:,.0f}x per simulator)",
            flush=True,
        )
    print(f"total median CPU {total:.2f} s; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
