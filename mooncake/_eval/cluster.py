"""The processes of a scenario: our master, our store pool (``mooncake_client``), vLLM servers.

Every process writes its output to ``RUN_DIR/logs/NAME.log``; every port is a free one picked
at start. Children get ``PYTHONPATH`` = the CPU shim directory (written into the run directory:
vLLM's ``MooncakeConnector`` asks ``torch.accelerator`` for a device index, which a CPU-only
torch refuses; the shim answers 0), then the directory this ``mooncake`` package is imported
from, so vLLM imports this package (and its compiled hot path, checked by
:func:`check_hot_path` in the vLLM python before anything starts).

:class:`Cluster` owns what it started: :meth:`Cluster.close` terminates every process it
started (and only those), newest first; :meth:`Proc.kill` sends SIGKILL (a crash, for the
fault scenario; SIGTERM would let the pool drain its objects).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from mooncake.errors import MooncakeError

__all__ = ["Cluster", "EvalError", "Proc", "check_hot_path", "free_port"]

SHIM = '''"""CPU-only torch: answer torch.accelerator.current_device_index() with 0 (the CPU)."""
import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
'''

#: The compiled modules a run must load (flag names of ``mooncake._fast``).
HOT_PATH_FLAGS = ("COMPILED", "TCP_COMPILED", "COPYQ_COMPILED", "INTMAP_COMPILED")


class EvalError(MooncakeError):
    """A scenario could not be run (a process did not start, a check failed to run)."""


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def package_root() -> Path:
    """The directory ``mooncake`` is imported from (a checkout's root, or site-packages)."""
    import mooncake

    return Path(mooncake.__file__).resolve().parent.parent


def check_hot_path(python: str) -> dict[str, Any]:
    """Imports ``mooncake._fast`` in ``python`` with the children's ``PYTHONPATH`` and returns
    its flags; raises :class:`EvalError` when a flag of :data:`HOT_PATH_FLAGS` is False (the
    pure-Python twins would be measured)."""
    code = (
        "import json, mooncake, mooncake._fast as f; print(json.dumps({'file': mooncake.__file__,"
        + ", ".join(f"'{n}': bool(getattr(f, '{n}', False))" for n in HOT_PATH_FLAGS)
        + "}))"
    )
    env = dict(os.environ, PYTHONPATH=str(package_root()))
    env.pop("MOONCAKE_NO_EXTENSIONS", None)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise EvalError(f"{python} cannot import mooncake: {out.stderr.strip()[-800:]}")
    flags: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    missing = [n for n in HOT_PATH_FLAGS if not flags.get(n)]
    if missing:
        raise EvalError(
            f"{python} loads the pure-Python twins ({', '.join(missing)} false; mooncake from "
            f"{flags['file']}): build the extensions first "
            "(python setup.py build_ext --inplace) or install the package"
        )
    return flags


@dataclass
class Proc:
    """A child process and its log."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    _fh: IO[bytes] | None = None
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL (no drain, no goodbye)."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def wait_line(self, marker: str, timeout: float) -> str:
        """The first log line containing ``marker``; raises if the process dies or time runs out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in self.log.read_text(errors="replace").splitlines():
                if marker in line:
                    return line
            if not self.alive():
                raise EvalError(f"{self.name} exited (rc={self.popen.returncode}); see {self.log}")
            time.sleep(0.2)
        raise EvalError(f"{self.name} printed no {marker!r} in {timeout:.0f} s; see {self.log}")


@dataclass
class Cluster:
    """The processes of one scenario (see the module docstring)."""

    run_dir: Path
    python: str
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        shim = self.run_dir / "cpu_shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(SHIM)
        self.base_env = dict(os.environ)
        self.base_env.pop("MOONCAKE_NO_EXTENSIONS", None)
        self.base_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim), str(package_root()), os.environ.get("PYTHONPATH", "")) if p
        )
        self.base_env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self.base_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.base_env.setdefault("MOONCAKE_PROTOCOL", "tcp")

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.run_dir / "logs" / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 (closed by Proc.stop)
        popen = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env={**self.base_env, **(env or {})}
        )
        proc = Proc(name, popen, log, fh)
        self.procs.append(proc)
        return proc

    def master(self, name: str = "master", client_ttl: str | None = None) -> tuple[Proc, str, str]:
        """Our master with metrics (and ``--client-ttl`` when given: how soon a dead pool's
        segment is unmounted); returns it, its RPC address and its /metrics URL."""
        argv = [self.python, "-m", "mooncake", "master", "--rpc-port", "0", "--metrics-port", "0"]
        if client_ttl:
            argv += ["--client-ttl", client_ttl]
        proc = self.spawn(name, argv)
        line = proc.wait_line("rpc=", 120)
        rpc = line.split("rpc=", 1)[1].split()[0]
        metrics = line.split("metrics=", 1)[1].split()[0]
        return proc, rpc, f"http://{metrics}/metrics"

    def pool(self, master: str, segment: str, name: str = "pool") -> Proc:
        """The standalone store client that owns the pool (``mooncake_client``)."""
        proc = self.spawn(
            name,
            [
                self.python,
                "-m",
                "mooncake._cli.real_client",
                "--host=127.0.0.1",
                f"--port={free_port()}",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={master}",
                "--protocol=tcp",
                f"--global_segment_size={segment}",
            ],
        )
        proc.wait_line("mooncake_client: segment", 120)
        return proc

    def store_config(self, master: str, name: str = "mooncake.json") -> Path:
        """A vLLM ``MOONCAKE_CONFIG_PATH`` file: standalone-store mode (instances give no
        memory; the pool holds the KV and outlives them)."""
        path = self.run_dir / name
        path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "64mb",
                }
            )
        )
        return path

    def vllm(
        self,
        name: str,
        model: Path,
        *,
        kv_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        block_size: int = 16,
        max_model_len: int = 1024,
    ) -> tuple[Proc, str]:
        """vLLM's OpenAI server on the model directory; returns it and its base URL (not yet
        ready: see :meth:`wait_ready`)."""
        port = free_port()
        argv = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load-format",
            "safetensors",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--enable-prompt-tokens-details",
            *(extra or []),
        ]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        telemetry = self.run_dir / f"telemetry-{name}.jsonl"
        proc = self.spawn(
            name, argv, {"MOONCAKE_TRANSFER_TELEMETRY_LOG": str(telemetry), **(env or {})}
        )
        return proc, f"http://127.0.0.1:{port}"

    def wait_ready(self, proc: Proc, url: str, timeout: float = 900.0) -> float:
        """Polls ``url/health`` until 200; returns the seconds since ``proc`` was started."""
        t0 = proc.started
        while time.monotonic() - t0 < timeout:
            if not proc.alive():
                text = proc.log.read_text(errors="replace").replace("\0", "")
                errs = [ln.strip() for ln in text.splitlines() if "Error:" in ln][-3:]
                raise EvalError(
                    f"{proc.name} exited (rc={proc.popen.returncode}): {' | '.join(errs)}\n"
                    f"{text[-3000:]}"
                )
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise EvalError(f"{proc.name} not ready after {timeout:.0f} s; see {proc.log}")

    def close(self) -> None:
        """Stops every process this cluster started, newest first."""
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                print(f"[eval] stopping {proc.name}: {exc}", file=sys.stderr)
        self.procs.clear()
