"""Miss-reason accounting: every miss gets a cause (sans-I/O).

The store records how each object stopped being readable (evicted by which policy from which
tier, removed, lost with its owner) in a :class:`MissLedger`; when a lookup then misses,
:meth:`MissLedger.classify` says why, and counts it. Reads that fail although the object
exists (the lease ran out mid-read, the transfer failed) are counted with
:meth:`MissLedger.record_miss`. The counters feed the metrics (labels ``reason``, ``policy``,
``tier``) and the client API returns the :class:`Miss` itself.

Bounded: the ledger remembers at most ``capacity`` lost keys (oldest forgotten first). A
forgotten key leaves a bit in a fixed-size filter, so a later miss on it is reported as
:attr:`MissReason.UNKNOWN` rather than wrongly as :attr:`MissReason.NEVER_STORED`; filter
collisions can only turn a ``NEVER_STORED`` into ``UNKNOWN``, never invent a cause.

Every call is O(1). Time is whatever the caller passes as ``now`` (the ledger reads no clock).

Compact: the remembered losses live in an :class:`~mooncake._fast.ObjectTable` (keys in its
arena, their age order in its recency list) and a few numeric columns, not as one Python
object per lost key, so a ledger of a million losses costs ~150 MiB less than records would
and gives the collector nothing to walk.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Any

from mooncake._fast import ObjectTable
from mooncake._miss import Miss, MissReason
from mooncake.errors import InvalidArgumentError

__all__ = ["Miss", "MissLedger", "MissReason"]


_LOSSES = (MissReason.EVICTED, MissReason.REMOVED, MissReason.OWNER_DIED)
#: ``Miss.detail`` of a key absent from a ledger that began after keys were stored
PREDATES_DETAIL = "the master restarted without its state: keys stored before are not on record"


def _code(key: Hashable) -> str:
    """The table key of ``key``: a ``str`` as itself, anything else by its ``repr`` (marked, so
    the two never collide)."""
    return "s" + key if type(key) is str else "r" + repr(key)


class MissLedger:
    """Remembers how keys were lost, attributes misses, and counts them.

    ``capacity`` bounds the remembered losses (default 1 Mi keys); ``filter_bits`` sizes the
    filter of forgotten keys (default 8 Mi bits = 1 MiB).
    """

    __slots__ = (
        "_at",
        "_counts",
        "_filter",
        "_filter_mask",
        "_kind",
        "_kind_ids",
        "_kinds",
        "_lost",
        "capacity",
        "forgotten",
        "predates",
    )

    def __init__(self, capacity: int = 1 << 20, *, filter_bits: int = 1 << 23) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"capacity must be >= 1, got {capacity!r}")
        if filter_bits < 8 or filter_bits & (filter_bits - 1):
            raise InvalidArgumentError(
                f"filter_bits must be a power of two >= 8, got {filter_bits!r}"
            )
        self.capacity = capacity
        self.forgotten = 0
        """Losses dropped to stay within ``capacity``."""
        self.predates: float | None = None
        """Set by :meth:`forget_earlier`: keys may have existed before this ledger began."""
        self._lost = ObjectTable()
        """The keys remembered (their loss order: the table's recency list, oldest first)."""
        self._kind = array("I")  # per handle: what the loss was (an index into _kinds)
        self._at = array("d")  # per handle: the time of the loss (NaN: none given)
        self._kinds: list[tuple[MissReason, str, str, str, str]] = []
        """Distinct (reason, policy, tier, owner, detail) of losses, interned: few in practice
        (a policy and tier per eviction path, an owner per dead client)."""
        self._kind_ids: dict[tuple[MissReason, str, str, str, str], int] = {}
        self._counts: Counter[tuple[MissReason, str, str]] = Counter()
        self._filter = bytearray(filter_bits // 8)
        self._filter_mask = filter_bits - 1

    # -- losses ----------------------------------------------------------------------------

    def _lose(
        self,
        keys: Iterable[Hashable],
        kind: tuple[MissReason, str, str, str, str],
        at: float | None,
    ) -> None:
        """Remember that each of ``keys`` was lost so (newest loss last)."""
        kid = self._kind_ids.get(kind)
        if kid is None:
            kid = self._kind_ids[kind] = len(self._kinds)
            self._kinds.append(kind)
        t = math.nan if at is None else at
        lost = self._lost
        find, add, unlink, push = lost.find, lost.add, lost.lru_unlink, lost.lru_push
        kinds, ats, cap = self._kind, self._at, self.capacity
        for key in keys:
            code = _code(key)
            h = find(code)
            if h >= 0:
                unlink(h)  # lost again: now the newest loss
            else:
                h = add(code)
                if h >= len(ats):  # the columns grow by half (amortized O(1))
                    grow = max(h + 1 - len(ats), len(ats) // 2 + 16)
                    kinds.extend(array("I", [0]) * grow)
                    ats.extend(array("d", [math.nan]) * grow)
            push(h, 0)
            kinds[h] = kid
            ats[h] = t
            if len(lost) > cap:
                old = lost.lru_first()
                bit = _stable_hash(lost.key(old)) & self._filter_mask
                lost.remove(old)
                self._filter[bit >> 3] |= 1 << (bit & 7)
                self.forgotten += 1

    def record_eviction(
        self, key: Hashable, *, policy: str, tier: str, now: float | None = None
    ) -> None:
        """``key`` was evicted by ``policy`` from ``tier`` (and is in no other tier)."""
        self._lose((key,), (MissReason.EVICTED, policy, tier, "", ""), now)

    def record_removal(self, key: Hashable, *, now: float | None = None, detail: str = "") -> None:
        """``key`` was removed explicitly."""
        self._lose((key,), (MissReason.REMOVED, "", "", "", detail), now)

    def record_owner_death(
        self, keys: Iterable[Hashable], *, owner: str, now: float | None = None
    ) -> None:
        """``keys`` lost their last replica with client ``owner``."""
        self._lose(keys, (MissReason.OWNER_DIED, "", "", owner, ""), now)

    def record_stored(self, key: Hashable) -> None:
        """A put of ``key`` completed: it is readable again, its old loss no longer applies."""
        h = self._lost.find(_code(key))
        if h >= 0:
            self._lost.remove(h)

    # -- misses ----------------------------------------------------------------------------

    def explain(self, key: Hashable) -> Miss:
        """Why a lookup of the absent ``key`` misses, without counting it."""
        code = _code(key)
        h = self._lost.find(code)
        if h >= 0:
            return self._miss(key, h)
        bit = _stable_hash(code) & self._filter_mask
        if self._filter[bit >> 3] & (1 << (bit & 7)):
            return Miss(key, MissReason.UNKNOWN)
        if self.predates is not None:
            # the records of keys before ``predates`` are gone: absent is not "never stored"
            return Miss(key, MissReason.UNKNOWN, at=self.predates, detail=PREDATES_DETAIL)
        return Miss(key, MissReason.NEVER_STORED)

    def forget_earlier(self, now: float | None = None) -> None:
        """Say that keys may have been stored before this ledger began, unrecorded (a master
        that restarted without its state learns it when a client remounts a segment it never
        had; a client it expired and that comes back looks the same, and only costs precision:
        its lost keys are on record already). From then on a key absent from the ledger reads
        ``UNKNOWN``, never a wrong ``NEVER_STORED``; the first call's ``now`` is kept."""
        if self.predates is None:
            self.predates = float("nan") if now is None else float(now)

    def _miss(self, key: Hashable, h: int) -> Miss:
        reason, policy, tier, owner, detail = self._kinds[self._kind[h]]
        at = self._at[h]
        return Miss(
            key,
            reason,
            policy=policy,
            tier=tier,
            owner=owner,
            at=None if at != at else at,
            detail=detail,
        )

    def classify(self, key: Hashable) -> Miss:
        """Attribute and count a miss on the absent ``key``."""
        miss = self.explain(key)
        self._counts[miss.reason, miss.policy, miss.tier] += 1
        return miss

    def record_miss(
        self,
        key: Hashable,
        reason: MissReason,
        *,
        tier: str = "",
        now: float | None = None,
        detail: str = "",
    ) -> Miss:
        """Count a miss on a key that exists but could not be read (lease, transfer)."""
        if not isinstance(reason, MissReason):
            raise InvalidArgumentError(f"reason must be a MissReason, got {reason!r}")
        if reason in _LOSSES or reason is MissReason.NEVER_STORED:
            raise InvalidArgumentError(
                f"{reason.name} is a loss or absence: record it with record_* and classify()"
            )
        miss = Miss(key, reason, tier=tier, at=now, detail=detail)
        self._counts[reason, "", tier] += 1
        return miss

    # -- counters --------------------------------------------------------------------------

    def counts(self) -> dict[tuple[str, str, str], int]:
        """Misses by (reason, policy, tier) label values; empty strings where not applicable."""
        return {(r.value, p, t): n for (r, p, t), n in self._counts.items()}

    def by_reason(self) -> dict[MissReason, int]:
        """Misses per reason, every reason present (zero if none)."""
        out = dict.fromkeys(MissReason, 0)
        for (reason, _, _), n in self._counts.items():
            out[reason] += n
        return out

    @property
    def total(self) -> int:
        """All misses counted."""
        return sum(self._counts.values())

    def __len__(self) -> int:
        """Losses remembered."""
        return len(self._lost)

    def __repr__(self) -> str:
        return f"<MissLedger {len(self._lost)} losses remembered, {self.total} misses counted>"

    def __canon__(self) -> Any:
        """The logical content, oldest loss first (for state fingerprints)."""
        lost = self._lost
        return (
            [(lost.key(h), self._miss(None, h)) for h in lost.lru_order()],
            sorted((repr(k), n) for k, n in self._counts.items()),
            bytes(self._filter),
            self.forgotten,
            self.capacity,
        )


def _stable_hash(key: Hashable) -> int:
    """A hash that is the same in every process (``hash(str)`` is salted per process): the
    ledger is part of the master's replicated state, and replicas must agree on it."""
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if isinstance(key, bytes):
        return zlib.crc32(key)
    if isinstance(key, int):
        return key
    return zlib.crc32(repr(key).encode("utf-8", "surrogatepass"))
