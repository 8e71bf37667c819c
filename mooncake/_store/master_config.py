"""The master server's settings: where it listens, its bounds, and which parts are on.

A leaf module (:mod:`mooncake._store.master` re-exports :class:`MasterServerConfig`), so the
command line, tests and tools can build a configuration without importing the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake._core.master import MasterConfig
from mooncake._store.keyscan import DEFAULT_BUDGET_S

if TYPE_CHECKING:
    from mooncake._store.ha_base import HaConfig
    from mooncake._store.kv_events import KvEventsConfig
    from mooncake._store.snapshots import SnapshotConfig

__all__ = [
    "DEFAULT_METRICS_PORT",
    "DEFAULT_RPC_PORT",
    "DEFAULT_SERVER_MAX_FRAME",
    "MasterServerConfig",
]

DEFAULT_RPC_PORT = 50051
DEFAULT_METRICS_PORT = 9003
DEFAULT_SERVER_MAX_FRAME = 16 << 20


@dataclass
class MasterServerConfig:
    """Where the master listens and how; ``state`` holds the metadata rules' settings."""

    rpc_address: str = "127.0.0.1"
    rpc_port: int = DEFAULT_RPC_PORT
    enable_metric_reporting: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = DEFAULT_METRICS_PORT
    enable_http_metadata_server: bool = False
    http_metadata_server_host: str = "127.0.0.1"
    http_metadata_server_port: int = 8080
    sweep_interval: float = 0.05
    max_frame: int = DEFAULT_SERVER_MAX_FRAME
    max_connections: int = 4096
    #: seconds from accept to the first byte
    request_timeout: float = 10.0
    #: seconds a begun frame may go without a byte
    progress_timeout: float = 20.0
    #: seconds a connection may sit between frames
    idle_timeout: float = 300.0
    #: bytes per second a frame must move on average, either way: one must be done within
    #: ``progress_timeout`` + its size / ``min_rate`` of its first byte
    min_rate: float = 64 << 10
    #: bytes of answers one connection gets per pass: it is not read again until they are sent
    reply_batch: int = 1 << 20
    #: bytes of unsent answers the master holds for all connections together; a connection
    #: whose unsent answers would not fit is closed
    reply_budget: int = 512 << 20
    #: the cluster secret clients must prove (None: ``$MOONCAKE_CLUSTER_SECRET``; "": off)
    cluster_secret: str | None = None
    regex_budget: float = DEFAULT_BUDGET_S
    state: MasterConfig = field(default_factory=MasterConfig)
    #: replicate the state through etcd (leader election, command log, standbys); None: off
    ha: HaConfig | None = None
    #: periodic snapshots to a local directory without HA (``--enable_snapshot``); None: off
    snapshot: SnapshotConfig | None = None
    #: threads serving the RPC connections where possible (trio's real clock, no
    #: replication: :mod:`mooncake._store.rpc_thread`); 0: every connection on the loop
    rpc_threads: int = 2
    #: publish KV events over ZMQ (``--enable_kv_events``: :mod:`mooncake._store.kv_events`)
    kv_events: KvEventsConfig | None = None
