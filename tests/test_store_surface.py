"""The published ``mooncake.store`` surface (0.3.13, recorded in tests/data/published_surface.json
by scripts/dump_published_surface.py) exists here with compatible signatures.

Compatible: every published overload binds to our method with the published positional
arguments, with each named argument given by keyword, and with the published defaults left
out. The tensor methods come from the tensor family's module; until it is installed they are
reported apart (and must then be missing entirely: no stub answers for them).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

import mooncake.store as store
from mooncake.store import MooncakeDistributedStore

SURFACE = json.loads((Path(__file__).parent / "data" / "published_surface.json").read_text())
METHODS: dict[str, list[dict[str, Any]]] = SURFACE["store_methods"]
HAVE_TENSORS = any("tensor" in n for n in dir(MooncakeDistributedStore))
#: module names of other published modules (buffer pools, NoF registration)
ELSEWHERE = {
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "MooncakeDistributedNoFRegister",
    "ReadTarget",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
}


def _is_tensor(name: str) -> bool:
    return "tensor" in name


def _binds(fn: Any, params: list[list[Any]]) -> str | None:
    """Why the published overload ``params`` does not bind to ``fn`` (None if it does)."""
    sig = inspect.signature(fn)
    if any(kind != "positional" for _, kind, _, _ in params):
        return None  # the published (*args, **kwargs) overload accepts anything
    required = [p for p in params if not p[2]]
    try:
        sig.bind(*range(len(required)))
    except TypeError as e:
        return f"positional required args: {e}"
    try:
        sig.bind(*range(len(params)))
    except TypeError as e:
        return f"all positional args: {e}"
    named = {p[0]: 0 for p in params if not p[0].startswith("arg")}
    positional = [0 for p in params if p[0].startswith("arg")]
    try:
        sig.bind(*positional, **named)
    except TypeError as e:
        return f"keyword args {sorted(named)}: {e}"
    return None


def test_every_published_method_binds_with_the_published_arguments() -> None:
    problems = []
    s = MooncakeDistributedStore()
    for name, overloads in sorted(METHODS.items()):
        if name.startswith("_pybind11") or (_is_tensor(name) and not HAVE_TENSORS):
            continue
        fn = getattr(s, name, None)
        if fn is None:
            problems.append(f"{name}: missing")
            continue
        for ov in overloads:
            why = _binds(fn, ov["params"])
            if why is not None:
                problems.append(f"{name}: {why}")
    assert problems == []


def test_tensor_methods_exist_or_are_absent_not_stubbed() -> None:
    tensor = sorted(n for n in METHODS if _is_tensor(n))
    assert len(tensor) == 42
    present = [n for n in tensor if hasattr(MooncakeDistributedStore, n)]
    assert present in ([], tensor)  # all of the family or none of it
    s = MooncakeDistributedStore()
    for name in ("put_tensor", "no_such_session_call", "get_tensor_of_nothing"):
        if name not in present:
            with pytest.raises(AttributeError):
                getattr(s, name)
            assert getattr(s, name, None) is None  # feature probes are not fooled


def test_published_module_names_exist() -> None:
    missing = [n for n in SURFACE["store_module"] if n not in ELSEWHERE and not hasattr(store, n)]
    assert missing == []
    for cls, members in SURFACE["members"].items():
        obj = getattr(store, cls)
        if cls in ("TaskType", "TaskStatus"):
            members = [m for m in members if m not in ("name", "value")]
            assert all(hasattr(obj, m) for m in members), cls
            continue
        inst = obj() if cls not in ("ReplicaDescriptor", "Descriptor", "MemoryDescriptor") else None
        target = inst if inst is not None else obj
        assert [m for m in members if not hasattr(target, m)] == [], cls


def test_no_method_answers_for_unpublished_names() -> None:
    ours = {n for n in dir(MooncakeDistributedStore) if not n.startswith("__")}
    published = set(METHODS)
    # our documented extensions: get_engine (what setup(engine=...) takes) and the metrics an
    # embedding server adds to its own exporter (docs/metrics.md), and drain (what SIGTERM
    # runs before exiting: docs/store.md "Graceful drain")
    extensions = {"get_engine", "metrics_registry", "serve_metrics", "drain"}
    extra = sorted(n for n in ours - published if not n.startswith("_") and n not in extensions)
    assert extra == []


def test_module_helpers_behave() -> None:
    import ctypes
    import os

    a = store.MooncakeHostMemAllocator()
    p = a.alloc(10_000)
    assert p % 4096 == 0
    ctypes.memmove(p, b"abc", 3)
    assert ctypes.string_at(p, 3) == b"abc"
    assert a.free(p) == 0 and a.free(p) == -1 and a.alloc(0) == 0
    with pytest.raises(TypeError):
        a.alloc("1")  # type: ignore[arg-type]
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(store.get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(store.get_free_func_addr())
    q = malloc(64)
    assert q
    free(q)
    before = os.sched_getaffinity(0)
    try:
        store.bind_to_numa_node(0)
        node0 = Path("/sys/devices/system/node/node0/cpulist")
        if node0.exists():
            cpus: set[int] = set()
            for part in node0.read_text().strip().split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            assert os.sched_getaffinity(0) == cpus
        store.bind_to_numa_node(4096)  # no such node: a warning, nothing else
    finally:
        os.sched_setaffinity(0, before)
    assert (
        store.PENDING == store.TaskStatus.PENDING
        and store.REPLICA_MOVE == store.TaskType.REPLICA_MOVE
    )
    ax, tp = store.ParallelAxis(), store.TensorParallelism()
    assert (ax.rank, ax.size, tp.axes) == (0, 1, [])


def test_init_all_is_setup_with_the_published_arguments() -> None:
    s = MooncakeDistributedStore()
    seen: list[tuple[Any, ...]] = []
    s.setup = lambda *a, **k: seen.append(a) or 0  # type: ignore[method-assign]
    assert s.init_all("tcp", "mlx5_0") == 0
    assert seen == [
        ("localhost:12345", "127.0.0.1:2379", 16 << 20, 1 << 30, "tcp", "mlx5_0", "127.0.0.1:50051")
    ]
