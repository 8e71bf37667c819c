"""The published ``mooncake.mooncake_ssd_register``: register SPDK targets' NVMe-oF SSDs.

Not supported by this package (no NVMe-oF transport): ``python -m
mooncake.mooncake_ssd_register --master_server_address=... --spdk_target_info="ip:... path:..."``
takes the published flags and exits 1 naming what is missing; ``MooncakeNoFRegister`` raises
:class:`~mooncake.errors.NotSupportedError` when constructed (:mod:`mooncake._nof_cli`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mooncake import _nof_cli

MODULE = "mooncake.mooncake_ssd_register"

MooncakeNoFRegister = _nof_cli.refusing_class(MODULE, "MooncakeNoFRegister")

__all__ = ["MooncakeNoFRegister", "main", "parse_arguments"]


def parse_arguments(argv: Sequence[str] | None = None) -> object:
    return _nof_cli.parse_arguments("mooncake_ssd_register", argv)


def main(argv: Sequence[str] | None = None) -> int:
    return _nof_cli.main(MODULE, "MooncakeNoFRegister", argv)


if __name__ == "__main__":
    sys.exit(main())
