"""A pytest plugin that tells which test files run code with a compiled twin.

``MOONCAKE_NO_EXTENSIONS=1 python -m pytest -p tests.helpers.twinprobe tests/test_x.py`` counts,
per test file, the calls into ``mooncake/_fast/*.py`` (the pure-Python twins and their loaders)
made in this process and prints them at the end. A file with none is a candidate for the
``twin_independent`` marker (docs/testing.md); child processes are not counted, so a test that
starts engines or masters in children depends on the twins whatever this says.
"""

from __future__ import annotations

import collections
import sys
import threading
from types import FrameType
from typing import Any

import pytest

_hits: collections.Counter[tuple[str, str]] = collections.Counter()
_current: list[str] = [""]


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and _current[0] and "/mooncake/_fast/" in frame.f_code.co_filename:
        _hits[(_current[0], frame.f_code.co_filename.rsplit("/", 1)[1])] += 1


def pytest_sessionstart(session: pytest.Session) -> None:
    sys.setprofile(_profile)
    threading.setprofile(_profile)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[0] = item.path.name


def pytest_sessionfinish(session: pytest.Session) -> None:
    sys.setprofile(None)
    threading.setprofile(None)
    per_file: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (test_file, twin), n in sorted(_hits.items()):
        per_file[test_file][twin] = n
    print("\ncalls into mooncake/_fast per test file:", dict(per_file) or "none")
