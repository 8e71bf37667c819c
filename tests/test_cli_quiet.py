"""CLI servers end ordinary events (Ctrl-C, a busy port, a bad flag) with one line, no traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mooncake._sync import LoopThread
from mooncake.testing import local_master_server
from tests.conftest import ROOT, clean_env
from tests.services import free_port

PY = sys.executable


def _script(entry: str) -> list[str]:
    """The console script ``module:function`` as a command line (this checkout's code)."""
    module, fn = entry.split(":")
    return [PY, "-c", f"import sys; from {module} import {fn} as f; sys.exit(f())"]


MASTER = _script("mooncake._cli.master:gflags_main")
HTTP_METADATA = _script("mooncake._cli.published:http_metadata_server_main")
BENCH = _script("mooncake._cli.published:transfer_engine_bench_main")


_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(), cwd=str(ROOT), timeout=timeout
    )


def _lines(text: str) -> list[str]:
    """stderr without the servers' INFO log lines."""
    return [ln for ln in text.splitlines() if ln.strip() and " INFO " not in ln]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(
    "argv",
    [
        [PY, "-m", "mooncake", "master", "--rpc-port", "0", "--metrics-port", "0"],
        [PY, "-m", "mooncake", "metadata-server", "--port", "0"],
        [*MASTER, "--rpc_port=@", "--metrics_port=0"],
        [*HTTP_METADATA, "--port", "0"],
    ],
    ids=["mooncake-master", "metadata-server", "mooncake_master", "http_metadata_server"],
)
def test_ctrl_c_exits_quietly(argv: list[str]) -> None:
    argv = [a.replace("@", str(free_port())) for a in argv]
    # A terminal's Ctrl-C meets a process whose SIGINT is the default; a suite started in the
    # background of a non-interactive shell hands its children SIGINT *ignored* (POSIX), and an
    # ignored SIGINT stays ignored across exec, so the server is started with it reset
    with subprocess.Popen(
        [PY, "-c", _SIGINT_DEFAULT, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # printed once every port is bound
            assert first, "the server did not start"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]


@pytest.mark.parametrize(
    "argv",
    [
        [PY, "-m", "mooncake", "master", "--rpc-port", "@", "--no-metrics"],
        [*MASTER, "--rpc_port=@", "--enable_metric_reporting=false"],
        [PY, "-m", "mooncake", "metadata-server", "--port", "@"],
        [*HTTP_METADATA, "--port", "@"],
    ],
    ids=["mooncake-master", "mooncake_master", "metadata-server", "http_metadata_server"],
)
def test_port_in_use_is_one_line(argv: list[str], busy_port: int) -> None:
    proc = _run([a.replace("@", str(busy_port)) for a in argv])
    assert proc.returncode == 1
    (line,) = _lines(proc.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line


@pytest.mark.parametrize(
    "argv",
    [
        [PY, "-m", "mooncake", "master", "--rpc-port", "70000"],
        [PY, "-m", "mooncake", "metadata-server", "--port", "70000"],
        [*MASTER, "--rpc_port=70000"],
    ],
    ids=["mooncake-master", "metadata-server", "mooncake_master"],
)
def test_port_out_of_range_is_refused(argv: list[str]) -> None:
    proc = _run(argv)
    assert proc.returncode == 2
    assert "70000 is out of range" in proc.stderr and "Traceback" not in proc.stderr


def test_gflags_typo_is_refused_with_the_nearest_flag() -> None:
    proc = _run([*MASTER, "--rpc_prot=5"])
    assert proc.returncode == 2
    (line,) = _lines(proc.stderr)
    assert "unknown flag --rpc_prot" in line and "--rpc_port" in line
    assert "mooncake master: rpc=" not in proc.stdout  # it did not come up on the defaults


def test_gflags_help_gives_meaning_and_default() -> None:
    proc = _run([*MASTER, "--help"])
    assert proc.returncode == 0
    out = proc.stdout
    i = out.index("--rpc_port (")
    assert "default: 0" in out[i : i + 80]
    assert "Port for RPC server" in out[i : i + 300]


def test_bench_help() -> None:
    proc = _run([*BENCH, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--block_size (default: 65536)" in proc.stdout and "unknown flag" not in proc.stderr


def test_version() -> None:
    proc = _run([PY, "-m", "mooncake", "--version"])
    assert proc.returncode == 0 and proc.stdout.startswith("mooncake 0.")


def test_bench_lists_only_what_exists() -> None:
    proc = _run([PY, "-m", "mooncake", "bench", "--help"])
    assert proc.returncode == 0 and "transfer" in proc.stdout and "store" not in proc.stdout


def test_demo_bad_transport_is_one_line() -> None:
    proc = _run([PY, "-m", "mooncake", "demo", "--transport", "bogus", "--seconds", "0.01"])
    assert proc.returncode == 2
    (line,) = _lines(proc.stderr)
    assert "transport 'bogus' is not installed" in line


def test_top_on_the_rpc_port_hints_at_the_metrics_port() -> None:
    loop = LoopThread(name="test-master")
    try:
        server = loop.enter(local_master_server())
        proc = _run([PY, "-m", "mooncake", "top", f"127.0.0.1:{server.rpc_port}", "--once"])
    finally:
        loop.close()
    assert proc.returncode == 1
    assert "metrics port" in proc.stderr and "RPC port" in proc.stderr


def test_master_logging_keeps_httpx_requests_at_debug() -> None:
    import logging

    from mooncake._cli.master import _setup_logging

    loggers = [logging.getLogger(n) for n in ("httpx", "httpcore")]
    saved = [lg.level for lg in loggers]
    try:
        _setup_logging("INFO")  # an HA master's etcd requests would be lines every second
        assert all(not lg.isEnabledFor(logging.INFO) for lg in loggers)
        _setup_logging("DEBUG")
        assert all(lg.isEnabledFor(logging.DEBUG) for lg in loggers)
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)
