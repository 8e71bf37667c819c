"""``scripts/run_upstream_tests.py`` runs one of upstream's own test files against this package
(needs a git directory of kvcache-ai/Mooncake: ``MOONCAKE_UPSTREAM_GIT`` or the mirror path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = os.environ.get("MOONCAKE_UPSTREAM_GIT", "/work/.mirror/kvcache-ai+Mooncake/repo")


@pytest.mark.skipif(not Path(MIRROR).is_dir(), reason="no git directory of upstream Mooncake")
def test_runner_counts_an_upstream_file(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "run_upstream_tests.py"),
            "--mirror",
            MIRROR,
            "-k",
            "test_import_structure",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mooncake-wheel/tests/test_import_structure.py: 3/3 passed" in proc.stdout
    results = json.loads(out.read_text())
    assert len(results) == 3 and {r["outcome"] for r in results} == {"passed"}
    assert "total: 3 passed=3 failed=0 error=0 skipped=0" in proc.stdout
