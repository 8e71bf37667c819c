"""``mooncake replay TRACE.jsonl``: replay a FAST'25 request trace against the production
eviction policies and the scheduling strategies, on a virtual clock.

Streams the trace once (progress bar on stderr), then prints: trace shape, theoretical maximum
hit, hit rate per policy and capacity (block- and token-weighted; global pool and ``N`` local
caches) beside Belady's offline optimum and each policy's gap to it, estimated prefill GPU seconds per request, KV bytes moved, TTFT per routing strategy, and with ``--admissions`` hit rates and SSD writes of a DRAM + SSD pair per admission rule.
``--json`` prints the report as JSON instead; ``--csv`` writes the per-request outcome table;
``--plots DIR`` writes the PNG figures. Tables are rich on a terminal (widened to fit) and
plain aligned text when stdout is a pipe or file: no number is ever cut. Exit status: 0, or 2 for a bad trace or bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Iterator
from typing import IO, Any

from mooncake.errors import MooncakeError
from mooncake.replay.sim import STRATEGIES as _STRATEGIES


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must be >= 0, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip().lower() for v in text.split(",") if v.strip())


def _policies(names: tuple[str, ...] | None, every: list[str]) -> tuple[str, ...]:
    if names is None or names == ("all",):
        return tuple(every)
    if names == ("none",):
        return ()
    return names


def _admissions(names: tuple[str, ...]) -> tuple[str, ...]:
    from mooncake.replay.tiers import ADMISSIONS

    return ADMISSIONS if names == ("all",) else names


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a FAST'25 trace: hit rates per policy/capacity, TTFT per scheduling strategy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "trace",
        help="JSONL trace (timestamp, input_length, output_length, hash_ids); .gz is read too",
    )
    p.add_argument(
        "--policies",
        type=_name_list,
        default=None,
        help="comma-separated eviction policies of the global-pool sweep "
        "(default or 'all': every shipped policy)",
    )
    p.add_argument(
        "--capacities",
        type=_int_list,
        default=None,
        help="comma-separated total cache capacities in blocks "
        "(default: 1000,2000,5000,5859,10000,20000,50000,58590,97656)",
    )
    p.add_argument("--instances", type=int, default=10, help="prefill instances N (default 10)")
    p.add_argument(
        "--instance-capacity",
        type=int,
        default=5859,
        help="blocks per instance for the scheduling runs (default 5859 = 3M tokens)",
    )
    p.add_argument(
        "--strategies",
        type=_name_list,
        default=_STRATEGIES,
        help=f"comma-separated routing strategies (default: {','.join(_STRATEGIES)}); "
        "'none' skips scheduling",
    )
    p.add_argument(
        "--schedule-policy", default="lru", help="eviction policy of the instances (default lru)"
    )
    p.add_argument(
        "--local-policies",
        type=_name_list,
        default=("lru",),
        help="policies of the N-local-caches runs of the sweep (default lru; 'all' for every "
        "shipped policy, 'none' to skip)",
    )
    p.add_argument(
        "--local-router",
        choices=("round_robin", "random"),
        default="round_robin",
        help="routing of requests to the local caches of the sweep (default round_robin)",
    )
    p.add_argument(
        "--balance-threshold",
        type=float,
        default=1.0,
        help="global cache-aware: transfer a prefix only if best_len > threshold x local prefix",
    )
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block (default 512)")
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=327_680,
        help="KV bytes per token (default 327680, LLaMA3-70B fp16)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=87.0,
        help="modelled KV transfer bandwidth between instances, GB/s (default 87)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip malformed trace lines and count them instead of failing at the first",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument(
        "--json-requests",
        action="store_true",
        help="with --json: include the per-request outcome table",
    )
    p.add_argument("--csv", metavar="PATH", help="write the per-request outcome table as CSV")
    p.add_argument(
        "--plots",
        metavar="DIR",
        help="write PNG plots into DIR (TRACESTEM_hit_rate.png, _belady_gap.png, "
        "_global_vs_local.png, _ttft.png)",
    )
    p.add_argument(
        "--no-belady",
        action="store_true",
        help="skip Belady's offline optimum (run by default at every capacity)",
    )
    p.add_argument(
        "--admissions",
        type=_name_list,
        default=(),
        help="comma-separated tier admission modes to compare on a DRAM cache of each capacity "
        "over an SSD of --ssd-ratio times it (write-through, always, tinylfu, tinylfu-dram, "
        "freq:N; 'all' for the default set): hit rates and SSD writes",
    )
    p.add_argument(
        "--ssd-ratio", type=int, default=4, help="SSD capacity / DRAM capacity (default 4)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


class _Progress:
    """Two rich progress bars on stderr: reading the trace (bytes), then simulating
    (simulator x request steps)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._read: Any = None
        self._sim: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description:<9}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=_stderr_console(),
                transient=True,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def lines(self, f: IO[bytes], size: int) -> Iterator[bytes]:
        if self._progress is None:
            yield from f
            return
        task = self._progress.add_task("read", total=size or None, unit="bytes")
        done = 0
        for n, line in enumerate(f, 1):
            done += len(line)
            if n % 512 == 0:
                self._progress.update(task, completed=done)
            yield line
        self._progress.update(task, completed=done)

    def simulate(self, done: int, total: int) -> None:
        if self._progress is None:
            return
        if self._sim is None:
            self._sim = self._progress.add_task("simulate", total=total, unit="sim x requests")
        self._progress.update(self._sim, completed=done)


