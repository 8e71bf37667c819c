"""Quarantine of segments whose holder looks dead (sans-I/O bookkeeping for the master).

A client whose transfer to a segment fails (connection refused, reset, timed out, the
same-host owner gone) reports the segment's name to the master (``ReportSegmentFailure``). The
master then treats every segment of that name as *quarantined*: no new allocations there, and
``GetReplicaList`` leaves its replicas out (an object with no other replica answers
``REPLICA_NOT_FOUND`` at once instead of letting every reader time out on it).

A quarantine ends in one of two ways:

* the holder proves it is alive: its next ``Ping`` (or remount) that arrives at least
  ``grace`` seconds after the report lifts it. A false report (a mistaken or hostile reporter)
  therefore costs a live holder at most about one heartbeat interval (1 s) plus ``grace``;
  ``grace`` keeps a heartbeat the holder sent just before dying from lifting it.
* the holder's client TTL ends (the master expires it and drops its segments as always).

A report lifted by the holder's heartbeat *refutes* its reporter: further reports of that
segment from the same reporter are ignored for ``refute_hold`` seconds, so one misbehaving
client can take a live segment out of service for at most ~one heartbeat per ``refute_hold``.
Only clients the master knows may report (with a cluster secret set, only authenticated
connections reach the master at all); a client cannot report its own segment.

The master state owns one :class:`Quarantine` (part of its snapshot and replicated through the
command log like every state change); this module knows segment names and clocks only, and
iterates in insertion order, so replicas applying the same reports agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Quarantine", "QuarantineStats"]

#: bound on remembered refutations (entries past their hold are pruned first)
MAX_REFUTED = 4096


@dataclass(slots=True)
class _Entry:
    since: float
    reporters: dict[str, None] = field(default_factory=dict)  # insertion-ordered: deterministic
    reason: str = ""


@dataclass
class QuarantineStats:
    """Monotonic counters (exported by the server as ``master_quarantine_*``)."""

    reports: int = 0
    """Reports received from known clients."""
    started: int = 0
    """Segments put in quarantine."""
    ignored: int = 0
    """Reports ignored: the reporter was refuted for that segment recently."""
    lifted: int = 0
    """Quarantines lifted by the holder's heartbeat (reports that proved false)."""
    ended: int = 0
    """Quarantines ended because the segment went away (owner expired or unmounted)."""


class Quarantine:
    """Quarantined segment names, who reported them, and refuted reporters."""

    def __init__(self, grace: float, refute_hold: float) -> None:
        self.grace = grace
        self.refute_hold = refute_hold
        self.names: dict[str, _Entry] = {}
        """Quarantined segment name -> when and by whom (test membership with ``in``)."""
        self._refuted: dict[tuple[str, str], float] = {}
        self.stats = QuarantineStats()

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __bool__(self) -> bool:
        return bool(self.names)

    def report(self, reporter: str, name: str, now: float, reason: str = "") -> bool:
        """Quarantine ``name`` on ``reporter``'s word (the caller checked both are known);
        whether the segment is quarantined now."""
        self.stats.reports += 1
        until = self._refuted.get((reporter, name))
        if until is not None:
            if until > now:
                self.stats.ignored += 1
                return name in self.names
            del self._refuted[(reporter, name)]
        entry = self.names.get(name)
        if entry is None:
            entry = self.names[name] = _Entry(now, reason=reason[:200])
            self.stats.started += 1
        entry.reporters[reporter] = None
        return True

    def suspect(self, name: str, now: float, reason: str) -> None:
        """Quarantine ``name`` on the master's own observation (its holder's heartbeat
        connection closed): lifted by the holder's next heartbeat (no grace: a heartbeat
        processed after the close came on a newer connection), and nobody is refuted for it."""
        if name not in self.names:
            self.names[name] = _Entry(now, reason=reason[:200])
            self.stats.started += 1

    def alive(self, names: Iterable[str], now: float) -> list[str]:
        """The holder of ``names`` was heard from at ``now``: lift those quarantined at least
        ``grace`` ago (their reporters are refuted); the names lifted."""
        lifted = []
        for name in names:
            entry = self.names.get(name)
            # a suspicion of the master's own (no reporter: the holder's heartbeat connection
            # closed) is lifted by any later heartbeat, which can only come on a newer
            # connection; a report waits out the grace
            if entry is None or (entry.reporters and now < entry.since + self.grace):
                continue
            del self.names[name]
            lifted.append(name)
            self.stats.lifted += 1
            if len(self._refuted) >= MAX_REFUTED:
                self._prune(now)
            for r in entry.reporters:
                if len(self._refuted) < MAX_REFUTED:
                    self._refuted[(r, name)] = now + self.refute_hold
        return lifted

    def end(self, name: str) -> None:
        """The last segment named ``name`` went away: its quarantine ends with it."""
        if self.names.pop(name, None) is not None:
            self.stats.ended += 1

    def info(self, name: str) -> tuple[float, str] | None:
        """``(since, reason)`` of a quarantined ``name``, else None."""
        entry = self.names.get(name)
        return None if entry is None else (entry.since, entry.reason)

    def _prune(self, now: float) -> None:
        self._refuted = {k: t for k, t in self._refuted.items() if t > now}
