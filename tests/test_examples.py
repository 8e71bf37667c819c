"""Every program under examples/ runs as its own process and reports success."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_env

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_every_example_is_listed() -> None:
    listed = (ROOT / "examples" / "README.md").read_text()
    assert EXAMPLES, "examples/ has no programs"
    assert [e for e in EXAMPLES if f"`{e}`" not in listed] == []


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if name == "custom_policy.py":
        assert "LeakyLargestFirst: caught" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout + proc.stderr
    if name in ("asyncio_service.py", "prefill_decode.py"):
        # examples use only the public API to start their master
        assert "mooncake._store" not in (ROOT / "examples" / name).read_text()
