"""Replicated master costs: RPC throughput of a leader on etcd, and SIGKILL-to-first-put failover.

Starts a real one-member etcd and ``mooncake master --enable-ha`` processes (tests/services.py,
tests/helpers/ha_procs.py), then

* ``throughput``: the RPC cases of ``benchmarks/master_ops.py`` against the leader (every
  mutation waits for its etcd txn; reads do not);
* ``failover``: ``--runs`` times, two masters, SIGKILL the leader, time until a put through the
  standby is acknowledged (no client-side resolution here: the standby's address is known);
  with fast failover on (the default) the standby revokes the dead leader's lease once its port
  refuses connections, ``--no-fast-failover`` waits for the lease as the published master does.

    python benchmarks/master_ha.py --lease-ttl 5 --runs 3 [--no-fast-failover]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import master_ops  # noqa: E402

from tests.helpers.ha_procs import HaMaster, mount, put, wait_leader  # noqa: E402
from tests.services import etcd_cluster  # noqa: E402


def throughput(conn: str, seconds: float) -> dict[str, float]:
    m = HaMaster(conn, "--log-level", "WARNING", cluster="bench-tput")
    try:
        wait_leader([m])
        port = int(m.address.rsplit(":", 1)[1])
        return master_ops.bench_rpc(port, seconds, 32, 32)
    finally:
        m.stop()


def failover(conn: str, ttl: int, runs: int, fast: bool = True) -> list[float]:
    out = []
    for run in range(runs):
        flags = ("--ha-lease-ttl", str(ttl), "--log-level", "WARNING")
        flags += ("--ha-fast-failover", "true" if fast else "false")
        ms = [HaMaster(conn, *flags, cluster=f"bench-f{ttl}-{run}") for _ in range(2)]
        try:
            leader = wait_leader(ms)
            other = next(m for m in ms if m is not leader)
            mount(leader.address)
            for i in range(20):
                assert put(leader.address, f"k{i}")
            time.sleep(1.0)  # the standby is caught up
            t0 = time.monotonic()
            leader.signal(signal.SIGKILL)
            i = 0
            while not put(other.address, f"after{i}"):
                i += 1
                time.sleep(0.02)
            out.append(time.monotonic() - t0)
        finally:
            for m in ms:
                m.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=2.0, help="per throughput case")
    ap.add_argument("--lease-ttl", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--no-fast-failover", action="store_true", help="standbys wait for the lease to expire"
    )
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    res: dict[str, object] = {}
    with etcd_cluster(1) as cluster:
        if not args.skip_throughput:
            tp = throughput(cluster.conn, args.seconds)
            res["throughput"] = tp
            for k, v in tp.items():
                print(f"{k:32s} {v:12.1f}")
        times = failover(cluster.conn, args.lease_ttl, args.runs, not args.no_fast_failover)
    res["failover_s"] = times
    print(
        f"failover (lease {args.lease_ttl} s, fast failover "
        + ("off" if args.no_fast_failover else "on")
        + "): "
        + " ".join(f"{t:.2f}" for t in times)
        + f"  median {statistics.median(times):.2f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
