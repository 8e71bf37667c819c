#!/usr/bin/env python3
"""Metadata-call speed and memory: this package's master vs the published master, same run.

Starts both masters with the same flags (ours: ``mooncake._cli.master:gflags_main`` run by this
interpreter, the repository on ``PYTHONPATH``; published: the anchor venv's ``mooncake_master``
binary), and for each ``--clients`` store client processes (this script, ``--role client``,
run by that side's own python: ours with ``mooncake.store.MooncakeDistributedStore`` from the
repository, the published one with the wheel's). Every client mounts a pre-faulted segment and
registers a pre-faulted staging buffer. Then, alternating the sides phase by phase (who goes
first alternates per round), with client 0 alone and with all clients at once:

* ``fill``: ``batch_put_from`` of 128 keys x 64 B until ``--objects`` objects (keys/s); master
  RSS per object = (RSS after - RSS before) / objects added,
* ``is_exist`` (sequential calls on existing keys), ``batch_is_exist`` (128 keys),
  ``put`` of 64 B and of 1 KiB (new keys), ``batch_put_from`` (128 keys x 64 B): each for
  ``--seconds`` per round, rate = sum over clients of calls (or keys) / own elapsed time,
  p50/p99 per call over every client's samples, and the master's CPU time (user + system,
  from ``/proc``) per call or key: what the master costs, whatever share of the CPUs the
  scheduler gave it.

Prints the medians over ``--rounds``, the ratio ours/published per row, the load average, and
writes a summary JSON (``--json``, default ``bench-results/master-vs-published-DATE.json`` under
the working directory; git ignores ``bench-results/``).
``--profile DIR`` runs ``py-spy record`` on our master and our client 0 during the first
round's one-client ``--profile-op`` phase (default ``is_exist``) (``--only ours`` to profile without the published side).

    python benchmarks/master_vs_published.py                         # 3 rounds, 1 and 4 clients
    python benchmarks/master_vs_published.py --rounds 5 --objects 200000
    python benchmarks/master_vs_published.py --only ours --ops is_exist --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_VENV = Path(
    os.environ.get("MOONCAKE_ANCHOR_VENV", str(Path.home() / ".cache/mooncake-anchor-venv"))
)
PY_SPY = Path(sys.executable).parent / "py-spy"
OPS = ["is_exist", "batch_is_exist", "put_64", "put_1k", "batch_put_from"]
BATCH = 128
KEY_PAD = "k" * 24  # keys of ~40 bytes, as the scale goal assumes


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = int(s.getsockname()[1])
    s.close()
    return p


def wait_port(port: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[int], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] / 1e3


# --------------------------------------------------------------------------------- client


class Client:
    """One store client driven by line commands on stdin (``--role client``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np

        from mooncake.store import MooncakeDistributedStore

        self.np = np
        self.idx = args.index
        self.s = MooncakeDistributedStore()
        rc = self.s.setup(
            "127.0.0.1",
            "P2PHANDSHAKE",
            args.segment_mib << 20,
            64 << 20,
            "tcp",
            "",
            args.master,
        )
        if rc != 0:
            raise SystemExit(f"setup failed: {rc}")
        self.buf = np.ones(BATCH * 1024, dtype=np.uint8)  # pre-faulted
        self.buf[:] = 7
        rc = self.s.register_buffer(self.buf.ctypes.data, self.buf.nbytes)
        if rc != 0:
            raise SystemExit(f"register_buffer failed: {rc}")
        self.v64 = bytes(range(64))
        self.v1k = bytes(1024)
        self.filled: list[str] = []
        self.seq = 0

    def key(self, tag: str) -> str:
        self.seq += 1
        return f"c{self.idx}-{tag}-{self.seq}-{KEY_PAD}"

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        start_at = cmd.get("start_at")
        if start_at:
            time.sleep(max(0.0, start_at - time.time()))
        if op == "fill":
            return self.fill(int(cmd["n"]))
        return self.timed(op, float(cmd["seconds"]))

    def _batch_from(self, keys: list[str]) -> list[int]:
        base = self.buf.ctypes.data
        return list(
            self.s.batch_put_from(keys, [base + 64 * i for i in range(len(keys))], [64] * len(keys))
        )

    def fill(self, n: int) -> dict[str, Any]:
        done = bad = 0
        t0 = time.perf_counter()
        while done < n:
            keys = [self.key("f") for _ in range(min(BATCH, n - done))]
            rcs = self._batch_from(keys)
            bad += sum(1 for r in rcs if r != 0)
            self.filled += keys
            done += len(keys)
        dt = time.perf_counter() - t0
        return {"count": done, "seconds": dt, "errors": bad}

    def timed(self, op: str, seconds: float) -> dict[str, Any]:
        import random

        rnd = random.Random(self.idx)
        s = self.s
        lat: list[int] = []
        count = errors = 0
        pc = time.perf_counter_ns
        keys = self.filled
        end = pc() + int(seconds * 1e9)
        t0 = pc()
        if op == "is_exist":
            while pc() < end:
                k = keys[rnd.randrange(len(keys))]
                a = pc()
                r = s.is_exist(k)
                lat.append(pc() - a)
                errors += r != 1
                count += 1
        elif op == "batch_is_exist":
            while pc() < end:
                ks = rnd.sample(keys, BATCH)
                a = pc()
                rs = s.batch_is_exist(ks)
                lat.append(pc() - a)
                errors += sum(1 for r in rs if r != 1)
                count += BATCH
        elif op in ("put_64", "put_1k"):
            v = self.v64 if op == "put_64" else self.v1k
            tag = "p" if op == "put_64" else "q"
            while pc() < end:
                k = self.key(tag)
                a = pc()
                r = s.put(k, v)
                lat.append(pc() - a)
                errors += r != 0
                count += 1
        elif op == "batch_put_from":
            while pc() < end:
                ks = [self.key("b") for _ in range(BATCH)]
                a = pc()
                rs = self._batch_from(ks)
                lat.append(pc() - a)
                errors += sum(1 for r in rs if r != 0)
                count += BATCH
        else:
            raise SystemExit(f"unknown op {op}")
        dt = (pc() - t0) / 1e9
        return {"count": count, "seconds": dt, "errors": errors, "lat_ns": lat}


def client_main(args: argparse.Namespace) -> int:
    c = Client(args)
    print("READY " + json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        res = c.run(cmd)
        print("RESULT " + json.dumps(res), flush=True)
    c.s.close()
    os._exit(0)


# --------------------------------------------------------------------------- orchestrator


class Side:
    """A master and its client processes (``ours`` or ``published``)."""

    def __init__(self, name: str, args: argparse.Namespace, logdir: Path) -> None:
        self.name = name
        self.rpc = free_port()
        metrics = free_port()
        flags = [
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}",
            *args.master_flag,
        ]
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        if name == "published":
            env.pop("PYTHONPATH", None)
            self.py = str(ANCHOR_VENV / "bin" / "python")
            mcmd = [str(ANCHOR_VENV / "bin" / "mooncake_master"), *flags]
        else:
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            self.py = sys.executable
            mcmd = [
                sys.executable,
                "-c",
                "import sys; from mooncake._cli.master import gflags_main; sys.exit(gflags_main())",
                *flags,
            ]
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.master = subprocess.Popen(
            mcmd,
            stdout=subprocess.DEVNULL,
            stderr=open(logdir / f"{name}-master.log", "w"),  # noqa: SIM115 (lives as long as the process)
            env=env,
            cwd="/",
        )
        if not wait_port(self.rpc, 30):
            raise SystemExit(f"{name} master did not open its RPC port; see {logdir}")
        self.clients: list[subprocess.Popen[str]] = []
        self.client_pids: list[int] = []
        for i in range(args.clients):
            p = subprocess.Popen(
                [
                    self.py,
                    str(Path(__file__).resolve()),
                    "--role",
                    "client",
                    "--index",
                    str(i),
                    "--master",
                    f"127.0.0.1:{self.rpc}",
                    "--segment-mib",
                    str(args.segment_mib),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(logdir / f"{name}-client{i}.log", "w"),  # noqa: SIM115
                text=True,
                env=env,
                cwd="/",
            )
            self.clients.append(p)
        for p in self.clients:
            self.client_pids.append(int(self._read(p)["pid"]))

    def _read(self, p: subprocess.Popen[str]) -> dict[str, Any]:
        assert p.stdout is not None
        while True:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{self.name}: a client exited (see its log)")
            tag, _, rest = line.partition(" ")
            if tag in ("READY", "RESULT"):
                return dict(json.loads(rest))

    def run(self, n_clients: int, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        use = self.clients[:n_clients]
        cmd = dict(cmd, start_at=time.time() + 0.1 if n_clients > 1 else 0)
        line = json.dumps(cmd) + "\n"
        for p in use:
            assert p.stdin is not None
            p.stdin.write(line)
            p.stdin.flush()
        return [self._read(p) for p in use]

    def master_rss(self) -> int:
        return rss_bytes(self.master.pid)

    def close(self) -> None:
        for p in self.clients:
            try:
                assert p.stdin is not None
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.clients:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.master.terminate()
        try:
            self.master.wait(10)
        except subprocess.TimeoutExpired:
            self.master.kill()


def summarize(results: list[dict[str, Any]], keys_per_call: int) -> dict[str, Any]:
    rate = sum(r["count"] / r["seconds"] for r in results if r["seconds"] > 0)
    lat: list[int] = []
    for r in results:
        lat += r.get("lat_ns", [])
    return {
        "rate": rate,
        "p50_us": pct(lat, 0.5),
        "p99_us": pct(lat, 0.99),
        "errors": sum(r["errors"] for r in results),
        "calls": sum(len(r.get("lat_ns", [])) for r in results),
        "keys_per_call": keys_per_call,
    }


def profile(side: Side, outdir: Path, seconds: float) -> list[subprocess.Popen[bytes]]:
    outdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for what, pid in (("master", side.master.pid), ("client0", side.client_pids[0])):
        cmd = [
            str(PY_SPY),
            "record",
            "--nonblocking",
            "-r",
            "500",
            "-d",
            str(int(seconds)),
            "-f",
            "raw",
            "-o",
            str(outdir / f"{side.name}-{what}.txt"),
            "--pid",
            str(pid),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches
    return procs


def orchestrate(args: argparse.Namespace) -> int:
    sides = ["ours", "published"] if not args.only else [args.only]
    if "published" in sides and not (ANCHOR_VENV / "bin" / "mooncake_master").exists():
        log("published Mooncake venv not found (scripts/setup-anchor.sh); measuring ours only")
        sides = ["ours"]
    ops = [o for o in args.ops.split(",") if o]
    counts = sorted({1, args.clients})
    logdir = Path(tempfile.mkdtemp(prefix="mc-master-vs-"))
    log(f"logs in {logdir}; load average {os.getloadavg()[0]:.2f}")
    running: dict[str, Side] = {}
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    memory: dict[str, dict[str, Any]] = {}
    try:
        for name in sides:
            log(f"starting {name}: master + {args.clients} clients")
            running[name] = Side(name, args, logdir)
        for name, side in running.items():
            base = side.master_rss()
            per = args.objects // args.clients
            t0 = time.perf_counter()
            res = side.run(args.clients, {"op": "fill", "n": per})
            dt = time.perf_counter() - t0
            after = side.master_rss()
            n = sum(r["count"] for r in res)
            memory[name] = {
                "objects": n,
                "rss_before": base,
                "rss_after": after,
                "bytes_per_object": (after - base) / n,
                "fill_keys_per_s": n / dt,
                "fill_errors": sum(r["errors"] for r in res),
            }
            log(
                f"{name}: filled {n} objects of 64 B in {dt:.1f} s ({n / dt:,.0f} keys/s, "
                f"{memory[name]['fill_errors']} errors); master RSS {base / 2**20:.0f} -> "
                f"{after / 2**20:.0f} MiB = {(after - base) / n:.0f} B/object"
            )
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else list(reversed(sides))
            for op in ops:
                for nc in counts:
                    for name in order:
                        side = running[name]
                        spies = []
                        if (
                            args.profile
                            and rnd == 0
                            and nc == 1
                            and op == args.profile_op
                            and name == "ours"
                        ):
                            spies = profile(side, Path(args.profile), args.seconds)
                        cpu0 = cpu_seconds(side.master.pid)
                        res = side.run(nc, {"op": op, "seconds": args.seconds})
                        cpu = cpu_seconds(side.master.pid) - cpu0
                        for sp in spies:
                            sp.wait(30)
                        kpc = BATCH if op in ("batch_is_exist", "batch_put_from") else 1
                        s = summarize(res, kpc)
                        s["master_cpu_us"] = cpu / max(1, sum(r["count"] for r in res)) * 1e6
                        rows.setdefault((op, nc, name), []).append(s)
                        unit = "keys/s" if kpc > 1 else "calls/s"
                        log(
                            f"round {rnd + 1}/{args.rounds} {op:15} {nc} client(s) {name:9} "
                            f"{s['rate']:>10,.0f} {unit:7} p50 {s['p50_us']:7.0f} us "
                            f"p99 {s['p99_us']:7.0f} us  errors {s['errors']}  "
                            f"(load {os.getloadavg()[0]:.1f})"
                        )
        for name, side in running.items():
            memory[name]["rss_end"] = side.master_rss()
    finally:
        for side in running.values():
            side.close()
    load = os.getloadavg()
    table = []
    for op in ops:
        for nc in counts:
            row: dict[str, Any] = {"op": op, "clients": nc}
            for name in sides:
                runs = rows.get((op, nc, name), [])
                for m in ("rate", "p50_us", "p99_us", "master_cpu_us"):
                    row[f"{name}_{m}"] = statistics.median(r[m] for r in runs) if runs else None
                row[f"{name}_rates"] = [round(r["rate"]) for r in runs]
                row[f"{name}_errors"] = sum(r["errors"] for r in runs)
            if len(sides) == 2 and row["published_rate"]:
                row["ratio"] = row["ours_rate"] / row["published_rate"]
            table.append(row)
    print(
        f"\nMaster over RPC, medians of {args.rounds} round(s) x {args.seconds:g} s; "
        f"{args.objects} objects of 64 B preloaded; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} on {os.cpu_count()} CPUs"
    )
    hdr = f"{'op':15} {'clients':>7} " + " ".join(
        f"{s + ' rate':>16} {'p50/p99 us':>13} {'cpu us':>6}" for s in sides
    )
    hdr += "   ratio" if len(sides) == 2 else ""
    print(hdr)
    print("-" * len(hdr))
    for r in table:
        cells = " ".join(
            f"{r[f'{s}_rate']:>16,.0f} {r[f'{s}_p50_us']:>6.0f}/{r[f'{s}_p99_us']:<6.0f} "
            f"{r[f'{s}_master_cpu_us']:>6.1f}"
            for s in sides
        )
        ratio = f"  {r['ratio']:5.2f}x" if "ratio" in r else ""
        errs = "".join(f"  ({s}: {r[f'{s}_errors']} errors)" for s in sides if r[f"{s}_errors"])
        print(f"{r['op']:15} {r['clients']:>7} {cells}{ratio}{errs}")
    print(
        "(rates: calls/s for is_exist and put, keys/s for the 128-key batches; cpu us: the "
        "master's user+system CPU per call or per key)"
    )
    for name, m in memory.items():
        print(
            f"{name:9} master RSS per object: {m['bytes_per_object']:.0f} B "
            f"({m['objects']} objects; {m['rss_before'] / 2**20:.0f} -> {m['rss_after'] / 2**20:.0f} MiB, "
            f"{m['rss_end'] / 2**20:.0f} MiB at the end); fill {m['fill_keys_per_s']:,.0f} keys/s"
        )
    if len(sides) == 2:
        print("\nGoal: >= 1.5x the published rate")
        for r in table:
            print(
                f"  [{'ok' if r.get('ratio', 0) >= 1.5 else 'MISSED'}] {r['op']} x{r['clients']} "
                f"{r.get('ratio', float('nan')):.2f}x"
            )
    # never into the source tree unasked: bench-results/ (git-ignored) of the working directory
    out = (
        Path(args.json).resolve()
        if args.json
        else Path.cwd()
        / "bench-results"
        / f"master-vs-published-{time.strftime('%Y-%m-%d-%H%M')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "load_average": load,
                "cpus": os.cpu_count(),
                "rounds": args.rounds,
                "seconds": args.seconds,
                "objects": args.objects,
                "clients": args.clients,
                "rows": table,
                "memory": memory,
            },
            indent=1,
        )
    )
    print(f"summary: {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=["orchestrator", "client"], default="orchestrator")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5, help="per phase per round")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--objects", type=int, default=100_000, help="64 B objects preloaded")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--only", choices=["ours", "published"])
    ap.add_argument("--segment-mib", type=int, default=128)
    ap.add_argument(
        "--master-flag", action="append", default=[], help="extra master flag (both sides)"
    )
    ap.add_argument("--profile", help="py-spy our master and client 0 during is_exist into DIR")
    ap.add_argument("--profile-op", default="is_exist", help="the phase --profile records")
    ap.add_argument("--json")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--master")
    args = ap.parse_args()
    if args.role == "client":
        return client_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
