#!/usr/bin/env python3
"""Store benchmark: this package's store vs the published Mooncake store, same script, same run.

Runs the anchor's unmodified ``mooncake_store_bench.py`` (``benchmarks/anchor``) alternately against

* the **published** wheel (the anchor venv's python, ``PYTHONPATH`` removed, its own
  ``mooncake_master`` binary), and
* **this** package (this interpreter with the repository on ``PYTHONPATH`` and a
  ``mooncake_master`` wrapper for ``mooncake._cli.master:gflags_main`` first on ``PATH``),

``--runs`` times each, then prints medians side by side (value x API: put/get GB/s and p50 us),
the ratio ours/published, and the two targets (4 KiB put/get p50 <= published; 1 MiB x 32
``batch_put_from``/``batch_get_into`` >= 1.5x published throughput). ``--phases`` adds the
``semantics``/``full``/``kill`` phases (their outcomes are printed by the anchor script itself;
``--keep DIR`` keeps every JSON).

    python benchmarks/store_bench.py                       # perf, 1 run each, all sizes
    python benchmarks/store_bench.py --runs 3 --sizes 4K,1M
    python benchmarks/store_bench.py --phases semantics,full,kill --only ours
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ANCHOR = Path(os.environ.get("MOONCAKE_ANCHOR_DIR", str(ROOT / "benchmarks" / "anchor")))
VENVS = [Path.home() / ".cache/mooncake-anchor-venv", Path("/opt/anchor-venv")]


def find_anchor_python(given: str | None) -> str | None:
    if given:
        return given
    for v in VENVS:
        py = v / "bin" / "python"
        if py.exists():
            return str(py)
    return None


def master_wrapper(tmp: Path) -> Path:
    """A ``mooncake_master`` executable that runs this package's gflags-compatible master."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    w = bindir / "mooncake_master"
    w.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import sys; from mooncake._cli.master import gflags_main; "
        'sys.exit(gflags_main())\' "$@"\n'
    )
    w.chmod(0o755)
    return bindir


