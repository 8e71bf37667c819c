"""An async store client holding a segment, drained on SIGTERM (``Store.drain_on_signal``).

Usage: async_holder.py MASTER BACKEND (trio or asyncio). Prints ``{"hostname": ...}`` once
mounted, waits for SIGTERM, drains, prints ``{"settled": ...}`` and leaves the block (unmount).
"""

from __future__ import annotations

import json
import sys

import anyio

import mooncake


async def main(master: str) -> None:
    async with mooncake.open_store(master, segment_size=16 << 20, local_buffer_size=0) as store:
        print(json.dumps({"hostname": store.segment_name}), flush=True)
        report = await store.drain_on_signal()
        print(json.dumps({"settled": report.settled, "moves": report.moves}), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], backend=sys.argv[2])
