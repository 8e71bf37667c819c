"""``mooncake master`` and the ``mooncake_master`` console script: the store master.

Two spellings of the same flags:

* ``mooncake master --rpc-port 50051 --client-ttl 10 ...`` (argparse, dashes);
* ``mooncake_master --rpc_port=50051 --client_ttl=10 ...``: the published binary's gflags
  spellings (``--flag=value``, ``--flag value``, ``-flag=value``, ``--bool_flag`` /
  ``--bool_flag=true|false`` / ``--nobool_flag``), so deployment scripts and benchmarks written
  for the published master start this one unchanged. Published flags this master does not
  implement are accepted with a warning on stderr; a flag the published binary does not have
  either (a typo such as ``--rpc_prot``) is refused, as gflags refuses it, naming the nearest
  real flag. ``mooncake_master --help`` lists every flag with its meaning and default. The
gflags table and its parsers are in :mod:`mooncake._cli.master_flags`.

Differences from the published binary, on purpose: both RPC and metrics bind loopback unless
told otherwise (the published default is 0.0.0.0). ``--rpc_port=0`` means ``--port`` (default
50051) in the gflags spelling, as published; ``mooncake master --rpc-port 0`` binds any free
port. Once every port is bound the master prints one line
``mooncake master: rpc=HOST:PORT metrics=HOST:PORT|off metadata=URL|off`` on stdout (plus
`` ha=etcd cluster=ID`` with ``--enable_ha``; the role, leader or standby, is in ``/status``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from mooncake._cli._published_flags import PUBLISHED_FLAGS
from mooncake._cli._quiet import port_arg, run_server
from mooncake._cli.master_flags import (
    _GFLAGS,
    HaFlags,
    KvFlags,
    _bool,
    _ratio,
    ha_settings,
    kv_settings,
    parse_duration,
    parse_gflags,
)
from mooncake._core.master import ALLOCATION_STRATEGIES, MasterConfig
from mooncake._store.master_config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_RPC_PORT,
    MasterServerConfig,
)
from mooncake.errors import InvalidArgumentError

log = logging.getLogger("mooncake.master")

__all__ = [
    "HaFlags",
    "gflags_main",
    "ha_settings",
    "parse_duration",
    "parse_gflags",
    "register",
    "run_master",
]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mooncake-py")
    except Exception:
        return "unknown"


#: gen-2 threshold of the master process: automatic full collections never run
_NO_FULL_GC = 1 << 30


def _no_full_collections() -> None:
    """Stop the collector's automatic full collections in the master process.

    A full collection walks every tracked object: the objects in flight, the miss ledger and
    every other record of the state (before the compact object table, a few Python objects
    per stored object: one full collection took ~0.7 s at 200 k objects and stalled every
    call). The state frees its objects by reference count (its operations leave no reference
    cycles), so only the
    young generations, where short-lived cycles of the RPC path die, keep collecting; what
    was allocated up to start-up is frozen out of them too. ``gc.collect()`` still works.
    """
    gc.freeze()
    g0, g1, _ = gc.get_threshold()
    gc.set_threshold(g0, g1, _NO_FULL_GC)


def run_master(config: MasterServerConfig, *, memory_allocator: str = "offset") -> int:
    """Run the master in the foreground until interrupted; returns the exit status."""
    import trio

    from mooncake._store.master import serve_master

    if memory_allocator != "offset":
        print(
            f"mooncake master: --memory_allocator={memory_allocator} is not available; "
            "only 'offset' is implemented",
            file=sys.stderr,
        )
        return 2
    try:
        config.state.validate()
    except InvalidArgumentError as e:
        print(f"mooncake master: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_master, config)
            _no_full_collections()
            metrics = (
                f"{config.metrics_host}:{server.metrics_port}" if server.metrics_port else "off"
            )
            metadata = (
                f"http://{config.http_metadata_server_host}:{server.http_metadata_port}/metadata"
                if server.http_metadata_port
                else "off"
            )
            ha = f" ha=etcd cluster={config.ha.cluster_id}" if config.ha is not None else ""
            print(
                f"mooncake master: rpc={config.rpc_address}:{server.rpc_port} "
                f"metrics={metrics} metadata={metadata}{ha}",
                flush=True,
            )
            if config.ha is not None and threading.current_thread() is threading.main_thread():
                # SIGTERM stops a replicated master cleanly: it revokes its lease on the way
                # out, so a standby takes over at once instead of after the lease TTL
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        log.info("master: SIGTERM, shutting down")
                        nursery.cancel_scope.cancel()
                        break

    # Ctrl-C: exit 0 quietly; a port in use or a bad setting: one line, exit 1
    return run_server("mooncake master", lambda: trio.run(main))


def _setup_logging(level: str) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: an HA master's etcd traffic (lease keep-alives, log
    # polls) would be several lines a second; they show at DEBUG
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(lvl if lvl <= logging.DEBUG else max(lvl, logging.WARNING))


#: this master's defaults where they differ from the published binary's
_OWN_DEFAULTS = {
    "rpc_address": "127.0.0.1",
    "metrics_host": "127.0.0.1",
    "http_metadata_server_host": "127.0.0.1",
    "kv_events_bind_endpoint": f'"{KvFlags.bind_endpoint}"',
    "kv_events_backend_id": f'"{KvFlags.backend_id}"',
}


#: flags of this master the published binary does not document: type, default, meaning
_OWN_FLAGS: dict[str, tuple[str, str, str]] = {
    "eviction_policy": (
        "string",
        "lru",
        "eviction policy: lru, lfu, fifo, sieve, s3fifo, prefix_lru (docs/policies.md)",
    ),
    "demote_timeout_sec": (
        "double",
        "30",
        "seconds a demotion to a client's SSD tier may take before the object is dropped",
    ),
    "ha_advertise_address": (
        "string",
        "",
        "host:port clients reach this master at (default: rpc_address:rpc_port)",
    ),
    "ha_lease_ttl": ("int32", "5", "seconds of the leader's etcd lease"),
    "tenant_quota": (
        "string",
        "",
        "per-tenant quotas NAME=BYTES[/OBJECTS],... (B/KB/MB/GB/TB; 0 = unlimited;"
        " docs/store.md, Tenants)",
    ),
    "ha_fast_failover": (
        "bool",
        "true",
        "a standby takes over once the leader's RPC port refuses connections",
    ),
    "snapshot_log_entries": ("int32", "10000", "HA: also snapshot after this many log batches"),
    "ha_ack_mode": (
        "string",
        "etcd",
        "HA: when a mutation is acknowledged: etcd (its log entry is in etcd) or replica (held"
        " by every in-sync standby, etcd written behind; docs/store.md)",
    ),
    "kv_events_replay_endpoint": (
        "string",
        KvFlags.replay_endpoint,
        "ZMQ ROUTER address serving replays of recent KV event batches (vLLM's protocol)",
    ),
    "kv_events_buffer_steps": (
        "int32",
        str(KvFlags.buffer_steps),
        "KV event batches kept for replay",
    ),
    "kv_events_flush_delay": (
        "double",
        f"{KvFlags.flush_delay:g}",
        "seconds a KV event may wait to be published while events keep coming (fuller batches)",
    ),
    "kv_events_heartbeat_interval": (
        "double",
        f"{KvFlags.heartbeat_interval:g}",
        "seconds between empty KV event batches on an idle stream (0: none)",
    ),
    "ha_etcd_linger_ms": (
        "double",
        "20",
        "HA replica mode: ms an etcd log append may wait to carry later entries too (the etcd"
        " lag of an acknowledged entry; 0: at once)",
    ),
    "version": ("bool", "false", "show the version and exit"),
    "help": ("bool", "false", "show this help and exit"),
    "helpfull": ("bool", "false", "show this help and exit"),
    "helpshort": ("bool", "false", "show this help and exit"),
    "v": ("int32", "0", "verbose logging level (glog's -v)"),
    "log_level": ("string", "INFO", "log level: DEBUG, INFO, WARNING, ERROR"),
}


def gflags_help() -> str:
    """``mooncake_master --help``: every flag with its meaning and default."""
    lines = [
        "mooncake_master (mooncake-py): the Mooncake Store master.",
        "Usage: mooncake_master [--flag=value | --flag value | --bool_flag | --nobool_flag]...",
        "",
        "Flags:",
    ]
    for name in sorted(_GFLAGS):
        typ, default, meaning = PUBLISHED_FLAGS.get(name) or _OWN_FLAGS[name]
        shown = _OWN_DEFAULTS.get(name, default) or '""'
        lines.append(f"  --{name} ({typ}, default: {shown})")
        if meaning:
            lines.append(f"      {meaning}")
    ignored = sorted(set(PUBLISHED_FLAGS) - set(_GFLAGS))
    lines += [
        "",
        "Accepted for compatibility and ignored (with a warning): "
        + ", ".join(f"--{n}" for n in ignored),
        "",
        "Any other flag is refused.",
    ]
    return "\n".join(lines)


def gflags_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mooncake_master`` console script (published flag spellings)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parsed = parse_gflags(argv)
    except InvalidArgumentError as e:
        print(f"mooncake_master: {e}", file=sys.stderr)
        return 2
    if parsed.help:
        print(gflags_help())
        return 0
    if parsed.version:
        print(f"mooncake_master version {_version()} (mooncake-py)")
        return 0
    _setup_logging(parsed.log_level)
    return run_master(parsed.server, memory_allocator=parsed.memory_allocator)


# -- mooncake master (argparse) -----------------------------------------------------------------


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "master",
        help="run the Mooncake Store master (metadata and allocation)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    d = MasterConfig()
    p.add_argument("--rpc-address", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--rpc-port", type=port_arg, default=DEFAULT_RPC_PORT, help="0 = any free port")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument(
        "--metrics-port", type=port_arg, default=DEFAULT_METRICS_PORT, help="0 = any free port"
    )
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics and /health")
    p.add_argument("--client-ttl", default=str(d.client_ttl), help="seconds (or 500ms, 1m ...)")
    p.add_argument("--default-kv-lease-ttl", default="10000", help="read lease, ms (or 10s ...)")
    p.add_argument("--default-kv-soft-pin-ttl", default="30m", help="ms (or 30m ...)")
    p.add_argument("--max-kv-soft-pin-ttl", default="24h", help="ms (or 24h ...)")
    p.add_argument(
        "--allow-evict-soft-pinned-objects", type=_bool, default=True, metavar="true|false"
    )
    p.add_argument(
        "--eviction-high-watermark-ratio", type=_ratio, default=d.eviction_high_watermark_ratio
    )
    p.add_argument("--eviction-ratio", type=_ratio, default=d.eviction_ratio)
    p.add_argument(
        "--eviction-policy",
        default=d.eviction_policy,
        help="lru (default), lfu, fifo, sieve, s3fifo, prefix_lru",
    )
    p.add_argument(
        "--tenant-quota",
        default="",
        help="per-tenant quotas NAME=BYTES[/OBJECTS],... (docs/store.md, Tenants)",
    )
    p.add_argument(
        "--allocation-strategy", default=d.allocation_strategy, choices=ALLOCATION_STRATEGIES
    )
    p.add_argument("--put-start-discard-timeout-sec", default=str(d.put_start_discard_timeout))
    p.add_argument("--put-start-release-timeout-sec", default=str(d.put_start_release_timeout))
    p.add_argument(
        "--offload-on-evict",
        type=_bool,
        default=d.offload_on_evict,
        metavar="true|false",
        help="demote evicted objects to the owning client's SSD tier when it has one",
    )
    p.add_argument("--demote-timeout-sec", default=str(d.demote_timeout))
    p.add_argument("--enable-http-metadata-server", action="store_true")
    p.add_argument("--http-metadata-server-host", default="127.0.0.1")
    p.add_argument("--http-metadata-server-port", type=port_arg, default=8080)
    p.add_argument("--seed", type=int, default=None, help="seed of the random placement")
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="require the cluster secret in this file (default: $MOONCAKE_CLUSTER_SECRET, if set)",
    )
    h = p.add_argument_group(
        "high availability and snapshots",
        "Several masters with --enable-ha and the same etcd and --cluster-id: one leads (the "
        "etcd key mooncake-store/<cluster_id>/master_view holds its address), the others "
        "tail its command log and take over when its 5 s lease ends; every mutation a "
        "client is told succeeded is in etcd first. Without HA, --enable-snapshot keeps "
        "periodic snapshots in --snapshot-backup-dir and --enable-snapshot-restore starts "
        "from the newest one.",
    )
    h.add_argument("--enable-ha", action="store_true", help="replicate through etcd")
    h.add_argument("--ha-backend-type", default="etcd", help="etcd (the only one supported)")
    h.add_argument("--ha-backend-connstring", default="", help="etcd members: host:port;host:port")
    h.add_argument("--etcd-endpoints", default="", help="legacy spelling of the connstring")
    h.add_argument("--cluster-id", default="mooncake_cluster", help="key namespace in etcd")
    h.add_argument(
        "--ha-advertise-address",
        default="",
        help="host:port clients reach this master at (default: --rpc-address:--rpc-port)",
    )
    h.add_argument(
        "--ha-lease-ttl",
        type=int,
        default=5,
        help="seconds of the leader's etcd lease (published: 5); a standby takes over this "
        "long after the leader dies",
    )
    h.add_argument(
        "--ha-fast-failover",
        default="true",
        help="true/false (default true): a standby revokes the leader's lease once the "
        "leader's RPC port, which accepted before, refuses connections (the process is "
        "gone); timeouts and unreachable hosts still wait for the lease",
    )
    h.add_argument(
        "--ha-ack-mode",
        default="etcd",
        choices=["etcd", "replica"],
        help="when a replicated leader acknowledges a mutation: etcd (default) once its log "
        "entry is in etcd; replica once every in-sync standby holds it in memory (etcd "
        "written behind; see docs/store.md for what each loses)",
    )
    h.add_argument(
        "--ha-etcd-linger-ms",
        type=float,
        default=20.0,
        help="replica mode: ms an etcd log append may wait so later entries share its txn "
        "(default 20; the most an acknowledged entry lags behind in etcd; 0: at once)",
    )
    h.add_argument("--enable-snapshot", action="store_true", help="take periodic snapshots")
    h.add_argument(
        "--enable-snapshot-restore", action="store_true", help="start from the newest snapshot"
    )
    h.add_argument("--snapshot-interval-seconds", default="600", help="seconds (or 10m ...)")
    h.add_argument(
        "--snapshot-log-entries",
        type=int,
        default=10_000,
        help="HA: also snapshot after this many log batches",
    )
    h.add_argument(
        "--snapshot-child-timeout-seconds",
        default="300",
        help="a snapshot's serializing child gets this long",
    )
    h.add_argument("--snapshot-retention-count", type=int, default=2)
    h.add_argument("--snapshot-backup-dir", default="", help="local directory for snapshot files")
    k = p.add_argument_group("KV events (ZMQ; upstream's kv_events_* flags, mooncake.kv_events)")
    k.add_argument("--enable-kv-events", action="store_true", help="publish KV cache events")
    k.add_argument(
        "--kv-events-bind-endpoint",
        default=KvFlags.bind_endpoint,
        help="ZMQ PUB address (tcp://127.0.0.1:* picks a free port; see /kv_events/status)",
    )
    k.add_argument("--kv-events-backend-id", default=KvFlags.backend_id)
    k.add_argument("--kv-events-tenant-id", default=KvFlags.tenant_id)
    k.add_argument(
        "--kv-events-replay-endpoint",
        default=KvFlags.replay_endpoint,
        help="ZMQ ROUTER for replays",
    )
    k.add_argument("--kv-events-buffer-steps", type=int, default=KvFlags.buffer_steps)
    k.add_argument("--kv-events-queue-capacity", type=int, default=KvFlags.queue_capacity)
    k.add_argument(
        "--kv-events-flush-delay",
        default=str(KvFlags.flush_delay),
        help="seconds an event may wait to be published while events keep coming (0: at once)",
    )
    k.add_argument(
        "--kv-events-heartbeat-interval",
        default=str(KvFlags.heartbeat_interval),
        help="seconds between empty batches on an idle stream (0: none)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run_args)


def _run_args(args: argparse.Namespace) -> int:
    try:
        state = MasterConfig(
            default_kv_lease_ttl=parse_duration(args.default_kv_lease_ttl, "ms"),
            default_kv_soft_pin_ttl=parse_duration(args.default_kv_soft_pin_ttl, "ms"),
            max_kv_soft_pin_ttl=parse_duration(args.max_kv_soft_pin_ttl, "ms"),
            allow_evict_soft_pinned_objects=args.allow_evict_soft_pinned_objects,
            eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
            eviction_ratio=args.eviction_ratio,
            eviction_policy=args.eviction_policy,
            tenant_quotas=args.tenant_quota,
            client_ttl=parse_duration(args.client_ttl, "s"),
            put_start_discard_timeout=parse_duration(args.put_start_discard_timeout_sec, "s"),
            put_start_release_timeout=parse_duration(args.put_start_release_timeout_sec, "s"),
            allocation_strategy=args.allocation_strategy,
            offload_on_evict=args.offload_on_evict,
            demote_timeout=parse_duration(args.demote_timeout_sec, "s"),
            seed=args.seed,
        )
        from mooncake._core.policies import make_policy

        make_policy(state.eviction_policy)
        from mooncake._cli.metadata_server import read_secret_file

        secret = read_secret_file(args.cluster_secret_file)
        flags = HaFlags(
            enable_ha=args.enable_ha,
            ha_backend_type=args.ha_backend_type,
            ha_backend_connstring=args.ha_backend_connstring,
            etcd_endpoints=args.etcd_endpoints,
            cluster_id=args.cluster_id,
            ha_advertise_address=args.ha_advertise_address,
            ha_lease_ttl=args.ha_lease_ttl,
            ha_fast_failover=_bool(args.ha_fast_failover),
            ha_ack_mode=args.ha_ack_mode,
            ha_etcd_linger_ms=args.ha_etcd_linger_ms,
            enable_snapshot=args.enable_snapshot,
            enable_snapshot_restore=args.enable_snapshot_restore,
            snapshot_interval_seconds=parse_duration(args.snapshot_interval_seconds, "s"),
            snapshot_log_entries=args.snapshot_log_entries,
            snapshot_child_timeout_seconds=parse_duration(args.snapshot_child_timeout_seconds, "s"),
            snapshot_retention_count=args.snapshot_retention_count,
            snapshot_backup_dir=args.snapshot_backup_dir,
        )
    except (InvalidArgumentError, OSError) as e:
        print(f"mooncake master: {e}", file=sys.stderr)
        return 2
    config = MasterServerConfig(
        rpc_address=args.rpc_address,
        rpc_port=args.rpc_port,
        enable_metric_reporting=not args.no_metrics,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        enable_http_metadata_server=args.enable_http_metadata_server,
        http_metadata_server_host=args.http_metadata_server_host,
        http_metadata_server_port=args.http_metadata_server_port,
        cluster_secret=secret,
        state=state,
    )
    try:
        ha_settings(flags, config)
        kv_settings(
            KvFlags(
                enable_kv_events=args.enable_kv_events,
                bind_endpoint=args.kv_events_bind_endpoint,
                backend_id=args.kv_events_backend_id,
                tenant_id=args.kv_events_tenant_id,
                replay_endpoint=args.kv_events_replay_endpoint,
                buffer_steps=args.kv_events_buffer_steps,
                queue_capacity=args.kv_events_queue_capacity,
                heartbeat_interval=parse_duration(args.kv_events_heartbeat_interval, "s"),
                flush_delay=parse_duration(args.kv_events_flush_delay, "s"),
            ),
            config,
        )
    except InvalidArgumentError as e:
        print(f"mooncake master: {e}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    return run_master(config)


if __name__ == "__main__":
    sys.exit(gflags_main())
