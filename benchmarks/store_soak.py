#!/usr/bin/env python3
"""Store soak: a real master, N client processes, eviction on, every value verified, faults.

A ``mooncake master`` process and ``--workers`` client processes, each with its own segment,
all through the published sync API (``mooncake.store.MooncakeDistributedStore``), plus
``--holders`` processes that only contribute a segment (the default fault victim). The pool is
smaller than the working set, so the master evicts all the time. Workers run a mix of
``put`` / ``upsert`` / ``get_into`` / ``remove`` / ``is_exist`` on one shared key space; every
value carries its key, a generation and a digest (:func:`make_value`), so a read that returns
one wrong byte -- of another key, an older extent, a reused one -- is detected and counted.

Faults (seconds from the start of the measured run):

* ``--kill-holder-at S``: SIGKILL one client holding data (a holder, or worker 0 without
  holders); ``--stop-holder`` makes it SIGSTOP instead (``--stop-for`` seconds, then SIGCONT).
* ``--restart-master-at S``: SIGKILL the master and start a new one on the same port.
* ``--restart-client-at S``: SIGKILL a holder and start it again (same SSD directory with
  ``--ssd``).

Around a restart the workers pause, the readable keys are counted, the fault is applied, the
clients get ``--settle`` seconds to re-mount and re-announce, the keys are counted again, and
the load resumes (so the count is not blurred by the workers' own removes).

Each second a progress line: ops/s, and the error codes seen by op. At the end a summary:
wrong bytes (must be 0), the ``-703`` (REPLICA_IS_NOT_READY) count, how long reads kept failing
after a holder fault (the last read that failed with a transfer-level code), failing-read
latency, and throughput in the fault window against the window before.

    python benchmarks/store_soak.py --seconds 40                       # no fault: 0 -703 expected
    python benchmarks/store_soak.py --seconds 30 --kill-holder-at 10   # dead holder
    python benchmarks/store_soak.py --seconds 30 --kill-holder-at 10 --stop-holder
    python benchmarks/store_soak.py --seconds 30 --restart-master-at 10 --ssd /tmp/soak-ssd

The worker and holder bodies (:func:`run_worker`, :func:`run_holder`) and :func:`make_value` /
:func:`wrong_bytes` are plain functions for other benchmarks to reuse.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
KIB = 1 << 10

# -- values ----------------------------------------------------------------------------------

_MAGIC = b"SOAK"
_HEAD = struct.Struct("<4sHQI16s")  # magic, key length, generation, payload length, digest


def _payload(key: str, gen: int, n: int) -> bytes:
    import numpy as np

    seed = int.from_bytes(
        hashlib.blake2b(f"{key}\0{gen}".encode(), digest_size=8).digest(), "little"
    )
    return np.random.default_rng(seed).bytes(n)


def _digest(key: bytes, gen: int, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key)
    h.update(gen.to_bytes(8, "little"))
    h.update(payload)
    return h.digest()


def make_value(key: str, gen: int, size: int) -> bytes:
    """A ``size``-byte value of ``key``: header (key, ``gen``, digest) + deterministic payload."""
    k = key.encode()
    n = size - _HEAD.size - len(k)
    if n < 0:
        raise ValueError(f"size {size} is too small for key {key!r}")
    payload = _payload(key, gen, n)
    return _HEAD.pack(_MAGIC, len(k), gen, n, _digest(k, gen, payload)) + k + payload


def wrong_bytes(key: str, data: bytes | memoryview) -> int:
    """How many bytes of ``data`` (read as ``key``'s value) are wrong: 0 for an intact value of
    ``key`` (any generation); every byte if the header is not ``key``'s; else the payload bytes
    that differ from the generation's deterministic payload (at least 1 when the digest fails)."""
    data = bytes(data)
    k = key.encode()
    if len(data) < _HEAD.size + len(k):
        return max(len(data), 1)
    magic, klen, gen, n, dig = _HEAD.unpack_from(data)
    if magic != _MAGIC or klen != len(k) or data[_HEAD.size : _HEAD.size + klen] != k:
        return len(data)
    body = data[_HEAD.size + klen :]
    if n != len(body):
        return len(data)
    if _digest(k, gen, body) == dig:
        return 0
    import numpy as np

    want = np.frombuffer(_payload(key, gen, n), dtype=np.uint8)
    got = np.frombuffer(body, dtype=np.uint8)
    return max(int((want != got).sum()), 1)


# -- the processes ---------------------------------------------------------------------------

CLEAR = (0, -704, -703, -707, -710)
"""Read outcomes that are not a failed transfer: success, not found, not ready (counted on its
own), lease expired (the read itself was slow: this machine's load, not a holder), no
reachable replica (answered at once). Any other code counts as a *failing* read."""


@dataclass
class SoakConfig:
    """What every worker and holder process needs (picklable)."""

    master: str
    keys: int = 2048
    sizes: list[int] = field(default_factory=lambda: [4 * KIB, 32 * KIB, 128 * KIB])
    segment_mib: int = 16
    buffer_mib: int = 8
    mix: dict[str, int] = field(
        default_factory=lambda: {
            "get": 50,
            "put": 15,
            "upsert": 15,
            "exist": 10,
            "remove": 10,
        }
    )
    seed: int = 1
    ssd_root: str = ""
    transport: str = "engine"
    """``shm``: same-host replicas by memcpy (``MC_STORE_MEMCPY=1``, what one host gives);
    ``engine``: every peer through the engine with its default transports (its same-host shm
    one included); ``tcp``: the engine on TCP only (``MC_FORCE_TCP=1``), as between hosts."""


def transport_env(transport: str) -> dict[str, str]:
    """The environment a client process of ``transport`` (see :class:`SoakConfig`) needs."""
    if transport not in ("shm", "engine", "tcp"):
        raise ValueError(f"transport must be shm, engine or tcp, got {transport!r}")
    return {
        "MC_STORE_MEMCPY": "1" if transport == "shm" else "0",
        "MC_FORCE_TCP": "1" if transport == "tcp" else "0",
    }


def _open(cfg: SoakConfig, segment_mib: int, ssd: str) -> Any:
    os.environ.update(transport_env(cfg.transport))
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    args: list[Any] = [
        "127.0.0.1",
        "P2PHANDSHAKE",
        segment_mib * MIB,
        cfg.buffer_mib * MIB,
        "tcp",
        "",
        cfg.master,
    ]
    kw: dict[str, Any] = {}
    if ssd:
        Path(ssd).mkdir(parents=True, exist_ok=True)
        kw = {"enable_ssd_offload": True, "ssd_offload_path": ssd}
    rc = s.setup(*args, **kw)
    if rc != 0:
        raise RuntimeError(f"setup failed: {rc}")
    return s


class Events:
    """The sending end of one process's event pipe (a pipe per process: a process killed in
    the middle of a send cannot leave a lock held that others need, as a shared queue could)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, item: Any) -> None:
        self.conn.send(item)


def run_holder(index: int, cfg: SoakConfig, events: Any, stop: Any) -> None:
    """A client that only contributes a segment (and an SSD tier with ``cfg.ssd_root``) until
    ``stop.value`` is true (a lock-free shared value); puts ``("ready", "h<index>", hostname, pid)`` on ``events``."""
    ssd = os.path.join(cfg.ssd_root, f"h{index}") if cfg.ssd_root else ""
    s = _open(cfg, cfg.segment_mib, ssd)
    events.put(("ready", f"h{index}", s.get_hostname(), os.getpid(), s._store.client_id))
    while not stop.value:
        time.sleep(0.05)
    s.close()


def run_worker(
    index: int, cfg: SoakConfig, events: Any, stop: Any, pause: Any | None = None
) -> None:
    """One worker: random ops on the shared key space until ``stop.value``, verifying every
    value read. Puts ``("ready", "w<index>", hostname, pid)`` on ``events``, then once a second
    ``("stats", "w<index>", second, counts, latencies, fail_times)``: ``counts`` maps
    ``"op:code"`` to a count (code ``0`` success; ``"get:wrong"`` counts wrong bytes read),
    ``latencies`` ``"op:code"`` to the summed seconds, ``fail_times`` the wall times
    (``time.time()``) of failing reads (a code not in :data:`CLEAR`). ``pause`` (a shared value),
    while true, holds the worker between ops."""
    import numpy as np

    ssd = os.path.join(cfg.ssd_root, f"w{index}") if cfg.ssd_root else ""
    s = _open(cfg, cfg.segment_mib, ssd)
    top = max(cfg.sizes)
    buf = np.zeros(top, dtype=np.uint8)
    ptr = buf.ctypes.data
    if s.register_buffer(ptr, top) != 0:
        raise RuntimeError("register_buffer failed")
    rng = random.Random(cfg.seed * 1000 + index)
    ops = list(cfg.mix)
    weights = [cfg.mix[o] for o in ops]
    events.put(("ready", f"w{index}", s.get_hostname(), os.getpid()))
    counts: collections.Counter[str] = collections.Counter()
    fail_t: list[float] = []
    lat: collections.defaultdict[str, float] = collections.defaultdict(float)
    second = int(time.time())
    try:
        while not stop.value:
            if pause is not None and pause.value:
                time.sleep(0.01)
                continue
            now = time.time()
            if int(now) != second:
                events.put(("stats", f"w{index}", second, dict(counts), dict(lat), fail_t))
                counts, lat, fail_t = (
                    collections.Counter(),
                    collections.defaultdict(float),
                    [],
                )
                second = int(now)
            op = rng.choices(ops, weights)[0]
            key = f"k{rng.randrange(cfg.keys)}"
            t0 = time.perf_counter()
            if op in ("put", "upsert"):
                v = make_value(key, rng.getrandbits(63), rng.choice(cfg.sizes))
                rc = s.put(key, v) if op == "put" else s.upsert(key, v)
            elif op == "get":
                rc = s.get_into(key, ptr, top)
                if rc > 0:
                    bad = wrong_bytes(key, buf[:rc].tobytes())
                    if bad:
                        counts["get:wrong"] += bad
                    rc = 0
            elif op == "exist":
                rc = s.is_exist(key)
                rc = 0 if rc in (0, 1) else rc
            else:
                rc = s.remove(key)
            dt = time.perf_counter() - t0
            counts[f"{op}:{rc}"] += 1
            lat[f"{op}:{rc}"] += dt
            if op == "get" and rc not in CLEAR:
                fail_t.append(time.time())
    finally:
        events.put(("stats", f"w{index}", second, dict(counts), dict(lat), fail_t))
        s.unregister_buffer(ptr)
        s.close()


# -- the master ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class MasterProc:
    """``python -m mooncake master`` on a fixed port (so a restart keeps the address)."""

    def __init__(self, port: int, flags: list[str]) -> None:
        self.port, self.flags = port, flags
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> str:
        env = dict(os.environ)
        env.setdefault("PYTHONPATH", str(ROOT))  # as given: the soak may run another tree
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", str(self.port)]
        cmd += ["--no-metrics", *self.flags]
        deadline = time.monotonic() + 30
        while True:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if "rpc=" in line:
                return line.split("rpc=", 1)[1].split()[0]
            self.proc.wait()
            if time.monotonic() > deadline:  # the port may still be held by the old one
                raise RuntimeError(f"the master did not start: {line!r}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Second:
    t: int
    ops: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)


class Soak:
    """Starts everything, applies the faults, aggregates the workers' counters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.readers: dict[Any, str] = {}
        # lock-free shared flags: a SIGKILLed process must not take a lock with it
        self.stop_ev = self.ctx.RawValue("i", 0)
        self.pause_ev = self.ctx.RawValue("i", 0)
        flags = ["--client-ttl", str(args.client_ttl), "--seed", str(args.seed)]
        self.master = MasterProc(args.port or free_port(), flags)
        self.procs: dict[str, Any] = {}
        self.hosts: dict[str, str] = {}
        self.client_ids: dict[str, str] = {}
        self.seconds: dict[int, Second] = {}
        self.fail_times: list[float] = []
        self.lat: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.totals: collections.Counter[str] = collections.Counter()
        self.marks: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.cfg: SoakConfig | None = None

    def _spawn(self, name: str) -> None:
        assert self.cfg is not None
        kind, i = name[0], int(name[1:])
        target = run_holder if kind == "h" else run_worker
        extra = (self.pause_ev,) if kind == "w" else ()
        r, w = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(
            target=target,
            args=(i, self.cfg, Events(w), self.stop_ev, *extra),
            daemon=True,
        )
        p.start()
        w.close()
        self.readers[r] = name
        self.procs[name] = p

    def _next(self, timeout: float) -> tuple[Any, ...] | None:
        """The next event of any process within ``timeout`` s (None: none came)."""
        from multiprocessing.connection import wait

        end = time.monotonic() + timeout
        while self.readers:
            ready = wait(list(self.readers), max(0.0, end - time.monotonic()))
            if not ready:
                return None
            for conn in ready:
                r: Any = conn
                try:
                    ev: tuple[Any, ...] = r.recv()
                    return ev
                except (EOFError, OSError):
                    del self.readers[r]  # the process is gone
                    r.close()
        return None

    def _wait_ready(self, names: set[str], limit: float = 60) -> None:
        end = time.monotonic() + limit
        while names:
            ev = self._next(max(0.1, end - time.monotonic()))
            if ev is None:
                raise RuntimeError(f"not ready within {limit} s: {sorted(names)}")
            if ev[0] == "ready":
                self.hosts[ev[1]] = ev[2]
                if len(ev) > 4:
                    self.client_ids[ev[1]] = ev[4]
                names.discard(ev[1])
            else:
                self._take(ev)

    def _take(self, ev: tuple[Any, ...]) -> None:
        if ev[0] != "stats":
            return
        _, _who, t, counts, lat, fail_t = ev
        sec = self.seconds.setdefault(t, Second(t))
        for k, n in counts.items():
            sec.codes[k] += n
            self.totals[k] += n
            if not k.endswith(":wrong"):
                sec.ops += n
        for k, v in lat.items():
            self.lat[k] += v
        self.fail_times += fail_t

    def _drain(self, until: float) -> None:
        while True:
            ev = self._next(max(0.0, until - time.time()))
            if ev is None:
                return
            self._take(ev)

    def _victim(self) -> str:
        return "h0" if self.args.holders else "w0"

    def _signal(self, name: str, sig: int) -> None:
        pid = self.procs[name].pid
        if pid is not None:
            os.kill(pid, sig)

    def _count_readable(self) -> tuple[int, int, int]:
        """Keys readable; of those the ones held only on an SSD tier; and of those the ones on
        the victim's SSD (the master's answer names the disk holders: an internal call)."""
        import functools

        loop, store = self._probe._loop, self._probe._store
        assert loop is not None and store is not None
        victim = self.client_ids.get(self._victim(), "")
        keys = [f"k{i}" for i in range(self.args.keys)]
        n = ssd = mine = 0
        for j in range(0, len(keys), 256):
            part = keys[j : j + 256]
            resps, _ = loop.call(functools.partial(store._batch_query, for_read=False), part)
            for r in resps:
                if isinstance(r, Exception):
                    continue
                n += 1
                if not r.replicas and r.disk_clients:
                    ssd += 1
                    mine += victim in r.disk_clients
        return n, ssd, mine

    def _restart(self, what: str) -> None:
        """Pause, count, restart ``what`` (``master`` or a holder), settle, count, resume."""
        self.pause_ev.value = 1
        time.sleep(0.3)
        c = self.counts
        c[f"{what}_before"], c[f"{what}_ssd_before"], c[f"{what}_victim_ssd_before"] = (
            self._count_readable()
        )
        self.marks[f"{what}_restart"] = time.time()
        if what == "master":
            self.master.kill()
            self.master.start()
        else:
            victim = self._victim()
            self._signal(victim, signal.SIGKILL)
            self.procs[victim].join()
            # at once, on the same SSD directory: the master still lists the dead instance
            self._spawn(victim)
            self._wait_ready({victim})
        # after a client restart, past its old instance's TTL: what the master still listed
        # only there is gone by then, what the new instance re-adopted stays
        time.sleep(self.args.settle if what == "master" else self.args.client_ttl + 1)
        c[f"{what}_after"], c[f"{what}_ssd_after"], c[f"{what}_victim_ssd_after"] = (
            self._count_readable()
        )
        self.pause_ev.value = 0

    def run(self) -> dict[str, Any]:
        a = self.args
        address = self.master.start()
        self.cfg = SoakConfig(
            master=address,
            keys=a.keys,
            sizes=[int(x) for x in a.sizes.split(",")],
            segment_mib=a.segment_mib,
            buffer_mib=a.buffer_mib,
            seed=a.seed,
            ssd_root=a.ssd or "",
            transport=a.transport,
        )
        names = [f"h{i}" for i in range(a.holders)] + [f"w{i}" for i in range(a.workers)]
        for n in names:
            self._spawn(n)
        os.environ.update(transport_env(a.transport))
        from mooncake.store import MooncakeDistributedStore

        self._probe = MooncakeDistributedStore()
        rc = self._probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 * MIB, "tcp", "", address)
        if rc != 0:
            raise RuntimeError(f"probe client setup failed: {rc}")
        self._wait_ready(set(names))
        start = time.time() + 1.0
        self._drain(start)
        self.seconds.clear()
        self.totals.clear()
        self.fail_times.clear()
        self.lat.clear()
        self.marks["start"] = start
        pending = []
        if a.kill_holder_at is not None:
            pending.append((a.kill_holder_at, "kill"))
        if a.restart_master_at is not None:
            pending.append((a.restart_master_at, "master"))
        if a.restart_client_at is not None:
            pending.append((a.restart_client_at, "client"))
        pending.sort()
        printed = int(start)
        end = start + a.seconds
        while time.time() < end:
            self._drain(min(end, time.time() + 0.2))
            now = time.time()
            while pending and now >= start + pending[0][0]:
                _, what = pending.pop(0)
                self._fault(what)
            # a second is complete once every live worker reported it: print with 1.5 s lag
            while printed + 1.5 < time.time() - 0.0 and printed < int(end):
                self._progress(printed, start)
                printed += 1
        self.stop_ev.value = 1
        self._drain(time.time() + 2)
        if a.stop_holder and "stop" in self.marks:
            self._signal(self._victim(), signal.SIGCONT)
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self._probe.close()
        self.master.stop()
        return self._summary(start, end)

    def _fault(self, what: str) -> None:
        a = self.args
        if what == "kill":
            victim = self._victim()
            self.marks["fault"] = time.time()
            if a.stop_holder:
                self._signal(victim, signal.SIGSTOP)
                self.marks["stop"] = self.marks["fault"]
                print(
                    f"# t={self.marks['fault'] - self.marks['start']:.1f} SIGSTOP {victim}",
                    flush=True,
                )
                if a.stop_for:
                    import threading

                    def cont() -> None:
                        time.sleep(a.stop_for)
                        self._signal(victim, signal.SIGCONT)

                    threading.Thread(target=cont, daemon=True).start()
            else:
                self._signal(victim, signal.SIGKILL)
                print(
                    f"# t={self.marks['fault'] - self.marks['start']:.1f} SIGKILL {victim}",
                    flush=True,
                )
        elif what == "master":
            print("# restarting the master", flush=True)
            self._restart("master")
            c = self.counts
            print(
                f"# master restarted: readable {c['master_before']} -> {c['master_after']}, "
                f"on SSD only {c['master_ssd_before']} -> {c['master_ssd_after']}",
                flush=True,
            )
        else:
            print(f"# restarting client {self._victim()}", flush=True)
            self._restart("client")
            c = self.counts
            print(
                f"# client restarted: readable {c['client_before']} -> {c['client_after']}, "
                f"on SSD only {c['client_ssd_before']} -> {c['client_ssd_after']}, on the "
                f"victim's SSD {c['client_victim_ssd_before']} -> {c['client_victim_ssd_after']}",
                flush=True,
            )

    def _progress(self, t: int, start: float) -> None:
        sec = self.seconds.get(t, Second(t))
        errs = {k: n for k, n in sorted(sec.codes.items()) if not k.endswith((":0",)) and n}
        print(f"t={t - int(start):4d}s ops/s={sec.ops:6d} {json.dumps(errs)}", flush=True)

    def _summary(self, start: float, end: float) -> dict[str, Any]:
        a = self.args
        per_sec = [self.seconds.get(t, Second(t)).ops for t in range(int(start), int(end))]
        out: dict[str, Any] = {
            "config": {k: v for k, v in vars(a).items()},
            "ops": sum(per_sec),
            "ops_per_s_median": statistics.median(per_sec) if per_sec else 0,
            "wrong_bytes": self.totals.get("get:wrong", 0),
            "replica_not_ready_703": {k: n for k, n in self.totals.items() if k.endswith(":-703")},
            "codes": dict(sorted(self.totals.items())),
            "counts": self.counts,
        }
        out["replica_not_ready_703_total"] = sum(out["replica_not_ready_703"].values())
        lat = {
            k: 1000 * self.lat[k] / self.totals[k]
            for k in self.lat
            if k.startswith("get:") and self.totals.get(k)
        }
        out["get_mean_ms_by_code"] = {k: round(v, 3) for k, v in sorted(lat.items())}
        fault = self.marks.get("fault")
        if fault is not None:
            after = [t for t in self.fail_times if t >= fault]
            out["holder_keys_failing_s"] = round(max(after) - fault, 3) if after else 0.0
            out["failing_reads_after_fault"] = len(after)
            w = a.window
            f = int(fault)
            before = [self.seconds.get(t, Second(t)).ops for t in range(f - w, f)]
            during = [self.seconds.get(t, Second(t)).ops for t in range(f + 1, f + 1 + w)]
            out["ops_per_s_before"] = statistics.mean(before) if before else 0
            out["ops_per_s_fault_window"] = statistics.mean(during) if during else 0
            if out["ops_per_s_before"]:
                out["fault_window_ratio"] = round(
                    out["ops_per_s_fault_window"] / out["ops_per_s_before"], 3
                )
        return out


