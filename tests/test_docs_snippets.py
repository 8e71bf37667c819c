"""Every ```python block of README.md and docs/*.md runs as written, in a fresh interpreter.

Conventions a block may use (comment lines anywhere in it):

* ``# needs: gpu`` / ``# needs: rdma``: hardware this machine may lack; the block is skipped,
  with that reason, unless ``MOONCAKE_DOCS_GPU=1`` / ``MOONCAKE_DOCS_RDMA=1`` says it is there.
* ``# setup: master``: the test starts a store master first and passes its address in
  ``MOONCAKE_MASTER`` (a block reads it with ``os.environ.get("MOONCAKE_MASTER",
  "127.0.0.1:50051")``, so as written it talks to ``mooncake master``'s default address).

Anything else a block needs it starts itself (``mooncake.testing.local_master``, a second
engine in the same block).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake._sync import LoopThread
from mooncake.testing import local_master
from tests.conftest import ROOT, clean_env

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NEEDS = re.compile(r"^\s*# needs: *([a-z, ]+)$", re.M)
_SETUP = re.compile(r"^\s*# setup: *([a-z, ]+)$", re.M)
_HARDWARE = {"gpu": "MOONCAKE_DOCS_GPU", "rdma": "MOONCAKE_DOCS_RDMA"}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    out = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = _blocks()


def _words(pattern: re.Pattern[str], code: str) -> set[str]:
    return {w.strip() for m in pattern.finditer(code) for w in m.group(1).split(",") if w.strip()}


def test_the_docs_have_snippets() -> None:
    # the harness never passes vacuously: the pages it reads hold python blocks
    assert len(BLOCKS) >= 15, [name for name, _ in BLOCKS]
    assert any(name.startswith("README.md") for name, _ in BLOCKS)


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    loop = LoopThread(name="docs-master")
    try:
        yield loop.enter(local_master())
    finally:
        loop.close()


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_snippet_runs(name: str, code: str, request: pytest.FixtureRequest) -> None:
    for need in sorted(_words(_NEEDS, code)):
        var = _HARDWARE.get(need)
        if var is None:
            pytest.fail(f"{name}: unknown '# needs: {need}' (known: {sorted(_HARDWARE)})")
        if os.environ.get(var) != "1":
            pytest.skip(f"{name} needs {need} hardware (set {var}=1 where it is present)")
    env = clean_env()
    setups = _words(_SETUP, code)
    unknown = setups - {"master"}
    assert not unknown, f"{name}: unknown '# setup:' {sorted(unknown)}"
    if "master" in setups:
        env["MOONCAKE_MASTER"] = request.getfixturevalue("master")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=240,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
