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

Shape (as raft implementations are split): the commit queue is sans-I/O
(:class:`mooncake._core.commitlog.CommitQueue`: tickets, barrier, durable, epoch); leadership
and the log are the :class:`~mooncake._store.ha_base.Election` and
:class:`~mooncake._store.ha_base.CommandLog` interfaces, on etcd by default
(:mod:`mooncake._store.ha_etcd`; :mod:`mooncake._store.ha_memory` for tests without etcd);
:class:`HaNode` here is the driver (the role loop, the flusher, applying entries); the server
is reached only through :class:`~mooncake._store.ha_base.ReplicaHost`, so nothing here imports
it.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Any

import anyio
import anyio.abc

from mooncake._core import commands
from mooncake._core.commands import Command
from mooncake._core.commitlog import MAX_ENTRY, CommitQueue, command_size, split_scan
from mooncake._core.master import MasterState
from mooncake._engine.metadata.etcd import EtcdKV
from mooncake._store import kv_events
from mooncake._store.ha_base import (
    DEFAULT_LEASE_TTL,
    LEASE_MARGIN,
    CommandLog,
    Election,
    HaConfig,
    LogGap,
    ReplicaHost,
    view_key,
)
from mooncake._store.ha_probe import LeaderProbe, probe_connect
from mooncake._store.ha_stream import HeldEntries, ReplicaLeader, follow_stream, start_replica
from mooncake._store.snapshots import DirSnapshots, EtcdSnapshots, ForkedSnapshot, Snapshot
from mooncake.errors import InvalidArgumentError, MetadataError, MooncakeError

log = logging.getLogger("mooncake.master.ha")

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LEASE_MARGIN",
    "MAX_ENTRY",
    "HaConfig",
    "HaNode",
    "command_size",
    "probe_connect",
    "split_scan",
    "view_key",
]

_POLL_S = 1.0
#: how often a paused log watch checks whether it is wanted again
_WATCH_CHECK_S = 0.05
_RANGE_LIMIT = 64


_Gap = LogGap  # its name inside this module (and to the tests that load through it)


