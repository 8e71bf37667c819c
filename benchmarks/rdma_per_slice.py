"""Per-slice cost of the rdma transport: one 64 MiB WRITE at several MC_SLICE_SIZE values.

    python benchmarks/rdma_per_slice.py

Both engines run in this process on the software provider, so each slice's copy is a plain
memmove and the time per slice at small slices is the transport's own work (slicing, NIC choice,
posting, reaping, all in Python) plus ~1 µs of copy.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE = 64 << 20


async def run(slice_size: int) -> float:
    import mooncake
    from mooncake._core.transfer import TransferRequest as R

    os.environ["MC_SLICE_SIZE"] = str(slice_size)
    async with (
        mooncake.open_engine(transports=["rdma"]) as a,
        mooncake.open_engine(transports=["rdma"]) as b,
    ):
        ba = await a.allocate(SIZE)
        bb = await b.allocate(SIZE)
        req = [R.write(ba.addr, bb.addr, SIZE)]
        await a.transfer(b.segment_name, req)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            (res,) = await a.transfer(b.segment_name, req)
            best = min(best, time.perf_counter() - t)
            assert res.ok, res
        return best


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(
            MOONCAKE_IBVERBS="soft",
            MC_SOFTVERBS_FABRIC=os.path.join(tmp, "fabric"),
            MC_SOFTVERBS_DEVICES="soft0,soft1",
        )
        for s in (4096, 65536, 1 << 20):
            best = anyio.run(run, s, backend="trio")
            n = SIZE // s
            print(
                f"slice {s >> 10:>5} KiB: {best * 1e3:7.1f} ms  {SIZE / best / 1e9:5.2f} GB/s  "
                f"{best / n * 1e6:6.1f} us/slice"
            )


if __name__ == "__main__":
    main()
