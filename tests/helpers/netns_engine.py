"""One engine per "host": run inside a network namespace, driven over stdin/stdout (JSON lines).

  python tests/helpers/netns_engine.py --hostname 10.77.0.1 --metadata etcd://10.77.0.254:2379 \
      --segment-name hostA [--user-timeout-ms 3000]

prints {"ready": segment, "rpc_port": p}, then answers one line per command:

  {"op": "alloc", "size": n, "seed": s}         -> {"addr": a, "sha": h}   (deterministic bytes)
  {"op": "sha", "addr": a, "length": n}         -> {"sha": h}
  {"op": "read"|"write", "segment": s, "local": a, "remote": r, "length": n}
                                                -> {"ok": bool, "error": str, "etype": str}
  {"op": "loop_read", ...same...}              -> {"started": true} after the first read, then,
                                                   once a read fails, {"ok": false, "error": ...,
                                                   "etype": ..., "reads": k}
  {"op": "quit"}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import anyio
import numpy as np

from mooncake._engine import _sockio
from mooncake._engine.engine import Buffer, Engine, open_engine
from mooncake.errors import MooncakeError


def out(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def sha(engine: Engine, addr: int, length: int) -> str:
    for buf in engine._buffers.values():
        if buf.addr <= addr and addr + length <= buf.addr + buf.length:
            off = addr - buf.addr
            return hashlib.sha256(bytes(buf.view[off : off + length])).hexdigest()
    raise ValueError(f"{addr:#x} is not in an allocated buffer")


async def one(engine: Engine, cmd: dict[str, Any]) -> tuple[bool, str, str]:
    fn = engine.read if cmd["op"] in ("read", "loop_read") else engine.write
    try:
        await fn(cmd["segment"], cmd["local"], cmd["remote"], cmd["length"])
        return True, "", ""
    except MooncakeError as e:
        return False, str(e), type(e).__name__


async def main(args: argparse.Namespace) -> None:
    async with open_engine(args.hostname, args.metadata, segment_name=args.segment_name) as engine:
        out({"ready": engine.segment_name, "rpc_port": engine.rpc_port})
        bufs: list[Buffer] = []
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                return
            if op == "alloc":
                buf = await engine.allocate(cmd["size"])
                rng = np.random.default_rng(cmd["seed"])
                buf.numpy()[: cmd["size"]] = rng.integers(0, 256, cmd["size"], dtype=np.uint8)
                bufs.append(buf)
                out({"addr": buf.addr, "sha": sha(engine, buf.addr, cmd["size"])})
            elif op == "sha":
                out({"sha": sha(engine, cmd["addr"], cmd["length"])})
            elif op in ("read", "write"):
                ok, err, etype = await one(engine, cmd)
                out({"ok": ok, "error": err, "etype": etype})
            elif op == "loop_read":
                reads = 0
                while True:
                    ok, err, etype = await one(engine, cmd)
                    if not ok:
                        out({"ok": False, "error": err, "etype": etype, "reads": reads})
                        break
                    reads += 1
                    if reads == 1:
                        out({"started": True})
            else:
                out({"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostname", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--segment-name", required=True)
    ap.add_argument("--user-timeout-ms", type=int, default=3000)
    a = ap.parse_args()
    # bound how long a cut link can stall a transfer (the defaults are 15 s / 5 s)
    _sockio.USER_TIMEOUT_MS = a.user_timeout_ms
    _sockio.KEEPALIVE_IDLE_S = 1
    _sockio.KEEPALIVE_INTVL_S = 1
    _sockio.KEEPALIVE_CNT = 2
    _sockio.CONNECT_TIMEOUT_S = 2.0
    anyio.run(main, a, backend="trio")
