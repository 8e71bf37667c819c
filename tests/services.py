"""Real metadata services for tests: etcd members, Redis, the HTTP metadata server.

Each starts as its own process on free loopback ports (or on an address inside a network
namespace via ``netns``), with a temporary data directory, waits until it answers, and is stopped
by its pid. Nothing here mocks a service.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: how long a service may take to answer after its start: generous, since a loaded machine
#: (parallel workers, a CPU hog) can take many seconds; waiting ends as soon as it answers
READY_S = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not installed (Debian: apt-get install etcd-server redis-server)")
    return path


def _netns_prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Stop one process we started, by its pid; SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait(pred: object, what: str, proc: subprocess.Popen[bytes], log: Path | None) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {READY_S} s")


# -- etcd -------------------------------------------------------------------------------------


@dataclass
class EtcdMember:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    netns: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        self.log = self.data_dir.with_suffix(".log")
        cmd = [
            *_netns_prefix(self.netns),
            need("etcd"),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            f"http://{self.endpoint}",
            "--advertise-client-urls",
            f"http://{self.endpoint}",
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            initial_cluster,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            f"mc-test-{os.getpid()}-{self.data_dir.parent.name}",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--log-level",
            "error",
            "--logger",
            "zap",
        ]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        if self.netns:
            probe = (
                "import json,sys,urllib.request as u;"
                f"sys.exit(json.load(u.urlopen('http://{self.endpoint}/health',timeout=1))"
                ".get('health')!='true')"
            )
            r = subprocess.run(
                [*_netns_prefix(self.netns), sys.executable, "-c", probe], capture_output=True
            )
            return r.returncode == 0
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop(self.proc, sig)


@dataclass
class EtcdCluster:
    members: list[EtcdMember] = field(default_factory=list)

    @property
    def conn(self) -> str:
        return "etcd://" + ";".join(m.endpoint for m in self.members)


@contextlib.contextmanager
def etcd_cluster(
    n: int = 1, *, host: str = "127.0.0.1", netns: str | None = None
) -> Iterator[EtcdCluster]:
    """``n`` etcd members on free ports of ``host``; all stopped (by pid) on exit."""
    need("etcd")
    tmp = Path(tempfile.mkdtemp(prefix="mc-etcd-"))
    if netns:  # a namespace of our own: its ports are all free
        plist = list(range(2379, 2379 + 2 * n))
    else:
        ports: set[int] = set()
        while len(ports) < 2 * n:
            ports.add(free_port(host))
        plist = sorted(ports)
    cluster = EtcdCluster(
        [
            EtcdMember(f"m{i}", host, plist[2 * i], plist[2 * i + 1], tmp / f"m{i}", netns)
            for i in range(n)
        ]
    )
    initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster.members)
    try:
        for m in cluster.members:
            m.start(initial)
        for m in cluster.members:
            assert m.proc is not None
            try:
                _wait(m.healthy, f"etcd member {m.name}", m.proc, m.log)
            except RuntimeError as e:
                tail = m.log.read_text(errors="replace")[-3000:] if m.log else ""
                raise RuntimeError(f"{e}\n{tail}") from None
        yield cluster
    finally:
        for m in cluster.members:
            m.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# -- redis ------------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_server(host: str = "127.0.0.1") -> Iterator[str]:
    """A private redis-server; yields ``redis://host:port``."""
    binary = need("redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="mc-redis-"))
    port = free_port(host)
    log = tmp / "redis.log"
    cmd = [
        binary,
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(tmp),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--logfile",
        str(log),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    try:
        _wait(ready, "redis-server", proc, log)
        yield f"redis://{host}:{port}"
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


# -- the HTTP metadata server (our CLI) ---------------------------------------------------------


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


@contextlib.contextmanager
def http_metadata_server(host: str = "127.0.0.1", netns: str | None = None) -> Iterator[str]:
    """``mooncake metadata-server`` in its own process; yields its URL."""
    cmd = [
        *_netns_prefix(netns),
        sys.executable,
        "-m",
        "mooncake",
        "metadata-server",
        "--host",
        host,
        "--port",
        "0",
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=python_env(), cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if "listening on " not in line:
            proc.wait(5)
            log.seek(0)
            raise RuntimeError(f"metadata-server did not start: {line!r} {log.read()[-2000:]!r}")
        yield line.split("listening on ", 1)[1].strip()
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()