class HaNode:
    """One master's replication role (see the module docstring); ``server.ha`` is this.

    ``election`` and ``log``: the backend (both or neither; default: etcd at
    ``config.endpoints``, whose client is :attr:`etcd`)."""

    def __init__(
        self,
        server: ReplicaHost,
        config: HaConfig,
        *,
        election: Election | None = None,
        log: CommandLog | None = None,
    ) -> None:
        if (election is None) != (log is None):
            raise InvalidArgumentError("HaNode takes both an election and a log, or neither")
        config.validate(need_endpoints=election is None)
        self.server = server
        self.config = config
        self.view_key = view_key(config.cluster_id)
        self.etcd: EtcdKV | None = None
        """The etcd client (None with another backend)."""
        self.snapshots: EtcdSnapshots | None = None
        if election is None or log is None:
            from mooncake._store.ha_etcd import etcd_backend

            self.etcd, etcd_election, etcd_log = etcd_backend(config)
            self.log_prefix = etcd_log.log_prefix
            self.snapshots = etcd_log.snapshots
            election, log = etcd_election, etcd_log
        self.election: Election = election
        self.log: CommandLog = log
        self.queue = CommitQueue(MAX_ENTRY)
        self.replica: ReplicaLeader | None = None
        self.held: dict[int, bytes] = {}
        """``replica`` standby: entries streamed by the leader, not yet applied from etcd."""
        self.held_term = 0
        self.streaming = False
        """``replica`` standby: its replication stream is up (it applies from there, and does
        not watch the etcd log meanwhile)."""
        self.local = (
            DirSnapshots(config.snapshot_dir, config.cluster_id, config.snapshot_retention)
            if config.snapshot_dir
            else None
        )
        self.role = "starting"
        self.serving = False
        self.leader_addr: str | None = None
        self.term = 0
        self.lease_deadline = 0.0
        # the view as last read by a standby: its term
        self._view_rev = 0
        self._probe = LeaderProbe(self.election.revoke_term, self._probe_target, self._revoked)
        self._lease_check = anyio.Event()
        self.applied_seq = self.latest_seq = self.snapshot_seq = 0
        self.last_now = 0.0
        self._last_now_local = 0.0
        self._from_scratch = True
        # leader side (the commit queue's waiters)
        self._durable_changed = anyio.Event()
        self._flush_now = anyio.Event()
        self._deposed = anyio.Event()
        self._wake = anyio.Event()
        self._snap_due = self._snap_busy = False
        self._snap_last = 0.0
        # counters
        self.batches = self.entries_applied = self.stepdowns = self.elections_won = 0
        self.apply_errors = self.early_revokes = 0
        self.config_mismatch = False
        self.adopted = 0
        """Entries a new leader held from the stream beyond the etcd log and appended."""
        self.held_apply = HeldEntries(self)

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
                self.step_down("lease not renewed in time")
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
        """Queue ``command`` (applied next by the caller) for the log; its ticket
        (:meth:`CommitQueue.append`: a command over one entry is refused, or split if it is a
        lease-only key scan)."""
        if self.role != "leader":
            raise MooncakeError("append on a master that is not the leader")
        ticket, flush = self.queue.append(command)
        if flush:
            self._flush_now.set()
        return ticket

    @property
    def barrier(self) -> int:
        return self.queue.barrier

    def mark_mutated(self) -> None:
        self.queue.mark_mutated()
        self._flush_now.set()

    async def wait_durable(self, ticket: int) -> bool:
        q = self.queue
        epoch = q.epoch
        while not q.is_durable(ticket):
            if q.epoch != epoch or self.role != "leader":
                return False
            ev = self._durable_changed
            self._flush_now.set()
            await ev.wait()
        if not q.may_answer(ticket, epoch):
            return False
        if anyio.current_time() >= self.lease_deadline:  # durable, but say nothing this late
            self.step_down("lease not renewed in time")
            return False
        return True

    def _durable_moved(self) -> None:
        ev, self._durable_changed = self._durable_changed, anyio.Event()
        ev.set()

    # -- main loop -------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Follow, campaign, lead, step down, follow again ... until cancelled."""
        started = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, True)
                tg.start_soon(self._watch, False)
                if self.config.fast_failover:
                    tg.start_soon(self._probe.run)
                if self.config.ack_mode == "replica":
                    tg.start_soon(follow_stream, self)
                    tg.start_soon(self.held_apply.run)
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
                        self.step_down(str(e))
                        self.role = "standby"
                        await anyio.sleep(0.5)
                    except Exception:  # a bug must not take the master down: start over
                        log.exception("master HA: unexpected failure; reloading")
                        self.step_down("unexpected failure")
                        self.role = "standby"
                        await anyio.sleep(1.0)
                    finally:
                        await self._release_lease()
        finally:
            with anyio.CancelScope(shield=True):
                await self.log.aclose()
                await self.election.aclose()

    def _log_watch_wanted(self) -> bool:
        """A leader does not watch its own log, nor a standby that applies from its stream."""
        return self.role == "standby" and not self.streaming

    def apply_held(self, committed: int) -> None:
        """``replica`` standby: etcd holds the leader's log up to ``committed``
        (:class:`~mooncake._store.ha_stream.HeldEntries`)."""
        self.held_apply.durable_upto(committed)

    def wake(self) -> None:
        """Wake the follow loop (it reads the log now)."""
        self._wake.set()

    @property
    def listen_host(self) -> str:
        return self.server.config.rpc_address

    async def _watch(self, is_log: bool) -> None:
        """Wake the follow loop on a change of the log (``is_log``: applying an entry that
        comes in order at once) or of the view; a broken watch is retried every poll."""
        scope = anyio.CancelScope()

        async def on_entry(seq: int, value: bytes | None) -> None:
            if not self._log_watch_wanted():
                scope.cancel()  # leading, or streaming: resumed when that ends
                return
            if value is not None and self.role == "standby":
                self.latest_seq = max(self.latest_seq, seq)
                if seq <= self.applied_seq:
                    return
                if seq == self.applied_seq + 1:
                    try:
                        self.apply_entry(seq, value)
                        return  # in order: nothing for the follow loop to read again
                    except _Gap:
                        pass  # the poll meets it too, and reloads
            self._wake.set()

        async def on_view(present: bool) -> None:
            if not present and self.role == "leader":
                self._lease_check.set()  # our key gone? the keep-alive asks etcd now
            self._wake.set()

        what = "the log" if is_log else "the view"
        while True:
            while is_log and not self._log_watch_wanted():  # noqa: ASYNC110 (role flags)
                await anyio.sleep(_WATCH_CHECK_S)
            if is_log:
                self._wake.set()  # what was committed while it was off: the poll reads it
            scope = anyio.CancelScope()  # on_entry cancels the current one
            with scope:
                try:
                    if is_log:
                        await self.log.watch(on_entry)
                    else:
                        await self.election.watch(on_view)
                except MetadataError as e:
                    log.warning("master HA: watch on %s: %s", what, e)
                except Exception:  # only a wake-up: the poll still follows the log
                    log.exception("master HA: watch on %s failed", what)
            if not scope.cancel_called:
                await anyio.sleep(_POLL_S)

    # -- standby ---------------------------------------------------------------------------

    async def _load(self) -> None:
        """A fresh state: the newest snapshot (the log's, else the local copy) + the log
        after it."""
        cfg = self.server.config.state
        last: _Gap | None = None
        for _ in range(5):
            snap: Snapshot | None = await self.log.newest_snapshot()
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
        while True:
            entries, more = await self.log.read(self.applied_seq + 1, _RANGE_LIMIT)
            for seq, data in entries:
                self.latest_seq = max(self.latest_seq, seq)
                if seq <= self.applied_seq:
                    continue
                if seq != self.applied_seq + 1:
                    raise _Gap(f"log entry {self.applied_seq + 1} is gone (next is {seq})")
                self.apply_entry(seq, data)
            if not more:
                return

    def apply_entry(self, seq: int, data: bytes) -> None:
        """Apply log entry ``seq`` (the next one) to the state; :class:`LogGap` if it does not
        decode (this master reloads)."""
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
        """Tail the log until the view is vacant."""
        while True:
            await self._catch_up()
            view = await self.election.leader()
            if view is None:
                self.leader_addr = None
                self._view_rev = 0
                return
            addr, self._view_rev = view
            if addr != self.leader_addr:
                log.info("master HA: following leader %s", addr)
            self.leader_addr = addr
            with anyio.move_on_after(_POLL_S):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _campaign(self) -> bool:
        isr = await self.log.read_isr()
        if isr and self.address not in isr:
            # the last leader acknowledged entries that only its in-sync standbys hold
            await anyio.sleep(0.2)
            return False
        sent = anyio.current_time()  # the lease runs from no earlier than this
        term = await self.election.campaign(self.address, self.config.lease_ttl)
        if term is None:
            return False
        self.term = term
        self.lease_deadline = sent + self.config.lease_ttl - LEASE_MARGIN
        self.elections_won += 1
        log.info("master HA: won the election (term %d) as %s", self.term, self.address)
        return True

    # -- leader ----------------------------------------------------------------------------

    async def _lead(self) -> None:
        self._deposed = anyio.Event()
        self.queue.reset()
        self.role = "leader"
        self.serving = False
        self.leader_addr = self.address
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keepalive)
            try:
                await self._catch_up()  # the old leader is fenced: this is the whole log
            except (_Gap, MetadataError) as e:
                self.step_down(f"cannot finish the log: {e}")
            if self.role == "leader" and self.config.ack_mode == "replica":
                rep = await start_replica(self, tg)  # what the last leader acknowledged first
                if rep is not None:
                    self.replica = rep
                    tg.start_soon(rep.write_etcd)
                    tg.start_soon(rep.keep_isr)
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
                if await self.wait_durable(self.queue.ticket):
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

    def replica_progress(self) -> None:
        """Acknowledge every batch up to the replica's acknowledged seq."""
        rep = self.replica
        if rep is not None and self.queue.acknowledged(rep.ack_seq()):
            self._durable_moved()

    async def write_replica_keys(self, members: frozenset[str], stream: str | None) -> bool:
        """Write the in-sync set (and the stream address), fenced by the term."""
        while self.role == "leader" and anyio.current_time() < self.lease_deadline:
            try:
                return await self.log.write_replicas(self.term, members, stream)
            except MetadataError as e:
                log.warning("master HA: writing the in-sync set: %s; retrying", e)
                await anyio.sleep(0.1)
        return False

    def step_down(self, why: str) -> None:
        """Stop leading at once (no answers, every client connection closed)."""
        if self.role != "leader":
            return
        log.warning("master HA: stepping down (term %d): %s", self.term, why)
        self.role = "standby"
        self.serving = False
        self.leader_addr = None
        self.stepdowns += 1
        self.queue.depose()
        kv_events.stand_down(self.server)
        self._durable_moved()
        self._deposed.set()
        self.server.close_connections()

    async def _keepalive(self) -> None:
        ttl = self.config.lease_ttl
        while self.role == "leader":
            with anyio.move_on_after(ttl / 5):
                await self._lease_check.wait()
            self._lease_check = anyio.Event()
            if not self.election.holds_lease:
                return
            sent = anyio.current_time()
            try:
                with anyio.fail_after(ttl / 2):
                    alive = await self.election.keepalive()
            except (MetadataError, TimeoutError) as e:
                log.warning("master HA: lease keep-alive failed: %s", e)
                continue
            if not alive:
                self.step_down("the lease expired in etcd")
                return
            self.lease_deadline = max(self.lease_deadline, sent + ttl - LEASE_MARGIN)

    async def _flusher(self, tg: anyio.abc.TaskGroup) -> None:
        cfg = self.config
        q = self.queue
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
            if not q.pending and not self._snap_due:
                continue
            batch = q.take_batch()  # at most MAX_ENTRY bytes (the rest goes in the next entry)
            seq = self.applied_seq + (1 if batch else 0)
            snap: tuple[int, ForkedSnapshot, float] | None = None
            if self._snap_due and not q.pending:  # the state is exactly "after seq"
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
                    q.published(seq, len(batch))
                    rep.publish(seq, data)
                else:
                    refused = await self.append_entries([(seq, data)])
                    if refused is not None:
                        self._snap_busy = False
                        self.step_down(refused)
                        return
                    q.committed(len(batch))
                    self._durable_moved()
                self.applied_seq = self.latest_seq = seq
                self.last_now = max(self.last_now, batch[-1].now)
                self.batches += 1
            if q.pending:
                self._flush_now.set()
            if snap is not None:
                tg.start_soon(self._write_snapshot, *snap)

    async def append_entries(self, entries: list[tuple[int, bytes]]) -> str | None:
        """Append the entries fenced by the term: None once written, else why not (fenced;
        unsure past the lease, then a successor decides; or the log refused them for longer
        than ``lease_ttl``: a leader that cannot append must not keep its lease and wedge the
        cluster, so it steps down and a standby, or itself later, takes over)."""
        seq = entries[0][0]
        first_failure: float | None = None
        while True:
            now = anyio.current_time()
            if now >= self.lease_deadline:
                return "lease not renewed in time (log append unfinished)"
            if first_failure is not None and now - first_failure > self.config.lease_ttl:
                return f"log append {seq} failed for over {self.config.lease_ttl} s"
            try:
                written = await self.log.append(entries, self.term)
            except MetadataError as e:
                log.warning("master HA: log append %d: %s; retrying", seq, e)
                if first_failure is None:
                    first_failure = now
                await anyio.sleep(0.1)
                continue
            return None if written else "a newer leader holds master_view (log append fenced)"

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
            if not await self.log.write_snapshot(snap, self.term):
                log.warning("master HA: snapshot %d fenced (no longer the leader)", snap.seq)
                return
            await self.log.compact(snap.seq)
            # reported once retention and compaction are done, so a reader of the status
            # never sees a snapshot whose older copies and log entries still linger
            self.snapshot_seq = max(self.snapshot_seq, snap.seq)
            log.info("master HA: snapshot at %d (%d bytes)", snap.seq, len(snap.data))
        except (MetadataError, OSError, InvalidArgumentError) as e:
            log.warning("master HA: snapshot %d failed: %s", seq, e)
        finally:
            self._snap_busy = False

    async def _release_lease(self) -> None:
        await self.election.release()

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
        return node_status(self)


