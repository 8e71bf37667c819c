"""Structured concurrency with trio: a nursery of transfers, one of them cancelled midway.

Two engines in one trio program (a "prefill" side that reads, a "decode" side that serves) move
blocks over TCP: several small ones and one large one. Every transfer runs in one nursery: if any of them failed, the others would be
cancelled and the error raised here, with nothing left running. One transfer sits in its own
cancel scope with a deadline that expires while its bytes are still moving. What cancellation
guarantees (see ``Engine.transfer``):

* when ``await engine.transfer(...)`` is cancelled, it returns (raising ``Cancelled``) only after
  no transport, thread or peer can still write into its local buffers: the buffer's bytes are
  final at that moment, and it may be unregistered and freed at once;
* the other transfers of the nursery are not affected.

Run::

    python examples/trio_cancellation.py
"""

from __future__ import annotations

import sys

import numpy as np
import trio

import mooncake
from mooncake import TransferRequest

BLOCK = 16 << 20  # the large, cancelled transfer
SMALL = 256 << 10  # the others
N = 4


async def main() -> int:
    async with (
        mooncake.open_engine("127.0.0.1", transports=["tcp"]) as decode,
        mooncake.open_engine("127.0.0.1", transports=["tcp"]) as prefill,
    ):
        src = await decode.allocate(N * BLOCK)
        src.numpy()[:] = np.random.default_rng(0).integers(0, 256, N * BLOCK, dtype=np.uint8)
        dst = await prefill.allocate(N * BLOCK)
        view = dst.numpy()
        view[:] = 0xEE  # a sentinel: whatever is still 0xEE was never written

        # First contact (handshake, descriptor, TCP lanes) happens here, not under the deadline,
        # and one timed block tells how long a block takes on this machine.
        await prefill.read(decode.segment_name, dst.addr, src.addr, 4096)
        t0 = trio.current_time()
        await prefill.read(decode.segment_name, dst.addr, src.addr, BLOCK)
        block_time = trio.current_time() - t0
        view[:] = 0xEE

        async def read_block(i: int) -> None:
            req = TransferRequest.read(dst.addr + i * BLOCK, src.addr + i * BLOCK, SMALL)
            (res,) = await prefill.transfer(decode.segment_name, [req])
            assert res.ok, res.error

        cancelled_at: bytes | None = None

        async def read_block_with_deadline(i: int) -> None:
            nonlocal cancelled_at
            with trio.move_on_after(block_time / 2) as scope:
                # 16 x 1 MiB requests; the deadline lands while they are in flight
                reqs = [
                    TransferRequest.read(
                        dst.addr + i * BLOCK + k * (1 << 20),
                        src.addr + i * BLOCK + k * (1 << 20),
                        1 << 20,
                    )
                    for k in range(BLOCK >> 20)
                ]
                await prefill.transfer(decode.segment_name, reqs)
            if scope.cancelled_caught:
                # The transfer has returned: nothing writes this block any more.
                cancelled_at = view[i * BLOCK : (i + 1) * BLOCK].tobytes()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_block_with_deadline, N - 1)
            for i in range(N - 1):
                nursery.start_soon(read_block, i)

        full = [
            np.array_equal(
                view[i * BLOCK : i * BLOCK + SMALL], src.numpy()[i * BLOCK : i * BLOCK + SMALL]
            )
            for i in range(N - 1)
        ]
        last = slice((N - 1) * BLOCK, N * BLOCK)
        if cancelled_at is None:
            print("the deadline never hit (the machine was fast): the last block completed")
            stable = np.array_equal(view[last], src.numpy()[last])
            written = BLOCK
        else:
            await trio.sleep(0.05)  # give a late writer, if there were one, the time to show
            stable = view[last].tobytes() == cancelled_at
            written = int(np.count_nonzero(view[last] != 0xEE))
            del view  # numpy views pin the mapping; drop ours, then unregister at once
            await prefill.unregister(dst)
        ok = all(full) and stable
        print(
            f"trio nursery: {sum(full)}/{N - 1} small transfers verified; cancelled one: "
            f"{written >> 10} KiB of {BLOCK >> 10} KiB written before the cancel, "
            f"unchanged afterwards: {stable}: {'OK' if ok else 'FAILED'}"
        )
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
