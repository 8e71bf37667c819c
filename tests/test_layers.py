"""The sans-I/O core never imports an event loop; the package imports without optional deps."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, clean_env


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        env=clean_env(),
        cwd=str(ROOT),
    ).stdout
    return set(out.split())


def test_core_imports_no_event_loop() -> None:
    import pkgutil

    import mooncake._core as core

    mods = [
        f"mooncake._core.{m.name}"
        for m in pkgutil.walk_packages(core.__path__)
        if not m.name.startswith("_")
    ]
    code = "\n".join(f"import {m}" for m in ["mooncake._core", *mods])
    loaded = _imported_after(code)
    for loop in ("anyio", "trio", "asyncio"):
        assert loop not in loaded, f"{loop} imported by the sans-I/O core"


def test_import_mooncake_is_light() -> None:
    loaded = _imported_after("import mooncake, mooncake.errors")
    assert "trio" not in loaded and "mooncake._engine.engine" not in loaded


def test_fast_twins_expose_the_same_names() -> None:
    from mooncake._fast import _pure

    try:
        from mooncake._fast import _io
    except ImportError:
        import pytest

        pytest.skip("compiled extension not built")
    public = {n for n in dir(_pure) if not n.startswith("_") and callable(getattr(_pure, n))}
    for name in public - {"Sequence"}:
        assert hasattr(_io, name), f"compiled _io lacks {name}"
