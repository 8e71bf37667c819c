"""The other side of an integration, in its own process, on the published sync API only.

``python -m tests.helpers.facade_peer [--hostname H] --protocol P --size N [--regions K]`` makes a
``mooncake.engine.TransferEngine``, initializes it as the integrations do (``P2PHANDSHAKE``,
the given protocol string), registers ``K`` numpy regions of ``N`` bytes each with one
``batch_register_memory`` call and prints ``{"segment": "host:rpc_port", "addrs": [...]}``.
Commands, one JSON per line:

  {"op": "digest", "region": r, "offset": o, "length": n}  -> {"digest": sha256 hex}
  {"op": "fill", "region": r, "seed": s}                    -> {} (deterministic bytes)
  {"op": "write", "session": s, "region": r, "remote": a, "length": n} -> {"rc": int}
  {"op": "batch_unregister"}                                -> {"rc": int}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--regions", type=int, default=1)
    args = ap.parse_args()

    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(args.hostname, "P2PHANDSHAKE", args.protocol, "") != 0:
        raise SystemExit("initialize failed")
    regions = [np.zeros(args.size, dtype=np.uint8) for _ in range(args.regions)]
    addrs = [int(r.ctypes.data) for r in regions]
    if te.batch_register_memory(addrs, [args.size] * args.regions) != 0:
        raise SystemExit("batch_register_memory failed")
    print(
        json.dumps({"segment": f"{args.hostname}:{te.get_rpc_port()}", "addrs": addrs}), flush=True
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, object] = {"ok": True}
        if cmd["op"] == "digest":
            view = regions[cmd["region"]][cmd["offset"] : cmd["offset"] + cmd["length"]]
            out["digest"] = hashlib.sha256(view.tobytes()).hexdigest()
        elif cmd["op"] == "fill":
            regions[cmd["region"]][:] = pattern(cmd["seed"], args.size)
        elif cmd["op"] == "write":
            out["rc"] = te.transfer_sync_write(
                cmd["session"], addrs[cmd["region"]], cmd["remote"], cmd["length"]
            )
        elif cmd["op"] == "batch_unregister":
            out["rc"] = te.batch_unregister_memory(addrs)
        else:
            out = {"ok": False, "error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(out), flush=True)
    te.close()


if __name__ == "__main__":
    main()
