"""``mooncake demo``: move real bytes between two engine processes and print what happened.

Starts a target engine in a child process (P2P handshake, loopback; the transport the engine
picks for a same-host peer, or ``--transport``), then from this process
writes and reads blocks of several sizes, single and batched, verifies every case byte for byte
(SHA-256 on both sides) and prints a table of throughput and latency.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio

# (block size, batch) cases; 32 MiB per side at most
CASES = [
    (4 << 10, 1),
    (4 << 10, 32),
    (64 << 10, 1),
    (64 << 10, 32),
    (1 << 20, 1),
    (1 << 20, 32),
    (16 << 20, 1),
]


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="move verified bytes between two engine processes")
    p.add_argument("--seconds", type=float, default=0.3, help="time per case (default 0.3)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument(
        "--transport",
        default=None,
        help="force a transport (tcp, shm); default: the engine's choice for the peer",
    )
    p.set_defaults(func=run)


def _fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


class _Peer:
    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake._cli._peer", "--size", str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the peer engine failed to start")
        info = json.loads(line)
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]

    def cmd(self, **c: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(c) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return out

    def close(self) -> None:
        try:
            self.cmd(op="quit")
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _demo(
    seconds: float, transport: str | None
) -> tuple[str, str, str, list[dict[str, Any]]]:
    import mooncake
    from mooncake._cli._peer import digest, pattern
    from mooncake._core.transfer import Opcode, TransferRequest

    span = max(size * batch for size, batch in CASES)
    peer = await anyio.to_thread.run_sync(_Peer, span)
    rows: list[dict[str, Any]] = []
    try:
        async with mooncake.open_engine("127.0.0.1") as engine:
            buf = await engine.allocate(span)
            arr = buf.numpy()
            used = engine._pick(await engine.peer(peer.segment), transport).name
            seed = 1
            for op in (Opcode.WRITE, Opcode.READ):
                for size, batch in CASES:
                    seed += 1
                    n = size * batch
                    reqs = [
                        TransferRequest(op, buf.addr + i * size, peer.addr + i * size, size)
                        for i in range(batch)
                    ]
                    # correctness first: one verified round
                    if op is Opcode.WRITE:
                        arr[:n] = pattern(seed, n)
                    else:
                        await anyio.to_thread.run_sync(
                            functools.partial(peer.cmd, op="fill", offset=0, length=n, seed=seed)
                        )
                    results = await engine.transfer(peer.segment, reqs, transport=used)
                    ok = all(r.ok for r in results)
                    if op is Opcode.WRITE:
                        remote = await anyio.to_thread.run_sync(
                            functools.partial(peer.cmd, op="digest", offset=0, length=n)
                        )
                        ok = ok and remote["digest"] == digest(arr[:n])
                    else:
                        ok = ok and digest(arr[:n]) == digest(pattern(seed, n))
                    # then timing
                    lat: list[float] = []
                    end = time.perf_counter() + seconds
                    while time.perf_counter() < end or len(lat) < 3:
                        t0 = time.perf_counter()
                        res = await engine.transfer(peer.segment, reqs, transport=used)
                        lat.append(time.perf_counter() - t0)
                        ok = ok and all(r.ok for r in res)
                    total = sum(lat)
                    rows.append(
                        {
                            "op": op.name.lower(),
                            "block": size,
                            "batch": batch,
                            "calls": len(lat),
                            "gbps": n * len(lat) / total / 1e9,
                            "p50_us": statistics.median(lat) * 1e6,
                            "verified": ok,
                        }
                    )
            local = engine.segment_name
    finally:
        await anyio.to_thread.run_sync(peer.close)
    return local, peer.segment, used, rows


def run(args: argparse.Namespace) -> int:
    from mooncake._cli._quiet import ordinary

    try:
        local, remote, used, rows = anyio.run(_demo, args.seconds, args.transport, backend="trio")
    except BaseException as e:
        exc = ordinary(e)
        if exc is None or isinstance(exc, KeyboardInterrupt):
            raise
        print(f"mooncake demo: {exc}", file=sys.stderr)  # a bad --transport, a busy port
        return 2
    if args.json:
        print(
            json.dumps(
                {"initiator": local, "target": remote, "transport": used, "results": rows},
                indent=2,
            )
        )
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"mooncake demo: {local} -> {remote} ({used}, P2P handshake)")
        for col in ("op", "block", "batch", "calls", "GB/s", "p50 µs", "bytes verified"):
            table.add_column(col, justify="right" if col not in ("op",) else "left")
        for r in rows:
            table.add_row(
                r["op"],
                _fmt_size(r["block"]),
                str(r["batch"]),
                str(r["calls"]),
                f"{r['gbps']:.3f}",
                f"{r['p50_us']:.0f}",
                "[green]yes[/green]" if r["verified"] else "[red]NO[/red]",
            )
        Console().print(table)
    return 0 if all(r["verified"] for r in rows) else 1
