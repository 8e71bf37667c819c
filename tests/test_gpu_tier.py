"""GPU tier check (benchmarks/gpu_tier_check.py) as a test: runs only where cupy sees a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gpu_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (the [cuda] extra)"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # cupy's own runtime errors when no driver is loaded
        return f"no usable CUDA device ({e})"
    return ""


REASON = _gpu_reason()


@pytest.mark.gpu
@pytest.mark.skipif(bool(REASON), reason=REASON or "gpu present")
def test_gpu_tier_check_passes(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_tier_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "report.json"
    assert gpu_tier_check.main(["--mib", "16", "--objects", "4", "--json", str(out)]) == 0
    assert '"store"' in out.read_text()


def test_gpu_check_without_gpu_skips_cleanly(tmp_path: Path) -> None:
    """Where there is no GPU the script reports a skip with the reason and exits 0."""
    if not REASON:
        pytest.skip("a GPU is present: the real check runs instead")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_tier_check
    finally:
        sys.path.pop(0)
    out = tmp_path / "report.json"
    assert gpu_tier_check.main(["--json", str(out)]) == 0
    assert '"skipped"' in out.read_text()