def node_status(node: HaNode) -> dict[str, Any]:
    """What :meth:`HaNode.status` reports: role, term and lease, log positions, counters."""
    now = anyio.current_time()
    leader = node.role == "leader" and node.serving
    lag = node.queue.lag if leader else max(0, node.latest_seq - node.applied_seq)
    return {
        "role": "leader" if leader else "standby",
        "leader": node.leader_addr or "",
        "address": node.address,
        "cluster_id": node.config.cluster_id,
        "term": node.term if node.role == "leader" else 0,
        "lease_ttl": node.config.lease_ttl,
        "lease_remaining": max(0.0, node.lease_deadline - now) if leader else 0.0,
        "applied_seq": node.applied_seq,
        "log_lag": lag,
        "last_snapshot_seq": node.snapshot_seq,
        "batches": node.batches,
        "entries_applied": node.entries_applied,
        "elections_won": node.elections_won,
        "stepdowns": node.stepdowns,
        "apply_errors": node.apply_errors,
        "config_mismatch": node.config_mismatch,
        "fast_failover": node.config.fast_failover,
        "early_revokes": node.early_revokes,
        "ack_mode": node.config.ack_mode,
        "in_sync": len(node.replica.isr) if node.replica is not None else 0,
        "held": len(node.held),
        "adopted": node.adopted,
        "stream_applied": node.held_apply.applied,
    }
