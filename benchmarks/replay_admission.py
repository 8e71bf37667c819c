"""Tier admission on the FAST'25 traces: hit rate and SSD writes per trace x capacity x rule.

For each trace and each DRAM capacity (blocks), a DRAM LRU over an SSD LRU of ``--ssd-ratio``
times it (``mooncake.replay.tiers.TierSim``), per admission mode: write-through (the baseline),
demote-on-evict (``always``), TinyLFU, TinyLFU with a DRAM filter too, and frequency thresholds
2 and 3. Prints a markdown table (what ``docs/replay.md`` shows), writes the JSON and a plot,
and says per trace at which capacities a rule matches write-through's block hit rate (within
``--tolerance`` percentage points, or above it) with at most half its SSD writes.

    python benchmarks/replay_admission.py tests/data/traces/*.jsonl.gz \\
        --json benchmarks/results/replay_admission.json --plot docs/img/replay_admission.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.tiers import ADMISSIONS, WRITE_THROUGH, TierSim
from mooncake.replay.trace import load_trace

CAPACITIES = (1000, 2000, 5000, 10000, 20000, 50000, 97656, 200000)


def sweep(path: str, capacities: tuple[int, ...], ratio: int) -> list[dict[str, Any]]:
    reqs = load_trace(path)
    kv, model = KVModel(), PrefillModel()
    rows = []
    for cap in capacities:
        for adm in ADMISSIONS:
            sim = TierSim(adm, cap, cap * ratio, kv=kv, model=model)
            for r in reqs:
                sim.feed(r)
            rows.append(sim.summary())
            print(f"  {os.path.basename(path)} {cap} {adm}", file=sys.stderr, flush=True)
    return rows


def matches(rows: list[dict[str, Any]], tolerance: float) -> list[tuple[int, str, float, float]]:
    """(capacity, rule, hit gain in points, writes share) where a rule matches write-through's
    hit rate with at most half its writes."""
    base = {r["dram_capacity_blocks"]: r for r in rows if r["admission"] == WRITE_THROUGH}
    out = []
    for r in rows:
        b = base[r["dram_capacity_blocks"]]
        if r["admission"] == WRITE_THROUGH or not b["ssd_writes"]:
            continue
        gain = 100 * (r["block_hit_rate"] - b["block_hit_rate"])
        share = r["ssd_writes"] / b["ssd_writes"]
        if gain >= -tolerance and share <= 0.5:
            out.append((r["dram_capacity_blocks"], r["admission"], gain, share))
    return out


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, (trace, rows) in enumerate(results.items()):
        for adm in ADMISSIONS:
            pts = [r for r in rows if r["admission"] == adm]
            caps = [r["dram_capacity_blocks"] for r in pts]
            axes[0][col].plot(caps, [100 * r["block_hit_rate"] for r in pts], marker="o", label=adm)
            axes[1][col].plot(
                caps, [r["ssd_write_bytes"] / 2**40 for r in pts], marker="o", label=adm
            )
        axes[0][col].set_title(f"{trace}: block hit rate (DRAM + SSD)")
        axes[1][col].set_title(f"{trace}: SSD bytes written")
        axes[0][col].set_ylabel("block hit %")
        axes[1][col].set_ylabel("TiB written (160 MiB blocks)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log")
            ax.set_xlabel("DRAM capacity (blocks); SSD = 4x")
            ax.grid(True, alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--ssd-ratio", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.5, help="percentage points (default 0.5)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    t0 = time.process_time()
    for path in args.traces:
        name = os.path.basename(path).split(".")[0]
        results[name] = sweep(path, CAPACITIES, args.ssd_ratio)
    cpu = time.process_time() - t0
    for name, rows in results.items():
        base = {
            r["dram_capacity_blocks"]: r["ssd_writes"]
            for r in rows
            if r["admission"] == WRITE_THROUGH
        }
        print(f"\n{name} (SSD = {args.ssd_ratio}x DRAM)\n")
        print(
            "| DRAM blocks | admission | block hit | DRAM hit | SSD hit | SSD writes | SSD TiB | writes vs WT |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            ref = base[r["dram_capacity_blocks"]]
            print(
                f"| {r['dram_capacity_blocks']} | {r['admission']} | {100 * r['block_hit_rate']:.2f} % "
                f"| {100 * r['dram_hit_rate']:.2f} % | {100 * r['ssd_hit_rate']:.2f} % "
                f"| {r['ssd_writes']} | {r['ssd_write_bytes'] / 2**40:.2f} "
                f"| {100 * r['ssd_writes'] / ref:.1f} % |"
            )
        found = matches(rows, args.tolerance)
        print(f"\nmatches (hit >= write-through - {args.tolerance} points, <= 50 % of its writes):")
        for cap, adm, gain, share in found:
            print(f"  {cap}: {adm} ({gain:+.2f} points, {100 * share:.1f} % of the writes)")
        if not found:
            print("  none")
    print(f"\nCPU {cpu:.1f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
