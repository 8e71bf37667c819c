#!/usr/bin/env python3
"""Transfer Engine side by side: mooncake-py (tcp, shm) vs the published Mooncake, in one run.

Each round runs, in alternating order, ``mooncake bench transfer`` once per transport of ours and
the published wheel's own bench (``benchmarks/anchor/mooncake_te_bench.py``, in its venv, with
``PYTHONPATH`` removed since both packages are named ``mooncake``) over the same shapes, buffer
size and case time, then the machine's limits (``benchmarks/anchor/sys_limits_bench.py``: memcpy,
iperf3) and a single-thread memcpy sweep of the block sizes. Results are medians over the
rounds; ratios are taken between medians of the same run. Both sides pre-fault their buffers.

Usage (from the repository root, extensions built)::

    .venv/bin/python benchmarks/transfer_vs_published.py --rounds 3 --out bench-results/te
    # -> bench-results/te/{raw.json, summary.json, table.md, throughput.png}

``--anchor-python`` defaults to ``~/.cache/mooncake-anchor-venv/bin/python`` or
``/opt/anchor-venv/bin/python`` (``bash scripts/setup-anchor.sh`` creates the first); without
one the published columns are left empty. ``--facade`` also runs the anchor's script unchanged
against our sync facade ``mooncake.engine.TransferEngine`` (when it exists).

``--small-ops`` measures the small-op latency table instead (4 KiB x 1 unless ``--tcp-sizes`` /
``--batches`` say otherwise), each round in alternating order: the published engine with the
anchor's script (``MC_FORCE_TCP=1`` and default), the same script unchanged against our facade
(caller-thread path over tcp, over shm with ``MOONCAKE_TRANSPORTS=shm,tcp``, and through the loop
thread with ``MOONCAKE_SYNC_FASTPATH=0``), and our async API (``mooncake bench transfer``, tcp
and shm). It writes ``small-ops.md``/``small-ops.json`` (medians of p50 and p99 per series, and
the ratio of each p50 median to the published one of the same run)::

    .venv/bin/python benchmarks/transfer_vs_published.py --small-ops --rounds 5 \
        --case-seconds 2 --buffer 64M --out bench-results/small-ops
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KIB, MIB = 1024, 1024 * 1024


def find_anchor_dir() -> Path | None:
    for p in (ROOT / "benchmarks" / "anchor", ROOT.parent / "shared" / "anchor"):
        if (p / "mooncake_te_bench.py").exists():
            return p
    return None


def find_anchor_python() -> str | None:
    for p in (
        Path.home() / ".cache" / "mooncake-anchor-venv" / "bin" / "python",
        Path("/opt/anchor-venv/bin/python"),
    ):
        if p.exists():
            return str(p)
    return None


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    return env


def run_json(
    cmd: list[str],
    out: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    timeout: float = 600,
) -> dict[str, Any] | None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    p = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        timeout=timeout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if p.returncode != 0 or not out.exists():
        print(f"  failed (rc={p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
        return None
    print(f"  done in {time.time() - t0:.1f} s", file=sys.stderr)
    return json.loads(out.read_text())


def ours(
    args: argparse.Namespace,
    transport: str,
    sizes: str,
    out: Path,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    cmd = [
        sys.executable,
        "-m",
        "mooncake",
        "bench",
        "transfer",
        "--transport",
        transport,
        "--sizes",
        sizes,
        "--batches",
        args.batches,
        "--ops",
        args.ops,
        "--buffer",
        args.buffer,
        "--case-seconds",
        str(args.case_seconds),
        "--no-progress",
        "--json",
        str(out),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env or {})
    return run_json(cmd, out, env=env)


def published(
    args: argparse.Namespace,
    py: str,
    script_dir: Path,
    out: Path,
    facade: bool = False,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    cmd = [
        py,
        str(script_dir / "mooncake_te_bench.py"),
        "--sizes",
        args.tcp_sizes,
        "--batches",
        args.batches,
        "--ops",
        args.ops,
        "--buffer",
        args.buffer,
        "--case-seconds",
        str(args.case_seconds),
        "--async-depth",
        "0",
        "--json",
        str(out),
    ]
    env = clean_env()
    if facade:
        env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env or {})
    return run_json(cmd, out, env=env, cwd=script_dir)


#: the series of --small-ops: (name, kind, extra environment)
SMALL_SERIES: list[tuple[str, str, dict[str, str]]] = [
    ("published tcp (MC_FORCE_TCP=1)", "published", {"MC_FORCE_TCP": "1"}),
    ("published (default)", "published", {}),
    ("ours sync tcp", "facade", {"MOONCAKE_SYNC_FASTPATH": "1"}),
    ("ours sync shm", "facade", {"MOONCAKE_TRANSPORTS": "shm,tcp"}),
    ("ours sync via loop thread", "facade", {"MOONCAKE_SYNC_FASTPATH": "0"}),
    ("ours async tcp", "ours-tcp", {}),
    ("ours async shm", "ours-shm", {}),
]


def small_ops(args: argparse.Namespace, outdir: Path) -> int:
    """The small-op latency table (see the module docstring)."""
    py = args.anchor_python
    anchor_dir = find_anchor_dir()
    raw: dict[str, list[dict[str, Any]]] = {}
    loads: list[list[float]] = []
    for rnd in range(args.rounds):
        order = SMALL_SERIES if rnd % 2 == 0 else list(reversed(SMALL_SERIES))
        loads.append([round(x, 2) for x in os.getloadavg()])
        for k, (name, kind, env) in enumerate(order):
            f = outdir / f"small-{rnd}-{k}.json"
            f.unlink(missing_ok=True)
            if kind in ("published", "facade"):
                if anchor_dir is None or (kind == "published" and not py):
                    continue
                r = published(
                    args,
                    py if kind == "published" else sys.executable,
                    anchor_dir,
                    f,
                    facade=kind == "facade",
                    extra_env=env,
                )
            else:
                r = ours(args, kind.split("-")[1], args.tcp_sizes, f, env)
            if r is not None:
                raw.setdefault(name, []).append(r)
    loads.append([round(x, 2) for x in os.getloadavg()])
    summary: dict[str, Any] = {"loadavg": loads, "series": {}}
    for name, runs in raw.items():
        acc: dict[str, dict[str, list[float]]] = {}
        for run in runs:
            for c in run.get("cases") or run.get("python_api", {}).get("cases", []):
                if "skipped" in c or c.get("errors"):
                    continue
                d = acc.setdefault(f"{c['op']}/{c['block']}/{c['batch']}", {"p50": [], "p99": []})
                d["p50"].append(c["call_us_p50"])
                d["p99"].append(c["call_us_p99"])
        summary["series"][name] = {
            k: {"p50": med(v["p50"]), "p99": med(v["p99"]), "n": len(v["p50"])}
            for k, v in acc.items()
        }
    (outdir / "small-ops.json").write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
    ser = summary["series"]
    ref = ser.get(SMALL_SERIES[0][0], {})
    keys = sorted(
        {k for v in ser.values() for k in v}, key=lambda k: (k.split("/")[0] != "write", k)
    )
    lines = [
        "| op | block | batch | series | p50 µs | p99 µs | p50 / published tcp |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        op, b, bt = k.split("/")
        for name, _, _ in SMALL_SERIES:
            v = ser.get(name, {}).get(k)
            if v is None:
                continue
            r = ref.get(k)
            ratio = f"**{v['p50'] / r['p50']:.2f}x**" if r and r["p50"] else "-"
            lines.append(
                f"| {op} | {fmt_block(int(b))} | {bt} | {name} | {v['p50']:.1f} | {v['p99']:.1f} "
                f"| {ratio} |"
            )
    md = "\n".join(lines) + (
        f"\n\n{args.rounds} rounds of {args.case_seconds} s cases; load average (1, 5, 15 min) "
        f"at the start of each round and at the end: {loads}\n"
    )
    (outdir / "small-ops.md").write_text(md)
    print(md)
    return 0


def limits(py: str, script_dir: Path, out: Path) -> dict[str, Any] | None:
    return run_json(
        [py, str(script_dir / "sys_limits_bench.py"), "--json", str(out)], out, cwd=script_dir
    )


def memcpy_sweep(sizes: list[int], seconds: float = 0.3) -> dict[int, float]:
    """Warm, pre-faulted single-thread memcpy GB/s per block size (our compiled memcpy_at)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from mooncake import _fast

    res: dict[int, float] = {}
    span = max(64 * MIB, 4 * max(sizes))
    src = np.empty(span, dtype=np.uint8)
    dst = np.empty(span, dtype=np.uint8)
    src.fill(1)  # pre-fault both: first touch would measure page faults, not memcpy
    dst.fill(0)
    sa, da = int(src.ctypes.data), int(dst.ctypes.data)
    for bs in sizes:
        n = span // bs
        i = 0
        t0 = time.perf_counter()
        while True:
            off = (i % n) * bs
            _fast.memcpy_at(da + off, sa + off, bs)
            i += 1
            if time.perf_counter() - t0 >= seconds and i >= 3:
                break
        res[bs] = i * bs / (time.perf_counter() - t0) / 1e9
    return res


