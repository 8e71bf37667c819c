"""A store client in its own process, driven over stdin/stdout (one JSON object per line).

Usage: store_client_driver.py MASTER SEGMENT_MIB LOCAL_BUFFER_MIB [SSD_DIR] (SSD_DIR: the
client's SSD tier). Prints
``{"hostname": ...}`` once set up, then answers commands:

  {"op": "put", "key": k, "seed": s, "size": n[, "replicas": r, "preferred": [seg...]]} -> {"rc"}
  {"op": "digest", "key": k}            -> {"len": n, "sha": hex} (of get(k))
  {"op": "exist", "key": k}             -> {"rc"}
  {"op": "put_partial", "key": k, "size": n}
        PutStart, write half of the replica, print {"started": true}, then hang (to be killed)
  {"op": "quit"}
Values are deterministic: ``value(seed, size)`` below, so another process can check them.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def value(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def main() -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    master, seg_mib, lb_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ssd = {"enable_ssd_offload": True, "ssd_offload_path": sys.argv[4]} if sys.argv[4:] else {}
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", seg_mib << 20, lb_mib << 20, "tcp", "", master, **ssd)
    if rc != 0:
        print(json.dumps({"error": f"setup rc={rc}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"hostname": s.get_hostname()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, object] = {}
        if op == "quit":
            break
        if op == "put":
            cfg = ReplicateConfig()
            cfg.replica_num = cmd.get("replicas", 1)
            cfg.preferred_segments = cmd.get("preferred", [])
            out["rc"] = s.put(cmd["key"], value(cmd["seed"], cmd["size"]), cfg)
        elif op == "digest":
            v = s.get(cmd["key"])
            out = {"len": len(v), "sha": hashlib.sha256(v).hexdigest()}
        elif op == "exist":
            out["rc"] = s.is_exist(cmd["key"])
        elif op == "put_partial":
            out = put_partial(s, cmd["key"], cmd["size"], cmd.get("preferred", []))
            print(json.dumps(out), flush=True)
            sys.stdin.read()  # hang until killed
            return
        print(json.dumps(out), flush=True)
    s.close()


def put_partial(s: object, key: str, size: int, preferred: list[str]) -> dict[str, object]:
    """PutStart and write only the first half of the replica, like a writer killed mid-put."""
    from mooncake._core import rpc
    from mooncake._core.store_types import ReplicateConfig

    store = s._store  # type: ignore[attr-defined]
    loop = s._loop  # type: ignore[attr-defined]

    async def go() -> dict[str, object]:
        src = await store.engine.allocate(size)
        src.numpy()[:] = 0x5A
        reps = await store.master.call(
            "PutStart",
            rpc.PutStartParams(
                client_id=store.client_id,
                key=key,
                size=size,
                config=ReplicateConfig(preferred_segments=preferred),
            ),
        )
        from mooncake._store.moves import _Op

        ops = [_Op(True, src.addr, r, size // 2) for r in reps]
        await store._move(ops)
        return {"started": True, "segments": [r.segment_name for r in reps]}

    out: dict[str, object] = loop.call(go)
    return out


if __name__ == "__main__":
    main()
