"""The ``mooncake_master`` gflags spellings: the flag table, its value parsers, and the HA and
KV-events settings they fill in (:func:`parse_gflags`; :mod:`mooncake._cli.master` runs the
master and has the argparse spelling).

``--flag=value``, ``--flag value``, ``-flag=value``, ``--bool_flag`` /
``--bool_flag=true|false`` / ``--nobool_flag`` all parse as gflags parses them. Published flags
this master does not implement are reported through ``warn`` and skipped; a flag the published
binary does not have either is refused, naming the nearest real flag.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from mooncake._cli._published_flags import FRAMEWORK_FLAGS, PUBLISHED_FLAGS
from mooncake._core.master import MasterConfig
from mooncake._core.master.config import parse_tenant_quotas
from mooncake._store.kv_events import KvEventsConfig
from mooncake._store.master_config import DEFAULT_RPC_PORT, MasterServerConfig
from mooncake.errors import InvalidArgumentError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, default_unit: str) -> float:
    """Seconds from ``"10000"`` (in ``default_unit``), ``"10s"``, ``"30m"``, ``"1h"``, ``"500ms"``."""
    m = _DURATION.match(str(text))
    if not m:
        raise InvalidArgumentError(f"bad duration {text!r}: want a number with optional ms|s|m|h")
    return float(m.group(1)) * _UNIT[m.group(2) or default_unit]


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "y", "t", "on"):
        return True
    if t in ("0", "false", "no", "n", "f", "off"):
        return False
    raise InvalidArgumentError(f"bad boolean {text!r}: want true or false")


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: a free one); anything else names the range."""
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise InvalidArgumentError(f"port {value} is out of range (0-65535; 0 picks a free port)")
    return value


def _ratio(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise InvalidArgumentError(f"ratio must be in [0, 1], got {text}")
    return v


@dataclass(frozen=True)
class _Flag:
    attr: str  # "server.x" or "state.x"
    parse: Callable[[str], Any]
    is_bool: bool = False


def _tenant_quotas(text: str) -> str:
    parse_tenant_quotas(text)  # the error names the bad entry
    return text


def _tenant_connector(text: str) -> str:
    if text != "file":
        raise InvalidArgumentError(f"only the file connector is supported, got {text!r}")
    return text


def _tenant_quota_file(path: str) -> str:
    """Upstream's tenant quota policy YAML (``version: 1``, ``tenants:`` of ``name``/``quota``,
    plus ``objects`` of ours) as a ``--tenant_quota`` list."""
    if not path:
        return ""
    try:
        text = open(path, encoding="utf-8").read()  # noqa: SIM115
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror}") from None
    entries: list[dict[str, str]] = []
    version = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip() or line.strip() == "tenants:":
            continue
        item = line.strip()
        if item.startswith("- "):
            entries.append({})
            item = item[2:].strip()
        k, colon, v = item.partition(":")
        if not colon:
            raise InvalidArgumentError(f"{path}: cannot read line {raw!r}")
        k, v = k.strip(), v.strip().strip("\"'")
        if k == "version" and not entries:
            version = v
        elif entries and k in ("name", "quota", "objects"):
            entries[-1][k] = v
        else:
            raise InvalidArgumentError(f"{path}: unexpected key {k!r}")
    if version != "1":
        raise InvalidArgumentError(f"{path}: the policy must have version: 1")
    out = ",".join(
        f"{e.get('name', '')}={e.get('quota', '0')}/{e.get('objects', '0')}" for e in entries
    )
    parse_tenant_quotas(out)
    return out


