"""A store client in a child process whose segment is FAKE device memory (the GPU tier's
two-process test). Usage: ``gpu_store_peer.py MASTER [--transports tcp,cuda]``.

Mounts ``--size`` bytes at ``cuda:0`` (``open_store(segment_location="cuda:0")`` with a
:class:`~mooncake.testing.fake_cuda.FakeCudaRuntime`), prints ``{"segment", "base", "size"}``,
then serves one JSON command per stdin line:

  {"op": "get", "key": k}                    -> {"data_hex": ...}   (the owner's own read)
  {"op": "put", "key": k, "data_hex": h}     the owner writes into its own segment
  {"op": "stats"}                            -> fake runtime counters
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

import mooncake
from mooncake._engine.engine import open_engine
from mooncake.store import ReplicateConfig
from mooncake.testing.fake_cuda import FakeCudaRuntime


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("master")
    ap.add_argument("--size", type=int, default=4 << 20)
    ap.add_argument("--transports", default="tcp,cuda")
    args = ap.parse_args()
    rt = FakeCudaRuntime()
    try:
        async with (
            open_engine(
                "127.0.0.1", transports=args.transports.split(","), cuda_runtime=rt
            ) as engine,
            mooncake.open_store(
                args.master, engine=engine, segment_size=args.size, segment_location="cuda:0"
            ) as store,
        ):
            dev = store.device_segment
            assert dev is not None
            print(
                json.dumps({"segment": store.segment_name, "base": dev.addr, "size": dev.length}),
                flush=True,
            )
            own = ReplicateConfig()
            own.preferred_segment = store.segment_name
            stdin = anyio.wrap_file(sys.stdin)
            async for line in stdin:
                cmd = json.loads(line)
                out: dict[str, Any] = {"ok": True}
                op = cmd["op"]
                if op == "get":
                    out["data_hex"] = (await store.get(cmd["key"])).hex()
                elif op == "put":
                    await store.put(cmd["key"], bytes.fromhex(cmd["data_hex"]), own)
                elif op == "stats":
                    out.update(copies=rt.copies, opens=rt.ipc_opens, live=rt.live())
                print(json.dumps(out), flush=True)
    finally:
        rt.close()


if __name__ == "__main__":
    anyio.run(main, backend="trio")
