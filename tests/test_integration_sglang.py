"""SGLang's own Mooncake HiCache backend and PD transfer wrapper on our package (opt-in).

The checks are ``tests/integration/sglang_hicache.py`` and ``tests/integration/sglang_pd.py``
(see their docstrings, and ``sglang_stubs.py`` for what is stubbed); this module runs them when
``MOONCAKE_INTEGRATION=1`` and the venv built by ``scripts/integration-sglang.sh`` exists.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

VENV = Path(os.environ.get("MOONCAKE_SGLANG_VENV", Path.home() / ".cache/mooncake-sglang-venv"))

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MOONCAKE_INTEGRATION") != "1",
        reason="SGLang integration checks are opt-in: MOONCAKE_INTEGRATION=1 "
        "(or run scripts/integration-sglang.sh)",
    ),
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists(),
        reason=f"no SGLang venv at {VENV}: build it with scripts/integration-sglang.sh",
    ),
]


@pytest.mark.parametrize("check", ["hicache", "pd"])
def test_sglang(check: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), str(ROOT / "tests/integration" / f"sglang_{check}.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("OK")
