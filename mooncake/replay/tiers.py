"""Two-tier (DRAM + SSD) prefix-cache replay with admission at the tier boundaries.

:class:`TierSim` replays a trace against a DRAM cache of ``dram_capacity`` blocks in front of
an SSD cache of ``ssd_capacity`` blocks, both LRU, and counts what reaches the SSD. Its
``admission`` is one of:

* ``"write-through"``: every block that enters DRAM is also written to the SSD (unless the SSD
  holds it already): the baseline an admission rule is measured against;
* a rule name of :func:`mooncake._core.tiers.make_admission` (``"always"``, ``"tinylfu"``,
  ``"freq:N"``...): a block is written to the SSD only when DRAM evicts it (or refuses it) and
  the rule's ``admit_ssd(key, ssd_victim)`` says yes; DRAM takes a new block only when
  ``admit_dram(key, dram_victim)`` says yes (a refused block is used once, then offered to the
  SSD as if evicted). ``"always"`` is plain demote-on-evict. Every block of every request is
  an access (``record``) for the rules that count frequencies.

A request's hit is the longest prefix of its ids resident in DRAM or on the SSD before its own
blocks are admitted (``dram_hit_blocks`` and ``ssd_hit_blocks`` split it); then its blocks
are touched or inserted in prompt order, each DRAM insert evicting DRAM's LRU block when full.
With ``ssd_capacity=0`` the DRAM hit rate is :class:`~mooncake.replay.sim.HitRateSim`'s LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from mooncake._core.tiers import Admission, make_admission
from mooncake.errors import InvalidArgumentError
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.sim import HitTotals
from mooncake.replay.trace import TraceRequest

__all__ = ["ADMISSIONS", "WRITE_THROUGH", "TierSim"]

WRITE_THROUGH = "write-through"
ADMISSIONS: tuple[str, ...] = (
    WRITE_THROUGH,
    "always",
    "tinylfu",
    "tinylfu-dram",
    "freq:2",
    "freq:3",
)
"""The admission modes :func:`~mooncake.replay.run.replay` compares by default."""


class TierSim:
    """DRAM LRU of ``dram_capacity`` blocks over an SSD LRU of ``ssd_capacity`` blocks."""

    def __init__(
        self,
        admission: str,
        dram_capacity: int,
        ssd_capacity: int,
        *,
        kv: KVModel,
        model: PrefillModel,
    ) -> None:
        if dram_capacity < 0 or ssd_capacity < 0:
            raise InvalidArgumentError(
                f"tier capacities must be >= 0 blocks, got {dram_capacity}, {ssd_capacity}"
            )
        self.admission = admission
        self._rule: Admission | None = (
            None if admission == WRITE_THROUGH else make_admission(admission)
        )
        self.dram_capacity = dram_capacity
        self.ssd_capacity = ssd_capacity
        self._dram: OrderedDict[int, None] = OrderedDict()
        self._ssd: OrderedDict[int, None] = OrderedDict()
        self._kv = kv
        self._model = model
        self.totals = HitTotals()
        self.hits: list[int] = []
        self.dram_hit_blocks = 0
        self.ssd_hit_blocks = 0
        self.ssd_writes = 0
        """Blocks written to the SSD."""
        self.dram_refused = 0
        """New blocks DRAM's admission refused."""
        self.ssd_refused = 0
        """Demoted blocks the SSD's admission refused."""

    @property
    def name(self) -> str:
        return f"tiers:{self.admission}:{self.dram_capacity}+{self.ssd_capacity}"

    def _write_ssd(self, key: int) -> None:
        ssd = self._ssd
        if self.ssd_capacity <= 0:
            return
        if len(ssd) >= self.ssd_capacity:
            ssd.popitem(last=False)
        ssd[key] = None
        self.ssd_writes += 1

    def _demote(self, key: int) -> None:
        ssd = self._ssd
        if key in ssd or self.ssd_capacity <= 0:
            return
        rule = self._rule
        if rule is None:
            return  # write-through: written when it entered DRAM (or evicted since)
        victim = next(iter(ssd)) if len(ssd) >= self.ssd_capacity else None
        if rule.admit_ssd(key, victim):
            self._write_ssd(key)
        else:
            self.ssd_refused += 1

    def feed(self, req: TraceRequest) -> None:
        dram, ssd = self._dram, self._ssd
        ids = req.hash_ids
        k = 0
        for key in ids:
            if key in dram:
                self.dram_hit_blocks += 1
            elif key in ssd:
                self.ssd_hit_blocks += 1
            else:
                break
            k += 1
        rule = self._rule
        record = rule.record if rule is not None else None
        cap = self.dram_capacity
        inserted = 0
        for key in ids:
            if record is not None:
                record(key)
            if key in dram:
                dram.move_to_end(key)
                continue
            if key in ssd:
                ssd.move_to_end(key)
            victim = next(iter(dram)) if len(dram) >= cap and dram else None
            if rule is not None and not rule.admit_dram(key, victim):
                self.dram_refused += 1
                self._demote(key)
                continue
            if cap <= 0:
                self._demote(key)
                continue
            if victim is not None:
                dram.popitem(last=False)
                self._demote(victim)
            dram[key] = None
            inserted += 1
            if rule is None and key not in ssd:
                self._write_ssd(key)
        self.totals.inserted_blocks += inserted
        self.totals.add(req, k, self._kv.block_tokens, self._model)
        self.hits.append(k)

    def release(self) -> None:
        """Drop the tiers' contents once the trace is done (the sums stay)."""
        self._dram = OrderedDict()
        self._ssd = OrderedDict()

    def summary(self) -> dict[str, Any]:
        blocks = self.totals.blocks or 1
        return {
            "name": self.name,
            "admission": self.admission,
            "dram_capacity_blocks": self.dram_capacity,
            "ssd_capacity_blocks": self.ssd_capacity,
            "dram_hit_rate": self.dram_hit_blocks / blocks,
            "ssd_hit_rate": self.ssd_hit_blocks / blocks,
            "ssd_writes": self.ssd_writes,
            "ssd_write_bytes": self.ssd_writes * self._kv.block_bytes,
            "dram_refused": self.dram_refused,
            "ssd_refused": self.ssd_refused,
            **self.totals.summary(self._kv),
        }
