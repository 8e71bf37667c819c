"""``mooncake c-abi``: where Mooncake's C ABI library and header are, for C and C++ builds.

``--cflags`` and ``--libs`` print compiler and linker flags (as ``pkg-config`` does);
``--root`` prints the directory to give TensorRT-LLM as ``MOONCAKE_ROOT`` (it holds
``lib/libtransfer_engine.so`` and ``include/transfer_engine_c.h``). With no option it prints
all three, and whether the library is built. Exit status 1 when the library is not built.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent / "_fast"
LIBRARY = ROOT / "lib" / "libtransfer_engine.so"
HEADER = ROOT / "include" / "transfer_engine_c.h"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "c-abi", help="flags to build C/C++ code against Mooncake's C ABI (transfer_engine_c.h)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cflags", action="store_true", help="print the include flag")
    g.add_argument("--libs", action="store_true", help="print the linker flags (with rpath)")
    g.add_argument("--root", action="store_true", help="print the MOONCAKE_ROOT directory")
    p.set_defaults(func=run)


def cflags() -> str:
    return f"-I{HEADER.parent}"


def libs() -> str:
    return f"-L{LIBRARY.parent} -Wl,-rpath,{LIBRARY.parent} -ltransfer_engine"


def run(args: argparse.Namespace) -> int:
    if not LIBRARY.exists():
        print(f"libtransfer_engine.so is not built ({LIBRARY}): run setup.py build_ext")
        return 1
    if args.cflags:
        print(cflags())
    elif args.libs:
        print(libs())
    elif args.root:
        print(ROOT)
    else:
        print(f"library: {LIBRARY}\nheader:  {HEADER}\nMOONCAKE_ROOT={ROOT}")
        print(f"cflags:  {cflags()}\nlibs:    {libs()}")
    return 0
