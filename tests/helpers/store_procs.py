"""Start a store master and store-client driver processes for multi-process tests.

``Master`` runs ``python -m mooncake master --rpc-port 0 ...`` and reads the address it prints;
``Client`` runs :mod:`tests.helpers.store_client_driver` (a sync ``MooncakeDistributedStore`` in
its own process, driven by one JSON command per line). Every process is stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("store_client_driver.py")
#: how long a child may take to print its ready line (a loaded machine starts Python slowly)
STARTUP_S = 120.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""))
    t.daemon = True
    t.start()
    t.join(timeout)
    if not box or not box[0]:
        raise RuntimeError(f"process {proc.pid} said nothing within {timeout} s (rc={proc.poll()})")
    return box[0]


class Master:
    def __init__(self, *flags: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "mooncake",
            "master",
            "--rpc-port",
            "0",
            "--no-metrics",
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
        )
        line = _readline(self.proc, STARTUP_S)
        # "mooncake master: rpc=HOST:PORT metrics=... metadata=..."
        self.address = line.split("rpc=", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


class Client:
    """A store client in its own process (sync facade)."""

    def __init__(
        self, master: str, segment_mib: int, local_buffer_mib: int = 16, ssd: str = ""
    ) -> None:
        cmd = [sys.executable, str(DRIVER), master, str(segment_mib), str(local_buffer_mib)]
        cmd += [ssd] if ssd else []
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        hello = json.loads(_readline(self.proc, STARTUP_S))
        if "error" in hello:
            raise RuntimeError(hello["error"])
        self.hostname: str = hello["hostname"]

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(_readline(self.proc, timeout))
        return out

    def cmd(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.recv()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                try:
                    f.close()
                except OSError:
                    pass
