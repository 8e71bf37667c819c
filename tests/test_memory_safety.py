"""No memory touched after ``unregister`` returns, under random interleavings, or the test dies.

``tests/helpers/stress_victim.py`` (a child process, so a crash is observed rather than
suffered) drives random transfer / unregister / close / peer-SIGKILL rounds over the local,
shm (memfd and process_vm) and tcp paths, against buffers that are ``mprotect(PROT_NONE)``'d
or overwritten by a fresh sentinel mapping the moment ``unregister`` returns. A late access from
the victim's own threads kills it with SIGSEGV; a late write from a peer (process_vm, a TCP
server thread) changes a sentinel byte. The deterministic versions of each path are in
``tests/test_pinning.py`` and ``tests/test_shm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake._engine.transports.shm import available
from tests.conftest import clean_env

VICTIM = Path(__file__).parent / "helpers" / "stress_victim.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason="shm needs Linux (AF_UNIX, memfd_create, /proc)"),
]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_interleavings_touch_nothing_after_unregister(seed: int) -> None:
    try:
        out = subprocess.run(
            [sys.executable, str(VICTIM), "--seed", str(seed), "--iters", "30"],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=280,  # a hang guard (a close that never returns used to be one way to fail)
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the victim hung (seed {seed}): {e.stderr!r:.2000}")
    assert out.returncode >= 0, f"victim killed by signal {-out.returncode}: {out.stderr[-3000:]}"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["damage"] == []
    stats = report["stats"]
    # the round actually exercised what it names
    assert stats["unregistered"] > 0 and stats["local"] > 0
    assert stats["shm"] > 0 and stats["tcp"] > 0
