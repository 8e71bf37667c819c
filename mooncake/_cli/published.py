"""Console scripts under the published binaries' names and flags.

``mooncake_http_metadata_server [--host H] [--port 8080] [--log-level INFO]`` runs
``mooncake metadata-server`` (same HTTP protocol; it binds loopback unless ``--host`` says
otherwise, where the published script binds every interface).

``transfer_engine_bench --mode=target|initiator ...`` takes the published gflags
(``--metadata_server --protocol --local_server_name --device_name --buffer_size --segment_id
--operation --block_size --batch_size --threads --duration --report_unit
--report_precision``) and prints the published lines: the target
``listening on <host>:<port>`` (its segment name) and then serves until killed; the initiator
``Test completed: duration D, batch count N, throughput T GB/s``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

_BENCH_FLAGS: dict[str, Any] = {
    "mode": "initiator",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "local_server_name": "127.0.0.1",
    "device_name": "",
    "buffer_size": 1 << 30,
    "segment_id": "",
    "operation": "read",
    "block_size": 65536,
    "batch_size": 128,
    "threads": 12,
    "duration": 10,
    "report_unit": "GB",
    "report_precision": 2,
    "auto_discovery": False,
    "backend": "classic",
    "nic_priority_matrix": "",
}
_UNITS = {
    "GB": 1e9,
    "GiB": 1 << 30,
    "Gb": 1e9 / 8,
    "MB": 1e6,
    "MiB": 1 << 20,
    "Mb": 1e6 / 8,
    "KB": 1e3,
    "KiB": 1 << 10,
    "Kb": 1e3 / 8,
}


def http_metadata_server_main(argv: Sequence[str] | None = None) -> int:
    """``mooncake_http_metadata_server``: the published flags over ``mooncake metadata-server``."""
    from mooncake._cli import metadata_server
    from mooncake._cli._quiet import port_arg
    from mooncake._engine.metadata import server

    p = argparse.ArgumentParser(
        prog="mooncake_http_metadata_server", description="HTTP Metadata Server for Mooncake"
    )
    p.add_argument("--port", type=port_arg, default=8080, help="Port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="Host to bind to (default: loopback)")
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="require the cluster secret in this file (else MOONCAKE_CLUSTER_SECRET, if set)",
    )
    a = p.parse_args(argv)
    ns = argparse.Namespace(
        host=a.host,
        port=a.port,
        path=server.DEFAULT_PATH,
        max_body=server.DEFAULT_MAX_BODY,
        max_connections=server.DEFAULT_MAX_CONNECTIONS,
        verbose=a.log_level == "DEBUG",
        cluster_secret_file=a.cluster_secret_file,
    )
    try:
        return metadata_server.run(ns)
    except KeyboardInterrupt:
        return 0


def parse_bench_flags(argv: Sequence[str]) -> dict[str, Any]:
    """gflags ``--name=value`` / ``--name value`` / ``--bool`` over the published defaults."""
    flags = dict(_BENCH_FLAGS)
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            raise SystemExit(f"transfer_engine_bench: unexpected argument {a!r}")
        name, eq, val = a.lstrip("-").partition("=")
        if name not in flags:
            raise SystemExit(f"transfer_engine_bench: unknown flag --{name}")
        if not eq:
            if isinstance(flags[name], bool):
                val = "true"
            else:
                i += 1
                if i >= len(args):
                    raise SystemExit(f"transfer_engine_bench: --{name} needs a value")
                val = args[i]
        kind = type(_BENCH_FLAGS[name])
        if kind is bool:
            flags[name] = val.lower() in ("1", "true", "yes")
        else:
            try:
                flags[name] = kind(val)
            except ValueError:
                raise SystemExit(
                    f"transfer_engine_bench: bad value for --{name}: {val!r}"
                ) from None
        i += 1
    return flags


#: what each flag of ``transfer_engine_bench`` means (the published bench's flags)
_BENCH_HELP = {
    "mode": "target (serve a buffer) or initiator (transfer to a target)",
    "metadata_server": "metadata connection string (P2PHANDSHAKE: none)",
    "protocol": "transport protocol (tcp; rdma where available)",
    "local_server_name": "this engine's address (host or host:port)",
    "device_name": "RDMA devices (comma separated), '' for none",
    "buffer_size": "bytes of the registered buffer",
    "segment_id": "initiator: the target's segment name (its 'listening on' line)",
    "operation": "read or write",
    "block_size": "bytes per transfer request",
    "batch_size": "requests per batch",
    "threads": "initiator threads",
    "duration": "seconds to run",
    "report_unit": "throughput unit: " + ", ".join(_UNITS),
    "report_precision": "digits after the point",
    "auto_discovery": "accepted; this implementation discovers transports itself",
    "backend": "accepted; one backend here",
    "nic_priority_matrix": "accepted; ignored",
}


def bench_help() -> str:
    """``transfer_engine_bench --help``: every flag with its meaning and default."""
    lines = [
        "transfer_engine_bench (mooncake-py): the Transfer Engine benchmark.",
        "Usage: transfer_engine_bench --mode=target|initiator [--flag=value]...",
        "",
        "Flags:",
    ]
    for name, default in _BENCH_FLAGS.items():
        lines.append(f"  --{name} (default: {default!r})")
        lines.append(f"      {_BENCH_HELP.get(name, '')}")
    return "\n".join(lines)


def transfer_engine_bench_main(argv: Sequence[str] | None = None) -> int:
    """``transfer_engine_bench``: the published C++ bench's flags and output lines."""
    import numpy as np

    from mooncake.engine import TransferEngine

    argv = sys.argv[1:] if argv is None else argv
    if any(a.lstrip("-") in ("help", "helpfull", "helpshort", "h") for a in argv):
        print(bench_help())
        return 0
    f = parse_bench_flags(argv)
    if f["mode"] not in ("target", "initiator"):
        print("transfer_engine_bench: --mode must be target or initiator", file=sys.stderr)
        return 2
    eng = TransferEngine()
    if (
        eng.initialize(
            f["local_server_name"], f["metadata_server"], f["protocol"], f["device_name"]
        )
        != 0
    ):
        print("transfer_engine_bench: engine initialization failed", file=sys.stderr)
        return 1
    buf = np.empty(f["buffer_size"], dtype=np.uint8)
    buf.fill(0)
    base = int(buf.ctypes.data)
    if eng.register_memory(base, buf.nbytes) != 0:
        print("transfer_engine_bench: memory registration failed", file=sys.stderr)
        return 1
    if f["mode"] == "target":
        host = f["local_server_name"].rsplit(":", 1)[0]
        print(f"listening on {host}:{eng.get_rpc_port()}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    seg = f["segment_id"]
    remote = eng.get_first_buffer_address(seg)
    if remote <= 0:
        print(f"transfer_engine_bench: segment {seg!r} has no buffer", file=sys.stderr)
        return 1
    bs, batch, nthreads = f["block_size"], f["batch_size"], max(1, f["threads"])
    span = bs * batch
    if span * nthreads > buf.nbytes:
        print(
            "transfer_engine_bench: buffer_size too small for threads x batch x block",
            file=sys.stderr,
        )
        return 1
    op = (
        eng.batch_transfer_sync_write if f["operation"] == "write" else eng.batch_transfer_sync_read
    )
    stop = time.monotonic() + f["duration"]
    counts = [0] * nthreads
    failed = threading.Event()

    def worker(t: int) -> None:
        locs = [base + t * span + i * bs for i in range(batch)]
        rems = [remote + t * span + i * bs for i in range(batch)]
        lens = [bs] * batch
        while time.monotonic() < stop and not failed.is_set():
            if op(seg, locs, rems, lens) != 0:
                failed.set()
                return
            counts[t] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dur = time.monotonic() - t0
    if failed.is_set():
        print("transfer_engine_bench: a transfer failed", file=sys.stderr)
        return 1
    n = sum(counts)
    unit = f["report_unit"] if f["report_unit"] in _UNITS else "GB"
    tput = n * span / dur / _UNITS[unit]
    prec = f["report_precision"]
    print(
        f"Test completed: duration {dur:.2f}, batch count {n}, throughput {tput:.{prec}f} {unit}/s",
        flush=True,
    )
    eng.close()
    return 0
