"""Eviction-policy throughput on a synthetic Zipf workload (single thread, pure Python).

Replays the same request stream against each policy, as a cache of ``--capacity`` bytes
would: a request for a tracked key is a hit (``on_access``); a miss inserts the key
(``on_insert``) and, when over capacity, asks ``victims`` for the excess and removes each
(``on_remove``). With ``--chain L`` every request fetches the first ``--chain-min``..L blocks of a chain, each
inserted with its predecessor as ``parent``, under longest-prefix lookup: only the blocks
before the first missing one are hits; the rest are recomputed and put again.

Reports, per policy, the median over ``--runs`` of requests/s and policy calls/s (every
``on_*`` and ``victims`` call counts as one), and the hit ratio (identical across runs).

    python benchmarks/policy_ops.py                      # all policies, defaults
    python benchmarks/policy_ops.py --policies lru sieve --requests 2000000 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Hashable

import numpy as np

from mooncake.policies import POLICIES, make_policy


def zipf_stream(universe: int, n: int, alpha: float, seed: int) -> list[int]:
    """``n`` ranks in ``[0, universe)``, P(rank i) proportional to 1 / (i + 1) ** alpha."""
    weights = 1.0 / np.arange(1, universe + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    ranks = np.searchsorted(cdf, rng.random(n), side="right")
    # Shuffle rank -> key so popularity is not correlated with key order.
    perm = rng.permutation(universe)
    return [int(x) for x in perm[np.minimum(ranks, universe - 1)]]


def always(key: Hashable) -> bool:
    return True


def run_once(
    name: str,
    stream: list[int],
    keys: list[str],
    size: int,
    capacity: int,
    chain: int,
    lengths: list[int],
) -> tuple[float, int, int, int]:
    """Replay ``stream``; return (seconds, requests, policy calls, hits)."""
    policy = make_policy(name)
    on_insert, on_access, on_remove, victims = (
        policy.on_insert,
        policy.on_access,
        policy.on_remove,
        policy.victims,
    )
    contains = policy.__contains__
    calls = hits = requests = 0
    start = time.perf_counter()
    if chain <= 1:
        for i in stream:
            key = keys[i]
            requests += 1
            if contains(key):
                on_access(key)
                hits += 1
                calls += 1
                continue
            on_insert(key, size)
            calls += 1
            excess = policy.total_bytes - capacity
            if excess > 0:
                out = victims(excess, always)
                calls += 1 + len(out)
                for victim in out:
                    on_remove(victim)
    else:
        for i, length in zip(stream, lengths, strict=True):
            base = i * chain
            parent: str | None = None
            missed = False
            for j in range(length):
                key = keys[base + j]
                requests += 1
                present = contains(key)
                if present and not missed:
                    on_access(key)
                    hits += 1
                    calls += 1
                elif present:
                    on_access(key)  # recomputed past the first miss, put again: a touch
                    calls += 1
                else:
                    missed = True
                    on_insert(key, size, parent=parent)
                    calls += 1
                    excess = policy.total_bytes - capacity
                    if excess > 0:
                        out = victims(excess, always)
                        calls += 1 + len(out)
                        for victim in out:
                            on_remove(victim)
                parent = key
    return time.perf_counter() - start, requests, calls, hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument("--universe", type=int, default=100_000, help="distinct keys (chains)")
    parser.add_argument("--requests", type=int, default=1_000_000, help="requests (chains)")
    parser.add_argument("--alpha", type=float, default=0.99, help="Zipf exponent")
    parser.add_argument("--cache-ratio", type=float, default=0.1, help="capacity / universe")
    parser.add_argument("--chain", type=int, default=1, help="blocks per request (prefix chains)")
    parser.add_argument(
        "--chain-min", type=int, default=0, help="shortest request prefix (default: --chain)"
    )
    parser.add_argument("--size", type=int, default=4096, help="bytes per object")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    stream = zipf_stream(args.universe, args.requests, args.alpha, args.seed)
    chain = max(args.chain, 1)
    lo = args.chain_min or chain
    rng = np.random.default_rng(args.seed + 1)
    lengths = [int(x) for x in rng.integers(lo, chain + 1, size=len(stream))]
    keys = [f"obj-{i}" for i in range(args.universe * max(args.chain, 1))]
    capacity = int(args.universe * max(args.chain, 1) * args.cache_ratio) * args.size
    results = {}
    for name in args.policies:
        runs = [
            run_once(name, stream, keys, args.size, capacity, args.chain, lengths)
            for _ in range(args.runs)
        ]
        _, requests, calls, hits = runs[0]
        secs = statistics.median(r[0] for r in runs)
        results[name] = {
            "requests_per_s": requests / secs,
            "calls_per_s": calls / secs,
            "hit_ratio": hits / requests,
            "requests": requests,
            "calls": calls,
            "seconds_median": secs,
            "seconds_all": [r[0] for r in runs],
        }
    if args.json:
        json.dump({"args": vars(args), "results": results}, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"Zipf alpha={args.alpha}, {args.universe} keys x chain {args.chain}, "
        f"{args.requests} requests, cache {args.cache_ratio:.0%}, median of {args.runs} runs, "
        f"Python {sys.version.split()[0]}"
    )
    print(f"{'policy':<12}{'requests/s':>14}{'calls/s':>14}{'hit ratio':>11}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['requests_per_s']:>14,.0f}{r['calls_per_s']:>14,.0f}"
            f"{r['hit_ratio']:>11.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
