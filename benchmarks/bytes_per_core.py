#!/usr/bin/env python3
"""Bytes moved per busy CPU core: the store's ``batch_get_into`` and the engine's reads over TCP,
ours against the published wheel, and iperf3 single-stream, in one run.

Every case runs real processes on loopback and charges them all: the CPU seconds (user + system,
``/proc/PID/stat``, all threads) that the master, the holder (or engine target) and the reader
spent during the timed window, against the bytes the reader got. Cases:

* ``store``: a master, a holder process that put ``--keys`` values of each ``--sizes`` into its own
  segment, and a reader process (its own small segment mounted only after the puts, so every
  value lives on the holder) that ``batch_get_into``\\ s them in batches of ``--batch`` for
  ``--seconds``. Ours runs with ``MC_STORE_MEMCPY=0`` (no same-host shared-memory plane: the
  bytes cross TCP, as between hosts).
* ``engine``: a target process with a registered buffer and a reader that
  ``batch_transfer_sync_read``\\ s 32 x 1 MiB, and ``transfer_sync_read``\\ s of 64 MiB, over ``tcp``
  (``MC_FORCE_TCP=1``).
* ``iperf3``: one stream over loopback, its own CPU figures (sender + receiver).

The published side runs the same roles in the anchor venv's interpreter (``PYTHONPATH``
removed, its own ``mooncake_master``); ``--only ours`` skips it. Medians over ``--runs``; the
load average is printed (a busy host inflates CPU per byte less than it hides wake-ups, but
still: compare within a run).

    python benchmarks/bytes_per_core.py --runs 3
    python benchmarks/bytes_per_core.py --runs 3 --sizes 1M,8M --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from sidemaster import free_port, start_master, wait_serving  # noqa: E402

MIB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")
ANCHOR_VENVS = [
    Path(os.environ.get("MOONCAKE_ANCHOR_VENV", Path.home() / ".cache/mooncake-anchor-venv")),
    Path("/opt/anchor-venv"),
]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# -- roles (run in either interpreter: standard library + numpy + that side's mooncake) --------


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _buffer(nbytes: int) -> Any:
    import numpy as np

    buf = np.empty(nbytes, dtype=np.uint8)
    buf[:] = 1  # pre-fault every page
    return buf


def _timed_window(step: Any, nbytes: int, seconds: float) -> None:
    """Say ready; on the next line run ``step`` (``nbytes`` a call; it returns an error text or
    None) for ``seconds``, say how many bytes in how long (or the error); wait for quit."""
    _say({"ready": True})
    sys.stdin.readline()
    moved, n = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n == 0:
        err = step()
        if err is not None:
            _say({"error": err})
            return
        moved += nbytes
        n += 1
    _say({"bytes": moved, "seconds": time.perf_counter() - t0, "calls": n})
    sys.stdin.readline()


def role_holder(args: argparse.Namespace) -> None:
    """Set up with a segment big enough for every value, put them, say ready, wait for quit."""
    import numpy as np

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    size, keys = args.size, args.keys
    s = MooncakeDistributedStore()
    seg = size * keys + 64 * MIB
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", seg, 64 * MIB, "tcp", "", args.master)
    if rc != 0:
        _say({"error": f"holder setup rc={rc}"})
        return
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    cfg.preferred_segments = [s.get_hostname()]
    value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    for i in range(keys):
        rc = s.put(f"v{i}", value, cfg)
        if rc != 0:
            _say({"error": f"put rc={rc}"})
            return
    _say({"ready": True})
    sys.stdin.readline()
    s.close()


def role_reader(args: argparse.Namespace) -> None:
    """Set up (small segment), register a buffer for one batch, say ready; on ``go`` read batches
    for ``seconds``, say how many bytes in how long; wait for quit."""
    from mooncake.store import MooncakeDistributedStore

    size, keys, batch = args.size, args.keys, args.batch
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", args.master)
    if rc != 0:
        _say({"error": f"reader setup rc={rc}"})
        return
    buf = _buffer(size * batch)
    base = buf.ctypes.data
    if s.register_buffer(base, buf.nbytes) != 0:
        _say({"error": "register_buffer failed"})
        return
    ptrs = [base + j * size for j in range(batch)]
    sizes = [size] * batch
    names = [f"v{i}" for i in range(keys)]
    start = iter(range(0, 1 << 62, batch))

    def step() -> str | None:
        i = next(start)
        got = s.batch_get_into([names[(i + j) % keys] for j in range(batch)], ptrs, sizes)
        bad = [g for g in got if g != size]
        return f"batch_get_into returned {bad[:3]}" if bad else None

    _timed_window(step, size * batch, args.seconds)
    s.unregister_buffer(base)
    s.close()


def role_target(args: argparse.Namespace) -> None:
    """An engine with one registered buffer; say its session and address; wait for quit."""
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        _say({"error": "target initialize failed"})
        return
    buf = _buffer(args.size)
    if e.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        _say({"error": "target register_memory failed"})
        return
    _say({"session": f"127.0.0.1:{e.get_rpc_port()}", "addr": buf.ctypes.data})
    sys.stdin.readline()


def role_initiator(args: argparse.Namespace) -> None:
    """Read ``batch`` x ``piece`` bytes per call from the target for ``seconds`` after ``go``."""
    from mooncake.engine import TransferEngine

    session, remote = args.session, args.remote
    piece, batch = args.piece, args.batch
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        _say({"error": "initiator initialize failed"})
        return
    buf = _buffer(piece * batch)
    base = buf.ctypes.data
    if e.register_memory(base, buf.nbytes) != 0:
        _say({"error": "initiator register_memory failed"})
        return
    locals_ = [base + j * piece for j in range(batch)]
    remotes = [remote + j * piece for j in range(batch)]
    lengths = [piece] * batch

    def step() -> str | None:
        if batch == 1:
            rc = e.transfer_sync_read(session, base, remote, piece)
        else:
            rc = e.batch_transfer_sync_read(session, locals_, remotes, lengths)
        return f"read rc={rc}" if rc != 0 else None

    _timed_window(step, piece * batch, args.seconds)


ROLES = {
    "holder": role_holder,
    "reader": role_reader,
    "target": role_target,
    "initiator": role_initiator,
}


# -- the driver -------------------------------------------------------------------------------


class Side:
    """Which interpreter and environment a side's processes run with."""

    def __init__(self, name: str, python: str) -> None:
        self.name = name
        self.python = python
        env = dict(os.environ)
        if name == "published":
            env.pop("PYTHONPATH", None)
            self.cwd = "/tmp"  # so ``import mooncake`` is the published wheel's
        else:
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            env["MC_STORE_MEMCPY"] = "0"
            self.cwd = str(ROOT)
        env["MC_FORCE_TCP"] = "1"
        self.env = env


