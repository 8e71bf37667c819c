"""The command line: ``mooncake demo`` moves verified bytes between two processes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, clean_env


def test_demo_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mooncake", "demo", "--seconds", "0.02", "--json"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["initiator"] != out["target"]
    assert out["transport"] in ("shm", "tcp")
    rows = out["results"]
    assert {r["op"] for r in rows} == {"read", "write"}
    assert all(r["verified"] and r["calls"] >= 3 and r["gbps"] > 0 for r in rows)


def test_help_lists_commands() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mooncake", "--help"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0 and "demo" in proc.stdout