def key(c: dict[str, Any]) -> tuple[str, int, int]:
    return (c["op"], int(c["block"]), int(c["batch"]))


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``{series: {"op/block/batch": {GBps, ops_per_s, call_us_p50, n}}}`` of medians."""
    out: dict[str, Any] = {}
    for series, runs in raw.items():
        if series in ("limits", "memcpy"):
            continue
        acc: dict[tuple[str, int, int], dict[str, list[float]]] = {}
        for run in runs:
            cases = run.get("cases") or run.get("python_api", {}).get("cases", [])
            for c in cases:
                if "skipped" in c or c.get("errors"):
                    continue
                d = acc.setdefault(key(c), {"GBps": [], "ops": [], "p50": []})
                d["GBps"].append(c["GBps"])
                d["ops"].append(c.get("ops_per_s", c["calls"] * c["batch"] / c["seconds"]))
                d["p50"].append(c["call_us_p50"])
        out[series] = {
            f"{k[0]}/{k[1]}/{k[2]}": {
                "GBps": med(v["GBps"]),
                "GBps_min": min(v["GBps"]),
                "GBps_max": max(v["GBps"]),
                "ops_per_s": med(v["ops"]),
                "call_us_p50": med(v["p50"]),
                "n": len(v["GBps"]),
            }
            for k, v in sorted(acc.items())
        }
    lim = raw.get("limits", [])
    out["limits"] = {
        "memcpy_GBps": med([r["memcpy"]["copy_GBps_mean"] for r in lim if "memcpy" in r]),
        "iperf3_1_GBps": med(
            [
                r["iperf3"][0]["receiver_GBps"]
                for r in lim
                if r.get("iperf3") and "receiver_GBps" in r["iperf3"][0]
            ]
        ),
        "rtt_4k_us": med(
            [r["tcp_pingpong"][1]["rtt_us_p50"] for r in lim if r.get("tcp_pingpong")]
        ),
    }
    sweeps = raw.get("memcpy", [])
    if sweeps:
        blocks = sorted({int(b) for s in sweeps for b in s})
        out["limits"]["memcpy_by_block_GBps"] = {
            str(b): med([s[str(b)] for s in sweeps if str(b) in s]) for b in blocks
        }
    return out


def fmt_block(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def table(summary: dict[str, Any]) -> str:
    lim = summary["limits"]
    pub = summary.get("published", {})
    tcp = summary.get("ours-tcp", {})
    shm = summary.get("ours-shm", {})
    fac = summary.get("facade", {})
    keys = sorted(
        set(tcp) | set(pub) | set(shm),
        key=lambda k: (k.split("/")[0] != "write", int(k.split("/")[1]), int(k.split("/")[2])),
    )

    def g(d: dict[str, Any], k: str, f: str = "GBps") -> float | None:
        v = d.get(k)
        return None if v is None else v[f]

    def s(x: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    lines = [
        "| op | block | batch | ours tcp GB/s | ours shm GB/s | published GB/s | facade GB/s "
        "| tcp / published | shm / published | ours tcp kops/s | published kops/s "
        "| ours tcp p50 µs | published p50 µs | p50 ratio | limit GB/s | tcp / iperf3 | shm / memcpy |",
        "|" + "---|" * 17,
    ]
    for k in keys:
        op, b, bt = k.split("/")
        blk = int(b)
        mc = lim.get("memcpy_by_block_GBps", {}).get(b) or lim.get("memcpy_GBps")
        ip = lim.get("iperf3_1_GBps")
        t, p, sh, fa = g(tcp, k), g(pub, k), g(shm, k), g(fac, k)
        t50, p50 = g(tcp, k, "call_us_p50"), g(pub, k, "call_us_p50")
        tops, pops = g(tcp, k, "ops_per_s"), g(pub, k, "ops_per_s")
        lines.append(
            f"| {op} | {fmt_block(blk)} | {bt} | {s(t)} | {s(sh)} | {s(p)} | {s(fa)} "
            f"| {ratio(t, p)} | {ratio(sh, p)} | {s(tops and tops / 1e3, '{:.1f}')} "
            f"| {s(pops and pops / 1e3, '{:.1f}')} | {s(t50, '{:.0f}')} | {s(p50, '{:.0f}')} "
            f"| {ratio(t50, p50)} | iperf3 {s(ip, '{:.2f}')} / memcpy {s(mc, '{:.1f}')} "
            f"| {ratio(t, ip)} | {ratio(sh, mc)} |"
        )
    return "\n".join(lines)


def docs_tables(summary: dict[str, Any]) -> str:
    """Two narrower tables for docs/benchmarks.md: TCP side by side, and shm against memcpy."""
    lim = summary["limits"]
    pub, tcp, shm, fac = (
        summary.get(k, {}) for k in ("published", "ours-tcp", "ours-shm", "facade")
    )
    ip = lim.get("iperf3_1_GBps")
    mcb = lim.get("memcpy_by_block_GBps", {})

    def order(k: str) -> tuple[bool, int, int]:
        op, b, bt = k.split("/")
        return (op != "write", int(b), int(bt))

    def v(d: dict[str, Any], k: str, f: str = "GBps") -> float | None:
        return d[k][f] if k in d else None

    def f(x: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    def r(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"**{a / b:.2f}x**"

    out = [
        "| op | block | batch | ours GB/s | published GB/s | ours / published | facade GB/s "
        "| ours kops/s | published kops/s | ours p50 µs | published p50 µs | p50 ours / published "
        "| ours / iperf3 |",
        "|" + "---|" * 13,
    ]
    for k in sorted(set(tcp) | set(pub), key=order):
        op, b, bt = k.split("/")
        t, p = v(tcp, k), v(pub, k)
        to, po = v(tcp, k, "ops_per_s"), v(pub, k, "ops_per_s")
        t5, p5 = v(tcp, k, "call_us_p50"), v(pub, k, "call_us_p50")
        out.append(
            f"| {op} | {fmt_block(int(b))} | {bt} | {f(t)} | {f(p)} | {r(t, p)} | {f(v(fac, k))} "
            f"| {f(to and to / 1e3, '{:.1f}')} | {f(po and po / 1e3, '{:.1f}')} "
            f"| {f(t5, '{:.0f}')} | {f(p5, '{:.0f}')} | {r(t5, p5)} | {r(t, ip)} |"
        )
    out += [
        "",
        "| op | block | batch | shm GB/s | memcpy GB/s (same block) | shm / memcpy | ours tcp GB/s "
        "| published GB/s | shm / published |",
        "|" + "---|" * 9,
    ]
    for k in sorted(shm, key=order):
        op, b, bt = k.split("/")
        sh, mc = v(shm, k), mcb.get(b)
        out.append(
            f"| {op} | {fmt_block(int(b))} | {bt} | {f(sh)} | {f(mc, '{:.2f}')} | {r(sh, mc)} "
            f"| {f(v(tcp, k))} | {f(v(pub, k))} | {r(sh, v(pub, k))} |"
        )
    return "\n".join(out)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one panel per batch size that has data (a run with --batches 1 draws one panel)
    batches = sorted(
        {
            int(k.split("/")[2])
            for series in ("ours-shm", "ours-tcp", "published", "facade")
            for k in (summary.get(series) or {})
            if k.count("/") == 2
        }
    ) or [1]
    fig, axes_ = plt.subplots(
        1, len(batches), figsize=(6.5 * len(batches), 5), sharey=True, squeeze=False
    )
    axes = list(axes_[0])
    styles = {
        "ours-shm": ("tab:green", "shm (mooncake-py)"),
        "ours-tcp": ("tab:blue", "tcp (mooncake-py)"),
        "published": ("tab:red", "tcp (published Mooncake)"),
        "facade": ("tab:purple", "tcp, sync facade (mooncake-py)"),
    }
    lim = summary["limits"]
    for ax, batch in zip(axes, batches, strict=True):
        for series, (color, label) in styles.items():
            data = summary.get(series)
            if not data:
                continue
            for op, ls in (("write", "-"), ("read", "--")):
                pts = sorted(
                    (int(k.split("/")[1]), v["GBps"])
                    for k, v in data.items()
                    if k.startswith(op + "/") and k.endswith(f"/{batch}")
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        ls,
                        marker="o",
                        color=color,
                        label=f"{label} {op}",
                    )
        mcb = lim.get("memcpy_by_block_GBps")
        if mcb:
            pts = sorted((int(b), v) for b, v in mcb.items())
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                ":",
                color="black",
                label="memcpy, 1 thread (limit for shm)",
            )
        if lim.get("iperf3_1_GBps"):
            ax.axhline(
                lim["iperf3_1_GBps"],
                color="gray",
                ls="-.",
                label="iperf3 loopback, 1 stream (limit for tcp)",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block size (bytes)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("throughput (GB/s, median of rounds)")
    # one legend for the figure, with every series any panel drew
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), fontsize=7, loc="lower center", ncol=3)
    fig.suptitle("Transfer Engine between two processes on one host (2-core shared VM)")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(seen) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tcp-sizes", default="4K,64K,256K,1M,4M,16M")
    ap.add_argument("--shm-sizes", default="4K,64K,256K,1M,4M,16M,64M")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--buffer", default="512M")
    ap.add_argument("--case-seconds", type=float, default=0.6)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--anchor-python", default=find_anchor_python())
    ap.add_argument("--no-published", action="store_true")
    ap.add_argument("--no-limits", action="store_true")
    ap.add_argument(
        "--facade", action="store_true", help="also run the anchor's script against our sync facade"
    )
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "te"))
    ap.add_argument("--summarize-only", action="store_true", help="re-summarize OUT/raw.json")
    ap.add_argument(
        "--small-ops", action="store_true", help="the small-op latency table (module docstring)"
    )
    args = ap.parse_args()

    # absolute: the published side's child runs in the anchor scripts' directory
    outdir = Path(args.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    if args.small_ops:
        if args.tcp_sizes == ap.get_default("tcp_sizes"):
            args.tcp_sizes = "4K"
        if args.batches == ap.get_default("batches"):
            args.batches = "1"
        return small_ops(args, outdir)
    anchor_dir = find_anchor_dir()
    raw: dict[str, list[dict[str, Any]]] = {}
    if args.summarize_only:
        raw = json.loads((outdir / "raw.json").read_text())
    else:
        py = args.anchor_python
        do_pub = bool(py and anchor_dir and not args.no_published)
        if not do_pub:
            print("published Mooncake: not run (no anchor venv or --no-published)", file=sys.stderr)
        sweep_sizes = sorted({int(x) for x in _sizes(args.tcp_sizes) + _sizes(args.shm_sizes)})
        for rnd in range(args.rounds):
            jobs: list[tuple[str, Any]] = []
            for t in args.transports.split(","):
                sizes = args.shm_sizes if t == "shm" else args.tcp_sizes
                jobs.append((f"ours-{t}", lambda f, t=t, sizes=sizes: ours(args, t, sizes, f)))
            if do_pub:
                assert py is not None and anchor_dir is not None
                jobs.append(("published", lambda f: published(args, py, anchor_dir, f)))
                if args.facade:
                    jobs.append(
                        (
                            "facade",
                            lambda f: published(args, sys.executable, anchor_dir, f, facade=True),
                        )
                    )
            if rnd % 2:
                jobs.reverse()  # interleave: neither side always runs first
            for series, job in jobs:
                f = outdir / f"{series}-{rnd}.json"
                f.unlink(missing_ok=True)
                r = job(f)
                if r is not None:
                    raw.setdefault(series, []).append(r)
            if not args.no_limits and anchor_dir is not None:
                f = outdir / f"limits-{rnd}.json"
                f.unlink(missing_ok=True)
                r = limits(sys.executable, anchor_dir, f)
                if r is not None:
                    raw.setdefault("limits", []).append(r)
            sw = memcpy_sweep(sweep_sizes)
            raw.setdefault("memcpy", []).append({str(k): v for k, v in sw.items()})
            (outdir / "raw.json").write_text(json.dumps(raw, indent=1))
    summary = summarize(raw)
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    md = table(summary)
    lim = summary["limits"]
    md += (
        f"\n\nLimits (median): memcpy 256 MiB {lim['memcpy_GBps'] or 0:.1f} GB/s, "
        f"iperf3 1 stream {lim['iperf3_1_GBps'] or 0:.2f} GB/s, "
        f"TCP ping-pong 4 KiB p50 {lim['rtt_4k_us'] or 0:.0f} µs; "
        f"{max((len(v) for v in raw.values()), default=0)} rounds.\n"
    )
    (outdir / "table.md").write_text(md)
    (outdir / "docs-tables.md").write_text(docs_tables(summary) + "\n")
    print(md)
    plot(summary, outdir / "throughput.png")
    print(f"wrote {outdir}/summary.json, table.md, throughput.png", file=sys.stderr)
    return 0


def _sizes(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        m = MIB if x.endswith("M") else KIB if x.endswith("K") else 1
        out.append(int(x.rstrip("MK")) * m)
    return out


if __name__ == "__main__":
    sys.exit(main())
