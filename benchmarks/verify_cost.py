#!/usr/bin/env python3
"""What verified reads cost: the same client, verification on and off, rounds interleaved.

A holder process contributes a segment; this process is a pure client (no segment of its own,
so every replica is in the holder) on the published sync API. Per round, with verification on
and then off (the order alternating), it measures

* ``batch_put_from`` and ``batch_get_into`` of ``--batch`` x ``--size`` values (GB/s), and
* ``get`` (bytes) and ``get_into`` of one ``--small`` value, ``--small-reps`` times (p50 us),

and prints the medians over rounds with the cost (on vs off), and the *paired* cost: the
median over rounds of each round's on against its own off (measured back to back, so a
loaded machine's drift between rounds cancels). Same-host replicas are read and
written with ``memcpy`` through the holder's memfd mapping; ``--tcp`` (``MC_STORE_MEMCPY=0``)
sends them through the engine (TCP) instead. ``--split`` also charges the batch get's CPU to
its copies (the thread CPU of the ``memcpy_at`` / ``copy_crc32c_batch`` calls it makes, in
whichever thread) and the rest (the loop, the RPC, the bookkeeping). ``--json FILE`` writes
the numbers.

    python benchmarks/verify_cost.py --rounds 9
    python benchmarks/verify_cost.py --rounds 9 --tcp
    MOONCAKE_CRC_KERNEL=sse42 python benchmarks/verify_cost.py --rounds 9   # another kernel
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", {seg}, 16 << 20, "tcp", "", "{master}") == 0
print("ready", flush=True)
sys.stdin.read()
s.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, limit: float = 30) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"master on port {port} did not come up")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired(on: list[float], off: list[float], ratio: bool) -> float:
    """The median over rounds of round ``i``'s ``on`` against its ``off``: ``on / off - 1``
    (in %) with ``ratio``, else ``on - off``."""
    if ratio:
        return med([(a / b - 1) * 100 for a, b in zip(on, off, strict=True) if b > 0])
    return med([a - b for a, b in zip(on, off, strict=True)])


class CopyClock:
    """Thread CPU spent in the copy primitives while :attr:`on` (``--split``): wraps
    ``_fast.memcpy_at`` and ``_fast.copy_crc32c_batch``, which the store's copies look up on
    the module at each call."""

    def __init__(self, fast: Any) -> None:
        self.on = False
        self.spent = 0.0
        self._lock = threading.Lock()
        for name in ("memcpy_at", "copy_crc32c_batch"):
            setattr(fast, name, self._wrap(getattr(fast, name)))

    def _wrap(self, f: Any) -> Any:
        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                if self.on:
                    with self._lock:
                        self.spent += time.thread_time() - t

        return timed


def small_blocks(args: argparse.Namespace, s: Any, store: Any, small: bytes, da: int) -> int:
    """The small ``get`` and ``get_into``, on and off in alternating blocks; per mode the
    median and the lowest of the blocks' p50s (a loaded machine inflates blocks at random;
    the lowest block is the least disturbed)."""
    store.verify.enabled = True  # the value carries its CRC; readers check it or not
    assert s.put("small", small) == 0
    p50: dict[str, dict[str, list[float]]] = {m: {"get": [], "get_into": []} for m in ("on", "off")}
    for blk in range(args.small_blocks):
        for mode in ("on", "off") if blk % 2 == 0 else ("off", "on"):
            store.verify.enabled = mode == "on"
            for api in ("get", "get_into"):
                lat = []
                for _ in range(args.small_reps):
                    t = time.perf_counter()
                    if api == "get":
                        s.get("small")
                    else:
                        s.get_into("small", da, args.small)
                    lat.append(time.perf_counter() - t)
                p50[mode][api].append(statistics.median(lat) * 1e6)
    # the copy out of the replica alone, no RPC (what verification adds to a get's path)
    fp = s._fast
    copy_us: dict[str, list[float]] = {"on": [], "off": []}
    if fp is not None:
        resp, deadline = fp._query("small")
        for blk in range(args.small_blocks):
            for mode in ("on", "off") if blk % 2 == 0 else ("off", "on"):
                store.verify.enabled = mode == "on"
                t = time.perf_counter()
                for _ in range(args.small_reps):
                    fp._copy_out("small", resp, args.small, None, deadline + 3600)
                copy_us[mode].append((time.perf_counter() - t) / args.small_reps * 1e6)
    v = store.verify.stats()
    s.close()
    if copy_us["on"]:
        on, off = copy_us["on"], copy_us["off"]
        print(
            f"copy out of the replica (fast path, no RPC): lowest on {min(on):.3f} us "
            f"off {min(off):.3f} us ({min(on) - min(off):+.3f}); median "
            f"{med(on):.3f} / {med(off):.3f} ({med(on) - med(off):+.3f})"
        )
    print(
        f"small={args.small} blocks={args.small_blocks}x{args.small_reps} "
        f"load={os.getloadavg()[0]:.2f}"
    )
    for api in ("get", "get_into"):
        on, off = p50["on"][api], p50["off"][api]
        print(
            f"{api:<9} p50 us  median on {med(on):.2f} off {med(off):.2f} "
            f"({med(on) - med(off):+.2f})  lowest on {min(on):.2f} off {min(off):.2f} "
            f"({min(on) - min(off):+.2f})"
        )
    print(f"verified {v['verified']} unverified {v['unverified']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"p50": p50, "verify": v}, indent=1))
    return 0


def primitives() -> int:
    """Best-of-15 times of memcpy, CRC32C and the fused copy+CRC32C on cache-hot buffers."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from mooncake import _fast

    def best(f: Any, reps: int) -> float:
        out = 1e9
        for _ in range(15):
            t = time.perf_counter()
            for _ in range(reps):
                f()
            out = min(out, (time.perf_counter() - t) / reps)
        return out * 1e6

    print(f"CRC32C kernel: {_fast.CRC_KERNEL}; load {os.getloadavg()[0]:.2f}")
    print(f"{'size':>8}{'memcpy us':>12}{'crc32c us':>12}{'copy+crc us':>14}{'crc GB/s':>10}")
    for n in (4096, 65536, 1 << 20):
        src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        sa, da = int(src.ctypes.data), int(dst.ctypes.data)
        reps = max(1, (8 << 20) // n)
        m = best(functools.partial(_fast.memcpy_at, da, sa, n), reps)
        c = best(functools.partial(_fast.crc32c_at, sa, n), reps)
        f = best(functools.partial(_fast.copy_crc32c, da, sa, n), reps)
        print(f"{n:>8}{m:>12.2f}{c:>12.2f}{f:>14.2f}{n / c / 1e3:>10.1f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--small", type=int, default=4096)
    ap.add_argument("--small-reps", type=int, default=2000)
    ap.add_argument("--tcp", action="store_true", help="MC_STORE_MEMCPY=0: replicas over TCP")
    ap.add_argument(
        "--split", action="store_true", help="the batch get's CPU: its copies and the rest"
    )
    ap.add_argument("--json")
    ap.add_argument(
        "--small-blocks",
        type=int,
        default=0,
        help="only the small get: this many blocks of --small-reps gets, on and off alternating",
    )
    ap.add_argument(
        "--primitives", action="store_true", help="only time the CRC32C primitives (best of 15)"
    )
    args = ap.parse_args()
    if args.primitives:
        return primitives()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.tcp:
        env["MC_STORE_MEMCPY"] = "0"
        os.environ["MC_STORE_MEMCPY"] = "0"
    port = free_port()
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", str(port), "--no-metrics"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    holder = None
    try:
        wait_port(port)
        seg = 4 * args.batch * args.size + (64 << 20)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER.format(seg=seg, master=f"127.0.0.1:{port}")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise SystemExit("holder did not start")
        return run(args, f"127.0.0.1:{port}")
    finally:
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(10)
        master.terminate()
        master.wait(10)


def run(args: argparse.Namespace, master: str) -> int:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from mooncake import _fast
    from mooncake.store import MooncakeDistributedStore

    clock = CopyClock(_fast) if args.split else None
    s = MooncakeDistributedStore()
    n, b = args.size, args.batch
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * n * b + (16 << 20), "tcp", "", master) == 0
    store = s._store
    assert store is not None
    src = np.random.default_rng(1).integers(0, 256, n * b, dtype=np.uint8)
    dst = np.zeros(n * b, dtype=np.uint8)
    sa, da = int(src.ctypes.data), int(dst.ctypes.data)
    assert s.register_buffer(sa, n * b) == 0 and s.register_buffer(da, n * b) == 0
    small = src[: args.small].tobytes()
    if args.small_blocks:
        return small_blocks(args, s, store, small, da)
    res: dict[str, dict[str, list[float]]] = {
        m: {
            "put_gbs": [],
            "get_gbs": [],
            "put_cpu_ms": [],
            "get_cpu_ms": [],
            **({"get_copy_cpu_ms": [], "get_rest_cpu_ms": []} if args.split else {}),
            "get_p50_us": [],
            "get_into_p50_us": [],
        }
        for m in ("on", "off")
    }
    fenced = 0
    warm: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in res}
    # round -1 warms up, unrecorded: the first touch of the destination buffer's pages and of
    # the segment's pages through this process's mapping is paid there, not by whichever mode
    # a measured round runs first
    for rnd in range(-1, args.rounds):
        out = res if rnd >= 0 else warm
        for mode in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
            store.verify.enabled = mode == "on"
            keys = [f"{mode}-{rnd}-{i}" for i in range(b)]
            addrs = [sa + i * n for i in range(b)]
            t, c = time.perf_counter(), time.process_time()
            rc = s.batch_put_from(keys, addrs, [n] * b)
            dt_put = time.perf_counter() - t
            cpu_put = time.process_time() - c
            assert all(c == 0 for c in rc), rc
            for _ in range(5):  # a read that outlives its window (-707) on a loaded box: again
                if clock is not None:
                    clock.on, clock.spent = True, 0.0
                t, c = time.perf_counter(), time.process_time()
                got = s.batch_get_into(keys, [da + i * n for i in range(b)], [n] * b)
                dt_get = time.perf_counter() - t
                cpu_get = time.process_time() - c
                copy_cpu = 0.0
                if clock is not None:
                    clock.on = False
                    copy_cpu = clock.spent
                if all(g == n for g in got):
                    break
                fenced += 1
            assert all(g == n for g in got), got
            out[mode]["put_gbs"].append(n * b / dt_put / 1e9)
            out[mode]["get_gbs"].append(n * b / dt_get / 1e9)
            out[mode]["put_cpu_ms"].append(cpu_put * 1e3)
            out[mode]["get_cpu_ms"].append(cpu_get * 1e3)
            if clock is not None:
                out[mode]["get_copy_cpu_ms"].append(copy_cpu * 1e3)
                out[mode]["get_rest_cpu_ms"].append((cpu_get - copy_cpu) * 1e3)
            skey = f"small-{mode}-{rnd}"
            assert s.put(skey, small) == 0
            lat = []
            for _ in range(args.small_reps):
                t = time.perf_counter()
                v = s.get(skey)
                lat.append(time.perf_counter() - t)
            assert v == small
            out[mode]["get_p50_us"].append(statistics.median(lat) * 1e6)
            lat = []
            for _ in range(args.small_reps):
                t = time.perf_counter()
                s.get_into(skey, da, args.small)
                lat.append(time.perf_counter() - t)
            out[mode]["get_into_p50_us"].append(statistics.median(lat) * 1e6)
            for k in [*keys, skey]:
                s.remove(k, True)
            time.sleep(0.6)  # removed space returns once the read windows closed (0.5 s)
    v = store.verify.stats()
    s.close()
    summary: dict[str, Any] = {
        "size": n,
        "batch": b,
        "small": args.small,
        "rounds": args.rounds,
        "path": "tcp" if args.tcp else "memcpy",
        "crc_compiled": _fast.CRC_COMPILED,
        "crc_hardware": _fast.CRC_HARDWARE,
        "crc_kernel": _fast.CRC_KERNEL,
        "loadavg": os.getloadavg(),
        "verify_stats": v,
        "fenced_batches_retried": fenced,
    }
    print(
        f"path={summary['path']} rounds={args.rounds} load={os.getloadavg()[0]:.2f} "
        f"crc_kernel={_fast.CRC_KERNEL}"
    )
    print(f"{'metric (median | best)':<30}{'on':>16}{'off':>16}{'cost':>18}{'paired':>10}")
    for metric in res["on"]:
        xs_on, xs_off = res["on"][metric], res["off"][metric]
        on, off = med(xs_on), med(xs_off)
        hi = metric.endswith("gbs")  # higher is better
        b_on, b_off = (max if hi else min)(xs_on), (max if hi else min)(xs_off)
        if hi:  # throughput: the cost is the fraction lost (1 - on / off)
            pc = -paired(xs_on, xs_off, True)
            pcs = f"{pc:+.1f}%"
            cost = f"{(1 - on / off) * 100:+.1f}% | {(1 - b_on / b_off) * 100:+.1f}%"
            label = f"{metric} ({b} x {n >> 10} KiB)"
        elif metric.endswith("cpu_ms"):
            pc = paired(xs_on, xs_off, True)
            pcs = f"{pc:+.1f}%"
            cost = f"{(on / off - 1) * 100:+.1f}% | {(b_on / b_off - 1) * 100:+.1f}%"
            label = f"{metric} ({b} x {n >> 10} KiB)"
        else:
            pc = paired(xs_on, xs_off, False)
            pcs = f"{pc:+.2f}"
            cost = f"{on - off:+.2f} | {b_on - b_off:+.2f} us"
            label = f"{metric} ({args.small >> 10} KiB)"
        summary[metric] = {
            "on": on,
            "off": off,
            "best_on": b_on,
            "best_off": b_off,
            "paired_cost": pc,
            "all_on": xs_on,
            "all_off": xs_off,
        }
        print(f"{label:<30}{on:>8.3f} |{b_on:>6.2f}{off:>8.3f} |{b_off:>6.2f}{cost:>18}{pcs:>10}")
    print(
        f"verified reads {v['verified']}, unverified {v['unverified']}, "
        f"fenced batches retried {fenced}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
