"""The published ``mooncake.mooncake_config``: ``MooncakeConfig`` from a JSON file or ``MOONCAKE_*``.

Fields, defaults and checks are the published ones: ``local_hostname``, ``metadata_server``,
``global_segment_size`` (default 3355443200), ``local_buffer_size`` (default 1 GiB),
``protocol`` (lower-cased; unknown names warn and pass through), ``device_name``,
``master_server_address``, ``enable_ssd_offload``, ``ssd_offload_path``, ``tenant_id``,
``enable_client_http_server``, ``client_http_port`` (9300). Sizes take ``"4gb"``, ``"512M"``,
``"1.5g"``; booleans ``true/false/yes/no/on/off/1/0/enable/disable``.

:meth:`MooncakeConfig.load_from_env` reads ``MOONCAKE_CONFIG_PATH`` (a JSON file) or else
``MOONCAKE_MASTER`` (required then), ``MOONCAKE_LOCAL_HOSTNAME``,
``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
``MOONCAKE_OFFLOAD_ENABLED``, ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``, ``MOONCAKE_TENANT_ID``,
``MOONCAKE_ENABLE_CLIENT_HTTP_SERVER`` and ``MOONCAKE_CLIENT_HTTP_PORT``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
    "MooncakeConfig",
]

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_KNOWN_PROTOCOLS = frozenset(
    [
        "tcp",
        "rdma",
        "efa",
        "nvmeof",
        "nvlink",
        "musa",
        "nvlink_intra",
        "hip",
        "barex",
        "cxl",
        "ascend",
        "ub",
        "ubshmem",
        "maca",
        "sunrise_link",
        "rpc_only",
    ]
)
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
_TRUE = ("true", "1", "yes", "on", "enable")
_FALSE = ("false", "0", "no", "off", "disable")


def _parse_segment_size(value: Any) -> int:
    """Bytes from an int or a string with an optional ``k/m/g/t`` (+``b``) suffix."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    s = value.strip().lower()
    if not s:
        raise ValueError("Invalid segment size: empty string")
    mult = 1
    if s.endswith("b"):
        s = s[:-1]
    if s and s[-1] in _UNITS:
        mult, s = _UNITS[s[-1]], s[:-1].strip()
        if not s:
            raise ValueError(f"Invalid segment size: missing number in {value!r}")
    elif not s:
        raise ValueError(f"Invalid segment size: missing number in {value!r}")
    return int(float(s) * mult)


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    s = str(value).strip().lower()
    if not s or s in _FALSE:
        return False
    if s in _TRUE:
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """What ``MooncakeDistributedStore.setup`` needs (see the module docstring)."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(
                f"Invalid protocol: {self.protocol!r}. Protocol must be a non-empty string, "
                "e.g. 'tcp' or 'rdma'."
            )
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _KNOWN_PROTOCOLS:
            logger.warning(
                "Unrecognised protocol %r; passing it through unchanged. Known protocols: %s.",
                self.protocol,
                ", ".join(sorted(_KNOWN_PROTOCOLS)),
            )
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"Invalid {name}: {getattr(self, name)}. Size must be non-negative."
                )
        for name in _REQUIRED:
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {v!r}.")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Read a JSON config file (``local_hostname``, ``metadata_server`` and
        ``master_server_address`` required)."""
        with open(file_path) as f:
            cfg = json.load(f)
        for name in _REQUIRED:
            if name not in cfg:
                raise ValueError(f"Missing required config field: {name}")
        path, tenant = cfg.get("ssd_offload_path"), cfg.get("tenant_id")
        return MooncakeConfig(
            local_hostname=cfg["local_hostname"],
            metadata_server=cfg["metadata_server"],
            global_segment_size=_parse_segment_size(
                cfg.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)
            ),
            local_buffer_size=_parse_segment_size(
                cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)
            ),
            protocol=cfg.get("protocol", "tcp"),
            device_name=cfg.get("device_name", ""),
            master_server_address=cfg["master_server_address"],
            enable_ssd_offload=_parse_bool(cfg.get("enable_ssd_offload", False)),
            ssd_offload_path="" if path is None else str(path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_parse_bool(cfg.get("enable_client_http_server", False)),
            client_http_port=int(cfg.get("client_http_port", 9300)),
        )

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """From ``MOONCAKE_CONFIG_PATH``, else from the ``MOONCAKE_*`` variables."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError(
                "Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER' "
                "is set."
            )
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_segment_size(
                env("MOONCAKE_GLOBAL_SEGMENT_SIZE", str(DEFAULT_GLOBAL_SEGMENT_SIZE))
            ),
            local_buffer_size=_parse_segment_size(
                env("MOONCAKE_LOCAL_BUFFER_SIZE", str(DEFAULT_LOCAL_BUFFER_SIZE))
            ),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(
                env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")
            ),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", "9300")),
        )
