"""Write throughput of a replicated master against a plain one, in the same run.

For each etcd size (``--etcd 1 3``) starts a real etcd cluster, then for each master kind
(``plain``: ``mooncake master``; ``ha``: ``--enable-ha`` on that etcd, one leader and
``--standbys`` standbys, each ``--ha-ack-mode`` given) runs ``--writers`` writer processes
(the sync facade, ``MooncakeDistributedStore``, each with its own segment) that put 4 KiB
values for ``--seconds``: ``put`` one key a call, and ``batch_put_from`` 32 keys a call.
Acknowledged keys per second (all writers together) are printed per case, with the ratio
HA / plain, and the etcd put latency (sequential txns: one fsync each) of the cluster.

    python benchmarks/ha_throughput.py --etcd 1 3 --seconds 3 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VALUE = 4096
BATCH = 32


def writer(address: str, op: str, seconds: float, idx: int, segment_mib: int) -> None:
    """One writer process: set up, say ``ready``, wait for a line, write, print the count."""
    import ctypes

    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment_mib << 20, 16 << 20, "tcp", "", address)
    if rc != 0:
        print(json.dumps({"error": f"setup {rc}"}), flush=True)
        return
    buf = ctypes.create_string_buffer(VALUE * BATCH)
    base = ctypes.addressof(buf)
    ctypes.memset(base, 0x5A, VALUE * BATCH)
    if s.register_buffer(base, VALUE * BATCH) != 0:
        print(json.dumps({"error": "register_buffer"}), flush=True)
        return
    value = bytes(VALUE)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    n = errors = i = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if op == "put":
            rc = s.put(f"w{idx}-{i}", value)
            i += 1
            n, errors = (n + 1, errors) if rc == 0 else (n, errors + 1)
        else:
            keys = [f"w{idx}-{i + j}" for j in range(BATCH)]
            i += BATCH
            rcs = s.batch_put_from(keys, [base + j * VALUE for j in range(BATCH)], [VALUE] * BATCH)
            ok = sum(1 for r in rcs if r == 0)
            n, errors = n + ok, errors + BATCH - ok
    cpu = time.process_time() - cpu0
    print(json.dumps({"keys": n, "errors": errors, "cpu": cpu}), flush=True)
    s.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_seconds() -> float:
    """Idle CPU seconds of the whole host so far (/proc/stat: idle + iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


#: pids of the etcd members, watched beside the masters
ETCD_PIDS: dict[str, int] = {}
#: an etcd member's client endpoint, whose request counters are printed per case
ETCD_ENDPOINT: list[str] = []
_ETCD_COUNTERS = (
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_mvcc_put_total",
    "etcd_server_proposals_committed_total",
    "etcd_debugging_mvcc_watch_stream_total",
)


def etcd_counters() -> dict[str, float]:
    """The request counters of the watched etcd member (gRPC methods handled, mvcc ops)."""
    if not ETCD_ENDPOINT:
        return {}
    with urllib.request.urlopen(f"http://{ETCD_ENDPOINT[0]}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _ETCD_COUNTERS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        elif name == "grpc_server_handled_total" and 'grpc_code="OK"' in line:
            method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[f"grpc {method}"] = out.get(f"grpc {method}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_writers(
    address: str,
    op: str,
    n: int,
    seconds: float,
    segment_mib: int,
    watch: dict[str, int] | None = None,
    profile: str | None = None,
) -> float:
    """Acknowledged keys/s of ``n`` writers; ``watch`` (name -> pid): print each one's CPU
    per acknowledged key; ``profile``: py-spy records each watched process into this prefix."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    watch = {**(watch or {}), **ETCD_PIDS}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--writer",
                address,
                op,
                str(seconds),
                str(w),
                str(segment_mib),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"writer did not start: {line!r}")
        spies = [
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(max(1, int(seconds))),
                    "-r",
                    "200",
                    "-f",
                    "raw",
                    "-o",
                    f"{profile}-{name}.txt",
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in watch.items()
            if profile
        ]
        cpu0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
        ec0 = etcd_counters()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        total = errors = 0
        wcpu = 0.0
        idle0 = _idle_seconds()
        for p in procs:
            assert p.stdout is not None
            res = json.loads(p.stdout.readline())
            if "error" in res:
                raise RuntimeError(res["error"])
            total += res["keys"]
            wcpu += res["cpu"]
            errors += res["errors"]
        if errors:
            print(f"  ({errors} writes refused)", flush=True)
        idle = _idle_seconds() - idle0
        ec = etcd_counters()
        delta = {k: v - ec0.get(k, 0.0) for k, v in ec.items() if v - ec0.get(k, 0.0) >= 1}
        if delta:
            print("  etcd: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(delta.items())))
        print(
            f"  writers: {wcpu:.2f} CPU s, {wcpu / max(1, total) * 1e6:.0f} us per key;"
            f" host idle {idle:.2f} CPU s of {seconds * (os.cpu_count() or 1):.0f}",
            flush=True,
        )
        for name, pid in watch.items():
            used = cpu_seconds(pid) - cpu0[name]
            print(
                f"  {name}: {used:.2f} CPU s, {used / max(1, total) * 1e6:.0f} us per key",
                flush=True,
            )
        for sp in spies:
            sp.wait()
        return total / seconds
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def etcd_put_latency(endpoint: str, n: int = 200) -> float:
    """Median seconds of one etcd put (a txn, so one fsync on the member's disk)."""
    import base64

    lat = []
    for i in range(n):
        body = json.dumps(
            {
                "key": base64.b64encode(f"bench/fsync/{i % 10}".encode()).decode(),
                "value": base64.b64encode(b"x" * 512).decode(),
            }
        ).encode()
        req = urllib.request.Request(f"http://{endpoint}/v3/kv/put", data=body, method="POST")
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def one_case(kind: str, conn: str, args: argparse.Namespace, op: str, tag: str) -> float:
    from tests.helpers.ha_procs import HaMaster, wait_leader
    from tests.helpers.store_procs import Master

    if kind == "plain":
        m = Master("--client-ttl", "600", "--log-level", "WARNING")
        try:
            prof = f"{args.profile}/{tag}-plain" if args.profile else None
            return run_writers(
                m.address,
                op,
                args.writers,
                args.seconds,
                args.segment_mib,
                {"plain": m.proc.pid},
                prof,
            )
        finally:
            m.stop()
    flags = ["--log-level", "WARNING"]
    if args.ha_ack_mode:
        flags += ["--ha-ack-mode", args.ha_ack_mode]
    flags += args.ha_flag
    cluster = f"tput-{tag}"
    logs = Path(args.log_dir) if args.log_dir else None

    def log(i: int) -> Path | None:
        return logs / f"{cluster}-m{i}.log" if logs else None

    ms = [HaMaster(conn, *flags, cluster=cluster, log=log(0))]
    try:
        leader = wait_leader(ms)
        for i in range(args.standbys):
            ms.append(HaMaster(conn, *flags, cluster=cluster, log=log(i + 1)))
        want = args.standbys if args.ha_ack_mode == "replica" else 0
        deadline = time.monotonic() + 60
        while leader.ha().get("in_sync", 0) < want and time.monotonic() < deadline:
            time.sleep(0.1)  # every standby follows (and, replica mode, is in sync)
        time.sleep(0.5)
        os.environ["MC_STORE_CLUSTER_ID"] = cluster
        watch = {"leader": leader.proc.pid}
        watch.update({f"standby{i}": hm.proc.pid for i, hm in enumerate(ms) if hm is not leader})
        prof = f"{args.profile}/{tag}-ha" if args.profile else None
        rate = run_writers(conn, op, args.writers, args.seconds, args.segment_mib, watch, prof)
        ha = leader.ha()
        if want:
            print(f"  (leader: in_sync {ha.get('in_sync')}, batches {ha.get('batches')})")
        return rate
    finally:
        for hm in ms:
            hm.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--writer", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--etcd", type=int, nargs="+", default=[1, 3], help="etcd member counts")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--standbys", type=int, default=2)
    ap.add_argument("--segment-mib", type=int, default=384)
    ap.add_argument("--ops", nargs="+", default=["put", "batch_put_from"])
    ap.add_argument("--ha-ack-mode", default="", help="passed to the HA masters")
    ap.add_argument(
        "--ha-flag", action="append", default=[], help="another flag for the HA masters"
    )
    ap.add_argument("--log-dir", help="the HA masters' logs go here")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--profile", help="py-spy raw profiles of the masters go in this folder")
    args = ap.parse_args()
    if args.writer:
        address, op, seconds, idx, seg = args.writer
        writer(address, op, float(seconds), int(idx), int(seg))
        return 0
    from tests.services import etcd_cluster

    out: dict[str, Any] = {"load_before": os.getloadavg()}
    for members in args.etcd:
        with etcd_cluster(members) as cluster:
            lat = etcd_put_latency(cluster.members[0].endpoint)
            ETCD_ENDPOINT[:] = [cluster.members[0].endpoint]
            ETCD_PIDS.clear()
            ETCD_PIDS.update(
                {f"etcd{i}": m.proc.pid for i, m in enumerate(cluster.members) if m.proc}
            )
            print(f"etcd x{members}: put latency median {lat * 1e3:.2f} ms", flush=True)
            res: dict[str, Any] = {"etcd_put_latency_ms": lat * 1e3}
            for op in args.ops:
                rows: dict[str, list[float]] = {"plain": [], "ha": []}
                for r in range(args.repeat):
                    for kind in ("plain", "ha"):
                        tag = f"{members}-{op}-{r}"
                        rows[kind].append(one_case(kind, cluster.conn, args, op, tag))
                        print(
                            f"  {op:15s} {kind:5s} run {r}: {rows[kind][-1]:10.0f} keys/s",
                            flush=True,
                        )
                plain, ha = statistics.median(rows["plain"]), statistics.median(rows["ha"])
                print(
                    f"etcd x{members} {op:15s} plain {plain:10.0f}  ha {ha:10.0f} keys/s"
                    f"  ratio {ha / plain:.2f}",
                    flush=True,
                )
                res[op] = {"plain": rows["plain"], "ha": rows["ha"], "ratio": ha / plain}
            out[f"etcd{members}"] = res
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
