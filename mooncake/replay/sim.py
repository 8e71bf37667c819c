"""Trace-driven simulators: prefix-cache hit rates and cache-aware scheduling on a virtual clock.

Every simulator is fed the trace's requests one at a time, in trace order, with ``feed(req)``
and keeps its own per-request outcome columns and running sums; the clock is the trace's
``timestamp`` (passed to the policies as seconds). Nothing here reads files or wall time.

* :class:`MaxHitSim` - infinite cache: the theoretical maximum hit.
* :class:`HitRateSim` - one global pool of ``capacity`` blocks, or ``instances`` local caches of
  ``capacity // instances`` blocks each with requests routed round-robin or at random.
* :class:`ScheduleSim` - ``instances`` prefill instances, each a FIFO server with its own local
  cache, and a routing strategy (``random``, ``round_robin``, ``load_balance``,
  ``local_cache_aware``, ``global_cache_aware``); TTFT = queueing + KV transfer + prefill.

Hit of a request (block count ``k``): the longest resident prefix of its ids before its own blocks
are admitted. Block-weighted hit rate = sum(k) / sum(len(ids)); token-weighted =
sum(min(block_tokens * k, input_length)) / sum(input_length).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mooncake.errors import InvalidArgumentError
from mooncake.replay.cache import BlockCache, InfiniteCache, PolicyFactory
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.trace import TraceRequest

Scope = Literal["global", "local"]
Router = Literal["round_robin", "random"]

#: Routing strategies of :class:`ScheduleSim`, worst to best in the paper's Fig. 5.
STRATEGIES: tuple[str, ...] = (
    "random",
    "round_robin",
    "load_balance",
    "local_cache_aware",
    "global_cache_aware",
)


@dataclass(slots=True)
class HitTotals:
    """Running sums shared by all simulators."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    prefill_s: float = 0.0
    prefill_nocache_s: float = 0.0
    inserted_blocks: int = 0

    def add(self, req: TraceRequest, k: int, block_tokens: int, model: PrefillModel) -> float:
        """Account one request with hit ``k`` blocks; returns its estimated prefill seconds."""
        n = req.input_length
        p = min(block_tokens * k, n)
        t = model.seconds(n, p)
        self.requests += 1
        self.blocks += len(req.hash_ids)
        self.hit_blocks += k
        self.tokens += n
        self.hit_tokens += p
        self.prefill_s += t
        self.prefill_nocache_s += model.seconds(n, 0)
        return t

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def summary(self, kv: KVModel) -> dict[str, Any]:
        n = self.requests or 1
        return {
            "requests": self.requests,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "hit_blocks": self.hit_blocks,
            "hit_tokens": self.hit_tokens,
            "prefill_s_per_request": self.prefill_s / n,
            "prefill_nocache_s_per_request": self.prefill_nocache_s / n,
            # KV read from the cache into the prefill GPU, and new KV written into the cache.
            "kv_bytes_read": self.hit_tokens * kv.bytes_per_token,
            "kv_bytes_written": self.inserted_blocks * kv.block_bytes,
        }


class MaxHitSim:
    """Infinite cache: the theoretical maximum hit of every request."""

    name = "max"

    def __init__(self, *, kv: KVModel, model: PrefillModel) -> None:
        self._cache = InfiniteCache()
        self._kv = kv
        self._model = model
        self.totals = HitTotals()
        self.hits: list[int] = []

    def feed(self, req: TraceRequest) -> None:
        ids = req.hash_ids
        k = self._cache.prefix_hit(ids)
        before = len(self._cache)
        self._cache.admit(ids, req.time_s)
        self.totals.inserted_blocks += len(self._cache) - before
        self.totals.add(req, k, self._kv.block_tokens, self._model)
        self.hits.append(k)

    @property
    def unique_blocks(self) -> int:
        return len(self._cache)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, **self.totals.summary(self._kv)}


