"""``mooncake bench``: benchmarks with progress, a table and ``--json``.

Each benchmark is a sub-subcommand (``mooncake bench transfer``; the store's benchmarks are
scripts, ``benchmarks/store_bench.py``, see docs/benchmarks.md)
living in its own module that exposes ``register(subparsers)``, exactly like the top-level
subcommands. Add new ones to ``_BENCHES``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

#: sub-subcommand modules under ``mooncake._cli``
_BENCHES: list[str] = ["bench_transfer"]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="benchmarks (transfer engine)", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name in _BENCHES:
        importlib.import_module(f"mooncake._cli.{name}").register(sub)

    def _help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_help)
