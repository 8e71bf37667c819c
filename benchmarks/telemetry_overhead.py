#!/usr/bin/env python3
"""Per-transfer telemetry overhead: the same transfers with the telemetry ring on and off, in
one run, interleaved round by round.

Four engines over loopback TCP in this process (``MOONCAKE_TRANSFER_TELEMETRY_RING`` read
when each is built: two with the default ring, two with ``0``); shm is off (``MC_FORCE_TCP=1``)
so both pairs take the same transport. Cases:

* ``async 4KiB x1``, ``async 1MiB x32``: ``await engine.transfer(...)`` (the async API);
* ``sync 4KiB x1``: the facade's ``transfer_sync_write`` (the calling-thread path);
* ``sync 1MiB x32``: the facade's ``batch_transfer_sync_write`` (through the loop).

Each case runs ``--rounds`` rounds of ``--seconds`` per side, alternating which side goes
first; printed: the median time per batch of each side and the overhead in percent.

    python benchmarks/telemetry_overhead.py --rounds 7 --seconds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["MC_FORCE_TCP"] = "1"

from mooncake.engine import TransferEngine  # noqa: E402


def _pair(ring: str) -> tuple[TransferEngine, TransferEngine]:
    os.environ["MOONCAKE_TRANSFER_TELEMETRY_RING"] = ring
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return a, b


def _timed(fn: Callable[[], Any], seconds: float) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per call of ``fn`` over ``seconds``. Both engines
    of a pair live in this process, so the CPU time is the whole cost of a transfer, and
    other processes on the machine change it far less than the wall time."""
    fn()
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return dt / n, (time.process_time() - c0) / n


def micro(n: int = 50_000) -> dict[str, float]:
    """The recording's own CPU per batch (no transfer): the loop path's begin + one group +
    finish, and the sync path's raw append; microseconds of this process's CPU time (so
    other processes on the machine count less), the best of 5 runs."""
    from time import perf_counter, process_time

    from mooncake._engine.telemetry import CURRENT, TelemetryRing

    def loop_path() -> float:
        ring = TelemetryRing(4096)
        t0 = process_time()
        for _ in range(n):
            rec = ring.begin("127.0.0.1:1", "write", 1, 4096)
            CURRENT.set(rec)
            rec.add_group("tcp", "127.0.0.1", 1, 4096, 1.0, 2.0, 0)
            ring.finish(rec, "completed")
        return (process_time() - t0) / n * 1e6

    def sync_path() -> float:
        ring = TelemetryRing(4096)
        t0 = process_time()
        for _ in range(n):
            a = perf_counter()
            ring.add_sync("127.0.0.1:1", "write", 1, 4096, "tcp", "127.0.0.1", a, perf_counter(), 0)
        return (process_time() - t0) / n * 1e6

    return {
        "loop_record_us": min(loop_path() for _ in range(5)),
        "sync_record_us": min(sync_path() for _ in range(5)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--json", default="")
    args = p.parse_args()
    pairs = {"on": _pair("4096"), "off": _pair("0")}
    os.environ.pop("MOONCAKE_TRANSFER_TELEMETRY_RING", None)
    assert pairs["on"][0]._engine is not None and pairs["on"][0]._engine.telemetry is not None
    assert pairs["off"][0]._engine is not None and pairs["off"][0]._engine.telemetry is None
    cases: dict[str, dict[str, Callable[[], Any]]] = {}
    for side, (a, b) in pairs.items():
        seg = f"127.0.0.1:{b.get_rpc_port()}"
        src = a.allocate_managed_buffer(32 << 20)
        dst = b.allocate_managed_buffer(32 << 20)
        loop, eng = a._e()
        from mooncake._core.transfer import TransferRequest as R

        one = [R.write(src, dst, 4096)]
        many = [R.write(src + i * (1 << 20), dst + i * (1 << 20), 1 << 20) for i in range(32)]

        def async_case(reqs: list[Any], eng: Any = eng, loop: Any = loop, seg: str = seg) -> Any:
            return lambda: loop.call(eng.transfer, seg, reqs)

        offs = [src + i * (1 << 20) for i in range(32)]
        dsts = [dst + i * (1 << 20) for i in range(32)]
        cases.setdefault("async 4KiB x1", {})[side] = async_case(one)
        cases.setdefault("async 1MiB x32", {})[side] = async_case(many)
        cases.setdefault("sync 4KiB x1", {})[side] = lambda a=a, seg=seg, src=src, dst=dst: (
            a.transfer_sync_write(seg, src, dst, 4096)
        )
        cases.setdefault("sync 1MiB x32", {})[side] = lambda a=a, seg=seg, offs=offs, dsts=dsts: (
            a.batch_transfer_sync_write(seg, offs, dsts, [1 << 20] * 32)
        )
    out: dict[str, Any] = {"micro": micro()}
    print(f"recording alone: {out['micro']}", flush=True)
    try:
        for name, sides in cases.items():
            t: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
            for r in range(args.rounds):
                for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    t[side].append(_timed(sides[side], args.seconds))
            res: dict[str, Any] = {}
            for k, col in (("wall", 0), ("cpu", 1)):
                on = statistics.median(x[col] for x in t["on"])
                off = statistics.median(x[col] for x in t["off"])
                res[f"{k}_us_on"], res[f"{k}_us_off"] = on * 1e6, off * 1e6
                res[f"{k}_overhead_pct"] = 100 * (on / off - 1)
            out[name] = res
            print(
                f"{name:16s} cpu on {res['cpu_us_on']:9.1f} us off {res['cpu_us_off']:9.1f} us "
                f"({res['cpu_overhead_pct']:+.1f} %)   wall on {res['wall_us_on']:9.1f} us "
                f"off {res['wall_us_off']:9.1f} us ({res['wall_overhead_pct']:+.1f} %)",
                flush=True,
            )
    finally:
        for a, b in pairs.values():
            a.close()
            b.close()
    out["loadavg"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps({"loadavg": out["loadavg"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
