"""Multi-host: engines in their own network namespaces discover each other through etcd or the
HTTP metadata server (running in a third namespace) and move verified bytes; a cut link fails
the initiator's transfer (no hang) and the engine recovers when the link comes back.

Topology (all made here, all removed afterwards, also on failure)::

    ns A 10.77.0.1 --veth--+
                           br0 (ns S, 10.77.0.254: etcd, metadata-server)
    ns B 10.77.0.2 --veth--+

Needs root and iproute2; skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import services

pytestmark = pytest.mark.netns

HELPER = services.ROOT / "tests" / "helpers" / "netns_engine.py"
SUBNET = "10.77.0"
_seq = itertools.count()


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass
class Lab:
    tag: str
    ns: dict[str, str] = field(default_factory=dict)  # role -> namespace
    ports: dict[str, str] = field(default_factory=dict)  # role -> its bridge port (in ns S)
    addr: dict[str, str] = field(default_factory=dict)

    def cut(self, role: str) -> None:
        _ip("-n", self.ns["S"], "link", "set", self.ports[role], "down")

    def mend(self, role: str) -> None:
        _ip("-n", self.ns["S"], "link", "set", self.ports[role], "up")


@contextlib.contextmanager
def lab() -> Iterator[Lab]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    tag = f"{os.getpid() % 100000}x{next(_seq)}"
    lb = Lab(tag)
    made: list[str] = []
    try:
        for role in ("S", "A", "B"):
            name = f"mc{role}{tag}"
            try:
                _ip("netns", "add", name)
            except RuntimeError as e:
                if not made:
                    pytest.skip(f"cannot create network namespaces here: {e}")
                raise
            made.append(name)
            lb.ns[role] = name
            _ip("-n", name, "link", "set", "lo", "up")
        s = lb.ns["S"]
        _ip("-n", s, "link", "add", "br0", "type", "bridge")
        _ip("-n", s, "addr", "add", f"{SUBNET}.254/24", "dev", "br0")
        _ip("-n", s, "link", "set", "br0", "up")
        lb.addr["S"] = f"{SUBNET}.254"
        for i, role in enumerate(("A", "B"), start=1):
            port = f"p{role}"
            # created directly inside the namespaces: nothing appears in the root namespace
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                lb.ns[role],
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                s,
            )
            _ip("-n", s, "link", "set", port, "master", "br0")
            _ip("-n", s, "link", "set", port, "up")
            _ip("-n", lb.ns[role], "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            _ip("-n", lb.ns[role], "link", "set", "eth0", "up")
            lb.ports[role] = port
            lb.addr[role] = f"{SUBNET}.{i}"
        yield lb
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(n in left for n in made), f"namespaces left behind: {left}"


class Host:
    """An engine process inside a namespace."""

    def __init__(self, lb: Lab, role: str, metadata: str) -> None:
        self.role = role
        self._buf = b""
        self.proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                lb.ns[role],
                sys.executable,
                str(HELPER),
                "--hostname",
                lb.addr[role],
                "--metadata",
                metadata,
                "--segment-name",
                f"host{role}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=services.python_env(),
            cwd=services.ROOT,
        )
        ready = self.recv(60)
        assert ready.get("ready") == f"host{role}", ready
        self.segment = ready["ready"]

    def recv(self, within: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + within
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            r, _, _ = select.select([fd], [], [], max(left, 0))
            if not r:
                raise AssertionError(f"host {self.role}: no answer within {within} s (hung?)")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"host {self.role} exited with {self.proc.wait(5)}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def call(self, within: float = 60, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.recv(within)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.send(op="quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        services.stop(self.proc)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    f.close()


@contextlib.contextmanager
def metadata_service(lb: Lab, kind: str) -> Iterator[str]:
    if kind == "etcd":
        with services.etcd_cluster(1, host=lb.addr["S"], netns=lb.ns["S"]) as cluster:
            yield cluster.conn
    else:
        with services.http_metadata_server(host=lb.addr["S"], netns=lb.ns["S"]) as url:
            yield url


@contextlib.contextmanager
def hosts(lb: Lab, conn: str) -> Iterator[tuple[Host, Host]]:
    made: list[Host] = []
    try:
        made.append(Host(lb, "A", conn))
        made.append(Host(lb, "B", conn))
        yield made[0], made[1]
    finally:
        for h in made:
            h.close()


@pytest.mark.parametrize("kind", [pytest.param("etcd", marks=pytest.mark.etcd), "http"])
def test_engines_in_namespaces_discover_each_other_and_move_bytes(kind: str) -> None:
    if kind == "etcd":
        services.need("etcd")
    n = 8 << 20
    with lab() as lb, metadata_service(lb, kind) as conn, hosts(lb, conn) as (a, b):
        src_b = b.call(op="alloc", size=n, seed=1)
        src_a = a.call(op="alloc", size=n, seed=2)
        dst_a = a.call(op="alloc", size=n, seed=3)
        r = a.call(
            op="read", segment=b.segment, local=dst_a["addr"], remote=src_b["addr"], length=n
        )
        assert r["ok"], r
        assert a.call(op="sha", addr=dst_a["addr"], length=n)["sha"] == src_b["sha"]
        # the other direction, B initiating a write into A
        r = b.call(
            op="write", segment=a.segment, local=src_b["addr"], remote=src_a["addr"], length=n
        )
        assert r["ok"], r
        assert a.call(op="sha", addr=src_a["addr"], length=n)["sha"] == src_b["sha"]


@pytest.mark.etcd
@pytest.mark.slow
def test_cut_link_fails_transfer_then_recovers() -> None:
    services.need("etcd")
    n = 32 << 20
    with lab() as lb, metadata_service(lb, "etcd") as conn, hosts(lb, conn) as (a, b):
        src = b.call(op="alloc", size=n, seed=7)
        dst = a.call(op="alloc", size=n, seed=8)
        a.send(op="loop_read", segment=b.segment, local=dst["addr"], remote=src["addr"], length=n)
        assert a.recv(60) == {"started": True}
        lb.cut("B")
        try:
            # transfers run back to back: the cut lands in one; the kernel (user timeout 3 s,
            # keepalive) fails its socket, and the initiator reports it instead of hanging
            failed = a.recv(60)
        finally:
            lb.mend("B")
        assert failed["ok"] is False and failed["reads"] >= 1, failed
        assert failed["etype"] in ("PeerDiedError", "PeerUnreachableError"), failed
        # back up: the same engine reaches B again (fresh lookup and connection) with good bytes
        deadline = time.monotonic() + 60
        while True:
            r = a.call(
                op="read", segment=b.segment, local=dst["addr"], remote=src["addr"], length=n
            )
            if r["ok"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r["ok"], r
        assert a.call(op="sha", addr=dst["addr"], length=n)["sha"] == src["sha"]
