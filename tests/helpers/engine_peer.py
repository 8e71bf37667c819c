"""A mooncake-py engine in its own process, driven over stdin/stdout (one JSON per line).

It allocates ``--alloc`` bytes with ``engine.allocate`` (memfd-backed) and registers a numpy
array of ``--array`` bytes (memory the engine did not allocate), fills both with
``(i * 7 + 1) & 0xff`` and prints ``{"segment", "alloc": addr, "array": addr, "pid"}``. Commands:

  {"op": "fill", "which": "alloc"|"array", "offset": o, "data_hex": h}
  {"op": "dump", "which": ..., "offset": o, "length": n}      -> {"data_hex": ...}
  {"op": "unregister", "which": ...}                           -> {"ok": true}
  {"op": "unregister_watch", "wait_s": t}                      -> {"before", "after"}
      unregister the array, then read its last byte at once and again ``wait_s`` later: a
      peer still writing after ``unregister`` returned shows as before != after
  {"op": "allocate", "which": name, "length": n, "value": v}   -> {"addr": ...} (filled with v)
  {"op": "quit"}

``--no-dumpable`` makes the process non-dumpable, so the kernel refuses process_vm_readv/writev
on it to callers without CAP_SYS_PTRACE (the ptrace-policy refusal the shm transport handles).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import numpy as np


def fill_pattern(v: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """``v[i] = (i * 7 + 1) & 0xff``, which repeats every 256 bytes: written as rows of one
    256-byte period (no temporary of eight bytes per element, hundreds of MB fill in a blink)."""
    period = ((np.arange(256, dtype=np.uint16) * 7 + 1) & 0xFF).astype(np.uint8)
    whole = len(v) - len(v) % 256
    v[:whole].reshape(-1, 256)[:] = period
    v[whole:] = period[: len(v) - whole]


async def main(args: argparse.Namespace) -> None:
    from mooncake._engine.engine import open_engine

    if args.no_dumpable:  # ptrace (so process_vm_*) now needs CAP_SYS_PTRACE in the caller
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0

    async with open_engine("127.0.0.1") as engine:
        buf = await engine.allocate(args.alloc)
        arr = np.empty(args.array, dtype=np.uint8)
        await engine.register(arr)
        views: dict[str, Any] = {"alloc": buf.numpy(), "array": arr}
        for v in views.values():
            fill_pattern(v)
        info = {"segment": engine.segment_name, "alloc": buf.addr, "array": int(arr.ctypes.data)}
        info["pid"] = __import__("os").getpid()
        print(json.dumps(info), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                break
            cmd = json.loads(line)
            op = cmd["op"]
            reply: dict[str, Any] = {"ok": True}
            if op == "quit":
                break
            v = views.get(cmd.get("which", ""))
            if op == "fill":
                data = bytes.fromhex(cmd["data_hex"])
                o = cmd["offset"]
                v[o : o + len(data)] = np.frombuffer(data, dtype=np.uint8)
            elif op == "dump":
                o, n = cmd["offset"], cmd["length"]
                reply["data_hex"] = v[o : o + n].tobytes().hex()
            elif op == "allocate":  # a new engine buffer, registered after peers listed ours
                extra = await engine.allocate(cmd["length"])
                views[cmd["which"]] = extra.numpy()
                views[cmd["which"]][:] = cmd.get("value", 0)
                reply["addr"] = extra.addr
            elif op == "unregister_watch":
                await engine.unregister(arr)
                reply["before"] = int(arr[-1])
                await anyio.sleep(cmd.get("wait_s", 0.5))
                reply["after"] = int(arr[-1])
            elif op == "unregister":
                which = cmd["which"]
                if which == "alloc":
                    views.pop("alloc")
                    v = None
                    await engine.unregister(buf)
                else:
                    await engine.unregister(arr)
            else:
                reply = {"ok": False, "error": f"unknown op {op}"}
            print(json.dumps(reply), flush=True)
        views.clear()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--alloc", type=int, default=1 << 20)
    ap.add_argument("--array", type=int, default=1 << 20)
    ap.add_argument("--no-dumpable", action="store_true")
    anyio.run(main, ap.parse_args(), backend="trio")