# published gflags name -> where it goes
_GFLAGS: dict[str, _Flag] = {
    "rpc_address": _Flag("server.rpc_address", str),
    "rpc_port": _Flag("server.rpc_port", port),
    "port": _Flag("legacy_port", port),
    "enable_metric_reporting": _Flag("server.enable_metric_reporting", _bool, True),
    "metrics_host": _Flag("server.metrics_host", str),
    "metrics_port": _Flag("server.metrics_port", port),
    "enable_http_metadata_server": _Flag("server.enable_http_metadata_server", _bool, True),
    "http_metadata_server_host": _Flag("server.http_metadata_server_host", str),
    "http_metadata_server_port": _Flag("server.http_metadata_server_port", port),
    "default_kv_lease_ttl": _Flag("state.default_kv_lease_ttl", lambda t: parse_duration(t, "ms")),
    "default_kv_soft_pin_ttl": _Flag(
        "state.default_kv_soft_pin_ttl", lambda t: parse_duration(t, "ms")
    ),
    "max_kv_soft_pin_ttl": _Flag("state.max_kv_soft_pin_ttl", lambda t: parse_duration(t, "ms")),
    "allow_evict_soft_pinned_objects": _Flag("state.allow_evict_soft_pinned_objects", _bool, True),
    "eviction_ratio": _Flag("state.eviction_ratio", _ratio),
    "eviction_high_watermark_ratio": _Flag("state.eviction_high_watermark_ratio", _ratio),
    "eviction_policy": _Flag("state.eviction_policy", str),
    "allocation_strategy": _Flag("state.allocation_strategy", str),
    "client_ttl": _Flag("state.client_ttl", lambda t: parse_duration(t, "s")),
    "put_start_discard_timeout_sec": _Flag(
        "state.put_start_discard_timeout", lambda t: parse_duration(t, "s")
    ),
    "put_start_release_timeout_sec": _Flag(
        "state.put_start_release_timeout", lambda t: parse_duration(t, "s")
    ),
    "enable_offload": _Flag("state.offload_on_evict", _bool, True),
    "offload_on_evict": _Flag("state.offload_on_evict", _bool, True),
    "demote_timeout_sec": _Flag("state.demote_timeout", lambda t: parse_duration(t, "s")),
    "memory_allocator": _Flag("memory_allocator", str),
    "tenant_quota": _Flag("state.tenant_quotas", _tenant_quotas),
    "tenant_quota_connector_type": _Flag("tenant_connector", _tenant_connector),
    "tenant_quota_connector_uri": _Flag("state.tenant_quotas", _tenant_quota_file),
    "enable_ha": _Flag("ha.enable_ha", _bool, True),
    "ha_backend_type": _Flag("ha.ha_backend_type", str),
    "ha_backend_connstring": _Flag("ha.ha_backend_connstring", str),
    "etcd_endpoints": _Flag("ha.etcd_endpoints", str),
    "cluster_id": _Flag("ha.cluster_id", str),
    "ha_advertise_address": _Flag("ha.ha_advertise_address", str),
    "ha_lease_ttl": _Flag("ha.ha_lease_ttl", int),
    "ha_fast_failover": _Flag("ha.ha_fast_failover", _bool, True),
    "ha_ack_mode": _Flag("ha.ha_ack_mode", str),
    "ha_etcd_linger_ms": _Flag("ha.ha_etcd_linger_ms", float),
    "enable_snapshot": _Flag("ha.enable_snapshot", _bool, True),
    "enable_snapshot_restore": _Flag("ha.enable_snapshot_restore", _bool, True),
    "snapshot_interval_seconds": _Flag(
        "ha.snapshot_interval_seconds", lambda t: parse_duration(t, "s")
    ),
    "snapshot_log_entries": _Flag("ha.snapshot_log_entries", int),
    "snapshot_child_timeout_seconds": _Flag(
        "ha.snapshot_child_timeout_seconds", lambda t: parse_duration(t, "s")
    ),
    "snapshot_retention_count": _Flag("ha.snapshot_retention_count", int),
    "snapshot_backup_dir": _Flag("ha.snapshot_backup_dir", str),
    "enable_kv_events": _Flag("kv.enable_kv_events", _bool, True),
    "kv_events_bind_endpoint": _Flag("kv.bind_endpoint", str),
    "kv_events_backend_id": _Flag("kv.backend_id", str),
    "kv_events_tenant_id": _Flag("kv.tenant_id", str),
    "kv_events_emit_legacy_compat": _Flag("kv.emit_legacy_compat", _bool, True),
    "kv_events_emit_object_key": _Flag("kv.emit_object_key", _bool, True),
    "kv_events_queue_capacity": _Flag("kv.queue_capacity", int),
    # upstream's legacy publisher flags: accepted, never written into events (as upstream)
    "kv_events_model_name": _Flag("kv.ignored", str),
    "kv_events_additional_salt": _Flag("kv.ignored", str),
    "kv_events_lora_name": _Flag("kv.ignored", str),
    "kv_events_block_size": _Flag("kv.ignored", int),
    "kv_events_dp_rank": _Flag("kv.ignored", int),
    # this master's own: replay, heartbeats
    "kv_events_replay_endpoint": _Flag("kv.replay_endpoint", str),
    "kv_events_buffer_steps": _Flag("kv.buffer_steps", int),
    "kv_events_heartbeat_interval": _Flag(
        "kv.heartbeat_interval", lambda t: parse_duration(t, "s")
    ),
    "kv_events_flush_delay": _Flag("kv.flush_delay", lambda t: parse_duration(t, "s")),
    "version": _Flag("version", _bool, True),
    "help": _Flag("help", _bool, True),
    "helpfull": _Flag("help", _bool, True),
    "helpshort": _Flag("help", _bool, True),
    "v": _Flag("verbosity", int),
    "log_level": _Flag("log_level", str),
}


