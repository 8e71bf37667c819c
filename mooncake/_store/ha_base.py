"""The interfaces of master high availability (:mod:`mooncake._store.ha`), in a leaf module.

Four narrow contracts, each implemented on one side and only asked for on the other, so
nothing here imports the server, the HA node or etcd:

* :class:`Replication`: what the server (:mod:`mooncake._store.master`) asks of its HA node;
* :class:`ReplicaHost`: what the HA node asks of the server it replicates;
* :class:`Election` and :class:`CommandLog`: leadership with fencing, and the replicated
  command log with its snapshots (the shape of Mooncake's own ``LeaderCoordinator`` and
  ``OpLogStore``): :mod:`mooncake._store.ha_etcd` implements them on etcd,
  :mod:`mooncake._store.ha_memory` in memory (failover tested without etcd);
* :class:`StreamNode`: what the replica stream (:mod:`mooncake._store.ha_stream`) asks of the
  node in ``--ha_ack_mode=replica``.

Errors: a backend call that could not reach (or was refused by) its store raises
:class:`~mooncake.errors.MetadataError`; the HA node retries or steps down, as the contract of
each of its loops says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._core import commands
    from mooncake._core.master import MasterConfig, MasterState
    from mooncake._store.snapshots import Snapshot

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LEASE_MARGIN",
    "CommandLog",
    "Election",
    "HaConfig",
    "HostConfig",
    "LogGap",
    "ReplicaHost",
    "Replication",
    "StreamNode",
    "view_key",
]

DEFAULT_LEASE_TTL = 5
#: the leader stops answering this long before its lease could have expired in etcd
LEASE_MARGIN = 0.5


def view_key(cluster_id: str) -> str:
    """The published key holding the leader's RPC address."""
    return f"mooncake-store/{cluster_id}/master_view"


@dataclass
class HaConfig:
    """Replication settings of a master (``--enable_ha`` and the snapshot flags)."""

    endpoints: list[str] = field(default_factory=list)
    """etcd base URLs (:func:`mooncake._engine.metadata.etcd.parse_endpoints`)."""
    cluster_id: str = "mooncake_cluster"
    lease_ttl: int = DEFAULT_LEASE_TTL
    advertise: str = ""
    """``host:port`` clients should reach this master at ("" = its RPC address and port)."""
    flush_linger: float = 0.1
    """Seconds entries nobody waits for (sweeps, lease-only calls) may wait for a txn."""
    snapshot_interval: float = 600.0
    snapshot_log_entries: int = 10_000
    snapshot_child_timeout: float = 300.0
    snapshot_retention: int = 2
    snapshot_dir: str | None = None
    """Also keep snapshot copies in this local directory."""
    fast_failover: bool = True
    """Standbys revoke a dead leader's lease once its RPC port is refused (module docstring)."""
    ack_mode: str = "etcd"
    """``etcd``: a mutation is acknowledged once its log entry is in etcd; ``replica``: once
    every in-sync standby holds it (:mod:`mooncake._store.ha_stream`), etcd written behind."""
    etcd_linger: float = 0.02
    """``replica``: while the in-sync set is not empty, the etcd append of an entry may wait
    this long for later entries to share its txn (the etcd lag an acknowledged entry can have;
    0: append at once)."""
    sync_timeout: float = 1.0
    """``replica``: a standby that has not acknowledged an entry this long leaves the in-sync
    set (acknowledgements wait at most this long for a stopped standby)."""

    def validate(self, *, need_endpoints: bool = True) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad setting
        (``need_endpoints=False``: a backend other than etcd is given)."""
        if need_endpoints and not self.endpoints:
            raise InvalidArgumentError("HA needs at least one etcd endpoint")
        if not self.cluster_id or "/" in self.cluster_id:
            raise InvalidArgumentError(f"bad cluster id {self.cluster_id!r}")
        if self.lease_ttl < 2:
            raise InvalidArgumentError(f"HA lease TTL must be >= 2 s, got {self.lease_ttl}")
        if self.snapshot_retention < 1:
            raise InvalidArgumentError("snapshot retention must be >= 1")
        if self.ack_mode not in ("etcd", "replica"):
            raise InvalidArgumentError(
                f"--ha_ack_mode must be etcd or replica, got {self.ack_mode!r}"
            )
        if not 0 <= self.etcd_linger <= 1:
            raise InvalidArgumentError(
                f"--ha_etcd_linger_ms must be 0-1000 ms, got {self.etcd_linger * 1000:g}"
            )
        if self.snapshot_interval <= 0 or self.snapshot_log_entries < 1:
            raise InvalidArgumentError("snapshot interval and log-length trigger must be > 0")


class LogGap(Exception):
    """The log no longer holds the entry after the applied one (compacted by a snapshot), or
    an entry does not decode: the master reloads from the newest snapshot."""


class Replication(Protocol):
    """What the server asks of the replication layer (:mod:`mooncake._store.ha`)."""

    def refusal(self) -> str | None:
        """None while this master leads and may answer; else why it may not (naming the
        leader when it knows one)."""

    def append(self, command: commands.Command) -> int:
        """Queue an applied command for the log; its ticket (increasing)."""

    @property
    def barrier(self) -> int:
        """The ticket of the last mutating command queued."""

    def mark_mutated(self) -> None:
        """The command queued last changed what clients can see (a sweep that evicted or
        expired something): later answers wait for it as for a mutation."""

    async def wait_durable(self, ticket: int) -> bool:
        """Until every command up to ``ticket`` is durable (True), or this master was deposed
        first (False: say nothing to the client)."""


class HostConfig(Protocol):
    """The part of the server's configuration HA reads."""

    @property
    def rpc_address(self) -> str: ...

    @property
    def state(self) -> MasterConfig: ...