def _say(message: str) -> None:
    """Plain lines on stderr (never wrapped: paths and line numbers stay greppable)."""
    print(message, file=sys.stderr)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def run(args: argparse.Namespace) -> int:
    from mooncake.replay.model import KVModel, PrefillModel
    from mooncake.replay.run import DEFAULT_CAPACITIES, ReplayConfig, available_policies, replay
    from mooncake.replay.trace import TraceStats, iter_trace, open_trace

    try:
        strategies = () if args.strategies == ("none",) else tuple(args.strategies)
        cfg = ReplayConfig(
            policies=_policies(args.policies, available_policies()),
            local_policies=_policies(args.local_policies, available_policies()),
            capacities=args.capacities if args.capacities is not None else DEFAULT_CAPACITIES,
            instances=args.instances,
            local_router=args.local_router,
            strategies=strategies,
            instance_capacity=args.instance_capacity,
            schedule_policy=args.schedule_policy.lower(),
            balance_threshold=args.balance_threshold,
            seed=args.seed,
            belady=not args.no_belady,
            admissions=_admissions(args.admissions),
            ssd_ratio=args.ssd_ratio,
            kv=KVModel(
                bytes_per_token=args.kv_bytes_per_token,
                block_tokens=args.block_tokens,
                bandwidth_bytes_per_s=args.bandwidth_gbps * 1e9,
            ),
            model=PrefillModel(),
        )
        stats = TraceStats()
        with (
            _Progress(not args.no_progress and not args.json) as prog,
            open_trace(args.trace) as f,
        ):
            # A gzip file's size says nothing about its lines: no total for the bar then.
            size = 0 if args.trace.endswith(".gz") else os.fstat(f.fileno()).st_size
            requests = iter_trace(
                prog.lines(f, size),
                source=args.trace,
                block_tokens=args.block_tokens,
                skip_bad=args.skip_bad,
                stats=stats,
            )
            report = replay(requests, cfg, progress=prog.simulate)
    except OSError as exc:
        _say(f"error: cannot read trace: {exc}")
        return 2
    except MooncakeError as exc:
        _say(f"error: {exc}")
        return 2

    if report.trace.requests == 0:
        _say(
            f"error: {args.trace}: no valid requests "
            f"({stats.skipped} bad line(s) skipped, {stats.blank} blank)"
        )
        return 2
    doc = report.to_dict(requests=args.json and args.json_requests)
    doc["trace_name"] = os.path.basename(args.trace)
    doc["skipped_lines"] = {"count": stats.skipped, "first": stats.skip_reasons}
    if args.csv:
        with open(args.csv, "w", newline="") as out:
            w = csv.writer(out)
            w.writerow(report.columns())
            w.writerows(report.request_rows())
    plots: list[str] = []
    if args.plots:
        from mooncake.replay.plots import write_plots

        stem = os.path.basename(args.trace).split(".")[0]
        plots = write_plots(doc, args.plots, prefix=f"{stem}_")
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_report(doc)
        if stats.skipped:
            _say(f"skipped {stats.skipped} bad line(s); first:")
            for line_no, reason in stats.skip_reasons[:5]:
                _say(f"  line {line_no}: {reason}")
        for p in plots:
            _say(f"wrote {p}")
        if args.csv:
            _say(f"wrote {args.csv}")
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _tib(x: float) -> str:
    return f"{x / 2**40:.2f}"


