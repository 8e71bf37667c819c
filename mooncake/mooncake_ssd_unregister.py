"""The published ``mooncake.mooncake_ssd_unregister``: unregister SPDK targets' NVMe-oF SSDs.

Not supported by this package (no NVMe-oF transport): ``python -m
mooncake.mooncake_ssd_unregister --master_server_address=... --spdk_target_info="ip:... path:..."``
takes the published flags and exits 1 naming what is missing; ``MooncakeNoFUnregister`` raises
:class:`~mooncake.errors.NotSupportedError` when constructed (:mod:`mooncake._nof_cli`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mooncake import _nof_cli

MODULE = "mooncake.mooncake_ssd_unregister"

MooncakeNoFUnregister = _nof_cli.refusing_class(MODULE, "MooncakeNoFUnregister")

__all__ = ["MooncakeNoFUnregister", "main", "parse_arguments"]


def parse_arguments(argv: Sequence[str] | None = None) -> object:
    return _nof_cli.parse_arguments("mooncake_ssd_unregister", argv)


def main(argv: Sequence[str] | None = None) -> int:
    return _nof_cli.main(MODULE, "MooncakeNoFUnregister", argv)


if __name__ == "__main__":
    sys.exit(main())
