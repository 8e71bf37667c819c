#!/usr/bin/env python3
"""KV events: the publisher's cost on master throughput, and failovers under load.

``throughput``: two ``mooncake master`` processes in one run, one without and one with
``--enable-kv-events`` (a subscriber process draining the stream); rounds alternate between
them, each round ``--seconds`` of pipelined PutStart+PutEnd pairs (``--depth`` in flight) on
one connection; the median of ``--rounds`` rounds per side, and the ratio. Also the bare
state-machine cost (``MasterState`` put pairs with and without a queue attached).

``failover``: one etcd, two HA masters with KV events, a writer thread putting (and removing
every 4th key) through the leader, and a subscriber in this process keeping an index of the
keys (stored on ``stored``, dropped on ``removed``; rebuilt from the leader's key list on a
``NewStream(resync=True)`` or an unrecovered gap). ``--failovers`` times: SIGKILL the
leader, restart it (it rejoins as a standby), wait for the new leader. Measured: SIGKILL to
the new stream's first batch at the subscriber; the new stream's announcement timestamp to
its receipt (the re-home once a leader exists); after each failover, with the writer paused,
the index is compared with the leader's keys: a difference is an undetected gap.

    python benchmarks/kv_events.py throughput --rounds 5 --seconds 2
    python benchmarks/kv_events.py throughput --rounds 9 --seconds 1 --baseline /tmp/old-tree
    python benchmarks/kv_events.py failover --failovers 20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from master_ops import CFG, SEG, SIZE, Conn  # noqa: E402

from mooncake._core import kv_events as kv  # noqa: E402
from mooncake._core import rpc  # noqa: E402
from mooncake._core.master import MasterConfig, MasterState  # noqa: E402
from mooncake.kv_events import Gap, KvEventSubscriber, NewStream, Received  # noqa: E402

ANY = "tcp://127.0.0.1:*"
KV = ["--enable-kv-events", "--kv-events-bind-endpoint", ANY, "--kv-events-replay-endpoint", ANY]


def _env(root: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Master:
    def __init__(self, *flags: str, log: Path | None = None, root: Path = ROOT) -> None:
        """A ``mooncake master`` of the source tree ``root`` (default: this one)."""
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--metrics-port"]
        cmd += ["0", "--client-ttl", "600", *flags]
        err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env(root), cwd=root
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.address = line.split("rpc=", 1)[1].split()[0]
        self.port = int(self.address.rsplit(":", 1)[1])
        self.metrics = line.split("metrics=", 1)[1].split()[0]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://{self.metrics}{path}", timeout=5) as r:
            return json.loads(r.read())

    def role(self) -> str:
        try:
            return str(self.get("/status")["ha"]["role"])
        except (OSError, KeyError):
            return "unreachable"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _put_pipe(c: Conn, tag: str, depth: int, seconds: float) -> float:
    n = 0
    i = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        keys = [f"{tag}-{i}-{j}" for j in range(depth)]
        i += 1
        c.send_many([("PutStart", rpc.PutStartParams("bench", k, SIZE, config=CFG)) for k in keys])
        c.recv(depth, "PutStart")
        c.send_many([("PutEnd", rpc.KeyClientParams("bench", k)) for k in keys])
        c.recv(depth, "PutEnd")
        n += depth
    return n / (time.perf_counter() - t0)


# a raw SUB counting batches (no decoding: the subscriber's CPU is not the master's cost)
_SUBSCRIBER = """
import os, sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b"")
s.setsockopt(zmq.RCVHWM, 100000); s.connect(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    if s.poll(500):
        while True:
            try:
                s.recv_multipart(zmq.NOBLOCK); n += 1
            except zmq.Again:
                break
    open(sys.argv[2] + ".tmp", "w").write(str(n)); os.replace(sys.argv[2] + ".tmp", sys.argv[2])
"""


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    # the sans-I/O hook alone
    def state_rate(attach: bool) -> float:
        m = MasterState(MasterConfig(seed=0))
        m.mount_segment("bench", SEG, 0.0)
        q = kv.EventQueue(capacity=1 << 16)
        if attach:
            kv.attach(m, q)
        n = 30_000
        t0 = time.process_time()  # this process's CPU: other load counts less
        for i in range(n):
            k = f"s-{i}"
            m.put_start("bench", k, SIZE, CFG, 1.0)
            m.put_end("bench", k, 1.0)
        return n / (time.process_time() - t0)

    st_off, st_on = [], []
    for _ in range(5):
        st_off.append(state_rate(False))
        st_on.append(state_rate(True))
    # side -> (source tree, flags, subscribed); "base_*": the same three of --baseline's tree
    trees = [("", ROOT)] + ([("base_", Path(args.baseline).resolve())] if args.baseline else [])
    specs: dict[str, tuple[Path, list[str], bool]] = {}
    kv_flags = KV + (["--kv-events-flush-delay", str(args.flush_delay)] if args.flush_delay else [])
    for prefix, root in trees:
        specs[prefix + "off"] = (root, [], False)
        specs[prefix + "on"] = (root, kv_flags, True)
        specs[prefix + "on_nosub"] = (root, kv_flags, False)  # publishing, nobody subscribed
    masters: dict[str, Master] = {}
    subs: list[subprocess.Popen[str]] = []
    count_files: dict[str, Path] = {}
    try:
        for name, (root, flags, subscribed) in specs.items():
            m = masters[name] = Master(*flags, root=root)
            if subscribed:
                ep = m.get("/kv_events/status")["endpoint"]
                count_files[name] = Path(f"/tmp/kv-bench-{os.getpid()}-{name}.count")
                sub = subprocess.Popen(
                    [sys.executable, "-c", _SUBSCRIBER, ep, str(count_files[name])],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=_env(),
                )
                subs.append(sub)
                assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the subscriptions reach the publishers
        conns = {}
        for name, m in masters.items():
            c = Conn(m.port)
            c.call("MountSegment", rpc.MountSegmentParams(client_id="bench", segment=SEG))
            conns[name] = c
        sides = list(specs)
        rates: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for name in order:
                pid = masters[name].proc.pid
                c0 = _cpu_s(pid)
                t0 = time.perf_counter()
                rate = _put_pipe(conns[name], f"r{r}", args.depth, args.seconds)
                ops = rate * (time.perf_counter() - t0)
                rates[name].append(rate)
                cpu[name].append((_cpu_s(pid) - c0) / ops * 1e6)
        time.sleep(1.5)
        st = {k: masters[k].get("/kv_events/status") for k in sides if specs[k][1]}
        received = {k: int(f.read_text()) if f.exists() else -1 for k, f in count_files.items()}
    finally:
        for sub in subs:
            sub.kill()
            sub.wait()
        for m in masters.values():
            m.stop()
        for f in count_files.values():
            f.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    res: dict[str, Any] = {
        "state_put_pairs_per_s_off": statistics.median(st_off),
        "state_put_pairs_per_s_on": statistics.median(st_on),
        "state_cost_pct": 100 * (1 - statistics.median(st_on) / statistics.median(st_off)),
        "master_cpu_us_per_pair": med,
        "master_cpu_rounds": cpu,
        "rpc_put_pairs_per_s": {k: statistics.median(v) for k, v in rates.items()},
    }
    for prefix, _ in trees:
        off = med[prefix + "off"]
        res[prefix + "master_cpu_cost_pct"] = 100 * (med[prefix + "on"] / off - 1)
        res[prefix + "master_cpu_cost_nosub_pct"] = 100 * (med[prefix + "on_nosub"] / off - 1)
    res["published"] = {
        k: {
            "events": v["published_events"],
            "batches": v["published_batches"],
            "dropped": v["dropped_events"],
            "subscriber_received_batches": received.get(k),
        }
        for k, v in st.items()
    }
    return res


# -- failover ---------------------------------------------------------------------------------


def _call(address: str, method: str, params: Any, timeout: float = 3.0) -> Any:
    import socket

    import msgspec

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(rpc.encode_request(1, method, params))
        dec = rpc.MessageDecoder()
        while True:
            msg = dec.next_message()
            if msg is not None:
                assert isinstance(msg, rpc.Response)
                return msg.code, (msgspec.msgpack.decode(msg.result) if msg.code == 0 else None)
            data = s.recv(1 << 20)
            if not data:
                return None, None
            dec.feed(data)


def failover(args: argparse.Namespace) -> dict[str, Any]:
    from tests import services

    tmp = Path(f"/tmp/kv-bench-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    with services.etcd_cluster(1) as etcd:
        ha = ["--enable-ha", "--ha-backend-connstring", etcd.conn, "--cluster-id", "kvb"]
        ms = [Master(*ha, *KV, log=tmp / "m0.log")]
        _wait_leader(ms)
        ms.append(Master(*ha, *KV, log=tmp / "m1.log"))
        # fixed endpoints per slot: a restarted master binds the ports its slot had
        eps = [m.get("/kv_events/status") for m in ms]
        slots = [
            (e["endpoint"], e["replay_endpoint"]) for e in eps
        ]  # tcp://127.0.0.1:PORT from the wildcard
        leader = _wait_leader(ms)
        stop = threading.Event()
        pause = threading.Event()
        lock = threading.Lock()
        writer_state = {"leader": leader.address, "puts": 0, "removes": 0, "errors": 0}

        def writer() -> None:
            i = 0
            mounted: set[str] = set()
            while not stop.is_set():
                if pause.is_set():
                    time.sleep(0.01)
                    continue
                addr = writer_state["leader"]
                try:
                    if addr not in mounted:
                        code, _ = _call(addr, "MountSegment", rpc.MountSegmentParams("w", SEG))
                        if code not in (0, -102):
                            raise OSError(code)
                        mounted.add(addr)
                    k = f"k{i}"
                    code, _ = _call(addr, "PutStart", rpc.PutStartParams("w", k, SIZE))
                    if code == 0:
                        code, _ = _call(addr, "PutEnd", rpc.KeyClientParams("w", k))
                    if code == 0:
                        writer_state["puts"] += 1
                        if i % 4 == 3:
                            _call(addr, "Remove", rpc.RemoveParams(f"k{i - 2}", True))
                            writer_state["removes"] += 1
                    else:
                        writer_state["errors"] += 1
                        time.sleep(0.02)
                    i += 1
                except OSError:
                    writer_state["errors"] += 1
                    mounted.discard(addr)
                    time.sleep(0.02)

        index: set[str] = set()
        resyncs = 0
        rehome_kill: list[float] = []
        rehome_open: list[float] = []
        undetected: list[int] = []
        gaps = 0

        pending_resync = [False]

        def rebuild(_addr: str = "") -> None:
            """Resync from whichever master answers GetAllKeys (standbys refuse it); one
            that finds none leaves the resync pending: it is retried before every poll."""
            nonlocal resyncs
            resyncs += 1
            for _ in range(20):
                for m in list(ms):
                    try:
                        code, keys = _call(m.address, "GetAllKeys", rpc.Empty(), timeout=1.0)
                    except OSError:
                        continue
                    if code == 0:
                        index.clear()
                        index.update(keys)
                        pending_resync[0] = False
                        return
                time.sleep(0.05)
            pending_resync[0] = True

        def handle(sub: KvEventSubscriber, notes: list[Any]) -> NewStream | None:
            nonlocal gaps
            if pending_resync[0]:
                rebuild()
            fresh = None
            for n in notes:
                if isinstance(n, NewStream):
                    fresh = n
                    if n.resync:
                        rebuild(writer_state["leader"])
                elif isinstance(n, Gap):
                    gaps += 1
                    if not n.recovered:
                        rebuild(writer_state["leader"])
                elif isinstance(n, Received):
                    for ev in n.batch.events:
                        if ev.object_key is None or ev.medium != "cpu":
                            continue
                        if ev.event_type == "stored":
                            index.add(ev.object_key)
                        elif ev.event_type == "removed":
                            index.discard(ev.object_key)
            return fresh

        def settle(sub: KvEventSubscriber, addr: str) -> int:
            pause.set()
            time.sleep(0.3)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                handle(sub, sub.poll(0.2))
                code, keys = _call(addr, "GetAllKeys", rpc.Empty())
                if code == 0 and set(keys) == index:
                    break
            code, keys = _call(addr, "GetAllKeys", rpc.Empty())
            diff = len(set(keys) ^ index) if code == 0 else -1
            pause.clear()
            return diff

        t = threading.Thread(target=writer, daemon=True)
        with KvEventSubscriber(
            [s[0] for s in slots], replay_endpoints=[s[1] for s in slots]
        ) as sub:
            t.start()
            t_end = time.monotonic() + 2
            while time.monotonic() < t_end:
                handle(sub, sub.poll(0.1))
            undetected.append(settle(sub, leader.address))
            for f in range(args.failovers):
                li = ms.index(leader)
                t_kill = time.monotonic()
                leader.stop(signal.SIGKILL)
                fresh = None
                deadline = time.monotonic() + 30
                new_leader = None
                while fresh is None and time.monotonic() < deadline:
                    notes = sub.poll(0.01)
                    recv_wall = time.time()
                    if new_leader is None:
                        cand = [m for m in ms if m is not leader and m.role() == "leader"]
                        if cand:
                            new_leader = cand[0]
                            with lock:
                                writer_state["leader"] = new_leader.address
                    fresh = handle(sub, notes)
                    if fresh is not None:
                        rehome_kill.append(time.monotonic() - t_kill)
                        first = next(
                            n for n in notes if isinstance(n, Received) and n.seq == fresh.seq
                        )
                        rehome_open.append(recv_wall - first.batch.timestamp / 1000)
                if fresh is None:
                    raise SystemExit(f"failover {f}: no new stream within 30 s")
                new_leader = _wait_leader([m for m in ms if m is not leader])
                writer_state["leader"] = new_leader.address
                # the killed master comes back as a standby on its slot's ports
                ep, rep = slots[li]
                flags = [*ha, "--enable-kv-events", "--kv-events-bind-endpoint", ep]
                flags += ["--kv-events-replay-endpoint", rep]
                ms[li] = Master(*flags, log=tmp / f"m{li}.log")
                leader = new_leader
                t_end = time.monotonic() + args.interval
                while time.monotonic() < t_end:
                    handle(sub, sub.poll(0.1))
                undetected.append(settle(sub, leader.address))
                print(
                    f"failover {f + 1}: new stream after {rehome_kill[-1] * 1000:.0f} ms, "
                    f"announcement to receipt {rehome_open[-1] * 1000:.1f} ms, "
                    f"index diff {undetected[-1]}, puts {writer_state['puts']}",
                    flush=True,
                )
            stop.set()
            t.join(5)
        for m in ms:
            m.stop()

    def dist(xs: list[float]) -> dict[str, float]:
        s = sorted(xs)
        return {
            "min": s[0],
            "p50": statistics.median(s),
            "p90": s[int(0.9 * (len(s) - 1))],
            "max": s[-1],
        }

    return {
        "failovers": args.failovers,
        "kill_to_new_stream_s": dist(rehome_kill),
        "announcement_to_receipt_s": dist(rehome_open),
        "index_differences": undetected,
        "undetected_gaps": sum(1 for d in undetected if d != 0),
        "gaps_reported": gaps,
        "resyncs": resyncs,
        "puts": writer_state["puts"],
        "removes": writer_state["removes"],
        "writer_errors": writer_state["errors"],
    }


def _wait_leader(ms: list[Master], timeout: float = 30) -> Master:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leaders = [m for m in ms if m.proc.poll() is None and m.role() == "leader"]
        if len(leaders) == 1:
            return leaders[0]
        time.sleep(0.05)
    raise SystemExit("no leader")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sp = p.add_subparsers(dest="cmd", required=True)
    t = sp.add_parser("throughput")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--seconds", type=float, default=2.0)
    t.add_argument("--depth", type=int, default=32)
    t.add_argument(
        "--flush-delay",
        type=float,
        default=0.0,
        help="--kv-events-flush-delay of the publishing masters (default: theirs)",
    )
    t.add_argument(
        "--baseline",
        default="",
        help="another source tree (with its compiled modules): its three masters join the "
        "rotation as base_off / base_on / base_on_nosub",
    )
    f = sp.add_parser("failover")
    f.add_argument("--failovers", type=int, default=20)
    f.add_argument("--interval", type=float, default=1.0)
    for s in (t, f):
        s.add_argument("--json", default="")
    args = p.parse_args()
    res = throughput(args) if args.cmd == "throughput" else failover(args)
    res["loadavg"] = os.getloadavg()
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 1 if res.get("undetected_gaps") else 0


if __name__ == "__main__":
    sys.exit(main())