def run_one(
    which: str, args: argparse.Namespace, anchor_py: str | None, tmp: Path, i: int
) -> dict[str, Any]:
    out = tmp / f"{which}-{i}.json"
    bench = str(args.anchor_dir / "mooncake_store_bench.py")
    flags = ["--phases", args.phases, "--sizes", args.sizes, "--json", str(out)]
    flags += ["--logdir", str(tmp / f"logs-{which}-{i}")]
    env = dict(os.environ)
    if which == "published":
        assert anchor_py is not None
        env.pop("PYTHONPATH", None)
        cmd = [anchor_py, bench, *flags]
    else:
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PATH"] = str(master_wrapper(tmp)) + os.pathsep + env.get("PATH", "")
        cmd = [sys.executable, bench, *flags]
    print(
        f"== {which} run {i + 1}: {' '.join(cmd[1:2])} {' '.join(flags[:4])}",
        file=sys.stderr,
        flush=True,
    )
    r = subprocess.run(cmd, env=env, cwd=str(args.anchor_dir), stdout=subprocess.PIPE, text=True)
    if args.show:
        print(f"---- {which} run {i + 1} ----")
        print(r.stdout)
    if r.returncode != 0 or not out.exists():
        raise SystemExit(f"{which} run {i + 1} failed (rc={r.returncode}); logs in {tmp}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for which, runs in results.items():
        for run in runs:
            for x in run.get("perf", []):
                r = rows.setdefault((x["size"], x["api"]), {"size": x["size"], "api": x["api"]})
                for m in ("put_GBps", "put_p50_us", "get_GBps", "get_p50_us"):
                    r.setdefault(f"{which}_{m}", []).append(x[m])
                r.setdefault(f"{which}_bad", []).append(x["verify_bad"])
                r.setdefault(f"{which}_errors", []).append(bool(x["put_errors"] or x["get_errors"]))
    out = []
    for key in sorted(rows):
        r = rows[key]
        for k, v in list(r.items()):
            if isinstance(v, list) and k.endswith(("GBps", "us")):
                r[k] = med(v)
        out.append(r)
    return out


def fmt_size(n: int) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sizes", default="4K,64K,1M,4M")
    ap.add_argument("--phases", default="perf")
    ap.add_argument("--only", choices=["ours", "published"])
    ap.add_argument("--anchor-dir", type=Path, default=DEFAULT_ANCHOR)
    ap.add_argument("--anchor-python")
    ap.add_argument("--show", action="store_true", help="print each run's own report")
    ap.add_argument("--keep", type=Path, help="keep every JSON in this folder")
    ap.add_argument("--json", help="write the side-by-side rows here")
    args = ap.parse_args()
    anchor_py = find_anchor_python(args.anchor_python)
    sides = ["ours", "published"] if not args.only else [args.only]
    if "published" in sides and anchor_py is None:
        print(
            "published Mooncake venv not found (run scripts/setup-anchor.sh); measuring ours only",
            file=sys.stderr,
        )
        sides = ["ours"]
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mc-store-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for i in range(args.runs):
        for which in sides if i % 2 == 0 else reversed(sides):  # alternate who goes first
            results[which].append(run_one(which, args, anchor_py, tmp, i))
    if "perf" not in args.phases.split(","):
        return 0
    rows = table(results)
    print(
        f"\nStore perf, median of {args.runs} run(s) each; load average now {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs. Ratio = ours / published (p50: published / ours; >1 = ours better)"
    )
    hdr = f"{'value':>7} {'API':34} " + " ".join(
        f"{h:>17}" for h in ("put GB/s", "put p50 us", "get GB/s", "get p50 us")
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        cells = []
        for m, better_low in (
            ("put_GBps", False),
            ("put_p50_us", True),
            ("get_GBps", False),
            ("get_p50_us", True),
        ):
            o = r.get(f"ours_{m}", float("nan"))
            p = r.get(f"published_{m}", float("nan"))
            ratio = (
                (p / o if better_low else o / p)
                if (o and p and o == o and p == p)
                else float("nan")
            )
            fmt = "{:.0f}" if better_low else "{:.3f}"
            cells.append(f"{fmt.format(o):>6}|{fmt.format(p):>6} {ratio:4.2f}x")
        bad = any(r.get("ours_bad", [])) or any(r.get("ours_errors", []))
        print(
            f"{fmt_size(r['size']):>7} {r['api']:34} "
            + " ".join(f"{c:>17}" for c in cells)
            + ("  (ours: errors/bad values!)" if bad else "")
        )
    print("(cells: ours|published ratio)")
    if len(sides) == 2:

        def get(size: int, api: str, m: str, side: str) -> float:
            for r in rows:
                if r["size"] == size and r["api"] == api:
                    return float(r.get(f"{side}_{m}", float("nan")))
            return float("nan")

        checks = [
            (
                "4 KiB put p50 <= published",
                get(4096, "put/get", "put_p50_us", "ours")
                <= get(4096, "put/get", "put_p50_us", "published"),
            ),
            (
                "4 KiB get p50 <= published",
                get(4096, "put/get", "get_p50_us", "ours")
                <= get(4096, "put/get", "get_p50_us", "published"),
            ),
        ]
        api = "batch_put_from/batch_get_into"
        for m in ("put_GBps", "get_GBps"):
            o, p = get(1 << 20, api, m, "ours"), get(1 << 20, api, m, "published")
            checks.append(
                (
                    f"1 MiB x 32 {api.split('/')[m == 'get_GBps']} >= 1.5x published ({o / p:.2f}x)"
                    if p == p and p
                    else f"1 MiB x 32 {m}",
                    o >= 1.5 * p,
                )
            )
        print("\nTargets:")
        for name, ok in checks:
            print(f"  [{'ok' if ok else 'MISSED'}] {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
