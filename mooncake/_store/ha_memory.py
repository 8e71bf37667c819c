"""In-memory :class:`~mooncake._store.ha_base.Election` and
:class:`~mooncake._store.ha_base.CommandLog`: master failover tested without etcd.

::

    cluster = MemoryCluster()
    node = HaNode(server, HaConfig(cluster_id="t", fast_failover=False),
                  election=cluster.election("m1"), log=cluster.log("m1"))

One :class:`MemoryCluster` stands for the etcd cluster of masters running on one event loop
(tests, trio's ``MockClock`` included: leases run on the loop's clock). It keeps etcd's
guarantees the HA node relies on: the view is created only while vacant, its term (a cluster
revision) increases, a lease expires ``ttl`` seconds after its last renewal, and every log
write is fenced by the writer's term. :meth:`MemoryCluster.partition` cuts a member off: each
of its calls raises :class:`~mooncake.errors.MetadataError` until :meth:`MemoryCluster.heal`,
as a master cut from etcd sees it. Everything is bounded by what the masters write (the log
is compacted by snapshots, as in etcd).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from mooncake._store.snapshots import Snapshot
from mooncake.errors import MetadataError

__all__ = ["MemoryCluster", "MemoryCommandLog", "MemoryElection"]

#: seconds between a watch's checks for an expired lease (nobody else may be calling)
_EXPIRY_CHECK_S = 0.05


@dataclass
class _View:
    address: str
    term: int
    lease: int


class MemoryCluster:
    """The shared store of one cluster's masters (see the module docstring)."""

    def __init__(self, retention: int = 2) -> None:
        self.retention = retention
        self.revision = 0
        self.view: _View | None = None
        self.leases: dict[int, tuple[float, int]] = {}
        """Lease id -> (expiry on the loop's clock, ttl)."""
        self.entries: dict[int, bytes] = {}
        self.snapshots: dict[int, Snapshot] = {}
        self.isr: list[str] = []
        self.stream: tuple[str, int] | None = None
        self.cut: set[str] = set()
        self.changed = anyio.Event()
        self._next_lease = 0

    def election(self, member: str) -> MemoryElection:
        return MemoryElection(self, member)

    def log(self, member: str) -> MemoryCommandLog:
        return MemoryCommandLog(self, member)

    def partition(self, member: str) -> None:
        """Cut ``member`` off: its calls fail until :meth:`heal`."""
        self.cut.add(member)

    def heal(self, member: str) -> None:
        self.cut.discard(member)

    # -- for the members ---------------------------------------------------------------------

    def reach(self, member: str) -> None:
        """Raise for a member cut off; expire what is due."""
        if member in self.cut:
            raise MetadataError(f"in-memory cluster: {member} is partitioned away")
        self.expire()

    def expire(self) -> None:
        now = anyio.current_time()
        for lid in [lid for lid, (end, _) in self.leases.items() if end <= now]:
            self.revoke(lid)

    def revoke(self, lid: int) -> bool:
        if self.leases.pop(lid, None) is None:
            return False
        if self.view is not None and self.view.lease == lid:
            self.view = None
            self.bump()
        return True

    def bump(self) -> int:
        self.revision += 1
        ev, self.changed = self.changed, anyio.Event()
        ev.set()
        return self.revision

    def fenced(self, term: int) -> bool:
        return self.view is None or self.view.term != term

    def grant(self, ttl: int) -> int:
        self._next_lease += 1
        self.leases[self._next_lease] = (anyio.current_time() + ttl, ttl)
        return self._next_lease

    async def wait_change(self, member: str) -> None:
        """Until something changes (or a lease may have expired), then :meth:`reach`."""
        with anyio.move_on_after(_EXPIRY_CHECK_S):
            await self.changed.wait()
        self.reach(member)


