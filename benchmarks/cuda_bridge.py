"""Cost of one completion wait (stream -> event loop), ``eventfd`` vs ``thread`` bridge.

    python benchmarks/cuda_bridge.py            # the real runtime when a GPU is usable
    python benchmarks/cuda_bridge.py --fake     # FAKE runtime: the loop-side overhead only

Each round awaits ``Completions.wait`` on an idle stream ``--n`` times (after 50 warm-up waits),
so the number is the bridge itself: enqueueing the callback or event, the wake-up, and getting
back to the task. Modes alternate twice to expose drift from machine load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mooncake._engine.cudaio import Completions


async def run(fake: bool, n: int) -> None:
    rt: Any
    if fake:
        from mooncake.testing.fake_cuda import FakeCudaRuntime

        rt = FakeCudaRuntime()
    else:
        from mooncake._fast import cuda

        rt = cuda.runtime()
        rt.set_device(0)
    stream = rt.stream_create()
    print(f"runtime: {rt.backend}")
    for mode in ("eventfd", "thread", "eventfd", "thread"):
        comp = Completions(rt, mode)
        for _ in range(50):
            await comp.wait(stream)
        t0 = time.perf_counter()
        for _ in range(n):
            await comp.wait(stream)
        print(f"{mode:8s} {(time.perf_counter() - t0) / n * 1e6:8.1f} us/wait")
        comp.close()
    rt.stream_destroy(stream)
    if fake:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    anyio.run(run, args.fake, args.n, backend="trio")


if __name__ == "__main__":
    main()
