"""Rolling restart of store holders under reads: failed gets, drain times, re-replication times.

    python benchmarks/rolling_restart.py [--holders 3] [--keys 200] [--size 65536]
        [--readers 2] [--rounds 1] [--drain-timeout 5] [--json]

Starts ``python -m mooncake master`` and ``--holders`` holder processes (the sync facade in
tests/helpers/store_client_driver.py, 32 MiB segments), puts ``--keys`` objects with
``replica_num = 2`` from this process (a pure client), then keeps ``--readers`` threads reading
and checking every key (SHA-256) while each holder in turn gets SIGTERM (it drains, exits),
is replaced by a fresh holder, and every key is back at two replicas before the next. Prints
gets, failed gets, and per restart: SIGTERM-to-exit seconds (the drain) and SIGTERM-to-
replicated seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--holders", type=int, default=3)
    ap.add_argument("--keys", type=int, default=200)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--drain-timeout", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ["MC_STORE_DRAIN_TIMEOUT"] = str(a.drain_timeout)
    master = Master("--client-ttl", "5")
    holders = [Client(master.address, 32) for _ in range(a.holders)]
    me = MooncakeDistributedStore()
    assert me.setup("127.0.0.1", "P2PHANDSHAKE", 0, 32 * MIB, "tcp", "", master.address) == 0
    keys = {f"roll{i}": hashlib.sha256(value(i, a.size)).hexdigest() for i in range(a.keys)}
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    for i, key in enumerate(keys):
        assert me.put(key, value(i, a.size), cfg) == 0
    stop = threading.Event()
    gets = [0] * a.readers
    failed = [0] * a.readers

    def read(n: int) -> None:
        while not stop.is_set():
            for key, digest in keys.items():
                ok = hashlib.sha256(me.get(key)).hexdigest() == digest
                gets[n] += 1
                failed[n] += not ok

    def replicated() -> bool:
        return all(len(me.get_replica_desc(k)) == 2 for k in keys)

    threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(a.readers)]
    for t in threads:
        t.start()
    drains: list[float] = []
    restores: list[float] = []
    rcs: list[int] = []
    t_start = time.monotonic()
    try:
        for _ in range(a.rounds):
            for i in range(a.holders):
                t0 = time.monotonic()
                os.kill(holders[i].proc.pid, signal.SIGTERM)
                rcs.append(holders[i].proc.wait(120))
                drains.append(time.monotonic() - t0)
                holders[i].stop()
                holders[i] = Client(master.address, 32)
                while not replicated():
                    time.sleep(0.02)
                restores.append(time.monotonic() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - t_start
        me.close()
        for c in holders:
            c.stop()
        master.stop()
    out = {
        "holders": a.holders,
        "keys": a.keys,
        "size": a.size,
        "restarts": len(drains),
        "exit_codes": rcs,
        "gets": sum(gets),
        "failed_gets": sum(failed),
        "gets_per_s": round(sum(gets) / elapsed, 1),
        "drain_s_median": round(statistics.median(drains), 3),
        "drain_s_max": round(max(drains), 3),
        "replicated_s_median": round(statistics.median(restores), 3),
        "replicated_s_max": round(max(restores), 3),
        "loadavg": os.getloadavg()[0],
    }
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:22} {v}")


if __name__ == "__main__":
    main()
