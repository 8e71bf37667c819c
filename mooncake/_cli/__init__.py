"""The ``mooncake`` command line.

Each subcommand lives in its own module under ``mooncake._cli`` and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (called with the parsed
namespace, returns the exit status). Add new subcommands to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_SUBCOMMANDS: list[str] = [
    "bench",
    "c_abi",
    "demo",
    "eval",
    "master",
    "metadata_server",
    "replay",
    "top",
]


def build_parser() -> argparse.ArgumentParser:
    from mooncake import __version__

    parser = argparse.ArgumentParser(prog="mooncake", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=f"mooncake {__version__} (mooncake-py)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"mooncake._cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
