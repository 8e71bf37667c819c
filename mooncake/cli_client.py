"""The published ``mooncake.cli_client``: entry point of the ``mooncake_client`` console script.

``main()`` runs the standalone store client (the published flags: ``--host``, ``--port``,
``--master_server_address``, ``--global_segment_size``, ...; see
:mod:`mooncake._cli.real_client`) in this process, serving dummy clients of this host.
Returns the exit status: 0 after SIGTERM / SIGINT, 1 when setup fails, 2 for bad flags.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``mooncake_client`` with ``sys.argv[1:]``."""
    from mooncake._cli.real_client import main as _main

    return _main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
