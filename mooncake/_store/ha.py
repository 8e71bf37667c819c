"""Master high availability through etcd: election, the replicated command log, standbys.

::

    config = MasterServerConfig(rpc_port=0, ha=HaConfig(endpoints=parse_endpoints("h:2379")))
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, config)   # leader or standby; server.ha says

Keys (etcd, under ``mooncake-store/<cluster_id>/``, the published layout for the view key):

* ``master_view``: the leader's RPC address ``host:port``, bound to a 5 s lease
  (``lease_ttl``), created only if absent (a txn comparing its create revision with 0), kept
  alive every ``lease_ttl / 5``. Its create revision is the leader's **term**.
* ``log/<20-digit seq>``: one batch of commands (:mod:`mooncake._core.commands`), msgpack.
* ``snapshot/...``: see :mod:`mooncake._store.snapshots`.

Leader: every command it applies (RPC calls other than pure reads, sweeps, stall credits) is
queued; a flusher writes the queue as one log entry per txn (**group commit**: what arrives
while a txn is in flight goes into the next). The txn compares the ``master_view`` key's create
revision with the leader's term, so once another master won the key nothing of the old leader
is appended. A mutating call is answered only after its entry is durable; every other answer
waits for the entries of the mutations queued before it, so no client ever sees state that a
failover could take back (lease-only calls' own entries are not waited for: a failover may
lose their lease extensions, which ``Promote`` covers). A fence that fails, a lease that is
lost or not renewed within ``lease_ttl - LEASE_MARGIN`` of the last keep-alive sent: the
leader **steps down** at once: it stops answering, closes every client connection (unanswered
calls get no reply at all), revokes its lease, and rebuilds its state from etcd as a standby.

With ``ack_mode="replica"`` (``--ha_ack_mode=replica``) the flusher sends each entry to the
standbys' memory at once and appends to etcd behind; a mutation is answered once the in-sync
standbys hold its entry (or it is in etcd): :mod:`mooncake._store.ha_stream`, which also says
who may campaign then and what a winner appends first. A command larger than one entry is
refused before it is applied (a lease-only key scan is logged in parts instead), and a leader
whose append fails for longer than its lease steps down.

Standby: loads the newest snapshot and the log after it, tails the log (a watch wakes it, a
range read fetches; a poll every second covers a silent watch; in ``replica`` mode, while its
stream is up, it applies the streamed entries etcd holds instead and does not watch the log)
and applies every entry through :func:`commands.apply`, so its state equals the leader's
(allocators included). It answers
every client call but ``ServiceReady`` with ``UNAVAILABLE_IN_CURRENT_MODE`` (-1011, "not the
leader: ... leader=host:port"), having applied nothing, so clients re-resolve the leader. When ``master_view`` disappears it campaigns; the
winner finishes the log (nobody else can append by then), sets its state clock so it continues
from the last applied ``now``, appends ``Promote(now, seed)`` and serves once that is durable.

Snapshots (leader): every ``snapshot_interval`` seconds or ``snapshot_log_entries`` batches,
the state is serialized at a batch boundary (by a forked child: the loop pauses only for the
fork), written (fenced) to etcd (and ``snapshot_dir`` if
set), older snapshots beyond ``snapshot_retention`` are deleted, and so are the log entries at
or below the new snapshot's seq.

Fast failover (``fast_failover``, ``--ha_fast_failover``, on by default; the probe's I/O is
:mod:`mooncake._store.ha_probe`): a standby, while a
leader holds ``master_view``, connects to the leader's RPC address every 0.2 s (a plain TCP
connect, closed at once; one in flight). When the connects of that term were accepted before
and then ``PROBE_REFUSALS`` in a row are actively refused (ECONNREFUSED: the host answered and
nothing listens there), the standby re-reads the key, checks its create revision is still the
term it probed, and revokes the lease named in the key (``/v3/lease/revoke``): that deletes
the key and the standbys campaign at once instead of waiting for the TTL. Why a live leader is
never revoked: a master opens its RPC listener before it joins the election and closes it only
when the process leaves ``serve_master``, so it listens for its whole leadership; a live
leader's kernel accepts connects (even a stopped or overloaded one's: the backlog), and a
timeout, unreachable host or reset is never acted on, so a partitioned or stopped leader is
deposed only by its lease expiring, as without fast failover. A port reused by another process
accepts, so no revoke. A leader address this standby never reached (a wrong advertise address,
loopback seen from another host) is never revoked (:mod:`mooncake._core.leader_probe`). Lease
ids are unique, so the revoke can only delete the probed term's key, never a newer leader's.
If a leader's lease is revoked anyway (a firewall starting to reject with resets), it is the
same as its lease expiring: its next fenced txn fails and its keep-alive (run at once when its
watch sees the key deleted) reports the lease gone, and it steps down.
"""

