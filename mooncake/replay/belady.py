"""Belady's offline optimum (MIN) for the prefix block cache: the reference curve of a replay.

Same cache semantics as :class:`~mooncake.replay.cache.BlockCache`: a request's hit is the
longest resident prefix of its ids before admission; then every block is touched or inserted
and the cache is trimmed to ``capacity``. At a trim MIN knows the future: it evicts the
resident blocks whose next reference is farthest away (never again first), ties broken
deepest block first (its position in the prompt).

Why this is the optimum of the block cache, not only of a flat cache, in three steps:

1. In a trace whose ids form a prefix tree (what :func:`~mooncake.replay.trace.iter_trace`
   checks) every request that reads a block reads its parent, so a parent's next reference
   is never later than its child's. The block MIN evicts first, the farthest and deepest, has
   therefore no resident child: MIN only ever evicts leaves, so its cache stays
   *prefix-closed* (every resident block's parent is resident) -- the prefix-closure rule of
   the block cache.
2. In a prefix-closed cache the resident blocks of a request form a prefix of it, so the
   request's hit is simply the number of its blocks that are resident: the flat hit count.
   Any other eviction schedule's prefix hit is at most its flat hit count.
3. MIN maximises the flat hit count over every schedule that evicts the same number of
   blocks at the same trims (Belady's exchange argument: evicting a block needed later
   instead of one needed sooner never gains a hit).

So no schedule of the block cache gets more hit blocks than MIN; ``tests/test_replay_belady.py``
checks it against an exhaustive search over every victim choice on small traces.

Cost: one backward pass for next references, then O(refs log refs) per capacity with a lazy
max-heap; the conversation trace (288,500 block references) takes about a second per capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from mooncake.errors import InvalidArgumentError
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.sim import HitTotals
from mooncake.replay.trace import TraceRequest

__all__ = ["NEVER", "BeladySim", "belady_hits", "next_references"]

NEVER = 1 << 62
"""Next reference of a block that is never read again."""


def next_references(traces: Sequence[Sequence[int]]) -> list[list[int]]:
    """For request ``i`` and position ``j``: the index of the next request that reads
    ``traces[i][j]`` (``NEVER`` if none)."""
    nxt: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in traces]
    for i in range(len(traces) - 1, -1, -1):
        ids = traces[i]
        out[i] = [nxt.get(key, NEVER) for key in ids]
        for key in ids:
            nxt[key] = i
    return out


def belady_hits(
    traces: Sequence[Sequence[int]], capacity: int, nexts: list[list[int]] | None = None
) -> list[int]:
    """Hit blocks of every request under MIN with ``capacity`` blocks (see module doc)."""
    return _belady(traces, capacity, nexts)[0]


def _belady(
    traces: Sequence[Sequence[int]], capacity: int, nexts: list[list[int]] | None
) -> tuple[list[int], int]:
    """(hit blocks per request, blocks inserted) under MIN."""
    if capacity < 0:
        raise InvalidArgumentError(f"cache capacity must be >= 0 blocks, got {capacity}")
    if nexts is None:
        nexts = next_references(traces)
    resident: dict[int, int] = {}  # block -> its current next reference
    heap: list[tuple[int, int, int]] = []  # (-next, -depth, block); stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    hits: list[int] = []
    inserted = 0
    for ids, nx in zip(traces, nexts, strict=True):
        k = 0
        for key in ids:
            if key not in resident:
                break
            k += 1
        hits.append(k)
        inserted += len(ids)
        for depth, key in enumerate(ids):
            n = nx[depth]
            if key in resident:
                inserted -= 1
            resident[key] = n
            push(heap, (-n, -depth, key))
        over = len(resident) - capacity
        while over > 0:
            neg_next, _, key = pop(heap)
            if resident.get(key) == -neg_next:
                del resident[key]
                over -= 1
        if len(heap) > 4 * len(resident) + 1024:
            heap = [e for e in heap if resident.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return hits, inserted


class BeladySim:
    """MIN over a whole trace at ``capacity`` blocks, summarised like a sweep cache.

    Offline: :meth:`run` needs every request at once (the next references), so it is not
    fed request by request like the online simulators.
    """

    policy = "belady"
    scope = "global"

    def __init__(self, capacity: int, *, kv: KVModel, model: PrefillModel) -> None:
        if capacity < 0:
            raise InvalidArgumentError(f"cache capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._kv = kv
        self._model = model
        self.totals = HitTotals()
        self.hits: list[int] = []

    @property
    def name(self) -> str:
        return f"global:belady:{self.capacity}"

    def run(self, requests: Sequence[TraceRequest], nexts: list[list[int]] | None = None) -> None:
        traces = [r.hash_ids for r in requests]
        self.hits, self.totals.inserted_blocks = _belady(traces, self.capacity, nexts)
        bt = self._kv.block_tokens
        for req, k in zip(requests, self.hits, strict=True):
            self.totals.add(req, k, bt, self._model)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "policy": self.policy,
            "scope": self.scope,
            "instances": 1,
            "capacity_blocks": self.capacity,
            "router": None,
            **self.totals.summary(self._kv),
        }
