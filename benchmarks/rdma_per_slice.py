"""Per-slice cost of the rdma transport, and rail scaling, on the software provider.

    python benchmarks/rdma_per_slice.py [--rounds 7] [--size-mib 64]

Both engines run in this process (trio) on ``libmcsoftverbs.so``, so a WR's copy is a plain
memmove inside ``ibv_post_send``. Each configuration runs in a fresh child process and reports
medians over ``--rounds`` transfers of one ``--size-mib`` WRITE:

* ``per-slice``: 4 KiB and 64 KiB slices with ``MC_SOFTVERBS_NOCOPY=1`` (the provider checks
  and completes every WR but moves no bytes): wall time and CPU time of the thread that posts
  and reaps (``time.thread_time``), per slice. That CPU time is the engine's own work plus the
  provider's per-WR checks (both run on that thread); with a provider that ignores the knob
  (older builds) the copy is included, and the separately measured memmove per slice
  (``memmove``: a 64 MiB copy's time divided by the slice count) is what to subtract.
* ``rails``: 64 KiB slices with the copy, over 1 and 4 fake NICs (``MC_SOFTVERBS_DEVICES``):
  wall time and GB/s; striping over 4 rails should cost nothing against 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


async def _measure(size: int, rounds: int) -> dict[str, float]:
    import mooncake
    from mooncake._core.transfer import TransferRequest as R

    async with (
        mooncake.open_engine(transports=["rdma"]) as a,
        mooncake.open_engine(transports=["rdma"]) as b,
    ):
        ba = await a.allocate(size)
        bb = await b.allocate(size)
        req = [R.write(ba.addr, bb.addr, size)]
        for _ in range(2):  # endpoints up, pages touched
            (res,) = await a.transfer(b.segment_name, req)
            assert res.ok, res
        walls, cpus = [], []
        for _ in range(rounds):
            c = time.thread_time()
            t = time.perf_counter()
            (res,) = await a.transfer(b.segment_name, req)
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
            assert res.ok, res
        return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def _memmove_per_slice(slice_size: int, rounds: int) -> float:
    """The copy's share of one slice: a 64 MiB memmove (numpy) divided by the slice count."""
    import numpy as np

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t)
    return statistics.median(out) / ((64 << 20) // slice_size)


def child(cfg: dict[str, int | str]) -> None:
    import anyio

    os.environ["MC_SLICE_SIZE"] = str(cfg["slice"])
    res = anyio.run(_measure, int(cfg["size"]), int(cfg["rounds"]), backend="trio")
    print(json.dumps(res))


def run_child(cfg: dict[str, int | str], env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(cfg)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    size = args.size_mib << 20
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        base = {"MOONCAKE_IBVERBS": "soft", "MC_SOFTVERBS_FABRIC": os.path.join(tmp, "fabric")}
        for s in (4096, 65536):
            cfg = {"slice": s, "size": size, "rounds": args.rounds}
            r = run_child(
                cfg, {**base, "MC_SOFTVERBS_DEVICES": "soft0,soft1", "MC_SOFTVERBS_NOCOPY": "1"}
            )
            n = size // s
            mm = _memmove_per_slice(s, 3)
            print(
                f"per-slice {s >> 10:>3} KiB x {n:>5}: wall {r['wall'] / n * 1e6:6.2f} us/slice  "
                f"cpu {r['cpu'] / n * 1e6:6.2f} us/slice  ({n / r['cpu'] / 1e6:5.2f} M slices/s "
                f"per core)  memmove {mm * 1e6:5.2f} us"
            )
        walls = {}
        for nr in (1, 4):
            devs = ",".join(f"soft{i}" for i in range(nr))
            cfg = {"slice": 65536, "size": size, "rounds": args.rounds}
            r = run_child(cfg, {**base, "MC_SOFTVERBS_DEVICES": devs, "MC_SOFTVERBS_NOCOPY": "0"})
            walls[nr] = r["wall"]
            print(
                f"rails {nr}: 64 KiB slices, copy: wall {r['wall'] * 1e3:7.2f} ms  "
                f"{size / r['wall'] / 1e9:5.2f} GB/s  cpu {r['cpu'] * 1e3:7.2f} ms"
            )
        print(f"4 rails / 1 rail throughput: {walls[1] / walls[4]:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


if __name__ == "__main__":
    main()