from __future__ import annotations

import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import msgspec.structs

from mooncake._core import commands
from mooncake._core.commands import Command, Durability
from mooncake._core.master import MasterState
from mooncake._engine.metadata.etcd import EtcdKV, _b64, _unb64, prefix_end
from mooncake._store import kv_events
from mooncake._store.ha_probe import LeaderProbe, probe_connect
from mooncake._store.ha_stream import MAX_TXN_ENTRIES, ReplicaLeader, follow_stream, read_isr
from mooncake._store.snapshots import DirSnapshots, EtcdSnapshots, ForkedSnapshot, Snapshot
from mooncake.errors import InvalidArgumentError, MetadataError, MooncakeError

if TYPE_CHECKING:
    from mooncake._store.master import MasterServer

log = logging.getLogger("mooncake.master.ha")

__all__ = ["HaConfig", "HaNode", "probe_connect", "view_key"]

DEFAULT_LEASE_TTL = 5
#: the leader stops answering this long before its lease could have expired in etcd
LEASE_MARGIN = 0.5
#: a log entry holds at most about this many bytes of commands
MAX_ENTRY = 1 << 20
_POLL_S = 1.0
#: how often a paused log watch checks whether it is wanted again
_WATCH_CHECK_S = 0.05
_RANGE_LIMIT = 64


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

    def validate(self) -> None:
        if not self.endpoints:
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


class _Gap(Exception):
    """The log no longer holds the entry after the applied one (compacted by a snapshot)."""


class _Deposed(Exception):
    pass


def command_size(cmd: Command) -> int:
    """An upper bound of the bytes ``cmd`` takes in an encoded log entry."""
    keys = cmd.keys
    return len(cmd.params) + len(cmd.method) + 64 + (sum(len(k) + 5 for k in keys) if keys else 0)