def headline(s: dict[str, Any]) -> str:
    """One line: the numbers the soak is run for."""
    parts = [
        f"ops/s median {s['ops_per_s_median']}",
        f"wrong bytes {s['wrong_bytes']}",
        f"-703 {s['replica_not_ready_703_total']}",
    ]
    if "holder_keys_failing_s" in s:
        parts.append(f"holder keys failing {s['holder_keys_failing_s']} s")
        parts.append(f"fault window {s.get('fault_window_ratio', 0):.0%} of before")
    for k, v in s.get("counts", {}).items():
        parts.append(f"{k} {v}")
    return "SOAK " + ", ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=40, help="measured run length")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--holders", type=int, default=1, help="segment-only client processes")
    p.add_argument("--keys", type=int, default=2048, help="shared key space")
    p.add_argument("--sizes", default=f"{4 * KIB},{32 * KIB},{128 * KIB}", help="value sizes")
    p.add_argument("--segment-mib", type=int, default=16, help="segment per process")
    p.add_argument("--buffer-mib", type=int, default=8, help="local buffer per process")
    p.add_argument("--client-ttl", type=float, default=10.0, help="the master's client TTL (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="master port (0: a free one)")
    p.add_argument(
        "--transport",
        choices=["shm", "engine", "tcp"],
        default="engine",
        help="shm: same-host memcpy; engine: the engine's default transports; tcp: TCP only",
    )
    p.add_argument("--ssd", default="", help="root directory of per-process SSD tiers")
    p.add_argument("--kill-holder-at", type=float, default=None)
    p.add_argument("--stop-holder", action="store_true", help="SIGSTOP instead of SIGKILL")
    p.add_argument("--stop-for", type=float, default=0.0, help="SIGCONT after this many s")
    p.add_argument("--restart-master-at", type=float, default=None)
    p.add_argument("--restart-client-at", type=float, default=None)
    p.add_argument("--settle", type=float, default=3.0, help="s after a restart before counting")
    p.add_argument("--window", type=int, default=10, help="fault window for throughput (s)")
    p.add_argument("--json", default="", help="write the summary here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = None
    if args.ssd == "tmp":
        tmp = tempfile.TemporaryDirectory(prefix="soak-ssd-")
        args.ssd = tmp.name
    soak = Soak(args)
    try:
        summary = soak.run()
    finally:
        soak.stop_ev.value = 1
        for p in soak.procs.values():
            if p.is_alive():
                p.kill()
        soak.master.kill()
        if tmp is not None:
            tmp.cleanup()
    print(json.dumps(summary, indent=1))
    print(headline(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if summary["wrong_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
