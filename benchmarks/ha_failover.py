#!/usr/bin/env python3
"""Master failover under load: real etcd, 2-3 HA masters, worker processes doing verified puts.

Starts ``--etcd-members`` etcd members, ``--masters`` ``mooncake master --enable_ha
--ha_backend_type=etcd --ha_backend_connstring=... --cluster_id=...`` processes and ``--workers``
client processes (the published sync API, master address ``etcd://...``). Each worker puts
unique keys at ``--put-rate`` per second (values from :func:`store_soak.make_value`: key,
generation and a digest inside every value), and reads back a random acknowledged key after
every put, checking its bytes.

Then ``--failovers`` times: wait ``--interval`` seconds, read the leader from
``mooncake-store/<cluster_id>/master_view``, SIGKILL it, and measure the time from the SIGKILL to
the first put *started after it* that succeeds (so through the new leader); then restart the
killed master, which joins as a standby. With ``--kill-etcd-member-at N`` (3 members) one etcd
member is SIGKILLed after failover N and stays down.

At the end every worker reads every key it was told was stored: a key that is missing or whose
bytes are wrong counts as *lost* / *corrupted* (goal: 0); a read that fails for another reason
(e.g. ``-707``, a read fence missed under load) is asked again up to 5 times first, and the
final codes are printed. Printed: one progress line per second
(puts/s, put errors by code) and per failover, then the failover-time distribution
(min/p50/p90/max) and the loss counts; ``--json PATH`` writes them too.

    python benchmarks/ha_failover.py                      # 1 etcd, 3 masters, 4 workers, 20 failovers
    python benchmarks/ha_failover.py --failovers 5 --masters 2
    python benchmarks/ha_failover.py --etcd-members 3 --kill-etcd-member-at 10

Exit status 1 if any acknowledged object was lost or corrupted, or a failover did not finish.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from store_soak import SoakConfig, _open, make_value, wrong_bytes  # noqa: E402

MIB = 1 << 20


# -- workers ---------------------------------------------------------------------------------


def run_worker(index: int, args: dict[str, Any], events: Any, stop: Any, close: Any) -> None:
    """Unique-key puts at ``put_rate``/s, each followed by a verified read of a random acked
    key; ``("acks", name, [(t_start, t_end), ...], {code: n})`` twice a second; after ``stop``,
    reads every acked key and sends ``("final", name, acked, missing, corrupted, {code: n})``,
    then keeps its segment mounted until ``close`` is set."""
    os.environ["MC_STORE_CLUSTER_ID"] = args["cluster_id"]
    cfg = SoakConfig(master=args["master"], segment_mib=args["segment_mib"], buffer_mib=8)
    import numpy as np

    s = _open(cfg, cfg.segment_mib, "")
    buf = np.zeros(args["size"], dtype=np.uint8)
    ptr = buf.ctypes.data
    if s.register_buffer(ptr, buf.nbytes) != 0:
        raise RuntimeError("register_buffer failed")

    def read(key: str) -> tuple[int, bytes]:
        rc = s.get_into(key, ptr, buf.nbytes)
        return (0, buf[:rc].tobytes()) if rc > 0 else (rc or -704, b"")

    name = f"w{index}"
    rng = random.Random(index)
    acked: list[str] = []
    acked_at: dict[str, tuple[float, float]] = {}
    events.put(("ready", name, os.getpid()))
    period = 1.0 / args["put_rate"]
    size = args["size"]
    pending: list[tuple[float, float]] = []
    codes: collections.Counter[str] = collections.Counter()
    last_flush = time.monotonic()
    n = 0
    next_t = time.monotonic()
    while not stop.is_set():
        key = f"{name}-{n}"
        n += 1
        t0 = time.time()
        rc = s.put(key, make_value(key, n, size))
        t1 = time.time()
        if rc == 0:
            acked.append(key)
            acked_at[key] = (t0, t1)
            pending.append((t0, t1))
            k = rng.choice(acked)
            rc, got = read(k)
            if rc:
                codes[f"get:{rc}"] += 1
            elif wrong_bytes(k, got):
                codes["get:wrong"] += 1
        else:
            codes[f"put:{rc}"] += 1
        if time.monotonic() - last_flush >= 0.5:
            events.put(("acks", name, pending, dict(codes)))
            pending, codes = [], collections.Counter()
            last_flush = time.monotonic()
        next_t += period
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_t = time.monotonic()
    events.put(("acks", name, pending, dict(codes)))
    missing = corrupted = 0
    bad: list[tuple[str, int, float, float]] = []
    final_codes: collections.Counter[str] = collections.Counter()
    for key in acked:
        rc, got = read(key)
        for _ in range(5):  # a transient failure (a read fence under load) is asked again
            if rc in (0, -704):
                break
            final_codes[f"retried:{rc}"] += 1
            time.sleep(0.2)
            rc, got = read(key)
        if rc:
            missing += 1
            final_codes[f"get:{rc}"] += 1
            bad.append((key, rc, *acked_at[key]))
        elif wrong_bytes(key, got):
            corrupted += 1
            bad.append((key, 0, *acked_at[key]))
    events.put(("final", name, len(acked), missing, corrupted, dict(final_codes), bad))
    close.wait(600)  # keep the segment (others' keys live in it) until every worker checked
    s.unregister_buffer(ptr)
    s.close()


# -- masters ---------------------------------------------------------------------------------


class HaMasterProc:
    """One ``mooncake master --enable_ha`` process (rpc port 0: a fresh port per start)."""

    def __init__(
        self, name: str, etcd_hosts: str, cluster_id: str, log_dir: Path, extra: list[str]
    ) -> None:
        self.name = name
        # the published --enable_ha --ha_backend_type=etcd --ha_backend_connstring=...
        # --cluster_id=..., in the spelling of ``mooncake master`` (which binds a free port)
        self.flags = [
            "--enable-ha",
            "--ha-backend-type",
            "etcd",
            "--ha-backend-connstring",
            etcd_hosts,
            "--cluster-id",
            cluster_id,
            *extra,
        ]
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> str:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--no-metrics"]
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [*cmd, *self.flags], stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "rpc=" not in line:
            raise RuntimeError(f"master {self.name} did not start: {line!r} (see {self.log})")
        self.address = line.split("rpc=", 1)[1].split()[0]
        return self.address

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def read_leader(endpoints: list[str], cluster_id: str) -> str | None:
    """The master_view value (the leader's ``host:port``), or None."""
    import anyio

    from mooncake._engine.metadata.etcd import EtcdKV
    from mooncake._store.leader import master_view_key

    async def get() -> str | None:
        kv = EtcdKV(endpoints)
        try:
            raw = await kv.get(master_view_key(cluster_id))
        finally:
            await kv.aclose()
        return raw.decode().strip() if raw else None

    try:
        return anyio.run(get)
    except Exception:  # etcd member down: the next read asks another
        return None


# -- the run ---------------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


class Run:
    def __init__(self, args: argparse.Namespace, etcd: Any) -> None:
        self.args = args
        self.etcd = etcd
        self.endpoints = [f"http://{m.endpoint}" for m in etcd.members]
        self.etcd_hosts = ";".join(m.endpoint for m in etcd.members)
        self.cluster_id = f"ha-bench-{os.getpid()}"
        self.log_dir = Path(args.log_dir or f"/tmp/ha-failover-{os.getpid()}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        extra = ["--ha-lease-ttl", str(args.ha_lease_ttl)] if args.ha_lease_ttl else []
        if args.ha_ack_mode:
            extra += ["--ha-ack-mode", args.ha_ack_mode]
        self.masters = [
            HaMasterProc(f"m{i}", self.etcd_hosts, self.cluster_id, self.log_dir, extra)
            for i in range(args.masters)
        ]
        self.ctx = mp.get_context("spawn")
        self.events: Any = self.ctx.Queue()
        self.stop_ev = self.ctx.Event()
        self.close_ev = self.ctx.Event()
        self.workers: dict[str, Any] = {}
        self.acks: list[tuple[float, float]] = []
        self.codes: collections.Counter[str] = collections.Counter()
        self.finals: dict[str, tuple[int, int, int, dict[str, int]]] = {}
        self.failovers: list[float] = []
        self.kills: list[float] = []
        self.bad: list[tuple[str, int, float, float]] = []
        self.unfinished = 0
        self._sec_acks = 0
        self._sec_codes: collections.Counter[str] = collections.Counter()
        self._last_print = time.monotonic()

    # events from the workers
    def drain(self, block_s: float = 0.0) -> None:
        deadline = time.monotonic() + block_s
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()) or 0.01)
            except queue.Empty:
                break
            if ev[0] == "acks":
                self.acks.extend(ev[2])
                self._sec_acks += len(ev[2])
                self.codes.update(ev[3])
                self._sec_codes.update(ev[3])
            elif ev[0] == "final":
                self.finals[ev[1]] = (ev[2], ev[3], ev[4], ev[5])
                self.bad.extend(ev[6])
            if time.monotonic() >= deadline:
                break
        now = time.monotonic()
        if now - self._last_print >= 1.0:
            errs = " ".join(f"{k}={v}" for k, v in sorted(self._sec_codes.items())) or "-"
            rate = self._sec_acks / (now - self._last_print)
            print(f"  {rate:7.0f} puts/s   errors: {errs}", flush=True)
            self._sec_acks, self._sec_codes = 0, collections.Counter()
            self._last_print = now

    def wait_leader(self, timeout: float) -> HaMasterProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            addr = read_leader(self.endpoints, self.cluster_id)
            for m in self.masters:
                if m.alive() and m.address == addr:
                    return m
            self.drain(0.1)
        raise RuntimeError(f"no live master is the leader after {timeout} s")

    def first_put_after(self, t_kill: float, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            after = [t1 for t0, t1 in self.acks if t0 > t_kill]
            if after:
                return min(after) - t_kill
            self.drain(0.05)
        return None

    def main(self) -> int:
        a = self.args
        print(
            f"etcd: {len(self.etcd.members)} member(s); masters: {a.masters}; workers: "
            f"{a.workers} x {a.put_rate} puts/s of {a.size} B; failovers: {a.failovers}; "
            f"leader lease: {a.ha_lease_ttl or 'default'} s; "
            f"logs in {self.log_dir}",
            flush=True,
        )
        for m in self.masters:
            m.start()
        leader = self.wait_leader(60)
        print(f"leader: {leader.name} at {leader.address}", flush=True)
        wargs = {
            "master": "etcd://" + self.etcd_hosts,
            "cluster_id": self.cluster_id,
            "put_rate": a.put_rate,
            "size": a.size,
            "segment_mib": a.segment_mib,
        }
        for i in range(a.workers):
            p = self.ctx.Process(
                target=run_worker, args=(i, wargs, self.events, self.stop_ev, self.close_ev)
            )
            p.start()
            self.workers[f"w{i}"] = p
        ready = 0
        deadline = time.monotonic() + 120
        while ready < a.workers:
            try:
                ev = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError("workers did not start") from None
            if ev[0] == "ready":
                ready += 1
        try:
            for f in range(1, a.failovers + 1):
                t_end = time.monotonic() + a.interval
                while time.monotonic() < t_end:
                    self.drain(0.1)
                leader = self.wait_leader(60)
                t_kill = time.time()
                self.kills.append(t_kill)
                os.kill(leader.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
                leader.proc.wait()  # type: ignore[union-attr]
                took = self.first_put_after(t_kill, a.failover_timeout)
                new = read_leader(self.endpoints, self.cluster_id)
                if took is None:
                    self.unfinished += 1
                    print(
                        f"failover {f}/{a.failovers}: killed {leader.name} ({leader.address}); "
                        f"NO successful put within {a.failover_timeout:g} s",
                        flush=True,
                    )
                else:
                    self.failovers.append(took)
                    print(
                        f"failover {f}/{a.failovers}: killed {leader.name} ({leader.address}); "
                        f"leader now {new}; first put after {took:.3f} s",
                        flush=True,
                    )
                leader.start()  # back as a standby
                if a.kill_etcd_member_at == f and len(self.etcd.members) > 1:
                    victim = self.etcd.members[-1]
                    victim.stop(signal.SIGKILL)
                    print(f"etcd member {victim.name} SIGKILLed (stays down)", flush=True)
            for _ in range(int(a.interval * 10)):
                self.drain(0.1)
        finally:
            self.stop_ev.set()
            deadline = time.monotonic() + 300
            while len(self.finals) < len(self.workers) and time.monotonic() < deadline:
                self.drain(0.2)
            self.close_ev.set()
            for p in self.workers.values():
                p.join(30)
                if p.is_alive():
                    p.kill()
            for m in self.masters:
                m.stop()
        return self.report()

    def report(self) -> int:
        acked = sum(v[0] for v in self.finals.values())
        lost = sum(v[1] for v in self.finals.values())
        corrupted = sum(v[2] for v in self.finals.values())
        out: dict[str, Any] = {
            "failovers": len(self.failovers) + self.unfinished,
            "unfinished": self.unfinished,
            "acknowledged": acked,
            "lost": lost,
            "corrupted": corrupted,
            "errors": dict(self.codes),
            "workers_reported": len(self.finals),
            "failover_s": self.failovers,
        }
        print()
        if self.failovers:
            xs = self.failovers
            out.update(min=min(xs), p50=statistics.median(xs), p90=pct(xs, 90), max=max(xs))
            print(
                f"failover time (SIGKILL -> first put through the new leader), "
                f"{len(xs)} failovers: min {min(xs):.3f} s  p50 {statistics.median(xs):.3f} s  "
                f"p90 {pct(xs, 90):.3f} s  max {max(xs):.3f} s"
            )
        print(
            f"acknowledged objects: {acked}; lost: {lost}; corrupted: {corrupted}; "
            f"unfinished failovers: {self.unfinished}; workers reporting: "
            f"{len(self.finals)}/{len(self.workers)}"
        )
        print("errors seen by workers:", dict(self.codes) or "none")
        final: collections.Counter[str] = collections.Counter()
        for v in self.finals.values():
            final.update(v[3])
        out["final_check"] = dict(final)
        print("final check of every acknowledged key:", dict(final) or "all read back intact")
        for key, rc, t0, t1 in sorted(self.bad, key=lambda b: b[3])[:20]:
            before = [t1 - k for k in self.kills if k <= t1]
            since = f"{min(before):.3f} s after kill {len(before)}" if before else "before any kill"
            print(f"  {key}: {rc or 'wrong bytes'}; put took {t1 - t0:.3f} s, acked {since}")
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(out, indent=1))
        bad = lost or corrupted or self.unfinished or len(self.finals) < len(self.workers)
        return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--failovers", type=int, default=20)
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--etcd-members", type=int, default=1, choices=(1, 3))
    p.add_argument("--kill-etcd-member-at", type=int, default=0, help="after this failover")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--put-rate", type=float, default=100.0, help="puts per second per worker")
    p.add_argument("--size", type=int, default=2048, help="value bytes")
    p.add_argument("--segment-mib", type=int, default=128)
    p.add_argument("--interval", type=float, default=3.0, help="seconds of load between kills")
    p.add_argument("--failover-timeout", type=float, default=60.0)
    p.add_argument(
        "--ha-lease-ttl",
        type=int,
        default=0,
        help="the masters' leader lease in seconds (0: their default, the published 5 s)",
    )
    p.add_argument("--ha-ack-mode", default="", help="the masters' --ha-ack-mode (etcd, replica)")
    p.add_argument("--log-dir", default="")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.masters < 2:
        p.error("--masters must be >= 2 (a leader and a standby)")
    from tests import services

    with services.etcd_cluster(args.etcd_members) as etcd:
        return Run(args, etcd).main()


if __name__ == "__main__":
    sys.exit(main())
