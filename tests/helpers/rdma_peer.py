"""An RDMA target engine in its own process for the transport tests (JSON lines on stdio).

``python -m tests.helpers.rdma_peer SIZE`` starts an engine with only the ``rdma`` transport,
maps ``SIZE`` bytes, registers them and prints ``{"segment", "addr", "size"}``. Commands:

* ``{"op": "fill", "offset", "length", "seed"}`` / ``{"op": "digest", "offset", "length"}``
* ``{"op": "rekey"}``: unregister the buffer and register the same memory again (new rkeys)
* ``{"op": "unregister"}``: unregister it for good
* ``{"op": "stats"}`` -> the transport's counters
* ``{"op": "quit"}`` -> closes the engine, answers the verbs layer's live-object counts
"""

from __future__ import annotations

import json
import mmap
import sys

import anyio
import numpy as np

import mooncake
from mooncake._cli._peer import digest, pattern


async def serve(size: int) -> None:
    from mooncake._fast import verbs

    mm = mmap.mmap(-1, size)
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = int(arr.ctypes.data)
    async with mooncake.open_engine("127.0.0.1", transports=["rdma"]) as engine:
        await engine.register((addr, size))
        print(json.dumps({"segment": engine.segment_name, "addr": addr, "size": size}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd.get("op")
            out: dict[str, object] = {"ok": True}
            if op == "quit":
                break
            if op == "fill":
                o, n = cmd["offset"], cmd["length"]
                arr[o : o + n] = pattern(cmd["seed"], n)
            elif op == "digest":
                o, n = cmd["offset"], cmd["length"]
                out["digest"] = digest(arr[o : o + n])
            elif op == "rekey":
                await engine.unregister(addr)
                await engine.register((addr, size))
            elif op == "unregister":
                await engine.unregister(addr)
            elif op == "stats":
                out["stats"] = dict(engine.transports[0].stats)  # type: ignore[attr-defined]
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
            print(json.dumps(out), flush=True)
    print(
        json.dumps(
            {"ok": True, "live": verbs.live_objects(), "provider": verbs.provider_live_objects()}
        ),
        flush=True,
    )


if __name__ == "__main__":
    anyio.run(serve, int(sys.argv[1]), backend="trio")