class MemoryElection:
    """A member's side of the view (:class:`~mooncake._store.ha_base.Election`)."""

    def __init__(self, cluster: MemoryCluster, member: str) -> None:
        self.cluster = cluster
        self.member = member
        self.lease: int | None = None

    @property
    def holds_lease(self) -> bool:
        return self.lease is not None

    async def campaign(self, address: str, ttl: int) -> int | None:
        c = self.cluster
        c.reach(self.member)
        lid = c.grant(ttl)
        self.lease = lid
        if c.view is not None:
            self.lease = None
            c.revoke(lid)
            return None
        term = c.bump()
        c.view = _View(address, term, lid)
        return term

    async def keepalive(self) -> bool:
        c = self.cluster
        c.reach(self.member)
        lid = self.lease
        if lid is None or lid not in c.leases:
            return False
        ttl = c.leases[lid][1]
        c.leases[lid] = (anyio.current_time() + ttl, ttl)
        return True

    async def release(self) -> None:
        lid, self.lease = self.lease, None
        if lid is not None and self.member not in self.cluster.cut:
            self.cluster.revoke(lid)

    async def leader(self) -> tuple[str, int] | None:
        c = self.cluster
        c.reach(self.member)
        return None if c.view is None else (c.view.address, c.view.term)

    async def watch(self, on_change: Callable[[bool], Awaitable[None]]) -> None:
        c = self.cluster
        c.reach(self.member)
        seen = c.view.term if c.view is not None else 0
        while True:
            await c.wait_change(self.member)
            now = c.view.term if c.view is not None else 0
            if now != seen:
                seen = now
                await on_change(c.view is not None)

    async def revoke_term(self, term: int, address: str) -> bool:
        c = self.cluster
        c.reach(self.member)
        if c.view is None or c.view.term != term:
            return False
        return c.revoke(c.view.lease)

    async def aclose(self) -> None:
        pass


class MemoryCommandLog:
    """A member's side of the log (:class:`~mooncake._store.ha_base.CommandLog`)."""

    def __init__(self, cluster: MemoryCluster, member: str) -> None:
        self.cluster = cluster
        self.member = member

    async def append(self, entries: list[tuple[int, bytes]], term: int) -> bool:
        c = self.cluster
        c.reach(self.member)
        if c.fenced(term):
            return False
        if any(seq in c.entries for seq, _ in entries):
            first, data = entries[0]
            return c.entries.get(first) == data  # an earlier attempt wrote them
        for seq, data in entries:
            c.entries[seq] = data
        c.bump()
        return True

    async def read(self, first: int, limit: int) -> tuple[list[tuple[int, bytes]], bool]:
        c = self.cluster
        c.reach(self.member)
        seqs = sorted(s for s in c.entries if s >= first)
        return [(s, c.entries[s]) for s in seqs[:limit]], len(seqs) > limit

    async def watch(self, on_entry: Callable[[int, bytes | None], Awaitable[None]]) -> None:
        c = self.cluster
        c.reach(self.member)
        last = max(c.entries, default=0)
        while True:
            await c.wait_change(self.member)
            for seq in sorted(s for s in c.entries if s > last):
                last = seq
                data = c.entries.get(seq)
                if data is not None:
                    await on_entry(seq, data)

    async def write_replicas(self, term: int, members: frozenset[str], stream: str | None) -> bool:
        c = self.cluster
        c.reach(self.member)
        if c.fenced(term):
            return False
        c.isr = sorted(members)
        if stream is not None:
            c.stream = (stream, term)
        c.bump()
        return True

    async def read_isr(self) -> list[str]:
        self.cluster.reach(self.member)
        return list(self.cluster.isr)

    async def read_stream(self) -> tuple[str, int] | None:
        self.cluster.reach(self.member)
        return self.cluster.stream

    async def newest_snapshot(self) -> Snapshot | None:
        c = self.cluster
        c.reach(self.member)
        return c.snapshots[max(c.snapshots)] if c.snapshots else None

    async def write_snapshot(self, snap: Snapshot, term: int) -> bool:
        c = self.cluster
        c.reach(self.member)
        if c.fenced(term):
            return False
        c.snapshots[snap.seq] = snap
        return True

    async def compact(self, upto: int) -> None:
        c = self.cluster
        c.reach(self.member)
        for seq in sorted(c.snapshots, reverse=True)[c.retention :]:
            del c.snapshots[seq]
        for seq in [s for s in c.entries if s <= upto]:
            del c.entries[seq]
        c.bump()

    async def aclose(self) -> None:
        pass
