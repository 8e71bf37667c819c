"""vLLM's, SGLang's and LMCache's own Mooncake code on our package (opt-in; marker ``integration``).

The checks are the scripts under ``tests/integration/`` (``<integration>_<check>.py``; their
docstrings say what each drives, what is stubbed and why), each run with the python of its own
venv, built by ``scripts/integration-<integration>.sh``. They run when ``MOONCAKE_INTEGRATION=1``
and that venv exists (``MOONCAKE_<INTEGRATION>_VENV`` overrides where); each takes from seconds
to minutes on two cores, so the default suite skips them with the reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

CHECKS = {
    "vllm": ("vLLM", ["store_reuse", "pd_disagg"], 1200),
    "sglang": ("SGLang", ["hicache", "pd"], 900),
    "lmcache": ("LMCache", ["store", "channel"], 900),
}


def _venv(integration: str) -> Path:
    default = Path.home() / f".cache/mooncake-{integration}-venv"
    return Path(os.environ.get(f"MOONCAKE_{integration.upper()}_VENV", default))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    ("integration", "check"),
    [(i, c) for i, (_, checks, _) in CHECKS.items() for c in checks],
)
def test_integration(integration: str, check: str) -> None:
    name, _, timeout = CHECKS[integration]
    script = f"scripts/integration-{integration}.sh"
    if os.environ.get("MOONCAKE_INTEGRATION") != "1":
        pytest.skip(f"{name} integration checks are opt-in: MOONCAKE_INTEGRATION=1 (or {script})")
    python = _venv(integration) / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {name} venv at {python.parent.parent}: build it with {script}")
    proc = subprocess.run(
        [str(python), str(ROOT / "tests/integration" / f"{integration}_{check}.py")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("OK")
