"""The published ``mooncake.cli_bench``: entry point of the ``transfer_engine_bench`` script.

``main()`` runs the transfer-engine benchmark with the published binary's gflags
(``--mode=initiator|target``, ``--metadata_server``, ``--segment_id``, ``--operation``,
``--block_size``, ``--batch_size``, ``--duration``, ...; see
:func:`mooncake._cli.published.transfer_engine_bench_main`) and returns its exit status.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``transfer_engine_bench`` with ``sys.argv[1:]``."""
    from mooncake._cli.published import transfer_engine_bench_main

    return transfer_engine_bench_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
