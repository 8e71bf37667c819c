"""Sans-I/O decision: has the master leader's process certainly gone? (fast failover)

A standby connects to the leader's RPC address every ``PROBE_INTERVAL`` seconds (plain TCP,
one attempt in flight, see :mod:`mooncake._store.ha`) and feeds each outcome to
:class:`DeathDetector`, which says when the standby may revoke the leader's etcd lease instead
of waiting for it to expire.

Contract (``observe`` returns True at most once per term):

* only ``REFUSED`` (ECONNREFUSED: the host answered with a reset, nothing listens on the port)
  counts as evidence of death; ``ACCEPTED`` and every ``OTHER`` outcome (timeout, unreachable,
  reset after connect, name resolution failure) break the streak: a stopped, overloaded or
  partitioned leader is never deposed early, its lease alone bounds it;
* the term must have **accepted** at least one probe before refusals count: a leader this
  standby never reached at that address (wrong advertise address, a loopback address seen from
  another host, a firewall that always rejects) is left to its lease, so a misconfiguration
  cannot make masters depose each other in a loop; only the transition from "listening" to
  "nothing listens" (what a process exit looks like) is acted on;
* ``refusals`` consecutive refusals, all for the same ``(term, address)``; a new term or
  address starts over.
"""

from __future__ import annotations

import enum

__all__ = ["PROBE_INTERVAL", "PROBE_REFUSALS", "DeathDetector", "ProbeOutcome"]

#: seconds between two connect probes of the leader (one in flight at a time)
PROBE_INTERVAL = 0.2
#: consecutive refused connects (after one accepted in the term) that mean "nothing listens"
PROBE_REFUSALS = 3


class ProbeOutcome(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    OTHER = "other"


class DeathDetector:
    """Consecutive-refusal counter for one leader term (see the module docstring)."""

    def __init__(self, refusals: int = PROBE_REFUSALS) -> None:
        if refusals < 1:
            raise ValueError(f"refusals must be >= 1, got {refusals}")
        self.refusals = refusals
        self._who: tuple[int, str] | None = None
        self._seen_accept = False
        self._streak = 0
        self._fired = False

    def reset(self) -> None:
        """Forget the current term (no leader known, or this master leads)."""
        self._who = None
        self._seen_accept = False
        self._streak = 0
        self._fired = False

    def observe(self, term: int, address: str, outcome: ProbeOutcome) -> bool:
        """Record one probe of ``address`` made while ``term`` held the view key; True when
        the leader of that term is certainly not serving there (revoke its lease now)."""
        if self._who != (term, address):
            self.reset()
            self._who = (term, address)
        if outcome is ProbeOutcome.ACCEPTED:
            self._seen_accept = True
            self._streak = 0
            return False
        if outcome is ProbeOutcome.OTHER or not self._seen_accept:
            self._streak = 0
            return False
        self._streak += 1
        if self._streak >= self.refusals and not self._fired:
            self._fired = True
            return True
        return False

    @property
    def streak(self) -> int:
        return self._streak
