"""A child process driven one JSON object per line: the harness of the multi-process tests.

The child prints one JSON object when it is ready (its segment name and whatever else the test
needs), then answers each command line with one JSON line. Closing stdin asks it to exit; a
child that does not within ``close_timeout`` seconds is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (our package, not an installed one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class LineDriver:
    """Start ``argv``, read its ready line into :attr:`info`; :meth:`cmd` sends one command."""

    def __init__(
        self, argv: Sequence[str], *, what: str, close_timeout: float = 10.0, check_ok: bool = True
    ) -> None:
        self.what = what
        self.close_timeout = close_timeout
        self.check_ok = check_ok
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} did not start (see its stderr above)")
        self.info: dict[str, Any] = json.loads(line)
        self.segment: str = self.info["segment"]

    def cmd(self, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"{self.what} died"
        out: dict[str, Any] = json.loads(line)
        if self.check_ok:
            assert out.get("ok"), out
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(self.close_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
