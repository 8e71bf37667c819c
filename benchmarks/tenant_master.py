#!/usr/bin/env python3
"""The master's cost of tenants: put rate and bytes per object, default tenant vs a named one.

Through the handlers the RPC server calls (``commands.HANDLERS``, tenant scoping included):
``PutStart``+``PutEnd`` pairs per second, then ``GetReplicaList`` per second, for the default
tenant (keys as they are) and for tenant ``--tenant`` (internal keys ``"\\0" tenant "\\0" key``,
a quota set so that admission runs). Memory: resident-set growth per stored object after
``--objects`` puts (each case in a fresh subprocess). Median of ``--repeats`` runs.

    python benchmarks/tenant_master.py --objects 200000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def one(tenant: str, objects: int) -> dict[str, float]:
    import gc

    from mooncake._core import commands, rpc
    from mooncake._core.master import MasterConfig, MasterState
    from mooncake._core.store_types import Segment

    quotas = f"{tenant}=1TB/100000000" if tenant else ""
    s = MasterState(MasterConfig(seed=0, tenant_quotas=quotas))
    s.mount_segment("c", Segment(id="seg", name="h:1", base=1 << 40, size=1 << 40), 0.0)
    h = commands.HANDLERS
    ps, pe, gr = h["PutStart"], h["PutEnd"], h["GetReplicaList"]
    keys = [f"key-{i:036d}" for i in range(objects)]  # 40-byte keys
    starts = [rpc.PutStartParams(client_id="c", key=k, size=4096, tenant=tenant) for k in keys]
    ends = [rpc.KeyClientParams(client_id="c", key=k, tenant=tenant) for k in keys]
    gets = [rpc.KeyParams(key=k, tenant=tenant) for k in keys]
    gc.collect()
    base = rss()
    t0 = time.perf_counter()
    for a, b in zip(starts, ends, strict=True):
        ps(s, a, 1.0)
        s.settle()
        pe(s, b, 1.0)
        s.settle()
    put = time.perf_counter() - t0
    gc.collect()
    grown = rss() - base
    t0 = time.perf_counter()
    for g in gets:
        gr(s, g, 2.0)
        s.settle()
    get = time.perf_counter() - t0
    assert s.object_count == objects
    return {
        "put_pairs_per_s": objects / put,
        "get_per_s": objects / get,
        "rss_bytes_per_object": grown / objects,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tenant", default="tenant-a")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(one(a.child, a.objects)))
        return
    out: dict[str, Any] = {}
    cases = (("default", ""), (a.tenant, a.tenant))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in cases}
    for _ in range(a.repeats):  # interleaved, a fresh process per run (RSS: the table's)
        for name, t in cases:
            r = subprocess.run(
                [sys.executable, __file__, "--child", t, "--objects", str(a.objects)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[name].append(json.loads(r.stdout))
    for name, _ in cases:
        med = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
        out[name] = med
        print(
            f"{name:>10}: {med['put_pairs_per_s']:9,.0f} put pairs/s  "
            f"{med['get_per_s']:9,.0f} gets/s  {med['rss_bytes_per_object']:6.1f} B/object RSS"
        )
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