def _global_local_pairs(doc: dict[str, Any]) -> list[tuple[str, int, float, float]]:
    """(policy, capacity, global token hit, local token hit) where both were run."""
    glob = {
        (c["policy"], c["capacity_blocks"]): c["token_hit_rate"]
        for c in doc["caches"]
        if c["scope"] == "global"
    }
    return [
        (c["policy"], c["capacity_blocks"], glob[key], c["token_hit_rate"])
        for c in doc["caches"]
        if c["scope"] == "local" and (key := (c["policy"], c["capacity_blocks"])) in glob
    ]


class _Table:
    """A table to print: a title, columns (left-justified ones named) and rows of text."""

    def __init__(self, title: str, columns: list[str], left: tuple[str, ...] = ()) -> None:
        self.title = title
        self.columns = columns
        self.left = set(left)
        self.rows: list[list[str]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def plain(self) -> str:
        """Aligned plain text: every cell whole, one line per row (grep- and diff-friendly)."""
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) for i, c in enumerate(self.columns)]

        def line(cells: list[str]) -> str:
            return "  ".join(
                cell.ljust(w) if col in self.left else cell.rjust(w)
                for cell, w, col in zip(cells, widths, self.columns, strict=True)
            ).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([self.title, line(self.columns), rule, *map(line, self.rows)])

    def rich(self) -> Any:
        from rich.table import Table

        tab = Table(title=self.title)
        for col in self.columns:
            # no_wrap + min_width: rich never folds or ellipsises a number ("36.3…").
            width = (
                max(len(col), *(len(r[len(tab.columns)]) for r in self.rows)) if self.rows else 0
            )
            tab.add_column(
                col,
                justify="left" if col in self.left else "right",
                no_wrap=True,
                min_width=width,
                overflow="ignore",
            )
        for row in self.rows:
            tab.add_row(*row)
        return tab


