"""``setup``'s arguments as the published client takes them, resolved to ``open_store`` options.

Both published forms: ``setup(local_hostname, metadata_server, global_segment_size,
local_buffer_size, protocol, rdma_devices, master_server_addr, engine=None,
enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
enable_client_http_server=False, client_http_port=9300)`` (positional or keyword) and
``setup(config_dict)`` (sizes may be strings such as ``"16MB"``).

* **protocol**: every protocol string the published client knows is accepted. What this
  implementation cannot use here is replaced, as the engine does, by what it can (TCP), with one
  warning naming both; an unknown string is ``INVALID_PARAMS``.
* **local_hostname** without a port gets a free port from ``MC_STORE_CLIENT_MIN_PORT`` ..
  ``MC_STORE_CLIENT_MAX_PORT`` (12300-14300), chosen at random as the published client does, so
  two clients of one process never share a segment name.
* **enable_ssd_offload** opens the local SSD tier at ``ssd_offload_path`` (else
  ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``, else ``/data/file_storage``) bounded by
  ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` (2 TiB by default), the published variables.
* **drain_timeout** (ours, after the published arguments; also a ``setup(dict)`` key): the bound
  in seconds of the drain SIGTERM runs (:mod:`mooncake.store._drain`); default 5 s or
  ``MC_STORE_DRAIN_TIMEOUT``.
* **verify** (ours, last; also a ``setup(dict)`` key): verified reads on (true) or off (false)
  for this client; unset: ``MOONCAKE_STORE_CHECKSUM``, else the default of
  :mod:`mooncake._store.verify` (off).
"""

from __future__ import annotations

import logging
import os
import random
import socket
from typing import Any

from mooncake._store.config import parse_size
from mooncake.errors import InvalidArgumentError

log = logging.getLogger("mooncake.store")

DEFAULT_SIZE = 16 << 20
SETUP_NAMES = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
    "drain_timeout",
    "verify",
)
#: config-file spellings accepted in ``setup(dict)`` for the published dict keys
CONFIG_ALIASES = {
    "master_server_address": "master_server_addr",
    "device_name": "rdma_devices",
}
#: protocol strings of the published client (``installTransport`` names)
PUBLISHED_PROTOCOLS = frozenset(
    {
        "tcp",
        "rdma",
        "efa",
        "cxl",
        "nvlink",
        "nvlink_intra",
        "hip",
        "cuda",
        "ascend",
        "ascend_direct",
        "hccl",
        "barex",
        "ubshmem",
        "nvmeof",
    }
)
_TRUE = ("1", "true", "yes", "on")


