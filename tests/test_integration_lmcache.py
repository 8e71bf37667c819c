"""LMCache's own Mooncake store connector and Mooncake transfer channel on our package (opt-in).

The checks are ``tests/integration/lmcache_store.py`` and ``tests/integration/lmcache_channel.py``
(see their docstrings: nothing of LMCache is stubbed; the store check makes our
``setup(dict)`` answer ``TypeError`` for its data path, and says why); this module runs them when
``MOONCAKE_INTEGRATION=1`` and the venv built by ``scripts/integration-lmcache.sh`` exists.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

VENV = Path(os.environ.get("MOONCAKE_LMCACHE_VENV", Path.home() / ".cache/mooncake-lmcache-venv"))

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MOONCAKE_INTEGRATION") != "1",
        reason="LMCache integration checks are opt-in: MOONCAKE_INTEGRATION=1 "
        "(or run scripts/integration-lmcache.sh)",
    ),
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists(),
        reason=f"no LMCache venv at {VENV}: build it with scripts/integration-lmcache.sh",
    ),
]


@pytest.mark.parametrize("check", ["store", "channel"])
def test_lmcache(check: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), str(ROOT / "tests/integration" / f"lmcache_{check}.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("OK")
