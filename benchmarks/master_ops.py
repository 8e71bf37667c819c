"""Master metadata throughput: PutStart+PutEnd pairs and GetReplicaList per second.

Three layers, each measured for ``--seconds`` per case:

* ``state``: the sans-I/O :class:`MasterState` called directly (the ceiling: no sockets, no codec);
* ``rpc``: a real ``mooncake_master`` subprocess (gflags flags, as deployments start it) and one
  client connection from this process using blocking sockets and the RPC codec -- sequential
  (one request in flight: latency bound) and pipelined (``--depth`` requests in flight);
* ``rpc-batch``: ``BatchPutStart``/``BatchPutEnd`` and ``BatchGetReplicaList`` of ``--batch`` keys.

Objects are 4 KiB on one 1 TiB segment (the master never touches memory, so nothing is
allocated here), keys unique per put, so no eviction happens. Prints a table; ``--json PATH``
writes the numbers.

    python benchmarks/master_ops.py --seconds 2 --json master_ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from mooncake._core import rpc  # noqa: E402
from mooncake._core.master import MasterConfig, MasterState  # noqa: E402
from mooncake._core.store_types import ReplicateConfig, Segment  # noqa: E402

SEG = Segment(id="bench-seg", name="127.0.0.1:9", base=1 << 40, size=1 << 40)
SIZE = 4096
CFG = ReplicateConfig()


def timed(fn: Callable[[int], int], seconds: float) -> tuple[int, float]:
    """Run ``fn(i)`` (returns ops done) until ``seconds`` pass; -> (ops, elapsed)."""
    ops = 0
    i = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        ops += fn(i)
        i += 1
        if (i & 63) == 0 and time.perf_counter() >= deadline:
            break
    return ops, time.perf_counter() - t0


def _pct(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    xs = sorted(samples)
    return xs[len(xs) // 2] * 1e6, xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6


def bench_state(seconds: float) -> dict[str, float]:
    m = MasterState(MasterConfig(seed=0))
    m.mount_segment("bench", SEG, 0.0)
    now = time.monotonic

    def put(i: int) -> int:
        k = f"s-{i}"
        m.put_start("bench", k, SIZE, CFG, now())
        m.put_end("bench", k, now())
        return 1

    n_put, t_put = timed(put, seconds)
    nkeys = min(n_put, 10000)

    def get(i: int) -> int:
        m.get_replica_list(f"s-{i % nkeys}", now())
        return 1

    n_get, t_get = timed(get, seconds)
    return {"put_pairs_per_s": n_put / t_put, "get_per_s": n_get / t_get}


class Conn:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dec = rpc.MessageDecoder()
        self.rid = 0

    def send(self, method: str, params: msgspec.Struct) -> None:
        self.rid += 1
        self.sock.sendall(rpc.encode_request(self.rid, method, params))

    def send_many(self, reqs: list[tuple[str, msgspec.Struct]]) -> None:
        out = []
        for method, params in reqs:
            self.rid += 1
            out.append(rpc.encode_request(self.rid, method, params))
        self.sock.sendall(b"".join(out))

    def recv(self, n: int, method: str) -> list[Any]:
        got: list[Any] = []
        while len(got) < n:
            msg = self.dec.next_message()
            if msg is None:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise RuntimeError("master closed the connection")
                self.dec.feed(data)
                continue
            assert isinstance(msg, rpc.Response)
            got.append(rpc.decode_result(method, msg))
        return got

    def call(self, method: str, params: msgspec.Struct) -> Any:
        self.send(method, params)
        return self.recv(1, method)[0]


def bench_rpc(port: int, seconds: float, depth: int, batch: int) -> dict[str, float]:
    c = Conn(port)
    c.call("MountSegment", rpc.MountSegmentParams(client_id="bench", segment=SEG))
    res: dict[str, float] = {}
    tag = f"r{time.monotonic_ns()}"

    # sequential: one request in flight
    lat: list[float] = []
    clock = time.perf_counter

    def put_seq(i: int) -> int:
        k = f"{tag}-q{i}"
        t0 = clock()
        c.call("PutStart", rpc.PutStartParams(client_id="bench", key=k, size=SIZE, config=CFG))
        c.call("PutEnd", rpc.KeyClientParams(client_id="bench", key=k))
        lat.append(clock() - t0)
        return 1

    n, t = timed(put_seq, seconds)
    res["put_pairs_per_s_sequential"] = n / t
    res["put_pair_us_sequential"] = t / n * 1e6
    res["put_pair_us_p50"], res["put_pair_us_p99"] = _pct(lat)
    nkeys = min(n, 10000)
    lat.clear()

    def get_seq(i: int) -> int:
        t0 = clock()
        c.call("GetReplicaList", rpc.KeyParams(key=f"{tag}-q{i % nkeys}"))
        lat.append(clock() - t0)
        return 1

    n, t = timed(get_seq, seconds)
    res["get_per_s_sequential"] = n / t
    res["get_us_sequential"] = t / n * 1e6
    res["get_us_p50"], res["get_us_p99"] = _pct(lat)

    # pipelined: `depth` PutStarts, then their PutEnds; `depth` gets
    def put_pipe(i: int) -> int:
        keys = [f"{tag}-p{i}-{j}" for j in range(depth)]
        c.send_many(
            [
                ("PutStart", rpc.PutStartParams(client_id="bench", key=k, size=SIZE, config=CFG))
                for k in keys
            ]
        )
        c.recv(depth, "PutStart")
        c.send_many([("PutEnd", rpc.KeyClientParams(client_id="bench", key=k)) for k in keys])
        c.recv(depth, "PutEnd")
        return depth

    n, t = timed(put_pipe, seconds)
    res["put_pairs_per_s_pipelined"] = n / t

    def get_pipe(i: int) -> int:
        c.send_many(
            [
                ("GetReplicaList", rpc.KeyParams(key=f"{tag}-q{(i * depth + j) % nkeys}"))
                for j in range(depth)
            ]
        )
        c.recv(depth, "GetReplicaList")
        return depth

    n, t = timed(get_pipe, seconds)
    res["get_per_s_pipelined"] = n / t

    # batch RPCs
    def put_batch(i: int) -> int:
        keys = [f"{tag}-b{i}-{j}" for j in range(batch)]
        items = c.call(
            "BatchPutStart",
            rpc.BatchPutStartParams(client_id="bench", keys=keys, sizes=[SIZE] * batch, config=CFG),
        )
        assert all(it.code == 0 for it in items)
        codes = c.call("BatchPutEnd", rpc.BatchKeyClientParams(client_id="bench", keys=keys))
        assert not any(codes)
        return batch

    n, t = timed(put_batch, seconds)
    res["put_pairs_per_s_batch"] = n / t

    def get_batch(i: int) -> int:
        keys = [f"{tag}-q{(i * batch + j) % nkeys}" for j in range(batch)]
        c.call("BatchGetReplicaList", rpc.KeysParams(keys=keys))
        return batch

    n, t = timed(get_batch, seconds)
    res["get_per_s_batch"] = n / t
    c.sock.close()
    return res


def start_master() -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake._cli.master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--enable_metric_reporting=false",
            "--client_ttl=3600",  # the bench connection does not ping
            "--log_level=WARNING",
        ],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if f":{port}" not in line:
        proc.kill()
        raise RuntimeError(f"master did not start: {line!r}")
    return proc, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=2.0, help="per case")
    ap.add_argument("--depth", type=int, default=32, help="requests in flight when pipelined")
    ap.add_argument("--batch", type=int, default=32, help="keys per batch RPC")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    results: dict[str, Any] = {
        "python": platform.python_version(),
        "seconds": args.seconds,
        "depth": args.depth,
        "batch": args.batch,
    }
    results["state"] = bench_state(args.seconds)
    proc, port = start_master()
    try:
        results["rpc"] = bench_rpc(port, args.seconds, args.depth, args.batch)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()

    s, r = results["state"], results["rpc"]
    rows = [
        ("state machine (no I/O)", s["put_pairs_per_s"], s["get_per_s"]),
        ("RPC, 1 in flight", r["put_pairs_per_s_sequential"], r["get_per_s_sequential"]),
        (f"RPC, {args.depth} pipelined", r["put_pairs_per_s_pipelined"], r["get_per_s_pipelined"]),
        (f"RPC, batch of {args.batch}", r["put_pairs_per_s_batch"], r["get_per_s_batch"]),
    ]
    print(f"{'case':<26} {'PutStart+PutEnd /s':>20} {'GetReplicaList /s':>20}")
    for name, p, g in rows:
        print(f"{name:<26} {p:>20,.0f} {g:>20,.0f}")
    print(
        f"sequential round trips p50 [p99]: PutStart+PutEnd {r['put_pair_us_p50']:.0f} "
        f"[{r['put_pair_us_p99']:.0f}] us, GetReplicaList {r['get_us_p50']:.0f} "
        f"[{r['get_us_p99']:.0f}] us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
