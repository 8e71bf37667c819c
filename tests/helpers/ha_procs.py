"""Replicated masters as processes, and a minimal blocking master RPC client, for HA tests.

``HaMaster`` runs ``python -m mooncake master --enable-ha ...`` on free ports and reads the
line it prints; ``status()`` reads its ``/status``. ``call()`` sends one framed request on a
fresh connection and returns ``(code, message, result)``: the tests speak the wire protocol
directly, so they see exactly what a master answers (or that it closed without answering).
Every process is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from mooncake._core import rpc
from mooncake._core.store_types import Segment
from tests.helpers.store_procs import STARTUP_S, _env, _readline

MiB = 1 << 20


class HaMaster:
    def __init__(
        self,
        etcd: str,
        *flags: str,
        cluster: str = "test",
        log: Path | None = None,
        prefix: tuple[str, ...] = (),
    ):
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "mooncake",
            "master",
            "--rpc-port",
            "0",
            "--metrics-port",
            "0",
            "--client-ttl",
            "600",
            "--enable-ha",
            "--ha-backend-connstring",
            etcd,
            "--cluster-id",
            cluster,
            *flags,
        ]
        self.log = log
        err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
        if log:
            err.close()  # type: ignore[union-attr]
        line = _readline(self.proc, STARTUP_S)
        self.address = line.split("rpc=", 1)[1].split()[0]
        self.metrics = line.split("metrics=", 1)[1].split()[0]

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.metrics}/status", timeout=5) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def ha(self) -> dict[str, Any]:
        try:
            out: dict[str, Any] = self.status()["ha"]
            return out
        except OSError:
            return {"role": "unreachable"}

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def wait_leader(masters: list[HaMaster], timeout: float = 30.0) -> HaMaster:
    """The one master that says it leads (and is serving), once exactly one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leaders = [m for m in masters if m.proc.poll() is None and m.ha()["role"] == "leader"]
        if len(leaders) == 1:
            return leaders[0]
        time.sleep(0.1)
    raise AssertionError(f"no single leader within {timeout} s: {[m.ha() for m in masters]}")


def _recv_frame(sock: socket.socket) -> bytes | None:
    buf = b""
    while len(buf) < rpc.HEADER.size:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    (n,) = rpc.HEADER.unpack_from(buf)
    while len(buf) < rpc.HEADER.size + n:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return buf


def send(sock: socket.socket, method: str, params: msgspec.Struct, req_id: int = 1) -> None:
    sock.sendall(rpc.encode_request(req_id, method, params))


def receive(sock: socket.socket) -> tuple[int, str, Any] | None:
    """One response (code, message, result as builtins), None if the master closed first."""
    try:
        frame = _recv_frame(sock)
    except OSError:
        return None
    if frame is None:
        return None
    dec = rpc.MessageDecoder(rpc.DEFAULT_MAX_FRAME)
    dec.feed(frame)
    msg = next(iter(dec))
    assert isinstance(msg, rpc.Response)
    result = msgspec.msgpack.decode(msg.result) if msg.code == 0 else None
    return msg.code, msg.message, result


def call(
    address: str, method: str, params: msgspec.Struct, timeout: float = 10.0
) -> tuple[int, str, Any] | None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        send(sock, method, params)
        return receive(sock)


def mount(address: str, client: str = "c0", mib: int = 64, idx: int = 0) -> None:
    seg = Segment(
        id=f"{client}-seg{idx}", name=f"127.0.0.1:{20000 + idx}", base=1 << 32, size=mib * MiB
    )
    r = call(address, "MountSegment", rpc.MountSegmentParams(client, seg))
    assert r is not None and r[0] == 0, r


def put(address: str, key: str, size: int = 4096, client: str = "c0") -> bool:
    """PutStart + PutEnd; True only if the master acknowledged the PutEnd."""
    try:
        r = call(address, "PutStart", rpc.PutStartParams(client, key, size))
        if r is None or r[0] != 0:
            return False
        r = call(address, "PutEnd", rpc.KeyClientParams(client, key))
    except OSError:
        return False
    return r is not None and r[0] == 0


def all_keys(address: str) -> set[str]:
    r = call(address, "GetAllKeys", rpc.Empty())
    assert r is not None and r[0] == 0, r
    return set(r[2])
