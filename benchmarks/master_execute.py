#!/usr/bin/env python3
"""The master server's per-call cost in process: ``MasterServer.handle_request`` on decoded
requests (no sockets, no event loop), ``--calls`` times the same request.

Cases: ``ready`` (``ServiceReady``: the request path around a trivial handler), ``get``
(``GetReplicaList`` of one complete 4 KiB object, a lease granted each time). Prints the
process CPU time per call. On a loaded host the instruction count is the steadier measure:
run it under callgrind with ``--calls N`` and ``--calls 0`` and divide the difference by N::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/master_execute.py --case get --calls 20000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mooncake._core import rpc  # noqa: E402
from mooncake._core.master import MasterState  # noqa: E402
from mooncake._core.store_types import Segment  # noqa: E402
from mooncake._store.master import MasterServer, MasterServerConfig  # noqa: E402


def _request(method: str, params: object, rid: bytes | None = None) -> rpc.Request:
    dec = rpc.MessageDecoder()
    dec.feed(rpc.encode_request(1, method, params, rid=rid))  # type: ignore[arg-type]
    (req,) = list(dec)
    assert isinstance(req, rpc.Request)
    return req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--case", choices=["ready", "get"], default="get")
    ap.add_argument("--calls", type=int, default=50_000)
    args = ap.parse_args()
    server = MasterServer(MasterServerConfig(), MasterState())
    seg = Segment(id="s1", name="n1", base=0, size=1 << 40, te_endpoint="n1")
    inst = b"b" * 8
    setup = [
        _request("MountSegment", rpc.MountSegmentParams(client_id="c", segment=seg), inst + b"\0" * 7 + b"\1"),
        _request("PutStart", rpc.PutStartParams(client_id="c", key="k", size=4096), inst + b"\0" * 7 + b"\2"),
        _request("PutEnd", rpc.PutEndParams(client_id="c", key="k"), inst + b"\0" * 7 + b"\3"),
    ]  # fmt: skip
    for req in setup:
        server.handle_request(req, 1.0)
    req = (
        _request("ServiceReady", rpc.Empty())
        if args.case == "ready"
        else _request("GetReplicaList", rpc.KeyParams(key="k"))
    )
    assert rpc.MessageDecoder().feed_messages(server.handle_request(req, 2.0))[0].code == 0  # type: ignore[union-attr]
    t = time.process_time()
    for _ in range(args.calls):
        server.handle_request(req, 2.0)
    if args.calls:
        per = (time.process_time() - t) / args.calls * 1e6
        print(f"{args.case}: {per:.2f} us per call (process CPU, {args.calls} calls)")


if __name__ == "__main__":
    main()
