"""``mooncake metadata-server``: Mooncake's HTTP metadata protocol, standalone."""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from typing import Any

from mooncake._cli._quiet import port_arg, run_server
from mooncake._engine.metadata import server


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "metadata-server",
        help="serve Mooncake's HTTP metadata protocol (GET/PUT/DELETE ?key=)",
        description=__doc__,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=port_arg, default=server.DEFAULT_PORT, help="0 = any free port")
    p.add_argument("--path", default=server.DEFAULT_PATH, help="URL path (default /metadata)")
    p.add_argument("--max-body", type=int, default=server.DEFAULT_MAX_BODY, help="bytes per PUT")
    p.add_argument(
        "--max-connections", type=int, default=server.DEFAULT_MAX_CONNECTIONS, help="served at once"
    )
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="require the cluster secret in this file (default: $MOONCAKE_CLUSTER_SECRET, if set)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import trio

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    try:
        secret = read_secret_file(args.cluster_secret_file)
    except OSError as e:
        print(f"mooncake metadata-server: cannot read the cluster secret: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(
                partial(
                    server.serve_http_metadata,
                    args.host,
                    args.port,
                    path=args.path,
                    max_body=args.max_body,
                    max_connections=args.max_connections,
                    secret=secret,
                )
            )
            # one parseable line for scripts and tests
            print(f"metadata-server listening on http://{host}:{port}{args.path}", flush=True)

    # Ctrl-C: exit 0 quietly; a port in use: one line naming it, exit 1
    return run_server(
        "mooncake metadata-server",
        lambda: trio.run(main),
        what=f"cannot listen on {args.host}:{args.port}",
    )


def read_secret_file(path: str | None) -> str | None:
    """The secret in ``path`` (surrounding whitespace dropped), or None (use the environment)."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()