@dataclass
class HaFlags:
    """The HA and snapshot flags, as given (:func:`ha_settings` checks and applies them)."""

    enable_ha: bool = False
    ha_backend_type: str = "etcd"
    ha_backend_connstring: str = ""
    etcd_endpoints: str = ""
    cluster_id: str = "mooncake_cluster"
    ha_advertise_address: str = ""
    ha_lease_ttl: int = 5
    ha_fast_failover: bool = True
    ha_ack_mode: str = "etcd"
    ha_etcd_linger_ms: float = 20.0
    enable_snapshot: bool = False
    enable_snapshot_restore: bool = False
    snapshot_interval_seconds: float = 600.0
    snapshot_log_entries: int = 10_000
    snapshot_child_timeout_seconds: float = 300.0
    snapshot_retention_count: int = 2
    snapshot_backup_dir: str = ""


@dataclass
class KvFlags(KvEventsConfig):
    """The KV event publisher's flags (upstream's ``kv_events_*``): the fields of
    :class:`~mooncake._store.kv_events.KvEventsConfig`, its defaults the flags' (upstream's but
    for the bind address: loopback, and a backend id), plus the switch and a sink for the
    legacy flags upstream accepts and ignores. :func:`kv_settings` checks and applies them."""

    enable_kv_events: bool = False
    ignored: Any = None


def kv_settings(flags: KvFlags, server: MasterServerConfig) -> None:
    """Fill ``server.kv_events`` from the flags (checked: :class:`InvalidArgumentError`)."""
    if not flags.enable_kv_events:
        return
    cfg = KvEventsConfig(**{f.name: getattr(flags, f.name) for f in fields(KvEventsConfig)})
    cfg.validate()
    server.kv_events = cfg


def ha_settings(flags: HaFlags, server: MasterServerConfig) -> None:
    """Fill ``server.ha`` / ``server.snapshot`` from the flags; raise
    :class:`InvalidArgumentError` naming what is wrong (an unsupported backend, no endpoints,
    snapshots without a place to keep them)."""
    from mooncake._engine.metadata.etcd import parse_endpoints
    from mooncake._store.ha import HaConfig
    from mooncake._store.snapshots import SnapshotConfig

    if flags.snapshot_retention_count < 1:
        raise InvalidArgumentError("--snapshot_retention_count must be >= 1")
    if flags.snapshot_interval_seconds <= 0:
        raise InvalidArgumentError("--snapshot_interval_seconds must be > 0")
    if flags.enable_ha:
        if flags.ha_backend_type != "etcd":
            raise InvalidArgumentError(
                f"--ha_backend_type={flags.ha_backend_type!r} is not supported by this master "
                "(only etcd: the replicated command log needs etcd's txn and watch)"
            )
        conn = flags.ha_backend_connstring or flags.etcd_endpoints
        if conn.startswith("etcd://"):
            conn = conn[len("etcd://") :]
        if not conn:
            raise InvalidArgumentError(
                "--enable_ha needs --ha_backend_connstring (or --etcd_endpoints): "
                "etcd members as host:port;host:port"
            )
        ha = HaConfig(
            endpoints=parse_endpoints(conn),
            cluster_id=flags.cluster_id,
            advertise=flags.ha_advertise_address,
            lease_ttl=flags.ha_lease_ttl,
            fast_failover=flags.ha_fast_failover,
            ack_mode=flags.ha_ack_mode,
            etcd_linger=flags.ha_etcd_linger_ms / 1000,
            snapshot_interval=flags.snapshot_interval_seconds,
            snapshot_log_entries=flags.snapshot_log_entries,
            snapshot_child_timeout=flags.snapshot_child_timeout_seconds,
            snapshot_retention=flags.snapshot_retention_count,
            snapshot_dir=flags.snapshot_backup_dir or None,
        )
        ha.validate()
        server.ha = ha
    elif flags.enable_snapshot or flags.enable_snapshot_restore:
        if not flags.snapshot_backup_dir:
            raise InvalidArgumentError(
                "--enable_snapshot without --enable_ha needs --snapshot_backup_dir "
                "(a local directory to keep the snapshots in)"
            )
        server.snapshot = SnapshotConfig(
            directory=flags.snapshot_backup_dir,
            cluster_id=flags.cluster_id,
            interval=flags.snapshot_interval_seconds,
            child_timeout=flags.snapshot_child_timeout_seconds,
            retention=flags.snapshot_retention_count,
            restore=flags.enable_snapshot_restore,
        )
        if not flags.enable_snapshot:  # restore only: no periodic snapshots
            server.snapshot.interval = float("inf")


