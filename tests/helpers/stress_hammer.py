"""An engine in its own process that hammers another segment's registered buffers.

Serves two buffers of its own (``engine.allocate``: memfd, and a numpy array: process_vm) of
``--size`` bytes for the other side's transfers, and prints ``{"segment", "alloc", "array"}``.
Reads target segments from stdin (one per line; an empty line stops hammering); while it has
one, ``--tasks`` tasks loop: refresh the target's descriptor, pick one of its buffers at random
and READ or WRITE (bytes ``0x77``) a random slice of it over ``shm`` or ``tcp``, ignoring every
failure (the buffers come and go under it on purpose).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import anyio
import numpy as np

from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import open_engine
from mooncake.errors import MooncakeError

WRITE_BYTE = 0x77


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with open_engine("127.0.0.1") as engine:
        own = await engine.allocate(args.size)
        arr = np.full(args.size, 0x33, dtype=np.uint8)
        await engine.register(arr)
        local = await engine.allocate(8 << 20)
        np.frombuffer(local.view, dtype=np.uint8)[:] = WRITE_BYTE
        print(
            json.dumps(
                {"segment": engine.segment_name, "alloc": own.addr, "array": int(arr.ctypes.data)}
            ),
            flush=True,
        )
        target: list[str] = []

        async def hammer() -> None:
            while True:
                if not target:
                    await anyio.sleep(0.005)
                    continue
                seg = target[0]
                try:
                    peer = await engine.peer(seg, refresh=True)
                    bufs = [b for b in peer.descriptor.buffers if b.name.startswith("cpu")]
                    if not bufs:
                        await anyio.sleep(0.001)
                        continue
                    b = rng.choice(bufs)
                    n = rng.randint(1, min(b.length, 8 << 20))
                    off = rng.randrange(0, b.length - n + 1)
                    op = rng.choice([TransferRequest.read, TransferRequest.write])
                    await engine.transfer(
                        seg, [op(local.addr, b.addr + off, n)], transport=rng.choice(["shm", "tcp"])
                    )
                except MooncakeError:
                    await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            for _ in range(args.tasks):
                tg.start_soon(hammer)
            while True:
                line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                if not line:
                    break
                target[:] = [line.strip()] if line.strip() else []
            tg.cancel_scope.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    anyio.run(main, ap.parse_args(), backend="trio")