def collect(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Both published ``setup`` forms as one dict of the published names."""
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        cfg = dict(args[0])
        for req in ("local_hostname", "metadata_server"):
            if req not in cfg:
                raise InvalidArgumentError(f"setup(config): missing required key {req!r}")
        # the spellings of the config files that vLLM's, SGLang's and LMCache's Mooncake
        # configs use (MOONCAKE_CONFIG_PATH JSON), where the dict's own name is absent
        for alias, name in CONFIG_ALIASES.items():
            if alias in cfg and name not in cfg:
                cfg[name] = cfg.pop(alias)
        known = (set(SETUP_NAMES) - {"engine"}) | {"ipc_socket_path"}
        unknown = set(cfg) - known
        if unknown:  # the published client ignores keys it does not read: so do we, aloud
            log.warning("setup(config): ignoring unknown keys %s", sorted(unknown))
            for k in unknown:
                del cfg[k]
        return cfg
    if len(args) > len(SETUP_NAMES):
        raise InvalidArgumentError(f"setup takes at most {len(SETUP_NAMES)} arguments")
    cfg = dict(zip(SETUP_NAMES, args, strict=False))
    for k, v in kwargs.items():
        if k not in SETUP_NAMES:
            raise InvalidArgumentError(f"setup: unexpected argument {k!r}")
        if k in cfg:
            raise InvalidArgumentError(f"setup: {k!r} given twice")
        cfg[k] = v
    for req in ("local_hostname", "metadata_server"):
        if req not in cfg:
            raise InvalidArgumentError(f"setup: missing {req!r}")
    return cfg


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


def resolve_protocol(protocol: str) -> str:
    """The protocol the store will use for ``protocol`` (warns once when it differs)."""
    asked = (protocol or "tcp").strip().lower()
    if asked not in PUBLISHED_PROTOCOLS:
        raise InvalidArgumentError(
            f"protocol {protocol!r} is not a Mooncake protocol ({', '.join(sorted(PUBLISHED_PROTOCOLS))})"
        )
    if asked == "tcp":
        return "tcp"
    if asked == "rdma":
        from mooncake._engine.transports import default_transports

        if "rdma" in default_transports():
            return "rdma"
    log.warning(
        "setup: protocol %r was asked; this host cannot use it here, so the store uses 'tcp'",
        protocol,
    )
    return "tcp"


def port_range() -> tuple[int, int]:
    lo = int(os.environ.get("MC_STORE_CLIENT_MIN_PORT", "12300") or 12300)
    hi = int(os.environ.get("MC_STORE_CLIENT_MAX_PORT", "14300") or 14300)
    if not 0 < lo <= hi < 65536:
        raise InvalidArgumentError(f"bad MC_STORE_CLIENT_MIN/MAX_PORT range {lo}-{hi}")
    return lo, hi


def has_port(hostname: str) -> bool:
    if hostname.startswith("["):
        return "]:" in hostname
    return hostname.count(":") == 1 and hostname.rsplit(":", 1)[1].isdigit()


def pick_port(host: str) -> int:
    """A port of the client range that ``host`` can bind now, chosen at random."""
    lo, hi = port_range()
    tries = min(200, hi - lo + 1)
    bind_host = "127.0.0.1" if host in ("localhost", "") else host
    for port in random.sample(range(lo, hi + 1), tries):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((bind_host, port))
        except OSError:
            continue
        return port
    raise InvalidArgumentError(f"no free port in {lo}-{hi} on {host!r}")


def open_store_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """``open_store`` keyword arguments for the collected ``setup`` arguments (no engine)."""
    hostname = str(cfg["local_hostname"])
    if not hostname:
        raise InvalidArgumentError("local_hostname must not be empty")
    opts: dict[str, Any] = {
        "master": str(cfg.get("master_server_addr") or "127.0.0.1:50051"),
        "hostname": hostname,
        "metadata": str(cfg["metadata_server"]),
        "segment_size": parse_size(
            cfg.get("global_segment_size", DEFAULT_SIZE), "global_segment_size"
        ),
        "local_buffer_size": parse_size(
            cfg.get("local_buffer_size", DEFAULT_SIZE), "local_buffer_size"
        ),
        "protocol": resolve_protocol(str(cfg.get("protocol") or "tcp")),
    }
    if _flag(cfg.get("enable_ssd_offload", False)):
        path = str(cfg.get("ssd_offload_path") or "") or os.environ.get(
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "/data/file_storage"
        )
        opts["ssd_path"] = path
        opts["ssd_capacity"] = parse_size(
            os.environ.get("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", str(2 << 40)),
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
        )
    if cfg.get("verify") is not None:
        opts["verify"] = _flag(cfg["verify"])
    tenant = cfg.get("tenant_id")
    if tenant not in (None, "", "default"):
        opts["tenant"] = str(tenant)
    if _flag(cfg.get("enable_client_http_server", False)):
        port = cfg.get("client_http_port", 9300)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise InvalidArgumentError(f"client_http_port must be in 1..65535, got {port!r}")
    return opts


def client_http_port(cfg: dict[str, Any]) -> int | None:
    """The port of the client HTTP endpoints (:mod:`mooncake.store._client_http`), or None
    when ``enable_client_http_server`` is off."""
    if not _flag(cfg.get("enable_client_http_server", False)):
        return None
    return int(cfg.get("client_http_port", 9300))
