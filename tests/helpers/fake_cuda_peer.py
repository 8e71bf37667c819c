"""Our engine in a child process with the FAKE CUDA runtime (logic tests of the cuda transport).

Allocates ``--size`` bytes of fake device memory (``engine.allocate(location="cuda:0")``) and, with
``--interior``, registers a second region starting ``--interior`` bytes inside another allocation
(to exercise ``ipc_offset``). Prints ``{"segment", "addr", "interior_addr"}``, then serves one
JSON command per stdin line:

  {"op": "fill", "which": "main"|"interior", "offset": o, "data_hex": h}
  {"op": "dump", "which": ..., "offset": o, "length": n}        -> {"data_hex": ...}
  {"op": "realloc"}             allocate a new "main", unregister the old -> {"addr": ...}
  {"op": "stats"}               -> fake runtime counters
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from mooncake._engine.engine import open_engine
from mooncake.testing.fake_cuda import FakeCudaRuntime, view


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--interior", type=int, default=0)
    ap.add_argument("--transports", default="tcp,cuda")
    args = ap.parse_args()
    rt = FakeCudaRuntime()
    try:
        async with open_engine(
            "127.0.0.1", transports=args.transports.split(","), cuda_runtime=rt
        ) as engine:
            main_mem = await engine.allocate(args.size, location="cuda:0")
            regions: dict[str, tuple[int, int]] = {"main": (main_mem.addr, args.size)}
            if args.interior:
                base = rt.malloc(args.interior + args.size)
                await engine.register((base + args.interior, args.size), location="cuda:0")
                regions["interior"] = (base + args.interior, args.size)
            print(
                json.dumps(
                    {
                        "segment": engine.segment_name,
                        "addr": main_mem.addr,
                        "interior_addr": regions.get("interior", (0, 0))[0],
                    }
                ),
                flush=True,
            )
            stdin = anyio.wrap_file(sys.stdin)
            async for line in stdin:
                cmd = json.loads(line)
                out: dict[str, Any] = {"ok": True}
                op = cmd["op"]
                if op in ("fill", "dump"):
                    addr, size = regions[cmd["which"]]
                    v = view(addr, size)
                    if op == "fill":
                        data = bytes.fromhex(cmd["data_hex"])
                        v[cmd["offset"] : cmd["offset"] + len(data)] = list(data)
                    else:
                        out["data_hex"] = bytes(
                            v[cmd["offset"] : cmd["offset"] + cmd["length"]]
                        ).hex()
                elif op == "realloc":
                    # the new allocation first, so it cannot reuse the old address (a peer's
                    # cached descriptor would still cover it: see transports/cuda.py)
                    old = main_mem
                    main_mem = await engine.allocate(args.size, location="cuda:0")
                    await engine.unregister(old)
                    regions["main"] = (main_mem.addr, args.size)
                    out["addr"] = main_mem.addr
                elif op == "stats":
                    out.update(copies=rt.copies, opens=rt.ipc_opens, live=rt.live())
                print(json.dumps(out), flush=True)
    finally:
        rt.close()


if __name__ == "__main__":
    anyio.run(main, backend="trio")
