"""Cost of one sync -> event loop -> sync crossing (a trivial coroutine), per mechanism.

The number behind :mod:`mooncake._sync`'s choice (and the fast path's reason to skip the loop):

* ``trio.from_thread.run`` into a trio loop on a thread,
* ``asyncio.run_coroutine_threadsafe(...).result()`` into an asyncio loop on a thread,
* ``mooncake._sync.LoopThread.call`` (what the sync facades use).

``python benchmarks/loop_crossing.py [--calls N] [--rounds R]`` prints, per mechanism, the
median over rounds of each round's median per-call time in microseconds, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable

import trio


async def _nothing() -> int:
    return 1


def _median_us(call: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def trio_crossing(calls: int) -> float:
    token: list[trio.lowlevel.TrioToken] = []
    ready, stop = threading.Event(), threading.Event()

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())
        ready.set()
        await trio.to_thread.run_sync(stop.wait)

    t = threading.Thread(target=trio.run, args=(main,))
    t.start()
    ready.wait()
    try:
        return _median_us(lambda: trio.from_thread.run(_nothing, trio_token=token[0]), calls)
    finally:
        stop.set()
        t.join()


def asyncio_crossing(calls: int) -> float:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever)
    t.start()
    try:
        return _median_us(
            lambda: asyncio.run_coroutine_threadsafe(_nothing(), loop).result(), calls
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join()
        loop.close()


def loopthread_crossing(calls: int) -> float:
    from mooncake._sync import LoopThread

    lt = LoopThread()
    try:
        return _median_us(lambda: lt.call(_nothing), calls)
    finally:
        lt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at start")
    for name, fn in (
        ("trio.from_thread.run", trio_crossing),
        ("asyncio.run_coroutine_threadsafe", asyncio_crossing),
        ("mooncake._sync.LoopThread.call", loopthread_crossing),
    ):
        rounds = [fn(a.calls) for _ in range(a.rounds)]
        print(
            f"{name:34s} median {statistics.median(rounds):7.1f} us/call "
            f"(round medians {', '.join(f'{r:.0f}' for r in rounds)})"
        )
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at end")


if __name__ == "__main__":
    main()
