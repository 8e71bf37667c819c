"""A store client of one tenant in its own process, on the published sync API only.

``python -m tests.helpers.tenant_client MASTER TENANT MODE ...``:

* ``write PREFIX N SIZE``: put ``N`` objects ``PREFIX{i}`` of ``SIZE`` bytes (each filled with
  the tenant's name), stopping at the first refusal; prints ``{"stored": [...], "codes": [...]}``.
* ``hold``: mounts its segment (``TENANT_CLIENT_SEGMENT`` bytes, default 4 MiB, as every
  mode) and keeps it until stdin closes (other clients run with ``TENANT_CLIENT_SEGMENT=0``,
  so what they store outlives them).
* ``read KEY...``: prints ``{"values": {key: bytes as latin-1 or null}, "exist": [...]}``.
* ``remove KEY...``: prints ``{"codes": [...]}``; ``remove_all``: ``{"removed": n, ...}``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    master, tenant, mode, *rest = sys.argv[1:]
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    segment = int(os.environ.get("TENANT_CLIENT_SEGMENT", str(4 << 20)))
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 4 << 20, "tcp", "", master, tenant_id=tenant)
    if rc != 0:
        print(json.dumps({"setup": rc}), flush=True)
        sys.exit(1)
    out: dict[str, object] = {}
    if mode == "hold":  # contributes its segment until stdin closes
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()
    elif mode == "write":
        prefix, n, size = rest[0], int(rest[1]), int(rest[2])
        stored, codes = [], []
        fill = (tenant.encode() * size)[:size]
        for i in range(n):
            code = s.put(f"{prefix}{i}", fill)
            codes.append(code)
            if code != 0:
                break
            stored.append(f"{prefix}{i}")
        out = {"stored": stored, "codes": codes}
    elif mode == "read":
        vals = {}
        for k in rest:
            v = s.get(k)
            vals[k] = v.decode("latin-1") if v else None
        out = {"values": vals, "exist": [s.is_exist(k) for k in rest]}
    elif mode == "remove":
        out = {"codes": [s.remove(k) for k in rest]}
    elif mode == "remove_all":
        out = {"removed": s.remove_all(force=True), "by_regex": s.remove_by_regex(".*", force=True)}
    print(json.dumps(out), flush=True)
    s.close()


if __name__ == "__main__":
    main()