class HitRateSim:
    """A global pool or ``instances`` local caches, one policy object per cache."""

    def __init__(
        self,
        policy: str,
        factory: PolicyFactory,
        capacity: int,
        *,
        scope: Scope = "global",
        instances: int = 1,
        router: Router = "round_robin",
        seed: int = 0,
        kv: KVModel,
        model: PrefillModel,
    ) -> None:
        if instances < 1:
            raise InvalidArgumentError(f"instances must be >= 1, got {instances}")
        if scope == "global":
            self._caches = [BlockCache(factory(), capacity)]
        elif scope == "local":
            self._caches = [BlockCache(factory(), capacity // instances) for _ in range(instances)]
        else:
            raise InvalidArgumentError(f"scope must be 'global' or 'local', got {scope!r}")
        if router not in ("round_robin", "random"):
            raise InvalidArgumentError(f"router must be round_robin or random, got {router!r}")
        self._released_evicted = 0
        self.policy = policy
        self.capacity = capacity
        self.scope: Scope = scope
        self.instances = instances
        self.router = router
        self._rng = random.Random(seed)
        self._next = 0
        self._kv = kv
        self._model = model
        self.totals = HitTotals()
        self.hits: list[int] = []

    @property
    def name(self) -> str:
        where = "global" if self.scope == "global" else f"local{self.instances}"
        return f"{where}:{self.policy}:{self.capacity}"

    def feed(self, req: TraceRequest) -> None:
        caches = self._caches
        if not caches:
            raise RuntimeError(f"{self.name}: fed after release()")
        if len(caches) == 1:
            cache = caches[0]
        elif self.router == "round_robin":
            cache = caches[self._next]
            self._next = (self._next + 1) % len(caches)
        else:
            cache = caches[self._rng.randrange(len(caches))]
        before = cache.inserted
        k = cache.admit(req.hash_ids, req.time_s)
        self.totals.inserted_blocks += cache.inserted - before
        self.totals.add(req, k, self._kv.block_tokens, self._model)
        self.hits.append(k)

    def release(self) -> None:
        """Drop the caches (and their policy objects) once the trace is done; the outcome
        columns and sums stay. Feeding afterwards is an error."""
        self._released_evicted += sum(c.evicted for c in self._caches)
        self._caches = []

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "policy": self.policy,
            "scope": self.scope,
            "instances": self.instances if self.scope == "local" else 1,
            "capacity_blocks": self.capacity,
            "router": self.router if self.scope == "local" else None,
            "evicted_blocks": self._released_evicted + sum(c.evicted for c in self._caches),
            **self.totals.summary(self._kv),
        }


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (``q`` in [0, 100])."""
    if not sorted_xs:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_xs)))
    return sorted_xs[min(rank, len(sorted_xs)) - 1]


class ScheduleSim:
    """``instances`` prefill instances behind one routing ``strategy``.

    Each instance is a FIFO single server with its own :class:`BlockCache` of ``capacity`` blocks
    (its DRAM share of the pool). A request arriving at ``t`` on instance ``i`` waits
    ``queue = max(0, busy_until[i] - t)``, then (``global_cache_aware`` only) pulls the prefix
    blocks it lacks from the instance holding the longest prefix at ``transfer_seconds``, then
    prefills its uncached tokens; TTFT = queue + transfer + prefill (decode and network latency
    are not modelled). The request's blocks are admitted to the chosen instance's cache when it
    is dispatched (a later request on the same FIFO instance runs after it anyway).

    Strategies: ``random`` and ``round_robin`` ignore load and cache; ``load_balance`` takes the
    shortest queue (ties broken at random); ``local_cache_aware`` minimises queue + prefill given
    the instance's own prefix hit; ``global_cache_aware`` is the paper's Algorithm 1: for every
    instance it also considers fetching the best prefix held anywhere (when that prefix is longer
    than ``balance_threshold`` times the instance's own, and it is faster), and takes the instance
    of least estimated TTFT - so a hot prefix is replicated to an idle instance when the instance
    that holds it is overloaded.
    """

    def __init__(
        self,
        strategy: str,
        factory: PolicyFactory,
        *,
        policy: str = "lru",
        instances: int,
        capacity: int,
        balance_threshold: float = 1.0,
        seed: int = 0,
        kv: KVModel,
        model: PrefillModel,
    ) -> None:
        if strategy not in STRATEGIES:
            raise InvalidArgumentError(
                f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}"
            )
        if instances < 1:
            raise InvalidArgumentError(f"instances must be >= 1, got {instances}")
        if balance_threshold < 1.0:
            raise InvalidArgumentError("balance_threshold must be >= 1")
        self.strategy = strategy
        self.policy = policy
        self.instances = instances
        self.capacity = capacity
        self.balance_threshold = balance_threshold
        self._caches = [BlockCache(factory(), capacity) for _ in range(instances)]
        self._busy = [0.0] * instances
        self._rng = random.Random(seed)
        self._next = 0
        self._kv = kv
        self._model = model
        self.totals = HitTotals()
        self.transferred_blocks = 0
        self.busy_s = 0.0
        self.last_finish = 0.0
        # per-request outcome columns
        self.instance: list[int] = []
        self.hits: list[int] = []
        self.queue_s: list[float] = []
        self.transfer_s: list[float] = []
        self.prefill_s: list[float] = []
        self.ttft_s: list[float] = []

    @property
    def name(self) -> str:
        return self.strategy

    def _pick(self, req: TraceRequest, t: float) -> tuple[int, int, int, int]:
        """Return ``(instance, hit_blocks, transfer_blocks, source_instance)``."""
        n_inst = self.instances
        strategy = self.strategy
        caches = self._caches
        ids = req.hash_ids
        if strategy == "random":
            i = self._rng.randrange(n_inst)
            return i, caches[i].prefix_hit(ids), 0, i
        if strategy == "round_robin":
            i = self._next
            self._next = (i + 1) % n_inst
            return i, caches[i].prefix_hit(ids), 0, i
        busy = self._busy
        if strategy == "load_balance":
            least = min(busy)
            if least <= t:
                ties = [j for j in range(n_inst) if busy[j] <= t]
            else:
                ties = [j for j in range(n_inst) if busy[j] == least]
            i = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
            return i, caches[i].prefix_hit(ids), 0, i
        n = req.input_length
        bt = self._kv.block_tokens
        seconds = self._model.seconds
        hits = [c.prefix_hit(ids) for c in caches]
        best_len = max(hits)
        best_src = hits.index(best_len)
        t_best = seconds(n, min(bt * best_len, n))
        global_aware = strategy == "global_cache_aware"
        choice = (math.inf, 0, 0, 0, 0)  # (estimated ttft, instance, hit, transfer, source)
        for j in range(n_inst):
            queue = busy[j] - t if busy[j] > t else 0.0
            k = hits[j]
            est = queue + seconds(n, min(bt * k, n))
            if est < choice[0]:
                choice = (est, j, k, 0, j)
            if global_aware and best_len > k * self.balance_threshold:
                est_x = queue + self._kv.transfer_seconds(best_len - k) + t_best
                if est_x < choice[0]:
                    choice = (est_x, j, best_len, best_len - k, best_src)
        _, i, k, moved, src = choice
        return i, k, moved, src

    def release(self) -> None:
        """Drop the instances' caches once the trace is done (outcomes stay)."""
        self._caches = []

    def feed(self, req: TraceRequest) -> None:
        if not self._caches:
            raise RuntimeError(f"{self.name}: fed after release()")
        t = req.time_s
        i, k, moved, src = self._pick(req, t)
        ids = req.hash_ids
        if moved:
            # the source serves the read: it counts as an access there
            self._caches[src].touch(ids[:k], t)
        cache = self._caches[i]
        before = cache.inserted
        cache.admit(ids, t)
        self.totals.inserted_blocks += cache.inserted - before
        prefill = self.totals.add(req, k, self._kv.block_tokens, self._model)
        transfer = self._kv.transfer_seconds(moved) if moved else 0.0
        start = max(t, self._busy[i])
        finish = start + transfer + prefill
        self._busy[i] = finish
        self.busy_s += transfer + prefill
        self.last_finish = max(self.last_finish, finish)
        self.transferred_blocks += moved
        self.instance.append(i)
        self.hits.append(k)
        self.queue_s.append(start - t)
        self.transfer_s.append(transfer)
        self.prefill_s.append(prefill)
        self.ttft_s.append(finish - t)

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_s)
        n = len(ttft) or 1
        return {
            "name": self.name,
            "strategy": self.strategy,
            "policy": self.policy,
            "instances": self.instances,
            "capacity_blocks_per_instance": self.capacity,
            "ttft_mean_s": sum(ttft) / n,
            "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p90_s": _percentile(ttft, 90),
            "ttft_p99_s": _percentile(ttft, 99),
            "ttft_max_s": ttft[-1] if ttft else math.nan,
            "queue_mean_s": sum(self.queue_s) / n,
            "transferred_blocks": self.transferred_blocks,
            "kv_bytes_transferred": self.transferred_blocks * self._kv.block_bytes,
            "gpu_busy_s": self.busy_s,
            **self.totals.summary(self._kv),
        }
