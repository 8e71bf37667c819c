"""``mooncake bench transfer``: the Transfer Engine between two processes on this host.

A *target* process (spawned here, the same Python) opens an engine, allocates and pre-faults a
buffer, fills a known pattern and prints its segment; this process (the *initiator*) opens its
own engine and sweeps ``op x block x batch`` for ``--case-seconds`` each, walking through the
buffer so every block touches new addresses. The shapes, the pre-faulting and the way throughput
and call latency are computed are those of the published engine's bench
(``shared/anchor/mooncake_te_bench.py``), so the two tables compare line by line; batch 1 is one
``transfer`` call with one request, batch 32 one call with 32.

Before timing it checks correctness: a read of the target's known 1 MiB prefix and a write of a
5 MiB + 123 B pattern read back through the engine must both match.

Output: a progress bar on stderr, a table on stdout, and with ``--json PATH`` the raw results
(``-`` for stdout, which then carries nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

DEFAULT_SIZES = "4K,64K,1M,16M"


def parse_size(s: str) -> int:
    """``4K``, ``1MiB``, ``2g``, ``4096`` -> bytes (binary units)."""
    t = s.strip().upper()
    mult = 1
    for suf, m in (("GIB", GIB), ("MIB", MIB), ("KIB", KIB), ("G", GIB), ("M", MIB), ("K", KIB)):
        if t.endswith(suf):
            mult = m
            t = t[: -len(suf)]
            break
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 4K, 1M, 16MiB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {s!r}")
    return n


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return f"{n}B"


def _list(conv: Any, s: str) -> list[Any]:
    return [conv(x) for x in s.split(",") if x.strip()]


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "transfer",
        help="Transfer Engine throughput and latency between two local processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"block sizes (default {DEFAULT_SIZES})")
    p.add_argument("--batches", default="1,32", help="requests per call (default 1,32)")
    p.add_argument("--ops", default="write,read", help="write,read (default both)")
    p.add_argument(
        "--transport",
        default="tcp",
        help="tcp, shm, or auto (the engine's own choice per peer); default tcp",
    )
    p.add_argument(
        "--buffer",
        type=parse_size,
        default=512 * MIB,
        help="registered buffer per process (default 512M; cases that do not fit are skipped)",
    )
    p.add_argument(
        "--memory",
        choices=("auto", "allocate", "numpy"),
        default="auto",
        help="registered memory on both sides: engine.allocate() (memfd, what shm maps) or a "
        "pre-faulted numpy array (what the published bench registers); auto = allocate for "
        "shm/auto, numpy for tcp",
    )
    p.add_argument("--case-seconds", type=float, default=1.0, help="time per case (default 1.0)")
    p.add_argument("--max-iters", type=int, default=200_000, help="call cap per case")
    p.add_argument("--backend", choices=("trio", "asyncio"), default="trio")
    p.add_argument("--json", metavar="PATH", help="write raw results as JSON ('-' = stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--serve-target", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        sizes = _list(parse_size, args.sizes)
        batches = _list(int, args.batches)
        ops = _list(str, args.ops)
    except argparse.ArgumentTypeError as e:
        print(f"mooncake bench transfer: {e}", file=sys.stderr)
        return 2
    bad = [o for o in ops if o not in ("read", "write")]
    if bad or any(b <= 0 for b in batches) or args.transport not in ("tcp", "shm", "auto"):
        print(
            f"mooncake bench transfer: bad --ops {args.ops!r}, --batches {args.batches!r} "
            f"or --transport {args.transport!r}",
            file=sys.stderr,
        )
        return 2
    import anyio

    memory = args.memory
    if memory == "auto":
        memory = "numpy" if args.transport == "tcp" else "allocate"
    if args.serve_target:
        anyio.run(_serve_target, args.buffer, memory, backend=args.backend)
        return 0
    out = run_bench(
        sizes=sizes,
        batches=batches,
        ops=ops,
        transport=args.transport,
        buffer=args.buffer,
        case_seconds=args.case_seconds,
        max_iters=args.max_iters,
        backend=args.backend,
        progress=not args.no_progress and args.json != "-",
        memory=memory,
    )
    if args.json == "-":
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print_table(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    ok = out["verify_read"] and out["verify_write"] is not False
    return 0 if ok else 1


def pattern(n: int, seed: int) -> Any:
    import numpy as np

    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) & 0xFF).astype(np.uint8)


# -- target ----------------------------------------------------------------------------------


class _Mem:
    """The registered buffer of a bench process: ``addr``, ``length`` and a numpy view."""

    def __init__(self, addr: int, length: int, arr: Any) -> None:
        self.addr, self.length, self.arr = addr, length, arr


async def _memory(engine: Any, size: int, kind: str) -> _Mem:
    if kind == "allocate":
        buf = await engine.allocate(size)
        return _Mem(buf.addr, buf.length, buf.numpy())
    import numpy as np

    arr = np.empty(size, dtype=np.uint8)
    arr.fill(0)  # pre-fault, as the published bench does
    await engine.register(arr)
    return _Mem(int(arr.ctypes.data), size, arr)


async def _serve_target(size: int, memory: str = "allocate") -> None:
    import anyio

    from mooncake._engine.engine import open_engine

    async with open_engine("127.0.0.1") as engine:
        buf = await _memory(engine, size, memory)
        arr = buf.arr
        arr[: 1 * MIB] = pattern(1 * MIB, 7)
        del arr  # an exported view would keep the mapping alive past the engine's close
        if memory == "allocate":
            buf.arr = None
        info = {"segment": engine.segment_name, "addr": buf.addr, "size": buf.length}
        print("TARGET " + json.dumps(info), flush=True)
        # serve until the initiator closes our stdin (or dies)
        await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def spawn_target(
    size: int, backend: str, memory: str = "allocate"
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a target process; returns it and its ``{segment, addr, size}``."""
    cmd = [sys.executable, "-m", "mooncake", "bench", "transfer", "--serve-target"]
    cmd += ["--buffer", str(size), "--backend", backend, "--memory", memory]
    # the child must import this very package, wherever it was imported from
    import mooncake

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(mooncake.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    box: dict[str, Any] = {}

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("TARGET "):
                box["v"] = json.loads(line[7:])
                return

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    th.join(60)
    if "v" not in box:
        stop_target(proc)
        raise RuntimeError(f"bench target (pid {proc.pid}) did not start")
    return proc, box["v"]


def stop_target(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)
        except Exception:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


# -- initiator -------------------------------------------------------------------------------


def run_bench(
    *,
    sizes: list[int],
    batches: list[int],
    ops: list[str],
    transport: str,
    buffer: int,
    case_seconds: float,
    max_iters: int,
    backend: str = "trio",
    progress: bool = True,
    memory: str = "allocate",
) -> dict[str, Any]:
    """Spawn a target, run every case against it, return the results (JSON-able)."""
    import anyio

    proc, info = spawn_target(buffer, backend, memory)
    try:
        return anyio.run(
            _initiate,
            info,
            sizes,
            batches,
            ops,
            transport,
            buffer,
            case_seconds,
            max_iters,
            progress,
            memory,
            backend=backend,
        )
    finally:
        stop_target(proc)


async def _initiate(
    info: dict[str, Any],
    sizes: list[int],
    batches: list[int],
    ops: list[str],
    transport: str,
    buffer: int,
    case_seconds: float,
    max_iters: int,
    progress: bool,
    memory: str = "allocate",
) -> dict[str, Any]:
    import numpy as np

    from mooncake import _fast
    from mooncake._core.transfer import TransferRequest
    from mooncake._engine.engine import open_engine

    seg, raddr, rsize = info["segment"], info["addr"], info["size"]
    size = min(buffer, rsize)
    tname = None if transport == "auto" else transport
    out: dict[str, Any] = {
        "engine": "mooncake-py",
        "compiled": _fast.COMPILED,
        "transport": transport,
        "segment": seg,
        "buffer": size,
        "pid": os.getpid(),
    }
    t0 = time.perf_counter()
    async with open_engine("127.0.0.1") as engine:
        out["engine_init_s"] = time.perf_counter() - t0
        buf = await _memory(engine, size, memory)
        arr = buf.arr
        laddr = buf.addr
        out["memory"] = memory

        async def one(op: str, off_l: int, off_r: int, n: int) -> bool:
            mk = TransferRequest.read if op == "read" else TransferRequest.write
            (res,) = await engine.transfer(
                seg, [mk(laddr + off_l, raddr + off_r, n)], transport=tname
            )
            return res.ok

        t1 = time.perf_counter_ns()
        await one("read", 0, 0, 4 * KIB)
        out["first_op_us"] = (time.perf_counter_ns() - t1) / 1e3
        t1 = time.perf_counter_ns()
        await one("read", 0, 0, 4 * KIB)
        out["second_op_us"] = (time.perf_counter_ns() - t1) / 1e3
        out["used_transport"] = engine._pick(await engine.peer(seg), tname).name

        ok = await one("read", 0, 0, 1 * MIB)
        out["verify_read"] = bool(ok and np.array_equal(arr[: 1 * MIB], pattern(1 * MIB, 7)))
        wlen = 5 * MIB + 123
        woff = 1 * MIB
        back = woff + 6 * MIB
        want = pattern(wlen, 99)
        verify_write: bool | None = None  # not checked: the buffer is too small
        if back + wlen <= size:
            arr[woff : woff + wlen] = want
            ok = await one("write", woff, woff, wlen)
            arr[back : back + wlen] = 0
            ok = ok and await one("read", back, woff, wlen)
            verify_write = bool(ok and np.array_equal(arr[back : back + wlen], want))
        out["verify_write"] = verify_write
        arr[:] = 0

        cases = [(op, bs, b) for op in ops for bs in sizes for b in batches]
        results: list[dict[str, Any]] = []
        bar = _Progress(len(cases), enabled=progress, label=f"transfer/{transport}")
        try:
            for op, bs, batch in cases:
                bar.start(f"{op} {fmt_size(bs)} x{batch}")
                if bs * batch > size:
                    results.append(
                        {"op": op, "block": bs, "batch": batch, "skipped": "does not fit buffer"}
                    )
                    bar.advance()
                    continue
                r = await _case(
                    engine, seg, laddr, raddr, size, op, bs, batch, tname, case_seconds, max_iters
                )
                results.append(r)
                bar.advance(f"{op} {fmt_size(bs)} x{batch}: {r['GBps']:.3f} GB/s")
        finally:
            bar.close()
        out["cases"] = results
        del arr
        if memory == "allocate":
            buf.arr = None
    return out


async def _case(
    engine: Any,
    seg: str,
    laddr: int,
    raddr: int,
    size: int,
    op: str,
    bs: int,
    batch: int,
    tname: str | None,
    case_seconds: float,
    max_iters: int,
) -> dict[str, Any]:
    from mooncake._core.transfer import TransferRequest

    mk = TransferRequest.read if op == "read" else TransferRequest.write
    nslots = size // bs
    slot = 0
    lat: list[int] = []
    errors = 0
    transfer = engine.transfer
    perf = time.perf_counter_ns
    t_start = time.perf_counter()
    while True:
        reqs = []
        for k in range(batch):
            off = ((slot + k) % nslots) * bs
            reqs.append(mk(laddr + off, raddr + off, bs))
        slot += batch
        t0 = perf()
        res = await transfer(seg, reqs, transport=tname)
        t1 = perf()
        if not all(r.ok for r in res):
            errors += 1
        lat.append(t1 - t0)
        el = time.perf_counter() - t_start
        if (el >= case_seconds and len(lat) >= 3) or len(lat) >= max_iters:
            break
        if el >= 4 * case_seconds + 10:
            break
    elapsed = time.perf_counter() - t_start
    lat.sort()
    n = len(lat)
    tot = n * bs * batch
    return {
        "op": op,
        "block": bs,
        "batch": batch,
        "calls": n,
        "errors": errors,
        "bytes": tot,
        "seconds": elapsed,
        "GBps": tot / elapsed / 1e9,
        "ops_per_s": n * batch / elapsed,
        "call_us_mean": sum(lat) / n / 1e3,
        "call_us_p50": lat[n // 2] / 1e3,
        "call_us_p99": lat[min(n - 1, int(n * 0.99))] / 1e3,
        "block_us_mean": sum(lat) / n / 1e3 / batch,
    }


class _Progress:
    """A rich progress bar on stderr (or nothing)."""

    def __init__(self, total: int, *, enabled: bool, label: str) -> None:
        self._p: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._p = Progress(
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            console=Console(file=sys.stderr),
            transient=False,
        )
        self._p.start()
        self._task = self._p.add_task("", total=total, label=label)

    def start(self, what: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=what + " ...")

    def advance(self, what: str = "") -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, description=what)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"mooncake-py transfer, {out['used_transport']} "
        f"({'compiled' if out['compiled'] else 'pure Python'}), buffer {fmt_size(out['buffer'])}"
    )
    for col in ("op", "block", "batch", "GB/s", "kops/s", "call p50 µs", "call p99 µs", "err"):
        t.add_column(col, justify="right")
    for r in out["cases"]:
        if "skipped" in r:
            t.add_row(r["op"], fmt_size(r["block"]), str(r["batch"]), "-", "-", "-", "-", "skip")
            continue
        t.add_row(
            r["op"],
            fmt_size(r["block"]),
            str(r["batch"]),
            f"{r['GBps']:.3f}",
            f"{r['ops_per_s'] / 1e3:.1f}",
            f"{r['call_us_p50']:.1f}",
            f"{r['call_us_p99']:.1f}",
            str(r["errors"]),
        )
    c = Console()
    c.print(t)
    c.print(
        f"first op {out['first_op_us']:.0f} µs, second {out['second_op_us']:.0f} µs; "
        f"verify read={out['verify_read']} write={out['verify_write']}"
    )
