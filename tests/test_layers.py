"""The package's layering: floors, import circles, no event loop in the sans-I/O core.

The import graph is read from the source (``ast`` for ``.py``, the import lines of ``.pyx`` and
``.pxd``), counting every import of a ``mooncake`` module: at the top, under
``TYPE_CHECKING``, and lazy ones inside functions. Imports by name at run time
(``importlib.import_module`` of a string) are not seen.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT, clean_env

PKG = ROOT / "mooncake"

#: The floor of each room (a top-level module or subpackage of ``mooncake``; ``mooncake``
#: itself is ``__init__``). An import may stay on its floor or go down, never up.
FLOORS: dict[str, int] = {
    # 1: leaves
    "errors": 1,
    "buffer_pool": 1,
    "_miss": 1,
    "_fast_copy": 1,
    # 2: C primitives and thread/loop helpers
    "_fast": 2,
    "_sync": 2,
    "_groups": 2,
    "_unsupported": 2,
    "_nof_cli": 2,
    "_restserver": 2,
    # 3: the sans-I/O core
    "_core": 3,
    # 4: the engine's drivers, trace replay
    "_engine": 4,
    "replay": 4,
    # 5: the store's drivers, the engine facade, test tools
    "_store": 5,
    "engine": 5,
    "testing": 5,
    # 6: the published facades
    "store": 6,
    "__init__": 6,
    "policies": 6,
    "allocator": 6,
    "mooncake_config": 6,
    "http_metadata_server": 6,
    "kv_events": 6,
    "ep": 6,
    "pg": 6,
    "mooncake_ep_buffer": 6,
    "mooncake_elastic_buffer": 6,
    "mooncake_ssd_register": 6,
    "mooncake_ssd_unregister": 6,
    "shared_segment": 6,
    # 7: tools and layers over the sync store
    "_cli": 7,
    "_eval": 7,
    "async_store": 7,
    "_structured": 7,
    "structured_object_store": 7,
    "dataproto_catalog": 7,
    "transfer_engine_topology_dump": 7,
    "vllm_v1_proxy_server": 7,
    "mooncake_store_service": 7,
    "_store_service_http": 7,
    # 8: entry points
    "__main__": 8,
    "cli": 8,
    "cli_client": 8,
    "cli_bench": 8,
}

#: Modules whose floor is not their room's: they sit in a lower room but are built on a facade.
MODULE_FLOORS: dict[str, int] = {
    # the Python half of the C ABI drives mooncake.engine.TransferEngine (floor 5)
    "mooncake._engine.cabi": 6,
}

#: Import circles still to be cut, each as the set of its modules. Nothing else may form one.
ALLOWED_CIRCLES: set[frozenset[str]] = {
    # the compiled CUDA runtime imports check()/driver_address_range() from the Python module
    # that loads it lazily (seen only when reading the .pyx)
    frozenset({"mooncake._fast.cuda", "mooncake._fast._cuda"}),
}

_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+(mooncake[\w.]*)\s+c?import\s+(.*)|c?import\s+(mooncake[\w.]*))"
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for ext in ("py", "pyx", "pxd"):
        for p in sorted(PKG.rglob(f"*.{ext}")):
            mods.setdefault(_module_name(p), p)
    return mods


def _imported(path: Path, name: str) -> Iterator[tuple[str, list[str]]]:
    """(module, names imported from it) for every import in the file ``path`` (module
    ``name``); relative imports resolved."""
    if path.suffix != ".py":
        for line in path.read_text().splitlines():
            m = _CYTHON_IMPORT.match(line)
            if m and m.group(1):
                names = [n.strip() for n in m.group(2).strip("( ").split(",")]
                yield m.group(1), [n.split(" as ")[0] for n in names if n]
            elif m:
                yield m.group(3), []
        return
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            yield base, [a.name for a in node.names]


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the ``mooncake`` modules it imports (a ``from pkg import sub`` of a submodule
    counts as importing ``pkg.sub``; a name below a module counts as the module). Cached:
    callers must not change it."""
    mods = _modules()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for base, names in _imported(path, name):
            if base != "mooncake" and not base.startswith("mooncake."):
                continue
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
            targets = subs if subs and len(subs) == len(names) else [*subs, base]
            out.update(t for t in map(resolve, targets) if t is not None)
        out.discard(name)
        graph[name] = out
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(module: str) -> int:
    return MODULE_FLOORS.get(module) or FLOORS[_room(module)]


