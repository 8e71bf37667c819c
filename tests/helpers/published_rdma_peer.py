"""The published Mooncake engine in RDMA mode, for the RDMA interop tests (anchor venv python).

Like ``published_peer.py`` but initialised with protocol ``rdma`` on the device named in
``MC_RDMA_PEER_DEVICE``; run with ``LD_LIBRARY_PATH`` pointing at a directory whose
``libibverbs.so.1`` is the project's software provider (or the real one on RNIC hosts). Prints
``{"segment", "addr", "rc"}``, then serves JSON-line commands:

  {"op": "fill", "offset": o, "data_hex": h} / {"op": "dump", "offset": o, "length": n}
  {"op": "write"|"read", "segment": s, "local_off": o, "remote": a, "length": n} -> {"rc": int}
  {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from mooncake.engine import TransferEngine  # the published wheel


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 16 << 20
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", os.environ["MC_RDMA_PEER_DEVICE"])
    if rc != 0:
        print(json.dumps({"error": f"initialize rc={rc}"}), flush=True)
        sys.exit(1)
    buf = np.zeros(size, dtype=np.uint8)
    base = int(buf.ctypes.data)
    rc = te.register_memory(base, size)
    print(
        json.dumps({"segment": f"127.0.0.1:{te.get_rpc_port()}", "addr": base, "rc": rc}),
        flush=True,
    )
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
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
