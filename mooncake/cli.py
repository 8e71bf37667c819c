"""The published ``mooncake.cli``: entry point of the ``mooncake_master`` console script.

``main()`` runs the store master with the published binary's gflags (``--port``,
``--rpc_port``, ``--enable_http_metadata_server``, ...; see
:func:`mooncake._cli.master.gflags_main`) in this process, so the PID the caller started is
the master's (the published module ``exec``\\ s its binary for the same reason). Returns the
exit status: 0 after a clean stop (SIGTERM / SIGINT), 2 for bad flags.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``mooncake_master`` with ``sys.argv[1:]``."""
    from mooncake._cli.master import gflags_main

    return gflags_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