class Proc:
    def __init__(self, side: Side, role: str, *flags: str) -> None:
        cmd = [side.python, str(Path(__file__).resolve()), "--role", role, *flags]
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=side.env,
            cwd=side.cwd,
        )

    def line(self, timeout: float = 300.0) -> dict[str, Any]:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"{self.p.args[3]} said nothing (rc={self.p.poll()})")
        out: dict[str, Any] = json.loads(box[0])
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def tell(self, text: str = "go") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.tell("quit")
                self.p.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def timed(reader: Proc, charged: list[int]) -> dict[str, float]:
    """Start ``reader``'s window and charge every pid in ``charged`` for it."""
    before = [cpu_seconds(p) for p in charged]
    reader.tell("go")
    out = reader.line()
    after = [cpu_seconds(p) for p in charged]
    cpu = sum(a - b for a, b in zip(after, before, strict=True))
    gb = out["bytes"] / 1e9
    return {"GB/s": gb / out["seconds"], "GB/cpu-s": gb / cpu if cpu > 0 else 0.0, "cpu_s": cpu}


def store_case(side: Side, size: int, args: argparse.Namespace) -> dict[str, float]:
    if side.name == "published":
        master, rpc = _start_side_master(side)
    else:
        master, rpc = start_master(False)
    addr = f"127.0.0.1:{rpc}"
    keys = max(args.batch, min(args.keys, (256 * MIB) // size))
    flags = ["--master", addr, "--size", str(size), "--keys", str(keys)]
    holder = Proc(side, "holder", *flags)
    reader = None
    try:
        holder.line()
        reader = Proc(
            side, "reader", *flags, "--batch", str(args.batch), "--seconds", str(args.seconds)
        )
        reader.line()
        return timed(reader, [master.pid, holder.p.pid, reader.p.pid])
    finally:
        for p in (reader, holder):
            if p is not None:
                p.stop()
        master.kill()
        master.wait()


def _start_side_master(side: Side) -> tuple[subprocess.Popen[bytes], int]:
    """The published master, started from the anchor interpreter (its wheel knows its binary)."""
    code = (
        "import sys; sys.path.insert(0, {!r}); import sidemaster, json; "
        "print(json.dumps(sidemaster.master_command(True, int(sys.argv[1]))))"
    ).format(str(ROOT / "tests" / "helpers"))
    rpc = free_port()
    cmd = json.loads(
        subprocess.check_output(
            [side.python, "-c", code, str(rpc)], env=side.env, cwd=side.cwd, text=True
        )
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_serving(proc, rpc), rpc


def engine_case(side: Side, piece: int, batch: int, args: argparse.Namespace) -> dict[str, float]:
    target = Proc(side, "target", "--size", str(piece * batch))
    initiator = None
    try:
        t = target.line()
        initiator = Proc(
            side,
            "initiator",
            "--session",
            t["session"],
            "--remote",
            str(t["addr"]),
            "--piece",
            str(piece),
            "--batch",
            str(batch),
            "--seconds",
            str(args.seconds),
        )
        initiator.line()
        return timed(initiator, [target.p.pid, initiator.p.pid])
    finally:
        for p in (initiator, target):
            if p is not None:
                p.stop()


def iperf3_case(seconds: float) -> dict[str, float]:
    """One iperf3 stream over loopback: a fresh one-off server per attempt (an attempt that
    fails, e.g. a client that came before the server listened, is retried)."""
    last = ""
    for _ in range(20):
        port = free_port()
        server = subprocess.Popen(
            ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.3)
            r = subprocess.run(
                [
                    "iperf3",
                    "-c",
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-t",
                    str(max(1, round(seconds))),
                    "-J",
                ],
                capture_output=True,
                text=True,
            )
            out = json.loads(r.stdout or "{}")
            end = out.get("end", {})
            if r.returncode != 0 or "sum_received" not in end:
                last = out.get("error", r.stderr.strip())
                continue
        finally:
            server.kill()
            server.wait()
        rate = end["sum_received"]["bits_per_second"] / 8 / 1e9
        cpu = end["cpu_utilization_percent"]
        busy = (cpu["host_total"] + cpu["remote_total"]) / 100.0  # cores busy, both ends
        return {"GB/s": rate, "GB/cpu-s": rate / busy if busy else 0.0, "cpu_s": busy * seconds}
    raise RuntimeError(f"iperf3 failed: {last}")


def anchor_python(given: str | None) -> str | None:
    if given:
        return given
    for v in ANCHOR_VENVS:
        if (v / "bin" / "python").exists():
            return str(v / "bin" / "python")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=sorted(ROLES))
    ap.add_argument("--master", default="")
    ap.add_argument("--size", type=int, default=MIB)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--session", default="")
    ap.add_argument("--remote", type=int, default=0)
    ap.add_argument("--piece", type=int, default=MIB)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="1M,4M,8M")
    ap.add_argument("--only", choices=["ours", "published"])
    ap.add_argument("--anchor-python")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.role:
        ROLES[args.role](args)
        return

    sides = []
    if args.only != "published":
        sides.append(Side("ours", sys.executable))
    anchor = anchor_python(args.anchor_python)
    if args.only != "ours":
        if anchor is None:
            print("no anchor venv (bash scripts/setup-anchor.sh): published columns left out")
        else:
            sides.append(Side("published", anchor))
    cases: list[tuple[str, Any]] = []
    for size in [parse_size(x) for x in args.sizes.split(",")]:
        label = f"store batch_get_into {size // MIB} MiB x {args.batch}"
        cases.append((label, lambda side, size=size: store_case(side, size, args)))
    cases.append(("engine read 1 MiB x 32", lambda side: engine_case(side, MIB, 32, args)))
    cases.append(("engine read 64 MiB x 1", lambda side: engine_case(side, 64 * MIB, 1, args)))

    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    loads = [os.getloadavg()[0]]
    for run in range(args.runs):
        order = sides if run % 2 == 0 else list(reversed(sides))
        for label, fn in cases:
            for side in order:
                print(f"run {run + 1}/{args.runs}: {side.name:9s} {label} ...", flush=True)
                r = fn(side)
                results.setdefault(label, {}).setdefault(side.name, []).append(r)
        r = iperf3_case(args.seconds)
        results.setdefault("iperf3 single stream", {}).setdefault("iperf3", []).append(r)
        loads.append(os.getloadavg()[0])

    def med(rows: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in rows)

    print()
    print(f"{'case':34s} {'side':10s} {'GB/s':>7s} {'GB/cpu-s':>9s}")
    summary: dict[str, Any] = {"load_average": loads, "cases": {}}
    iperf = results["iperf3 single stream"]["iperf3"]
    for label, by_side in results.items():
        for name, rows in by_side.items():
            gbs, per = med(rows, "GB/s"), med(rows, "GB/cpu-s")
            summary["cases"].setdefault(label, {})[name] = {
                "GB/s": gbs,
                "GB/cpu-s": per,
                "runs": rows,
            }
            print(f"{label:34s} {name:10s} {gbs:7.2f} {per:9.2f}")
    big = results["engine read 64 MiB x 1"].get("ours")
    if big:
        ratio = med(big, "GB/s") / med(iperf, "GB/s")
        summary["engine_64MiB_over_iperf3"] = ratio
        print(f"\nengine 64 MiB reads / iperf3 single stream: {ratio:.2f}x")
    print(f"load average: {', '.join(f'{x:.1f}' for x in loads)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
