"""The victim of ``tests/test_memory_safety.py``: random transfer / unregister / close / SIGKILL.

Runs ``--iters`` rounds (seeded). Each round registers fresh buffers (raw ``mmap`` ranges
between guard pages, and ``engine.allocate`` memfds), starts transfers that touch them over
every path (own-segment copies on worker threads; shm and tcp to and from a hammer peer, see
``stress_hammer.py``, which also hammers our buffers from its side), and after a random delay
unregisters them in random order. The moment ``unregister`` returns, a raw range is *retired*:
either ``mprotect(PROT_NONE)`` (any late access from this process crashes it) or replaced by a
fresh mapping filled with a sentinel (a late write from anyone, a peer's process_vm or TCP
server thread included, shows as a changed byte). Some rounds close the engine with batches in
flight, some SIGKILL the hammer mid-round. At the end every guard page and sentinel range must
be intact; it prints a JSON summary and exits 0, or 3 when a byte was touched late.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio

from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Buffer, Engine, open_engine
from mooncake.errors import MooncakeError

PAGE = mmap.PAGESIZE
SENT = 0x5C
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FIXED = 0x10
HAMMER = Path(__file__).with_name("stress_hammer.py")


def _map(n: int, at: int | None = None) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_FIXED if at else 0)
    p = libc.mmap(at, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(p)


class Raw:
    """``[guard page | n bytes | guard page]``; only the middle is registered."""

    def __init__(self, n: int) -> None:
        self.n = (n + PAGE - 1) // PAGE * PAGE
        self.base = _map(self.n + 2 * PAGE)
        self.addr = self.base + PAGE
        ctypes.memset(self.base, SENT, PAGE)
        ctypes.memset(self.addr + self.n, SENT, PAGE)
        ctypes.memset(self.addr, 0x11, self.n)
        self.retired = ""

    def retire(self, how: str) -> None:
        """Called the moment unregister returned (or the engine closed)."""
        self.retired = how
        if how == "protnone":
            assert libc.mprotect(self.addr, self.n, 0) == 0
        else:  # a new owner of the same addresses, as a reused allocation would be
            _map(self.n, self.addr)
            ctypes.memset(self.addr, SENT, self.n)

    def damage(self) -> list[str]:
        out = []
        for name, a, n in (
            ("low guard", self.base, PAGE),
            ("high guard", self.addr + self.n, PAGE),
        ):
            if ctypes.string_at(a, n).count(SENT) != n:
                out.append(f"{name} of {self.addr:#x} touched")
        if self.retired == "sentinel":
            data = ctypes.string_at(self.addr, self.n)
            bad = self.n - data.count(SENT)
            if bad:
                out.append(f"{bad} bytes written into {self.addr:#x} after its unregister")
        return out

    def free(self) -> None:
        libc.munmap(self.base, self.n + 2 * PAGE)


class Hammer:
    def __init__(self, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HAMMER), "--seed", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.info: dict[str, Any] = json.loads(self.proc.stdout.readline())

    def aim(self, segment: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(segment + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


async def one_round(
    rng: random.Random, engine: Engine, hammer: Hammer, stats: dict[str, int], raws: list[Raw]
) -> None:
    bufs: list[Any] = []
    for _ in range(rng.randint(2, 4)):
        n = rng.choice([64 << 10, 3 << 20, 12 << 20, 40 << 20])
        if rng.random() < 0.7:
            raw = Raw(n)
            raws.append(raw)
            await engine.register((raw.addr, raw.n), location="cpu:0")
            bufs.append(raw)
        else:
            bufs.append(await engine.allocate(n))
    seg_h = hammer.info["segment"]

    def length(b: Any) -> int:
        return int(b.n) if isinstance(b, Raw) else int(b.length)

    async def transfer() -> None:
        a, b = rng.sample(bufs, 2)
        n = rng.randint(1, min(length(a), length(b)))
        path = rng.choice(["local", "shm", "tcp"])
        op = rng.choice([TransferRequest.read, TransferRequest.write])
        try:
            if path == "local":
                await engine.transfer(engine.segment_name, [op(a.addr, b.addr, n)])
            else:
                remote = hammer.info[rng.choice(["alloc", "array"])]
                n = min(n, 64 << 20)
                await engine.transfer(seg_h, [op(a.addr, remote, n)], transport=path)
            stats[path] += 1
        except MooncakeError:
            stats["refused"] += 1

    async def unregister_all() -> None:
        await anyio.sleep(rng.random() * 0.02)
        for b in rng.sample(bufs, len(bufs)):
            await engine.unregister(b.addr)
            if isinstance(b, Raw):
                b.retire(rng.choice(["protnone", "sentinel"]))
            stats["unregistered"] += 1

    async with anyio.create_task_group() as tg:
        for _ in range(rng.randint(1, 6)):
            tg.start_soon(transfer)
        if rng.random() < 0.1:
            await anyio.sleep(rng.random() * 0.01)
            hammer.kill()
            stats["killed"] += 1
        tg.start_soon(unregister_all)


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    stats = dict.fromkeys(("local", "shm", "tcp", "refused", "unregistered", "killed"), 0)
    stats["closed"] = 0
    raws: list[Raw] = []
    hammer = Hammer(args.seed)
    it = 0
    try:
        while it < args.iters:
            open_raws: list[Raw] = []
            async with open_engine("127.0.0.1") as engine:
                hammer.aim(engine.segment_name)
                while it < args.iters:
                    it += 1
                    if hammer.proc.poll() is not None:
                        hammer = Hammer(args.seed + it)
                        hammer.aim(engine.segment_name)
                    if rng.random() < 0.15:
                        # close with batches in flight: submitted into the engine's own tasks
                        for _ in range(3):
                            raw = Raw(rng.choice([3 << 20, 24 << 20]))
                            raws.append(raw)
                            open_raws.append(raw)
                            await engine.register((raw.addr, raw.n), location="cpu:0")
                            mem: Buffer = await engine.allocate(24 << 20)
                            n = min(raw.n, mem.length)
                            engine.submit(
                                engine.segment_name, [TransferRequest.write(raw.addr, mem.addr, n)]
                            )
                            engine.submit(
                                hammer.info["segment"],
                                [TransferRequest.read(raw.addr, hammer.info["alloc"], n)],
                            )
                        await anyio.sleep(rng.random() * 0.01)
                        stats["closed"] += 1
                        break
                    await one_round(rng, engine, hammer, stats, raws)
            # the engine is closed: everything it had registered is released
            for raw in open_raws:
                raw.retire(rng.choice(["protnone", "sentinel"]))
    finally:
        hammer.aim("")
        hammer.close()
    await anyio.sleep(0.3)  # give any late writer time to show itself
    damage = [d for r in raws for d in r.damage()]
    print(json.dumps({"stats": stats, "raws": len(raws), "damage": damage[:20]}), flush=True)
    for r in raws:
        if r.retired != "protnone":
            r.free()
    sys.exit(3 if damage else 0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=40)
    anyio.run(main, ap.parse_args(), backend="trio")
