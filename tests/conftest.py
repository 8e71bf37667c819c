"""Shared fixtures: the anyio backend (trio is the reference), peer processes, the anchor venv;
the suite's Hypothesis profile and the ``exclusive`` marker (see docs/testing.md)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent

# No per-example deadline and no "too slow" health check: a loaded machine (parallel workers, a
# CPU hog beside the suite) must not fail a property that holds. Explicit ``@settings`` keep
# their example counts and inherit these. HYPOTHESIS_PROFILE=thorough runs 10x more examples
# where a test does not pin its own count.
settings.register_profile(
    "mooncake", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("thorough", parent=settings.get_profile("mooncake"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mooncake"))


@pytest.fixture(autouse=True)
def _machine_share(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``exclusive`` runs while no other worker runs a test:
    it takes an exclusive lock on a file shared by the session's workers, every other test a
    shared one. Without xdist this does nothing."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        yield
        return
    lock_path = tmp_path_factory.getbasetemp().parent / "machine.lock"
    exclusive = request.node.get_closest_marker("exclusive") is not None
    with open(lock_path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def clean_env(**extra: str) -> dict[str, str]:
    """Environment for child processes of *our* package (repo root importable)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.update(extra)
    return env


class PeerProc:
    """An engine in a child process (``python -m mooncake._cli._peer``), driven line by line."""

    def __init__(self, size: int = 16 << 20, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake._cli._peer", "--size", str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env or clean_env(),
            cwd=str(ROOT),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "peer engine did not start"
        info = json.loads(line)
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]
        self.size: int = info["size"]

    def cmd(self, **c: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(c) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "peer engine died"
        out: dict[str, Any] = json.loads(line)
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd(op="quit")
                self.proc.wait(timeout=10)
            except (AssertionError, OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def peer() -> Iterator[PeerProc]:
    p = PeerProc(size=80 << 20)
    try:
        yield p
    finally:
        p.close()


def anchor_python() -> str | None:
    """The published wheel's venv python, if installed (see shared/anchor/setup.sh)."""
    for cand in (
        os.environ.get("MOONCAKE_ANCHOR_PYTHON", ""),
        os.path.join(
            os.environ.get(
                "MOONCAKE_ANCHOR_VENV", os.path.expanduser("~/.cache/mooncake-anchor-venv")
            ),
            "bin",
            "python",
        ),
        "/opt/anchor-venv/bin/python",
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _settle_after_each_call() -> None:
    """Drive every ``MasterState`` the tests build as the master server does: after each
    top-level call (one command), the objects it touched settle back into cold rows of the
    object table (``MasterState.settle``). Without this, tests that call the state directly
    would keep every object in its hot form and never exercise the compact one."""
    import functools

    from mooncake._core.master import MasterState

    depth = [0]

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(self: MasterState, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.settle()

        return call

    for name in dir(MasterState):
        if name.startswith("_") or name in ("settle", "restore", "snapshot", "check_invariants"):
            continue
        attr = getattr(MasterState, name)
        if callable(attr) and not isinstance(attr, type):
            setattr(MasterState, name, wrap(attr))


_settle_after_each_call()