class _Out:
    """Where the report goes: rich on a terminal (widened to fit every table), plain text
    when stdout is a pipe or a file, so no number is ever cut to the terminal width."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._con: Any = None
        if self.tty:
            from rich.console import Console

            self._con = Console()

    def line(self, text: str) -> None:
        if self._con is not None:
            self._con.print(text, soft_wrap=True, highlight=False, markup=False)
        else:
            print(text)

    def table(self, table: _Table) -> None:
        if not table.rows:
            return
        if self._con is None:
            print()
            print(table.plain())
            return
        from rich.console import Console

        tab = table.rich()
        need = self._con.measure(tab).maximum
        con = self._con if need <= self._con.width else Console(width=need)
        con.print(tab)


def _print_report(doc: dict[str, Any]) -> None:
    out = _Out()
    t = doc["trace"]
    mx = doc["max"]
    out.line(
        f"{doc['trace_name']}: {t['requests']} requests over {t['duration_s']:.0f} s, "
        f"mean input {t['mean_input']:.2f} / output {t['mean_output']:.2f} tokens, "
        f"{t['unique_blocks']} unique blocks, {t['block_refs']} block references, "
        f"max {t['max_blocks']} blocks per request"
    )
    out.line(
        f"theoretical max hit (infinite cache): block-weighted {_pct(mx['block_hit_rate'])}, "
        f"token-weighted {_pct(mx['token_hit_rate'])}; est. prefill "
        f"{mx['prefill_nocache_s_per_request']:.3f} s/request without cache, "
        f"{mx['prefill_s_per_request']:.3f} s with an infinite one"
    )
    belady = doc.get("belady", [])
    if doc["caches"] or belady:
        tab = _Table(
            "Hit rate per policy and capacity (blocks)",
            [
                "scope",
                "policy",
                "blocks",
                "block hit",
                "token hit",
                "of max",
                "prefill s/req",
                "KV read TiB",
                "KV written TiB",
            ],
            left=("scope", "policy"),
        )
        for c in [*doc["caches"], *belady]:
            scope = c["scope"] if c["scope"] == "global" else f"{c['instances']}xlocal"
            tab.add_row(
                scope,
                c["policy"],
                str(c["capacity_blocks"]),
                _pct(c["block_hit_rate"]),
                _pct(c["token_hit_rate"]),
                f"{100 * c['token_hit_rate'] / mx['token_hit_rate']:.1f}%"
                if mx["token_hit_rate"]
                else "-",
                f"{c['prefill_s_per_request']:.3f}",
                _tib(c["kv_bytes_read"]),
                _tib(c["kv_bytes_written"]),
            )
        out.table(tab)
    _print_tiers(out, doc.get("tiers", []))
    gaps = _belady_gaps(doc)
    if gaps:
        policies = sorted(
            {p for _, p, _, _ in gaps}, key=[c["policy"] for c in doc["caches"]].index
        )
        tab = _Table(
            "Gap to Belady's optimum (token-weighted hit, percentage points below it)",
            ["blocks", "belady", *policies],
            left=(),
        )
        by_cap: dict[int, dict[str, float]] = {}
        opt = {b["capacity_blocks"]: b["token_hit_rate"] for b in belady}
        for cap, policy, _, gap in gaps:
            by_cap.setdefault(cap, {})[policy] = gap
        for cap in sorted(by_cap):
            tab.add_row(
                str(cap),
                _pct(opt[cap]),
                *(f"{100 * by_cap[cap][p]:.2f}" if p in by_cap[cap] else "-" for p in policies),
            )
        out.table(tab)
    pairs = _global_local_pairs(doc)
    if pairs:
        n_inst = doc["config"]["instances"]
        tab = _Table(
            f"Global pool vs {n_inst} local caches of C/{n_inst} (token-weighted)",
            ["policy", "C (blocks)", "global", "local", "global/local"],
            left=("policy",),
        )
        for policy, cap, g, loc in pairs:
            ratio = f"{g / loc:.2f}x" if loc else "-"
            tab.add_row(policy, str(cap), _pct(g), _pct(loc), ratio)
        out.table(tab)
    if doc["schedules"]:
        cfg = doc["config"]
        tab = _Table(
            f"Scheduling: {cfg['instances']} prefill instances x "
            f"{cfg['instance_capacity']} blocks ({cfg['schedule_policy']}), modelled TTFT",
            [
                "strategy",
                "mean TTFT s",
                "P50 s",
                "P90 s",
                "P99 s",
                "mean queue s",
                "token hit",
                "prefill s/req",
                "KV moved TiB",
            ],
            left=("strategy",),
        )
        for s in doc["schedules"]:
            tab.add_row(
                s["strategy"],
                f"{s['ttft_mean_s']:.3f}",
                f"{s['ttft_p50_s']:.3f}",
                f"{s['ttft_p90_s']:.3f}",
                f"{s['ttft_p99_s']:.3f}",
                f"{s['queue_mean_s']:.3f}",
                _pct(s["token_hit_rate"]),
                f"{s['prefill_s_per_request']:.3f}",
                _tib(s["kv_bytes_transferred"]),
            )
        out.table(tab)


def _print_tiers(out: _Out, tiers: list[dict[str, Any]]) -> None:
    """The tier admission table: hit rates and SSD writes, writes relative to write-through."""
    if not tiers:
        return
    base = {
        t["dram_capacity_blocks"]: t["ssd_writes"]
        for t in tiers
        if t["admission"] == "write-through"
    }
    tab = _Table(
        "Tier admission: DRAM LRU over an SSD LRU (blocks), SSD writes",
        [
            "DRAM",
            "SSD",
            "admission",
            "block hit",
            "DRAM hit",
            "SSD hit",
            "SSD writes",
            "SSD TiB written",
            "writes vs write-through",
        ],
        left=("admission",),
    )
    for t in tiers:
        ref = base.get(t["dram_capacity_blocks"])
        tab.add_row(
            str(t["dram_capacity_blocks"]),
            str(t["ssd_capacity_blocks"]),
            t["admission"],
            _pct(t["block_hit_rate"]),
            _pct(t["dram_hit_rate"]),
            _pct(t["ssd_hit_rate"]),
            str(t["ssd_writes"]),
            _tib(t["ssd_write_bytes"]),
            f"{100 * t['ssd_writes'] / ref:.1f}%" if ref else "-",
        )
    out.table(tab)


def _belady_gaps(doc: dict[str, Any]) -> list[tuple[int, str, float, float]]:
    """(capacity, policy, policy token hit, Belady minus policy) for global sweep caches."""
    opt = {b["capacity_blocks"]: b["token_hit_rate"] for b in doc.get("belady", [])}
    return [
        (
            c["capacity_blocks"],
            c["policy"],
            c["token_hit_rate"],
            opt[c["capacity_blocks"]] - c["token_hit_rate"],
        )
        for c in doc["caches"]
        if c["scope"] == "global" and c["capacity_blocks"] in opt
    ]