class ReplicaHost(Protocol):
    """What the HA node asks of the server it replicates (a
    :class:`~mooncake._store.master.MasterServer`)."""

    state: MasterState
    """Replaced by the node when it (re)loads: a standby's state is rebuilt from the log."""
    clock_offset: float
    """Set by a new leader so the state's clock goes on from the last applied ``now``."""
    kv_publisher: Any
    """The KV event publisher or None (:func:`mooncake._store.kv_events.lead`)."""

    @property
    def config(self) -> HostConfig: ...

    @property
    def rpc_port(self) -> int: ...

    def now(self) -> float:
        """The state's clock."""

    def run_command(self, command: commands.Command) -> Any:
        """Apply (and, through :class:`Replication`, log) an internal command."""

    def close_connections(self) -> None:
        """Shut every client connection (a deposed leader: its clients re-resolve)."""


class Election(Protocol):
    """Leadership with fencing: at most one master holds the view at a time, each holding a
    **term** (increasing across holders) that fences its :class:`CommandLog` writes."""

    @property
    def holds_lease(self) -> bool:
        """Whether this master holds a lease (granted by :meth:`campaign`, until
        :meth:`release`)."""

    async def campaign(self, address: str, ttl: int) -> int | None:
        """Try to become leader under a lease of ``ttl`` seconds: the term if it won, None if
        another master holds the view. Raising, the lease may be held (the answer may have
        been lost after it won): the caller releases it."""

    async def keepalive(self) -> bool:
        """Renew the lease: False if it is gone (expired, revoked)."""

    async def release(self) -> None:
        """Give up the lease (and with it the view), if held; never raises."""

    async def leader(self) -> tuple[str, int] | None:
        """(address, term) of the master holding the view, or None when it is vacant."""

    async def watch(self, on_change: Callable[[bool], Awaitable[None]]) -> None:
        """Call ``on_change(present)`` on each change of the view until cancelled (returns or
        raises when the watch broke: the caller polls meanwhile)."""

    async def revoke_term(self, term: int, address: str) -> bool:
        """Revoke the lease of the leader of ``term`` if the view still belongs to that term
        (fast failover): True if this call removed it."""

    async def aclose(self) -> None: ...


class CommandLog(Protocol):
    """The replicated log (entries numbered 1, 2, ... each a batch of encoded commands), its
    snapshots and, in ``replica`` mode, the in-sync set and the stream's address. Every write
    is fenced by a term: it succeeds only while that term holds the :class:`Election`'s view."""

    async def append(self, entries: list[tuple[int, bytes]], term: int) -> bool:
        """Write the entries (each seq not written before) in one step: True once written
        (also when an earlier attempt wrote them and its answer was lost), False fenced."""

    async def read(self, first: int, limit: int) -> tuple[list[tuple[int, bytes]], bool]:
        """(Entries from ``first`` on in seq order, at most ``limit``; whether more may
        follow)."""

    async def watch(self, on_entry: Callable[[int, bytes | None], Awaitable[None]]) -> None:
        """Call ``on_entry(seq, data)`` for each entry written (``data`` None: deleted) until
        cancelled (returns or raises when the watch broke: the caller polls meanwhile)."""

    async def write_replicas(self, term: int, members: frozenset[str], stream: str | None) -> bool:
        """Write the in-sync set (and the stream's ``host:port`` unless None): False fenced."""

    async def read_isr(self) -> list[str]:
        """The in-sync set's members ([] when none is written)."""

    async def read_stream(self) -> tuple[str, int] | None:
        """(address, term) of the replication stream, or None."""

    async def newest_snapshot(self) -> Snapshot | None: ...

    async def write_snapshot(self, snap: Snapshot, term: int) -> bool:
        """Store ``snap``: False fenced (nothing usable written)."""

    async def compact(self, upto: int) -> None:
        """Drop snapshots beyond retention and the entries up to ``upto``."""

    async def aclose(self) -> None: ...


class StreamNode(Protocol):
    """What the replica stream (:mod:`mooncake._store.ha_stream`) asks of the HA node."""

    config: HaConfig
    role: str
    term: int
    applied_seq: int
    latest_seq: int
    adopted: int
    held: dict[int, bytes]
    held_term: int
    streaming: bool
    log: CommandLog

    @property
    def address(self) -> str:
        """``host:port`` clients (and the stream's leader) know this master by."""

    async def append_entries(self, entries: list[tuple[int, bytes]]) -> str | None:
        """Append fenced by the term, retrying: None once written, else why not."""

    def step_down(self, why: str) -> None: ...

    def replica_progress(self) -> None:
        """Acknowledge every batch up to the replica's acknowledged seq."""

    async def write_replica_keys(self, members: frozenset[str], stream: str | None) -> bool: ...

    def stream_term(self) -> int:
        """The term whose replication stream this standby should hold (0: none)."""

    def apply_held(self, committed: int) -> None:
        """The leader says its log is durable up to ``committed``: apply the held entries."""

    def apply_entry(self, seq: int, data: bytes) -> None:
        """Apply entry ``seq`` (the one after :attr:`applied_seq`); :class:`LogGap` if it does
        not decode."""

    def wake(self) -> None:
        """Wake the follow loop (it reads what it lacks from the log)."""

    @property
    def listen_host(self) -> str:
        """The host the leader's stream listener binds (its RPC address)."""
