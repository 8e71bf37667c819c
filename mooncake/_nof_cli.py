"""The published NVMe-oF SSD (un)registration commands, which this package cannot carry out.

``mooncake.mooncake_ssd_register`` / ``mooncake.mooncake_ssd_unregister`` log into SPDK target
hosts over SSH (paramiko), list their NVMe-oF subsystems and register them with the master as
SSD segments through ``MooncakeDistributedNoFRegister``. This package has no NVMe-oF transport
(``MooncakeDistributedNoFRegister`` refuses with :class:`~mooncake.errors.NotSupportedError`),
so the commands parse the published flags and then refuse, naming what is missing; the classes
refuse when constructed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from mooncake import _unsupported
from mooncake.errors import NotSupportedError

MISSING = "an NVMe-oF transport and SPDK targets (MooncakeDistributedNoFRegister)"


def parse_arguments(prog: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published flags of both commands."""
    p = argparse.ArgumentParser(prog=prog, description="Mooncake SSD (un)register over NVMe-oF")
    p.add_argument("--master_server_address", type=str, required=True)
    p.add_argument("--spdk_target_info", action="append", required=True)
    p.add_argument("--username", type=str, default="root")
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--password", type=str)
    p.add_argument("--key-file", type=str)
    p.add_argument("-D", "--define", action="append", default=[])
    return p.parse_args(argv)


def refusing_class(module: str, name: str) -> Any:
    """``name(cli_config=None, spdk_targets=None)`` raising :class:`NotSupportedError`."""
    return _unsupported.cls(module, name, MISSING)


def main(module: str, name: str, argv: Sequence[str] | None = None) -> int:
    """Parse the published flags, then refuse: exit status 1 with the reason on stderr."""
    prog = module.rsplit(".", 1)[-1]
    parse_arguments(prog, argv)
    err = NotSupportedError(_unsupported.refusal(module, name, MISSING))
    print(f"{prog}: {err}", file=sys.stderr)
    return 1
