"""The published ``mooncake.transfer_engine_topology_dump``: print the local device topology.

``transfer_engine_topology_dump [--device-name mlx5_0,mlx5_1] [--backend auto|te|tent]
[--use-custom-topo] [--custom-topo-json PATH]`` prints ``Local topology [<backend>/<mode>]: ``
followed by Mooncake's topology JSON (``{"cpu:0": [[preferred NICs], [available NICs]], ...}``;
``{}`` on a host without RDMA devices), as the published command does. By default custom
overrides are cleared so the output is what discovery finds; ``--custom-topo-json`` (or
``--use-custom-topo`` with ``MC_CUSTOM_TOPO_JSON`` set) loads a matrix instead. There is one
engine here, so ``tent`` prints the same matrix as ``te``. Exit status 0, or 1 with an
``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["dump_te_topology", "main", "parse_args", "resolve_backend"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published command line."""
    p = argparse.ArgumentParser(
        description=(
            "Dump device topology for classic Transfer Engine or TENT. By default clears "
            "custom topology overrides so the output reflects auto-discovery."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device-name", type=str, default="", help="IB device name(s), comma-separated")
    p.add_argument("--backend", choices=("auto", "te", "tent"), default="auto")
    p.add_argument("--use-custom-topo", action="store_true", help="keep MC_CUSTOM_TOPO_JSON")
    p.add_argument("--custom-topo-json", type=str, default=None, help="custom topology JSON path")
    return p.parse_args(argv)


def resolve_backend(backend: str) -> str:
    """``auto`` follows ``MC_USE_TENT`` / ``MC_USE_TEV1`` as the published command does."""
    if backend == "auto":
        return "tent" if os.environ.get("MC_USE_TENT") or os.environ.get("MC_USE_TEV1") else "te"
    return backend


def dump_te_topology(device_name: str) -> str:
    """The engine's ``get_local_topology`` (no engine needs to be set up for it)."""
    from mooncake.engine import TransferEngine

    return TransferEngine().get_local_topology(device_name=device_name or None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    backend = resolve_backend(args.backend)
    saved = os.environ.get("MC_CUSTOM_TOPO_JSON")
    if args.custom_topo_json is not None:
        os.environ["MC_CUSTOM_TOPO_JSON"] = args.custom_topo_json
        mode = f"custom ({args.custom_topo_json})"
    elif args.use_custom_topo:
        if not saved:
            print("error: --use-custom-topo requires MC_CUSTOM_TOPO_JSON", file=sys.stderr)
            return 1
        mode = f"custom ({saved})"
    else:
        os.environ.pop("MC_CUSTOM_TOPO_JSON", None)
        mode = "discover"
    try:
        topo = dump_te_topology(args.device_name)
    except Exception as exc:
        print(f"error: failed to dump topology: {exc}", file=sys.stderr)
        return 1
    finally:
        if saved is None:
            os.environ.pop("MC_CUSTOM_TOPO_JSON", None)
        else:
            os.environ["MC_CUSTOM_TOPO_JSON"] = saved
    print(f"Local topology [{backend}/{mode}]: {topo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
