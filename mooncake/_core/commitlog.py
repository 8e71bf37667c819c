"""The leader's commit queue, sans I/O: tickets, the barrier, what is durable, the epoch.

A replicated leader (:mod:`mooncake._store.ha`) applies every command it runs at once and
queues it here for the log; the queue numbers it (its **ticket**, 1, 2, ... in this term),
hands batches of at most one log entry's bytes to the driver (:meth:`CommitQueue.take_batch`)
and learns back how far the log holds them (:meth:`committed`, or in ``replica`` mode
:meth:`published` + :meth:`acknowledged`). An answer may be sent once every ticket up to the
one it waits for is durable and the **epoch** it was queued in is still current: stepping
down (:meth:`depose`) or a new term (:meth:`reset`) starts a new epoch, so nothing queued
before is ever acknowledged.

Which ticket an answer waits for: a mutating command its own; anything else the
:attr:`~CommitQueue.barrier`, the ticket of the last mutation queued (so no client sees state
a failover could take back). There is no clock and no event loop here: the driver wakes its
waiters when :meth:`committed` / :meth:`acknowledged` say the durable ticket moved.
"""

from __future__ import annotations

import msgspec.structs

from mooncake._core import commands
from mooncake._core.commands import Command, Durability
from mooncake.errors import InvalidArgumentError

__all__ = ["MAX_ENTRY", "CommitQueue", "command_size", "is_mutating", "split_scan"]

#: a log entry holds at most about this many bytes of commands
MAX_ENTRY = 1 << 20


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


def is_mutating(cmd: Command) -> bool:
    """Whether ``cmd`` changes what clients can read (its answer waits for its own entry)."""
    if cmd.kind == "rpc":
        return commands.durability(cmd.method) is Durability.MUTATING
    return (cmd.kind == "scan" and cmd.method == "RemoveByRegex") or cmd.kind == "quota"


class CommitQueue:
    """Commands queued for the log and how far it holds them (see the module docstring)."""

    def __init__(self, max_entry: int = MAX_ENTRY) -> None:
        self.max_entry = max_entry
        self.pending: list[Command] = []
        self.pending_bytes = 0
        self.ticket = 0
        """The ticket of the last command queued."""
        self.durable = 0
        """Every ticket up to this one is in the log (or held by the in-sync standbys)."""
        self.barrier = 0
        """The ticket of the last mutating command queued."""
        self.epoch = 0
        self._taken = 0
        self._seq_ticket: dict[int, int] = {}

    def reset(self) -> None:
        """A new term: nothing queued, tickets from 1 again, a new epoch."""
        self.pending, self.pending_bytes = [], 0
        self.ticket = self.durable = self.barrier = self._taken = 0
        self._seq_ticket = {}
        self.epoch += 1

    def depose(self) -> None:
        """This master stopped leading: what is queued is dropped, and no waiter of the
        epoch that ends may answer (:meth:`may_answer`)."""
        self.epoch += 1
        self.pending, self.pending_bytes = [], 0

    def append(self, command: Command) -> tuple[int, bool]:
        """Queue ``command`` (applied next by the caller): (its ticket, whether it is a
        mutation, so the driver should flush at once).

        A command that would not fit one entry (``max_entry``) is refused with
        :class:`InvalidArgumentError` before anything is applied, except a lease-only key scan
        (``GetReplicaListByRegex`` over many keys), which is queued as several scans of parts
        of its keys: applying them one after the other is applying it once."""
        size = command_size(command)
        if size <= self.max_entry:  # _queue, inlined: this runs for every logged call
            self.pending.append(command)
            self.pending_bytes += size
            self.ticket += 1
            if is_mutating(command):
                self.barrier = self.ticket
                return self.ticket, True
            return self.ticket, False
        parts = split_scan(command, self.max_entry // 2) if not is_mutating(command) else None
        if parts is None:
            raise InvalidArgumentError(
                f"{command.method or command.kind} would log {size} bytes, more than the "
                f"{self.max_entry} one replicated log entry holds; split the request "
                "(a narrower pattern, fewer keys)"
            )
        flush = False
        for part in parts:
            flush = self._queue(part, command_size(part))[1] or flush
        return self.ticket, flush

    def _queue(self, command: Command, size: int) -> tuple[int, bool]:
        self.pending.append(command)
        self.pending_bytes += size
        self.ticket += 1
        mutating = is_mutating(command)
        if mutating:
            self.barrier = self.ticket
        return self.ticket, mutating

    def mark_mutated(self) -> None:
        """The command queued last changed what clients can see: later answers wait for it."""
        self.barrier = self.ticket

    def take_batch(self) -> list[Command]:
        """The next commands for one entry, in order: at most ``max_entry`` bytes (but at
        least one command while any is queued); the rest stays queued."""
        n, size = 0, 0
        for cmd in self.pending:
            more = command_size(cmd)
            if n and size + more > self.max_entry:
                break
            size += more
            n += 1
        batch = self.pending[:n]
        del self.pending[:n]
        self.pending_bytes = max(0, self.pending_bytes - size)
        return batch

    def committed(self, n: int) -> None:
        """The next ``n`` commands taken are in the log (``etcd`` acknowledgement)."""
        self.durable += n

    def published(self, seq: int, n: int) -> None:
        """The next ``n`` commands taken went out as entry ``seq`` (``replica`` mode: durable
        once :meth:`acknowledged` reaches ``seq``)."""
        self._taken += n
        self._seq_ticket[seq] = self._taken

    def acknowledged(self, seq: int) -> bool:
        """Every entry up to ``seq`` is held where it counts: whether :attr:`durable` moved."""
        t = self.durable
        pend = self._seq_ticket
        while pend:
            first = next(iter(pend))
            if first > seq:
                break
            t = pend.pop(first)
        if t > self.durable:
            self.durable = t
            return True
        return False

    def is_durable(self, ticket: int) -> bool:
        return self.durable >= ticket

    def may_answer(self, ticket: int, epoch: int) -> bool:
        """Whether an answer queued in ``epoch`` that waits for ``ticket`` may be sent now."""
        return epoch == self.epoch and self.durable >= ticket

    @property
    def lag(self) -> int:
        """Commands queued and not yet durable."""
        return self.ticket - self.durable