@dataclass
class _Parsed:
    server: MasterServerConfig
    ha: HaFlags = field(default_factory=HaFlags)
    kv: KvFlags = field(default_factory=KvFlags)
    legacy_port: int = DEFAULT_RPC_PORT
    memory_allocator: str = "offset"
    version: bool = False
    help: bool = False
    verbosity: int = 0
    log_level: str = "INFO"
    tenant_connector: str = "file"


def parse_gflags(argv: Sequence[str], *, warn: Callable[[str], None] | None = None) -> _Parsed:
    """Parse ``mooncake_master`` gflags-style arguments into a config.

    Flags of the published binary this master does not implement are reported through
    ``warn`` and skipped (a following token that is not a flag is taken as their value). A
    flag the published binary does not have either, and bad values of known flags, raise
    :class:`InvalidArgumentError` naming the flag.
    """
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    parsed = _Parsed(MasterServerConfig(rpc_port=0))  # 0 until --rpc_port: then --port
    parsed.server.state = MasterConfig()
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        i += 1
        if not tok.startswith("-") or tok in ("-", "--"):
            warn(f"mooncake_master: ignoring stray argument {tok!r}")
            continue
        body = tok.lstrip("-")
        name, eq, value = body.partition("=")
        flag = _GFLAGS.get(name)
        if flag is None and name.startswith("no") and not eq:
            flag = _GFLAGS.get(name[2:])
            if flag is not None and flag.is_bool:
                name, eq, value = name[2:], "=", "false"
            else:
                flag = None
        if flag is None:
            if name not in PUBLISHED_FLAGS and name not in FRAMEWORK_FLAGS:
                near = difflib.get_close_matches(name, list(_GFLAGS), n=1)
                hint = f" (did you mean --{near[0]}?)" if near else ""
                raise InvalidArgumentError(
                    f"unknown flag --{name}{hint}; mooncake_master --help lists the flags"
                )
            if not eq and i < len(args) and not args[i].startswith("-"):
                i += 1  # its value
            warn(f"mooncake_master: flag --{name} is not supported by this master; ignored")
            continue
        if not eq:
            if flag.is_bool:
                value = "true"
            elif i < len(args):
                value = args[i]
                i += 1
            else:
                raise InvalidArgumentError(f"flag --{name} needs a value")
        try:
            v = flag.parse(value)
        except (ValueError, InvalidArgumentError) as e:
            raise InvalidArgumentError(f"flag --{name}={value!r}: {e}") from None
        _assign(parsed, flag.attr, v)
    if parsed.server.rpc_port == 0:
        parsed.server.rpc_port = parsed.legacy_port
    ha_settings(parsed.ha, parsed.server)
    kv_settings(parsed.kv, parsed.server)
    return parsed


def _assign(parsed: _Parsed, attr: str, value: Any) -> None:
    if attr.startswith("server."):
        setattr(parsed.server, attr[7:], value)
    elif attr.startswith("state."):
        setattr(parsed.server.state, attr[6:], value)
    elif attr.startswith("ha."):
        setattr(parsed.ha, attr[3:], value)
    elif attr.startswith("kv."):
        setattr(parsed.kv, attr[3:], value)
    else:
        setattr(parsed, attr, value)
