"""Start a master beside a side-by-side run: the published ``mooncake_master`` or ours.

Standard library only: scripts that run under both this checkout's python and the published
wheel's (benchmarks and drivers that measure one side against the other) import this file by
path (``tests/helpers`` on ``sys.path``, never the checkout's root, so ``import mooncake`` in
the published interpreter still finds the published wheel).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A loopback TCP port free at the time of the call."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


def master_command(published: bool, rpc_port: int) -> list[str]:
    """The command line of a master on loopback ``rpc_port`` without an HTTP metrics port of its own
    (the published binary has no switch to turn it off: it gets a free port)."""
    if published:
        import mooncake

        binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        return [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
        ]
    return [sys.executable, "-m", "mooncake", "master", "--rpc-port", str(rpc_port), "--no-metrics"]


def start_master(published: bool, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], int]:
    """Start a master and return it with its RPC port once that port accepts connections.

    Raises ``RuntimeError`` (after killing the process) if the port does not open within
    ``timeout`` seconds or the process exits first.
    """
    rpc = free_port()
    proc = subprocess.Popen(
        master_command(published, rpc), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return wait_serving(proc, rpc, timeout), rpc


def wait_serving(
    proc: subprocess.Popen[bytes], rpc: int, timeout: float = 60.0
) -> subprocess.Popen[bytes]:
    """``proc`` once loopback ``rpc`` accepts connections; ``RuntimeError`` (after killing it)
    if it exits first or the port does not open within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"master exited with {proc.returncode} before serving")
        try:
            socket.create_connection(("127.0.0.1", rpc), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"master did not open 127.0.0.1:{rpc} within {timeout:.0f} s")
