"""The ``mooncake_client`` console script: the published standalone store client.

It owns a segment (``--global_segment_size``), a transfer engine and the master connection,
and serves dummy clients of this host (``setup_dummy(..., "host:<--port>")``) on the abstract
socket ``@mooncake_client_<port>.sock`` (:mod:`mooncake.store._standalone`). Flags as the
published binary spells them (gflags style, ``--flag=value`` or ``--flag value``; booleans
also as ``--flag`` / ``--noflag``)::

    --host=0.0.0.0 --port=50052 --metadata_server=http://127.0.0.1:8080/metadata
    --master_server_address=127.0.0.1:50051 --protocol=tcp --device_names=
    --global_segment_size="4 GB" --local_buffer_size=0 --threads=1 --tenant_id=default
    --enable_offload=false

``--threads`` is accepted (the store runs on one event loop here); ``--enable_offload`` opens
the SSD tier (``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``). ``--host=0.0.0.0`` publishes this
host's loopback address unless a concrete one is given: servers bind what they are given, and
the engine refuses to guess an interface. Prints one ``mooncake_client: ...`` line once it
serves. SIGTERM drains the segment first (``--drain_timeout`` seconds at most, 5 by default:
no new replicas land on it, replicated objects are re-replicated elsewhere, sole copies moved
where there is room, reads in flight finish; see :mod:`mooncake._store.draining`), then
unmounts it and exits 0; SIGINT unmounts at once and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

FLAGS: dict[str, tuple[type, Any]] = {
    "host": (str, "0.0.0.0"),
    "port": (int, 50052),
    "metadata_server": (str, "http://127.0.0.1:8080/metadata"),
    "master_server_address": (str, "127.0.0.1:50051"),
    "protocol": (str, "tcp"),
    "device_names": (str, ""),
    "global_segment_size": (str, "4 GB"),
    "local_buffer_size": (str, "0"),
    "threads": (int, 1),
    "tenant_id": (str, "default"),
    "enable_offload": (bool, False),
    "start_offload_rpc_server": (bool, True),
    "enable_http_server": (bool, False),
    "http_port": (int, 9300),
    "log_dir": (str, ""),
    "drain_timeout": (float, 5.0),
}
_TRUE = ("1", "true", "yes", "t", "y", "on")
_FALSE = ("0", "false", "no", "f", "n", "off")


def parse_flags(argv: Sequence[str]) -> dict[str, Any]:
    """The published flags from ``argv`` (``ValueError`` naming a bad or unknown one)."""
    out = {k: v for k, (_, v) in FLAGS.items()}
    it = iter(argv)
    for arg in it:
        if not arg.startswith("-"):
            raise ValueError(f"unexpected argument {arg!r}")
        name, eq, value = arg.lstrip("-").partition("=")
        if name in ("help", "h"):
            out["help"] = True
            continue
        negated = name.startswith("no") and name[2:] in FLAGS and FLAGS[name[2:]][0] is bool
        if negated:
            out[name[2:]] = False
            continue
        if name not in FLAGS:
            raise ValueError(f"unknown flag --{name}")
        kind = FLAGS[name][0]
        if kind is bool:
            if not eq:
                out[name] = True
                continue
            low = value.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError(f"--{name}: expected true or false, got {value!r}")
            out[name] = low in _TRUE
            continue
        if not eq:
            value = next(it, None)  # type: ignore[assignment]
            if value is None:
                raise ValueError(f"--{name} needs a value")
        try:
            out[name] = kind(value)
        except ValueError:
            raise ValueError(f"--{name}: expected a {kind.__name__}, got {value!r}") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags = parse_flags(argv)
    except ValueError as e:
        print(f"mooncake_client: {e}", file=sys.stderr)
        return 2
    if flags.get("help"):
        print(__doc__)
        return 0
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from mooncake.store import MooncakeDistributedStore
    from mooncake.store._standalone import StandaloneServer

    host = flags["host"]
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    store = MooncakeDistributedStore()
    rc = store.setup(
        host,
        flags["metadata_server"],
        flags["global_segment_size"],
        flags["local_buffer_size"],
        flags["protocol"],
        flags["device_names"],
        flags["master_server_address"],
        None,
        flags["enable_offload"],
        "",
        flags["tenant_id"],
        flags["enable_http_server"],
        flags["http_port"],
    )
    if rc != 0:
        print(f"mooncake_client: setup failed ({rc})", file=sys.stderr)
        return 1
    try:
        server = StandaloneServer(store, flags["port"])
    except OSError as e:
        print(f"mooncake_client: cannot serve port {flags['port']}: {e}", file=sys.stderr)
        store.close()
        return 1
    done = threading.Event()
    drain = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            drain.set()
        done.set()
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"mooncake_client: segment {store.get_hostname()} serving dummy clients at "
        f"@mooncake_client_{flags['port']}.sock",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.stop()
        if drain.is_set():
            store.drain(flags["drain_timeout"])
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
