#!/usr/bin/env python3
"""Write the published ``mooncake.store`` / ``mooncake.engine`` surface as JSON.

Run with the published wheel's interpreter (``scripts/anchor-venv.sh`` builds one)::

    $ANCHOR/bin/python scripts/dump_published_surface.py > tests/data/published_surface.json

For each class method: its overloads as parameter lists ``[name, kind, has_default,
default]`` read from the pybind11 signatures in the docstrings (``kind``: ``positional`` or
``var_positional`` / ``var_keyword``); module-level names; the members of the value types.
``tests/test_store_surface.py`` checks this package against the file without the wheel.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from importlib import metadata
from typing import Any

SIG = re.compile(r"^(?:\d+\.\s*)?(\w+)\((.*)\)(?:\s*->\s*(.*))?$")


def _split(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _params(args: str) -> list[list[Any]]:
    params = []
    for a in _split(args):
        if a.startswith("self"):
            continue
        if a.startswith("**"):
            params.append([a[2:], "var_keyword", False, None])
            continue
        if a.startswith("*"):
            params.append([a[1:], "var_positional", False, None])
            continue
        name, _, rest = a.partition(":")
        default = None
        has_default = "=" in rest
        if has_default:
            default = rest.split("=", 1)[1].strip()
        params.append([name.strip(), "positional", has_default, default])
    return params


def overloads(obj: Any, name: str) -> list[dict[str, Any]]:
    out = []
    for line in (getattr(obj, "__doc__", None) or "").splitlines():
        m = SIG.match(line.strip())
        if m and m.group(1) == name:
            out.append({"params": _params(m.group(2)), "returns": (m.group(3) or "").strip()})
    return out


def dump_class(cls: type) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for n, obj in inspect.getmembers(cls):
        if n.startswith("__") or not callable(obj) or inspect.isclass(obj):
            continue
        methods[n] = overloads(obj, n)
    return methods


def main() -> None:
    import mooncake.engine as engine
    import mooncake.store as store

    version = ""
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            version = f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            pass
    members = {}
    for n in (
        "ReplicateConfig",
        "ReplicaDescriptor",
        "BufferHandle",
        "QueryTaskResponse",
        "MooncakeHostMemAllocator",
        "ParallelAxis",
        "TensorParallelism",
        "TaskType",
        "TaskStatus",
        "MemoryDescriptor",
        "DiskDescriptor",
        "Descriptor",
    ):
        members[n] = sorted(a for a in dir(getattr(store, n)) if not a.startswith("_"))
    out = {
        "wheel": version,
        "store_module": sorted(n for n in dir(store) if not n.startswith("_")),
        "engine_module": sorted(n for n in dir(engine) if not n.startswith("_")),
        "store_methods": dump_class(store.MooncakeDistributedStore),
        "engine_methods": dump_class(engine.TransferEngine),
        "members": members,
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
