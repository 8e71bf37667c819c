"""A published-Mooncake engine in its own process, driven over stdin/stdout (one JSON per line).

Run with the anchor venv's python. It registers a pre-faulted buffer of ``--size`` bytes and
prints ``{"segment": ..., "addr": ...}``; then it reads commands:

  {"op": "fill", "offset": o, "data_hex": h}         write bytes into its own buffer
  {"op": "dump", "offset": o, "length": n}           -> {"data_hex": ...}
  {"op": "write"|"read", "segment": s, "local_off": o, "remote": a, "length": n}
                                                     -> {"rc": int} (transfer_sync_*)
  {"op": "batch_write"|"batch_read", "segment": s, "local_offs": [...], "remotes": [...],
   "lengths": [...]}                                 -> {"rc": int}
  {"op": "quit"}
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mooncake.engine import TransferEngine  # the published wheel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=16 << 20)
    args = ap.parse_args()
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        print(json.dumps({"error": f"initialize rc={rc}"}), flush=True)
        sys.exit(1)
    buf = np.zeros(args.size, dtype=np.uint8)
    buf.fill(0)
    base = int(buf.ctypes.data)
    rc = te.register_memory(base, args.size)
    seg = f"127.0.0.1:{te.get_rpc_port()}"
    print(json.dumps({"segment": seg, "addr": base, "rc": rc}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, object] = {}
        if op == "quit":
            break
        if op == "fill":
            data = bytes.fromhex(cmd["data_hex"])
            buf[cmd["offset"] : cmd["offset"] + len(data)] = np.frombuffer(data, np.uint8)
        elif op == "dump":
            out["data_hex"] = bytes(buf[cmd["offset"] : cmd["offset"] + cmd["length"]]).hex()
        elif op in ("write", "read"):
            fn = te.transfer_sync_write if op == "write" else te.transfer_sync_read
            out["rc"] = fn(cmd["segment"], base + cmd["local_off"], cmd["remote"], cmd["length"])
        elif op in ("batch_write", "batch_read"):
            fn = (
                te.batch_transfer_sync_write if op == "batch_write" else te.batch_transfer_sync_read
            )
            out["rc"] = fn(
                cmd["segment"],
                [base + o for o in cmd["local_offs"]],
                cmd["remotes"],
                cmd["lengths"],
            )
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
