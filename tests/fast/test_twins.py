"""Every pure-Python twin exports every name of its compiled module, and the package's one
backend switch picks what the environment asks for.

The names come from the compiled modules' ``.pyi`` stubs (read with ``ast``, so this runs where
nothing is built) and, where a module is built, from the module itself; class members are
compared too (a twin's ``ServeConn`` needs every method the compiled one has).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from mooncake import _fast

FAST = Path(_fast.__file__).parent
TWINS = [(compiled, twin) for compiled, (twin, _, _) in _fast.PUBLIC_API.items()]


def _stub_names(compiled: str) -> dict[str, set[str]]:
    """Top-level public names of ``compiled``'s stub, each with its public members (classes)."""
    tree = ast.parse((FAST / f"{compiled}.pyi").read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for n in node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(n.name)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    members.add(n.target.id)  # a data attribute (cdef readonly)
            out[node.name] = {
                m for m in members if not m.startswith("_") or m in ("__len__", "__iter__")
            }
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
    return {k: v for k, v in out.items() if not k.startswith("_")}


def _members(mod: ModuleType, cls: str) -> set[str]:
    """What instances of ``mod.cls`` have: class attributes plus the ``self.X = ...`` its
    methods assign (a pure class's data attributes live on the instance)."""
    names = set(dir(getattr(mod, cls)))
    src = Path(mod.__file__ or "")
    if src.suffix == ".py":
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    return names


def _compiled_or_none(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"mooncake._fast.{name}")
    except ImportError:
        return None


@pytest.mark.parametrize(("compiled", "twin"), TWINS)
def test_twin_has_every_name_of_the_stub(compiled: str, twin: str) -> None:
    names = _stub_names(compiled)
    assert names, f"{compiled}.pyi lists no public names"
    mod = importlib.import_module(f"mooncake._fast.{twin}")
    for name, members in names.items():
        assert hasattr(mod, name), f"twin {twin} lacks {name} (in {compiled}.pyi)"
        have = _members(mod, name) if members else set()
        for m in members:
            assert m in have, f"twin {twin}.{name} lacks {m} (in {compiled}.pyi)"


@pytest.mark.parametrize(("compiled", "twin"), TWINS)
def test_twin_has_every_name_of_the_compiled_module(compiled: str, twin: str) -> None:
    cmod = _compiled_or_none(compiled)
    if cmod is None:
        pytest.skip(f"{compiled} is not built")
    tmod = importlib.import_module(f"mooncake._fast.{twin}")
    public = {n for n in vars(cmod) if not n.startswith("_")}
    stub = _stub_names(compiled)
    missing_stub = public - set(stub)
    # what a compiled module exports beyond its stub is an import it made (os, array...)
    assert all(isinstance(getattr(cmod, n), ModuleType) or n in dir(tmod) for n in missing_stub), (
        f"{compiled} exports {sorted(missing_stub)} beyond its stub and {twin}"
    )
    for name in stub:
        assert hasattr(cmod, name), f"{compiled}.pyi lists {name}, the built module lacks it"
        if isinstance(getattr(cmod, name), type):
            cmembers = {m for m in dir(getattr(cmod, name)) if not m.startswith("_")}
            tmembers = _members(tmod, name)
            assert cmembers <= stub[name], f"{compiled}.pyi's {name} lacks {cmembers - stub[name]}"
            assert cmembers <= tmembers, f"{twin}.{name} lacks {sorted(cmembers - tmembers)}"


@pytest.mark.parametrize(("compiled", "twin"), TWINS)
def test_package_reexports_what_the_switch_picked(compiled: str, twin: str) -> None:
    _, flags, names = _fast.PUBLIC_API[compiled]
    cmod = _compiled_or_none(compiled)
    want = cmod if cmod is not None and not _fast.FORCED_PURE else None
    picked = want or importlib.import_module(f"mooncake._fast.{twin}")
    assert getattr(_fast, flags["COMPILED"]) is (want is not None)
    for flag, alias in flags.items():
        assert getattr(_fast, alias) == getattr(picked, flag), f"_fast.{alias} is not {flag}"
        assert alias in _fast.__all__
    assert set(names) <= set(_stub_names(compiled)), f"{compiled}: re-exports not in its stub"
    for name in names:
        assert getattr(_fast, name) is getattr(picked, name), f"_fast.{name} is not {picked}'s"
        assert name in _fast.__all__
