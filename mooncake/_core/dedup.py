"""The master's dedup ledger: request id -> the reply of a mutating call, bounded (sans-I/O).

A store client sends a request id (``rid``, :mod:`mooncake._core.rpc`: 8 bytes naming the client
instance, a big-endian u64 sequence number) with every mutating call, and resends the same
``rid`` when it retries the call after a lost connection or a failover. The master looks the
``rid`` up before applying the call and records the framed reply after; a repeated ``rid`` is
answered with the recorded reply (same code, same result) and not applied again. The ledger is
part of the master's replicated state (the apply path that the command log replays records into
it) and of its snapshots (:meth:`DedupLedger.snapshot` / :meth:`DedupLedger.restore`), so a retry
that reaches a new leader after a failover is answered there too.

Bounds (all configurable; the defaults in brackets):

* ``per_client`` [1024] replies per client instance: recording one more evicts that instance's
  oldest recorded reply, and the instance's *floor* rises to its sequence number.
* ``max_bytes`` [64 MiB] of recorded replies in all (each entry counted as its reply's length
  plus :data:`ENTRY_OVERHEAD`): beyond it the oldest replies of the least recently active
  instance that still has any are evicted first (raising its floor the same way). A single
  reply larger than ``max_bytes`` is therefore not kept at all (its retry is refused).
* ``max_clients`` [8192] instances: recording for one more forgets the least recently active
  instance entirely (its entries and its floor).

What happens beyond them: :meth:`DedupLedger.lookup` of a *retried* ``rid`` whose instance is
known and whose sequence number is at or below the instance's floor raises
:class:`StaleRequestError` -- the ledger cannot tell whether it applied that call, so the call
is refused, never applied a second time. A *first* attempt (its id marked with
:data:`~mooncake._core.rpc.RID_FIRST`, as this package's clients send every call the first
time) is never refused: it cannot have been applied, however many later calls of its instance
(threads of one client draw from one counter but send on their own connections, so ids arrive
out of order) were recorded meanwhile. An unmarked id (an older client) keeps the floor rule. A ``rid`` of a forgotten instance
looks new and is applied: that needs ``max_clients`` other instances to have recorded a
mutation since the forgotten one last did, while its retry was still pending (clients retry for
at most their failover timeout).

Determinism: the ledger's contents depend only on the sequence of ``record`` calls (no clocks,
no randomness), so every replica applying the same commands holds the same ledger.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from mooncake._core.rpc_types import RID_BYTES, RID_FIRST, check_rid
from mooncake.errors import ErrorCode, InvalidArgumentError, StoreError

DEFAULT_PER_CLIENT = 1024
DEFAULT_MAX_CLIENTS = 8192
DEFAULT_MAX_BYTES = 64 << 20
ENTRY_OVERHEAD = 64
"""Bytes charged per entry on top of its reply (key, dict slot): keeps many tiny replies bounded."""
_SNAPSHOT_VERSION = 1


class StaleRequestError(StoreError):
    """A retried request id is older than what the master still remembers: it cannot tell
    whether the call was applied, so it refuses it rather than apply it twice (answered as
    ``RPC_FAIL``)."""

    code = ErrorCode.RPC_FAIL


@dataclass(slots=True)
class _Client:
    floor: int
    replies: OrderedDict[int, bytes]  # seq -> recorded reply, oldest first


class _Snapshot(msgspec.Struct, array_like=True):
    version: int
    per_client: int
    max_clients: int
    max_bytes: int
    clients: list[tuple[bytes, int, list[tuple[int, bytes]]]]  # least recently active first


def _split(rid: bytes) -> tuple[bytes, int, bool]:
    """(instance, sequence number, whether the id is marked as a first attempt)."""
    raw = int.from_bytes(rid[8:], "big")
    seq = raw & ~RID_FIRST
    if len(rid) != RID_BYTES or not seq:
        check_rid(rid)  # raises, naming what is wrong
    return rid[:8], seq, raw != seq


class DedupLedger:
    """Recorded replies of mutating calls by request id (see the module docstring for bounds).

    ``lookup(rid)`` -> the recorded reply, ``None`` if the call is new, or
    :class:`StaleRequestError`; ``record(rid, reply)`` after applying a new call. A malformed
    ``rid`` raises :class:`~mooncake.errors.InvalidArgumentError` from both.
    """

    __slots__ = ("_clients", "_nbytes", "evicted", "max_bytes", "max_clients", "per_client")

    def __init__(
        self,
        per_client: int = DEFAULT_PER_CLIENT,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if per_client < 1 or max_clients < 1 or max_bytes < 1:
            raise InvalidArgumentError("dedup ledger bounds must be >= 1")
        self.per_client = per_client
        self.max_clients = max_clients
        self.max_bytes = max_bytes
        self._clients: OrderedDict[bytes, _Client] = OrderedDict()  # least recently active first
        self._nbytes = 0
        self.evicted = 0
        """Replies dropped to keep the bounds (entries and forgotten instances' entries)."""

    def __len__(self) -> int:
        return sum(len(c.replies) for c in self._clients.values())

    @property
    def nbytes(self) -> int:
        """Bytes charged against ``max_bytes`` now."""
        return self._nbytes

    @property
    def clients(self) -> int:
        return len(self._clients)

    def lookup(self, rid: bytes) -> bytes | None:
        """The reply recorded for ``rid``; None if never seen; StaleRequestError if evicted
        (a retry only: a first attempt is new by definition, whatever the floor)."""
        inst, seq, first = _split(rid)
        c = self._clients.get(inst)
        if c is None:
            return None
        reply = c.replies.get(seq)
        if reply is not None:
            return reply
        if seq <= c.floor and not first:
            raise StaleRequestError(
                f"request {seq} of this client is older than the {self.per_client} replies "
                "the master keeps per client; it cannot tell whether it was applied"
            )
        return None

    def record(self, rid: bytes, reply: bytes) -> None:
        """Remember ``reply`` as the answer to ``rid`` (a call just applied), then evict to the
        bounds. Recording a ``rid`` again replaces its reply."""
        inst, seq, _ = _split(rid)
        c = self._clients.get(inst)
        if c is None:
            c = self._clients[inst] = _Client(0, OrderedDict())
        else:
            self._clients.move_to_end(inst)
            old = c.replies.pop(seq, None)
            if old is not None:
                self._nbytes -= len(old) + ENTRY_OVERHEAD
        c.replies[seq] = reply
        self._nbytes += len(reply) + ENTRY_OVERHEAD
        while len(c.replies) > self.per_client:
            self._drop_oldest(c)
        while len(self._clients) > self.max_clients:
            _, gone = self._clients.popitem(last=False)
            self.evicted += len(gone.replies)
            self._nbytes -= sum(len(r) + ENTRY_OVERHEAD for r in gone.replies.values())
        while self._nbytes > self.max_bytes:
            for c0 in self._clients.values():  # least recently active first
                if c0.replies:
                    self._drop_oldest(c0)
                    break
            else:
                break

    def _drop_oldest(self, c: _Client) -> None:
        seq, reply = c.replies.popitem(last=False)
        c.floor = max(c.floor, seq)
        self._nbytes -= len(reply) + ENTRY_OVERHEAD
        self.evicted += 1

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The ledger as bytes (msgpack): restores to an equal ledger, same eviction order."""
        return msgspec.msgpack.encode(
            _Snapshot(
                _SNAPSHOT_VERSION,
                self.per_client,
                self.max_clients,
                self.max_bytes,
                [(inst, c.floor, list(c.replies.items())) for inst, c in self._clients.items()],
            )
        )

    @classmethod
    def restore(cls, data: bytes) -> DedupLedger:
        """The ledger :meth:`snapshot` wrote; InvalidArgumentError if ``data`` is not one."""
        try:
            snap = msgspec.msgpack.decode(data, type=_Snapshot)
        except msgspec.DecodeError as e:
            raise InvalidArgumentError(f"not a dedup ledger snapshot: {e}") from None
        if snap.version != _SNAPSHOT_VERSION:
            raise InvalidArgumentError(f"dedup ledger snapshot version {snap.version} unknown")
        led = cls(snap.per_client, snap.max_clients, snap.max_bytes)
        for inst, floor, replies in snap.clients:
            if len(inst) != 8:
                raise InvalidArgumentError("dedup ledger snapshot: bad client instance")
            c = led._clients[inst] = _Client(floor, OrderedDict(replies))
            led._nbytes += sum(len(r) + ENTRY_OVERHEAD for r in c.replies.values())
        return led

    def state(self) -> list[tuple[bytes, int, list[tuple[int, bytes]]]]:
        """Everything the ledger holds, in eviction order (for comparisons in tests)."""
        return [(i, c.floor, list(c.replies.items())) for i, c in self._clients.items()]


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CLIENTS",
    "DEFAULT_PER_CLIENT",
    "ENTRY_OVERHEAD",
    "DedupLedger",
    "StaleRequestError",
]