def test_tarjan_finds_circles() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert circles(g) == {frozenset("abc"), frozenset("de")}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_the_graph_counts_type_checking_and_lazy_imports() -> None:
    g = import_graph()
    # under TYPE_CHECKING (mooncake/errors.py) and inside a function (transports/__init__.py)
    assert "mooncake._miss" in g["mooncake.errors"]
    assert "mooncake._engine.transports.shm" in g["mooncake._engine.transports"]
    # a Cython module's imports
    assert "mooncake.errors" in g["mooncake._fast._verbs_qp"]
    assert "mooncake._fast._verbs_lib" in g["mooncake._fast._verbs_qp"]  # a cimport


def test_import_circles_are_only_the_known_ones() -> None:
    found = circles(import_graph())
    for c in sorted(found, key=sorted):
        print("import circle:", " <-> ".join(sorted(c)))
    assert found == ALLOWED_CIRCLES, (
        f"new circles: {[sorted(c) for c in found - ALLOWED_CIRCLES]}; "
        f"cut (drop from ALLOWED_CIRCLES): {[sorted(c) for c in ALLOWED_CIRCLES - found]}"
    )


def test_no_import_goes_up_a_floor() -> None:
    graph = import_graph()
    rooms = {_room(m) for m in graph}
    assert rooms <= FLOORS.keys(), f"rooms without a floor: {sorted(rooms - FLOORS.keys())}"
    up = sorted(
        f"{m} (floor {_floor(m)}) -> {t} (floor {_floor(t)})"
        for m, targets in graph.items()
        for t in targets
        if _floor(t) > _floor(m)
    )
    assert not up, "imports going up a floor:\n" + "\n".join(up)


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


def test_ha_and_the_rpc_threads_never_import_the_server() -> None:
    """The server imports its HA node and RPC threads; they reach it only through the
    protocols of ``_store/ha_base.py`` and ``_store/rpc_thread.py`` (the circle test says
    the same only while the server imports every one of them)."""
    graph = import_graph()
    server = "mooncake._store.master"
    below = [
        "mooncake._store.ha",
        "mooncake._store.ha_base",
        "mooncake._store.ha_etcd",
        "mooncake._store.ha_memory",
        "mooncake._store.ha_probe",
        "mooncake._store.ha_stream",
        "mooncake._store.rpc_thread",
        "mooncake._core.commitlog",
    ]
    for m in below:
        assert server not in graph[m], f"{m} imports the master server"
    assert "mooncake._store.ha" in graph[server] and "mooncake._store.rpc_thread" in graph[server]
    assert "mooncake._store.ha" not in graph["mooncake._store.ha_stream"]


#: The most lines a class (``end_lineno - lineno + 1``) and a module may have.
MAX_CLASS_LINES = 600
MAX_MODULE_LINES = 800

#: What is still over, with its size now: an entry may only shrink, and goes once it fits
#: (module paths relative to ``mooncake/``; classes as ``path:Class``).
OVERSIZED: dict[str, int] = {}


def _sizes() -> dict[str, int]:
    """Lines of every ``.py`` module of the package and of every class in it."""
    out: dict[str, int] = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        src = p.read_text()
        out[rel] = len(src.splitlines())
        for node in ast.walk(ast.parse(src, str(p))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                out[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_class_or_module_is_too_large() -> None:
    sizes = _sizes()

    def limit(name: str) -> int:
        return MAX_CLASS_LINES if ":" in name else MAX_MODULE_LINES

    over = {n: k for n, k in sizes.items() if k > limit(n)}
    new = sorted(
        f"{n}: {k} lines (at most {limit(n)})" for n, k in over.items() if n not in OVERSIZED
    )
    grown = sorted(
        f"{n}: {over[n]} lines, was {OVERSIZED[n]}"
        for n in over.keys() & OVERSIZED.keys()
        if over[n] > OVERSIZED[n]
    )
    fits = sorted(n for n in OVERSIZED if n not in over)
    assert not new, "too large (split by responsibility):\n" + "\n".join(new)
    assert not grown, "an oversized file or class grew:\n" + "\n".join(grown)
    assert not fits, f"now within the limits: drop from OVERSIZED: {fits}"


def test_the_size_check_sees_classes_and_modules() -> None:
    sizes = _sizes()
    assert sizes["_engine/engine.py"] > 100
    assert 100 < sizes["_engine/engine.py:Engine"] < sizes["_engine/engine.py"]
    assert "errors.py" in sizes