def split_scan(cmd: Command, budget: int = MAX_ENTRY // 2) -> list[Command] | None:
    """A key-scan command as several scans of at most ``budget`` bytes each (None: not a
    scan, or one key alone is over the budget)."""
    if cmd.kind != "scan" or not cmd.keys:
        return None
    base = command_size(msgspec.structs.replace(cmd, keys=[]))
    parts: list[Command] = []
    chunk: list[str] = []
    size = base
    for k in cmd.keys:
        n = len(k) + 5
        if base + n > budget:
            return None
        if size + n > budget and chunk:
            parts.append(msgspec.structs.replace(cmd, keys=chunk))
            chunk, size = [], base
        chunk.append(k)
        size += n
    parts.append(msgspec.structs.replace(cmd, keys=chunk))
    return parts


def _is_mutating(cmd: Command) -> bool:
    if cmd.kind == "rpc":
        return commands.durability(cmd.method) is Durability.MUTATING
    return (cmd.kind == "scan" and cmd.method == "RemoveByRegex") or cmd.kind == "quota"


class HaNode:
    """One master's replication role (see the module docstring); ``server.ha`` is this."""

    def __init__(self, server: MasterServer, config: HaConfig) -> None:
        config.validate()
        self.server = server
        self.config = config
        self.etcd = EtcdKV(list(config.endpoints), lease_ttl=config.lease_ttl)
        pre = f"mooncake-store/{config.cluster_id}/"
        self.view_key = view_key(config.cluster_id)
        self.log_prefix = pre + "log/"
        self.stream_key = pre + "stream"
        self.isr_key = pre + "isr"
        self.replica: ReplicaLeader | None = None
        self.held: dict[int, bytes] = {}
        """``replica`` standby: entries streamed by the leader, not yet applied from etcd."""
        self.held_term = 0
        self.streaming = False
        """``replica`` standby: its replication stream is up (it applies from there, and does
        not watch the etcd log meanwhile)."""
        self._taken = 0
        self._seq_ticket: dict[int, int] = {}
        self.snapshots = EtcdSnapshots(self.etcd, pre + "snapshot/", config.snapshot_retention)
        self.local = (
            DirSnapshots(config.snapshot_dir, config.cluster_id, config.snapshot_retention)
            if config.snapshot_dir
            else None
        )
        self.role = "starting"
        self.serving = False
        self.leader_addr: str | None = None
        self.term = 0
        self.lease_id: str | None = None
        self.lease_deadline = 0.0
        # the view key as last read by a standby: its create revision (the leader's term)
        self._view_rev = 0
        self._probe = LeaderProbe(self.etcd, self.view_key, self._probe_target, self._revoked)
        self._lease_check = anyio.Event()
        self.applied_seq = 0
        self.latest_seq = 0
        self.snapshot_seq = 0
        self.last_now = 0.0
        self._last_now_local = 0.0
        self._from_scratch = True
        # leader side
        self._pending: list[Command] = []
        self._pending_bytes = 0
        self._ticket = 0
        self._durable = 0
        self._barrier = 0
        self._epoch = 0
        self._durable_changed = anyio.Event()
        self._flush_now = anyio.Event()
        self._deposed = anyio.Event()
        self._wake = anyio.Event()
        self._snap_due = False
        self._snap_last = 0.0
        self._snap_busy = False
        # counters
        self.batches = 0
        self.entries_applied = 0
        self.stepdowns = 0
        self.elections_won = 0
        self.apply_errors = 0
        self.config_mismatch = False
        self.early_revokes = 0
        self.adopted = 0
        self.stream_applied = 0
        self._commit_target = 0
        self._apply_wanted = anyio.Event()
        """``replica`` standby: entries applied from the stream (the rest came from etcd)."""
        """Entries a new leader held from the stream beyond the etcd log and appended."""

    # -- what the server asks ------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.config.advertise:
            return self.config.advertise
        host = self.server.config.rpc_address
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.server.rpc_port}"

    def refusal(self) -> str | None:
        if self.role == "leader":
            if anyio.current_time() >= self.lease_deadline:
                self._step_down("lease not renewed in time")
            elif self.serving:
                return None
            else:
                return "not the leader yet (taking over); retry"
        who = self.leader_addr
        return (
            f"not the leader: this master is a standby; leader={who}"
            if who
            else "not the leader: this master is a standby and no leader is known; retry"
        )

    def append(self, command: Command) -> int:
        """Queue ``command`` (applied next by the caller) for the log; its ticket.

        A command that would not fit one log entry (:data:`MAX_ENTRY`) is refused with
        :class:`InvalidArgumentError` before anything is applied, except a lease-only key scan
        (``GetReplicaListByRegex`` over many keys), which is logged as several scans of parts
        of its keys: applying them one after the other is applying it once."""
        if self.role != "leader":
            raise MooncakeError("append on a master that is not the leader")
        size = command_size(command)
        if size > MAX_ENTRY:
            parts = split_scan(command) if not _is_mutating(command) else None
            if parts is None:
                raise InvalidArgumentError(
                    f"{command.method or command.kind} would log {size} bytes, more than the "
                    f"{MAX_ENTRY} one replicated log entry holds; split the request "
                    "(a narrower pattern, fewer keys)"
                )
            for part in parts:
                self._queue(part, command_size(part))
            return self._ticket
        return self._queue(command, size)

    def _queue(self, command: Command, size: int) -> int:
        self._pending.append(command)
        self._pending_bytes += size
        self._ticket += 1
        if _is_mutating(command):
            self._barrier = self._ticket
            self._flush_now.set()
        return self._ticket

    @property
    def barrier(self) -> int:
        return self._barrier

    def mark_mutated(self) -> None:
        self._barrier = self._ticket
        self._flush_now.set()

    async def wait_durable(self, ticket: int) -> bool:
        epoch = self._epoch
        while self._durable < ticket:
            if self._epoch != epoch or self.role != "leader":
                return False
            ev = self._durable_changed
            self._flush_now.set()
            await ev.wait()
        if self._epoch != epoch:
            return False
        if anyio.current_time() >= self.lease_deadline:  # durable, but say nothing this late
            self._step_down("lease not renewed in time")
            return False
        return True

    # -- main loop -------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Follow, campaign, lead, step down, follow again ... until cancelled."""
        started = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, self.log_prefix, True)
                tg.start_soon(self._watch, self.view_key, False)
                if self.config.fast_failover:
                    tg.start_soon(self._probe.run)
                if self.config.ack_mode == "replica":
                    tg.start_soon(follow_stream, self)
                    tg.start_soon(self._apply_stream)
                while True:
                    try:
                        await self._load()
                        if not started:
                            started = True
                            task_status.started()
                        while True:
                            self.role = "standby"
                            await self._follow()
                            if await self._campaign():
                                break
                        await self._lead()
                    except (MetadataError, _Gap) as e:
                        log.warning("master HA: %s; retrying", e)
                        self._step_down(str(e))
                        self.role = "standby"
                        await anyio.sleep(0.5)
                    except Exception:  # a bug must not take the master down: start over
                        log.exception("master HA: unexpected failure; reloading")
                        self._step_down("unexpected failure")
                        self.role = "standby"
                        await anyio.sleep(1.0)
                    finally:
                        await self._release_lease()
        finally:
            with anyio.CancelScope(shield=True):
                await self.etcd.aclose()

    def _log_watch_wanted(self) -> bool:
        """A leader does not watch its own log, nor a standby that applies from its stream."""
        return self.role == "standby" and not self.streaming

    def apply_held(self, committed: int) -> None:
        """``replica`` standby: the leader says etcd holds its log up to ``committed``: the
        held entries up to there are applied (:meth:`_apply_stream`)."""
        if self.role != "standby" or committed <= self._commit_target:
            return
        self.latest_seq = max(self.latest_seq, committed)
        self._commit_target = committed
        self._apply_wanted.set()

    async def _apply_stream(self) -> None:
        """Apply held entries up to the leader's etcd watermark, one per scheduler turn (so
        the stream reader acknowledges what arrives meanwhile without waiting for a burst);
        a seq not held (from before the stream began) or one that does not decode wakes the
        follow loop, which reads it from etcd (and reloads on a bad one)."""
        while True:
            await self._apply_wanted.wait()
            self._apply_wanted = anyio.Event()
            while self.role == "standby" and self.applied_seq < self._commit_target:
                data = self.held.get(self.applied_seq + 1)
                if data is None:
                    self._wake.set()
                    break
                try:
                    self._apply_entry(self.applied_seq + 1, data)
                except _Gap:
                    self._wake.set()
                    break
                self.stream_applied += 1
                await anyio.lowlevel.checkpoint()

    async def _watch(self, key: str, is_log: bool) -> None:
        scope = anyio.CancelScope()

        async def on_event(k: str, value: bytes | None) -> None:
            if is_log and not self._log_watch_wanted():
                scope.cancel()  # leading, or streaming: resumed when that ends
                return
            if is_log and value is not None and self.role == "standby":
                try:
                    seq = int(k.rsplit("/", 1)[1])
                except ValueError:
                    return
                self.latest_seq = max(self.latest_seq, seq)
                if seq <= self.applied_seq:
                    return
                if seq == self.applied_seq + 1:
                    try:
                        self._apply_entry(seq, value)
                        return  # in order: nothing for the follow loop to read again
                    except _Gap:
                        pass  # the poll meets it too, and reloads
            if not is_log and value is None and self.role == "leader":
                self._lease_check.set()  # our key gone? the keep-alive asks etcd now
            self._wake.set()

        while True:
            while is_log and not self._log_watch_wanted():  # noqa: ASYNC110 (role flags)
                await anyio.sleep(_WATCH_CHECK_S)
            if is_log:
                self._wake.set()  # what was committed while it was off: the poll reads it
            scope = anyio.CancelScope()  # on_event cancels the current one
            with scope:
                try:
                    await self.etcd.watch(key, on_event)
                except MetadataError as e:
                    log.warning("master HA: watch on %s: %s", key, e)
                except Exception:  # only a wake-up: the poll still follows the log
                    log.exception("master HA: watch on %s failed", key)
            if not scope.cancel_called:
                await anyio.sleep(_POLL_S)

    # -- standby ---------------------------------------------------------------------------

    async def _load(self) -> None:
        """A fresh state: the newest snapshot (etcd, else the local copy) + the log after it."""
        cfg = self.server.config.state
        last: _Gap | None = None
        for _ in range(5):
            snap: Snapshot | None = await self.snapshots.newest()
            if snap is None and self.local is not None:
                snap = await self.local.newest()
            if snap is not None:
                state = MasterState.restore(snap.data, cfg)
                self.applied_seq = self.snapshot_seq = snap.seq
                self.last_now = snap.last_now
                self._from_scratch = False
            else:
                state = MasterState(cfg)
                self.applied_seq = self.snapshot_seq = 0
                self.last_now = 0.0
                self._from_scratch = True
            self._last_now_local = 0.0
            self.server.state = state
            try:
                await self._catch_up()
                log.info(
                    "master HA: state loaded (snapshot %d, log applied to %d)",
                    self.snapshot_seq,
                    self.applied_seq,
                )
                return
            except _Gap as e:
                last = e  # compacted meanwhile (a newer snapshot exists), or a bad entry
        raise _Gap(f"no snapshot plus log could be loaded (last: {last})")

    async def _catch_up(self) -> None:
        end = prefix_end(self.log_prefix.encode())
        while True:
            start = (self.log_prefix + f"{self.applied_seq + 1:020d}").encode()
            obj = await self.etcd.call(
                "/v3/kv/range",
                {"key": _b64(start), "range_end": _b64(end), "limit": _RANGE_LIMIT},
            )
            kvs = obj.get("kvs") or []
            for kv in kvs:
                key = _unb64(kv["key"]).decode()
                try:
                    seq = int(key.rsplit("/", 1)[1])
                except ValueError:
                    continue
                self.latest_seq = max(self.latest_seq, seq)
                if seq <= self.applied_seq:
                    continue
                if seq != self.applied_seq + 1:
                    raise _Gap(f"log entry {self.applied_seq + 1} is gone (next is {seq})")
                self._apply_entry(seq, _unb64(kv.get("value", "")))
            if len(kvs) < _RANGE_LIMIT:
                return

    def _apply_entry(self, seq: int, data: bytes) -> None:
        try:
            batch = commands.decode_commands(data)
        except InvalidArgumentError as e:
            # nothing after it can be applied safely: this master reloads (the newest snapshot,
            # once the leader took one past the entry, skips it) and may not lead meanwhile
            self.apply_errors += 1
            log.error("master HA: log entry %d does not decode: %s; reloading", seq, e)
            raise _Gap(f"log entry {seq} does not decode") from None
        state = self.server.state
        for cmd in batch:
            if cmd.kind == "promote" and cmd.config:
                mine = commands.config_fingerprint(self.server.config.state)
                if cmd.config != mine and not self.config_mismatch:
                    log.error(
                        "master HA: the leader runs with other state settings (%s, here %s): "
                        "this master's state will diverge; start every master of cluster %r "
                        "with the same flags",
                        cmd.config,
                        mine,
                        self.config.cluster_id,
                    )
                self.config_mismatch = cmd.config != mine
            try:
                commands.apply(state, cmd)
            except MooncakeError:
                pass  # the leader's call failed the same way
            except Exception:
                self.apply_errors += 1
                log.exception("master HA: applying %s from entry %d failed", cmd.method, seq)
            self.last_now = max(self.last_now, cmd.now)
        self._last_now_local = anyio.current_time()
        self.applied_seq = seq
        self.held.pop(seq, None)
        self.entries_applied += 1

    async def _follow(self) -> None:
        """Tail the log until ``master_view`` is vacant."""
        while True:
            await self._catch_up()
            obj = await self.etcd.call("/v3/kv/range", {"key": _b64(self.view_key)})
            kvs = obj.get("kvs") or []
            if not kvs:
                self.leader_addr = None
                self._view_rev = 0
                return
            addr = _unb64(kvs[0].get("value", "")).decode("utf-8", "replace")
            self._view_rev = int(kvs[0].get("create_revision", 0) or 0)
            if addr != self.leader_addr:
                log.info("master HA: following leader %s", addr)
            self.leader_addr = addr
            with anyio.move_on_after(_POLL_S):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _campaign(self) -> bool:
        obj = await self.etcd.call("/v3/kv/range", {"key": _b64(self.isr_key)})
        kvs = obj.get("kvs") or []
        isr = read_isr(_unb64(kvs[0].get("value", ""))) if kvs else []
        if isr and self.address not in isr:
            # the last leader acknowledged entries that only its in-sync standbys hold
            await anyio.sleep(0.2)
            return False
        sent = anyio.current_time()  # the lease runs from no earlier than this
        obj = await self.etcd.call("/v3/lease/grant", {"TTL": self.config.lease_ttl})
        if "ID" not in obj:
            raise MetadataError(f"etcd lease grant refused: {obj}")
        lid = str(obj["ID"])
        # held from here: if the txn's answer is lost (it may have won), the HA loop revokes
        # the lease, so this master does not follow itself until the lease ends
        self.lease_id = lid
        vk = _b64(self.view_key)
        r = await self.etcd.call(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": vk, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [
                    {"request_put": {"key": vk, "value": _b64(self.address), "lease": lid}}
                ],
            },
        )
        if not r.get("succeeded"):
            self.lease_id = None
            await self._revoke(lid)
            return False
        self.term = int(r["header"]["revision"])
        self.lease_deadline = sent + self.config.lease_ttl - LEASE_MARGIN
        self.elections_won += 1
        log.info("master HA: won the election (term %d) as %s", self.term, self.address)
        return True

    # -- leader ----------------------------------------------------------------------------

    async def _lead(self) -> None:
        self._deposed = anyio.Event()
        self._pending, self._pending_bytes = [], 0
        self._ticket = self._durable = self._barrier = self._taken = 0
        self._seq_ticket = {}
        self._epoch += 1
        self.role = "leader"
        self.serving = False
        self.leader_addr = self.address
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keepalive)
            try:
                await self._catch_up()  # the old leader is fenced: this is the whole log
            except (_Gap, MetadataError) as e:
                self._step_down(f"cannot finish the log: {e}")
            if self.role == "leader" and self.config.ack_mode == "replica":
                await self._start_replica(tg)
            if self.role == "leader":
                loop_now = anyio.current_time()
                target = self.last_now
                if self._last_now_local:
                    target += max(0.0, loop_now - self._last_now_local)
                self.server.clock_offset = target - loop_now
                genesis = self._from_scratch and self.applied_seq == 0
                kv_events.lead(self.server, self.term)  # a new stream: epoch = this term
                self.server.run_command(
                    commands.Promote(
                        self.server.now(),
                        secrets.randbits(63),
                        genesis=genesis,
                        config=commands.config_fingerprint(self.server.config.state),
                    )
                )
                self._snap_last = loop_now
                tg.start_soon(self._flusher, tg)
                if await self.wait_durable(self._ticket):
                    self.serving = True
                    log.info(
                        "master HA: leading at %s (term %d, log at %d)",
                        self.address,
                        self.term,
                        self.applied_seq,
                    )
            await self._deposed.wait()
            tg.cancel_scope.cancel()
        self.replica = None

    # -- replica acknowledgement (mooncake._store.ha_stream) ----------------------------------

    def stream_term(self) -> int:
        """The term whose replication stream this standby should hold (0: none)."""
        if self.role != "standby" or not self.leader_addr or self.config.ack_mode != "replica":
            return 0
        return self._view_rev

    async def _start_replica(self, tg: anyio.abc.TaskGroup) -> None:
        """Append and apply the entries this master holds beyond the etcd log (every entry the
        last leader acknowledged), then open the stream and name it with an empty in-sync
        set."""
        held, self.held = self.held, {}
        first = seq = self.applied_seq + 1
        while seq in held:
            chunk: list[tuple[int, bytes]] = []
            size = 0
            while seq in held and len(chunk) < MAX_TXN_ENTRIES:
                if chunk and size + len(held[seq]) > MAX_ENTRY:
                    break
                chunk.append((seq, held[seq]))
                size += len(held[seq])
                seq += 1
            refused = await self.append_entries(chunk)  # several a txn, as the stream wrote
            if refused is not None:
                self._step_down(refused)
                return
            for s, data in chunk:
                self._apply_entry(s, data)
                self.latest_seq = s
        self.adopted += seq - first
        if seq > first:
            log.info("master HA: appended %d held entries (%d to %d)", seq - first, first, seq - 1)
        rep = ReplicaLeader(self)
        await tg.start(rep.serve, self.server.config.rpc_address)
        host = self.address.rpartition(":")[0]
        if not await self.write_replica_keys(frozenset(), f"{host}:{rep.port}"):
            self._step_down("a newer leader holds master_view (stream key fenced)")
            return
        self.replica = rep
        tg.start_soon(rep.write_etcd)
        tg.start_soon(rep.keep_isr)

    def replica_progress(self) -> None:
        """Acknowledge every batch up to the replica's acknowledged seq."""
        rep = self.replica
        if rep is None:
            return
        ack = rep.ack_seq()
        t = self._durable
        pend = self._seq_ticket
        while pend:
            first = next(iter(pend))
            if first > ack:
                break
            t = pend.pop(first)
        if t > self._durable:
            self._durable = t
            ev, self._durable_changed = self._durable_changed, anyio.Event()
            ev.set()

    async def write_replica_keys(self, members: frozenset[str], stream: str | None) -> bool:
        """Write the in-sync set (and the stream address), fenced by the term."""
        import json

        ops = [
            {
                "request_put": {
                    "key": _b64(self.isr_key),
                    "value": _b64(json.dumps({"term": self.term, "members": sorted(members)})),
                }
            }
        ]
        if stream is not None:
            spec = json.dumps({"addr": stream, "term": self.term})
            ops.append({"request_put": {"key": _b64(self.stream_key), "value": _b64(spec)}})
        while self.role == "leader" and anyio.current_time() < self.lease_deadline:
            try:
                r = await self.etcd.call("/v3/kv/txn", {"compare": self._fence(), "success": ops})
            except MetadataError as e:
                log.warning("master HA: writing the in-sync set: %s; retrying", e)
                await anyio.sleep(0.1)
                continue
            return bool(r.get("succeeded"))
        return False

    def step_down(self, why: str) -> None:
        self._step_down(why)

    def _step_down(self, why: str) -> None:
        if self.role != "leader":
            return
        log.warning("master HA: stepping down (term %d): %s", self.term, why)
        self.role = "standby"
        self.serving = False
        self.leader_addr = None
        self.stepdowns += 1
        self._epoch += 1
        kv_events.stand_down(self.server)
        self._pending, self._pending_bytes = [], 0
        ev, self._durable_changed = self._durable_changed, anyio.Event()
        ev.set()
        self._deposed.set()
        self.server.close_connections()

    async def _keepalive(self) -> None:
        ttl = self.config.lease_ttl
        while self.role == "leader":
            with anyio.move_on_after(ttl / 5):
                await self._lease_check.wait()
            self._lease_check = anyio.Event()
            lid = self.lease_id
            if lid is None:
                return
            sent = anyio.current_time()
            try:
                with anyio.fail_after(ttl / 2):
                    obj = await self.etcd.call("/v3/lease/keepalive", {"ID": lid})
            except (MetadataError, TimeoutError) as e:
                log.warning("master HA: lease keep-alive failed: %s", e)
                continue
            result = obj.get("result", obj)
            if int(result.get("TTL", 0) or 0) <= 0:
                self._step_down("the lease expired in etcd")
                return
            self.lease_deadline = max(self.lease_deadline, sent + ttl - LEASE_MARGIN)

    async def _flusher(self, tg: anyio.abc.TaskGroup) -> None:
        cfg = self.config
        while self.role == "leader":
            with anyio.move_on_after(cfg.flush_linger):
                await self._flush_now.wait()
            self._flush_now = anyio.Event()
            now = anyio.current_time()
            if not self._snap_busy and (
                now - self._snap_last >= cfg.snapshot_interval
                or self.applied_seq - self.snapshot_seq >= cfg.snapshot_log_entries
            ):
                self._snap_due = True
            if not self._pending and not self._snap_due:
                continue
            # take at most MAX_ENTRY bytes of commands (the rest goes in the next entry)
            n, size = 0, 0
            for cmd in self._pending:
                more = command_size(cmd)
                if n and size + more > MAX_ENTRY:
                    break
                size += more
                n += 1
            batch = self._pending[:n]
            del self._pending[:n]
            self._pending_bytes = max(0, self._pending_bytes - size)
            seq = self.applied_seq + (1 if batch else 0)
            snap: tuple[int, ForkedSnapshot, float] | None = None
            if self._snap_due and not self._pending:  # the state is exactly "after seq"
                self._snap_due = False
                self._snap_last = now
                if seq > self.snapshot_seq:
                    try:  # forked here: the child sees the state exactly "after seq"
                        child = ForkedSnapshot(
                            self.server.state.snapshot, cfg.snapshot_child_timeout
                        )
                        snap = (seq, child, self.server.now())
                        self._snap_busy = True
                    except Exception:
                        log.exception("master HA: serializing the state failed")
            if batch:
                data = commands.encode_commands(batch)
                rep = self.replica
                if rep is not None:  # acknowledged by the standbys or etcd (ha_stream)
                    self._taken += len(batch)
                    self._seq_ticket[seq] = self._taken
                    rep.publish(seq, data)
                else:
                    refused = await self._append_entry(seq, data)
                    if refused is not None:
                        self._snap_busy = False
                        self._step_down(refused)
                        return
                    self._durable += len(batch)
                    ev, self._durable_changed = self._durable_changed, anyio.Event()
                    ev.set()
                self.applied_seq = self.latest_seq = seq
                self.last_now = max(self.last_now, batch[-1].now)
                self.batches += 1
            if self._pending:
                self._flush_now.set()
            if snap is not None:
                tg.start_soon(self._write_snapshot, *snap)

    def _fence(self) -> list[dict[str, Any]]:
        return [
            {
                "key": _b64(self.view_key),
                "target": "CREATE",
                "result": "EQUAL",
                "create_revision": str(self.term),
            }
        ]

    async def _append_entry(self, seq: int, data: bytes) -> str | None:
        return await self.append_entries([(seq, data)])

    async def append_entries(self, entries: list[tuple[int, bytes]]) -> str | None:
        """Write ``log/<seq>`` fenced by the term: None once written, else why not (fenced;
        unsure past the lease, then a successor decides; or etcd refused it for longer than
        ``lease_ttl``: a leader that cannot append must not keep its lease and wedge the
        cluster, so it steps down and a standby, or itself later, takes over)."""
        keys = [_b64(self.log_prefix + f"{s:020d}") for s, _ in entries]
        seq, data = entries[0]
        key = keys[0]
        body = {
            "compare": [
                *self._fence(),
                *(
                    {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                    for k in keys
                ),
            ],
            "success": [
                {"request_put": {"key": k, "value": _b64(d)}}
                for k, (_, d) in zip(keys, entries, strict=True)
            ],
            "failure": [
                {"request_range": {"key": _b64(self.view_key)}},
                {"request_range": {"key": key}},
            ],
        }
        fenced = "a newer leader holds master_view (log append fenced)"
        first_failure: float | None = None
        while True:
            now = anyio.current_time()
            if now >= self.lease_deadline:
                return "lease not renewed in time (log append unfinished)"
            if first_failure is not None and now - first_failure > self.config.lease_ttl:
                return f"log append {seq} failed for over {self.config.lease_ttl} s"
            try:
                r = await self.etcd.call("/v3/kv/txn", body)
            except MetadataError as e:
                log.warning("master HA: log append %d: %s; retrying", seq, e)
                if first_failure is None:
                    first_failure = now
                await anyio.sleep(0.1)
                continue
            if r.get("succeeded"):
                return None
            # an earlier attempt may have committed (its answer was lost)
            resp = r.get("responses") or []
            try:
                view = resp[0]["response_range"].get("kvs") or []
                entry = resp[1]["response_range"].get("kvs") or []
            except (IndexError, KeyError, AttributeError):
                return fenced
            mine = bool(view) and int(view[0].get("create_revision", 0)) == self.term
            written = mine and bool(entry) and _unb64(entry[0].get("value", "")) == data
            return None if written else fenced

    async def _write_snapshot(self, seq: int, child: ForkedSnapshot, last_now: float) -> None:
        try:
            snap = Snapshot(seq, await child.result(), last_now)
            while self.replica is not None and self.replica.etcd_seq < seq:
                self.replica.hurry.set()
                await anyio.sleep(0.01)
            if self.role != "leader":
                return
            if self.local is not None:
                await self.local.write(snap)
            if not await self.snapshots.write(snap, self._fence()):
                log.warning("master HA: snapshot %d fenced (no longer the leader)", snap.seq)
                return
            await self.snapshots.prune()
            end = (self.log_prefix + f"{snap.seq + 1:020d}").encode()
            await self.etcd.call(
                "/v3/kv/deleterange",
                {"key": _b64(self.log_prefix.encode()), "range_end": _b64(end)},
            )
            # reported once retention and compaction are done, so a reader of the status
            # never sees a snapshot whose older copies and log entries still linger
            self.snapshot_seq = max(self.snapshot_seq, snap.seq)
            log.info("master HA: snapshot at %d (%d bytes)", snap.seq, len(snap.data))
        except (MetadataError, OSError, InvalidArgumentError) as e:
            log.warning("master HA: snapshot %d failed: %s", seq, e)
        finally:
            self._snap_busy = False

    async def _revoke(self, lid: str) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await self.etcd.call("/v3/lease/revoke", {"ID": lid})
            except MetadataError as e:
                log.info("master HA: revoking lease %s: %s", lid, e)

    async def _release_lease(self) -> None:
        lid, self.lease_id = self.lease_id, None
        if lid is not None:
            await self._revoke(lid)

    # -- fast failover (standby) -----------------------------------------------------------

    def _probe_target(self) -> tuple[str, int] | None:
        """What fast failover probes: the leader this standby follows, and its term."""
        addr, term = self.leader_addr, self._view_rev
        if self.role != "standby" or not addr or not term or addr == self.address:
            return None
        return addr, term

    def _revoked(self) -> None:
        self.early_revokes += 1
        self._wake.set()

    # -- introspection ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The ``ha`` part of ``/status`` (and ``/ha_status``)."""
        now = anyio.current_time()
        leader = self.role == "leader" and self.serving
        lag = self._ticket - self._durable if leader else max(0, self.latest_seq - self.applied_seq)
        return {
            "role": "leader" if leader else "standby",
            "leader": self.leader_addr or "",
            "address": self.address,
            "cluster_id": self.config.cluster_id,
            "term": self.term if self.role == "leader" else 0,
            "lease_ttl": self.config.lease_ttl,
            "lease_remaining": max(0.0, self.lease_deadline - now) if leader else 0.0,
            "applied_seq": self.applied_seq,
            "log_lag": lag,
            "last_snapshot_seq": self.snapshot_seq,
            "batches": self.batches,
            "entries_applied": self.entries_applied,
            "elections_won": self.elections_won,
            "stepdowns": self.stepdowns,
            "apply_errors": self.apply_errors,
            "config_mismatch": self.config_mismatch,
            "fast_failover": self.config.fast_failover,
            "early_revokes": self.early_revokes,
            "ack_mode": self.config.ack_mode,
            "in_sync": len(self.replica.isr) if self.replica is not None else 0,
            "held": len(self.held),
            "adopted": self.adopted,
            "stream_applied": self.stream_applied,
        }
