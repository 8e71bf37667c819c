"""One pass over a trace feeding every simulator of a :class:`ReplayConfig`; the report.

:func:`replay` takes an iterable of :class:`~mooncake.replay.trace.TraceRequest` (streamed, never
materialised) and feeds each request, in order, to: the infinite cache (theoretical maximum), a
global pool per (policy, capacity), ``instances`` local caches per (local policy, capacity),
one :class:`~mooncake.replay.sim.ScheduleSim` per strategy, and one two-tier
:class:`~mooncake.replay.tiers.TierSim` per (admission, capacity). The
:class:`ReplayReport` holds trace statistics, every simulator's summary and the per-request
outcome columns (:meth:`ReplayReport.request_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from mooncake._core.policies import POLICIES, make_policy
from mooncake.errors import InvalidArgumentError
from mooncake.replay.belady import BeladySim, next_references
from mooncake.replay.cache import PolicyFactory
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.sim import STRATEGIES, HitRateSim, MaxHitSim, Router, ScheduleSim, Scope
from mooncake.replay.tiers import TierSim
from mooncake.replay.trace import TraceRequest

#: Capacity sweep (blocks) of the paper's Fig. 9 form; 5,859 blocks = 3M tokens, 58,590 = 10 x
#: 3M tokens (REFERENCE's 10-instance pool), 97,656 = 50M tokens.
DEFAULT_CAPACITIES: tuple[int, ...] = (
    1000,
    2000,
    5000,
    5859,
    10000,
    20000,
    50000,
    58590,
    97656,
)


def policy_factory(name: str) -> PolicyFactory:
    """A zero-argument factory building the production policy ``name`` (checked now)."""
    make_policy(name)  # raises InvalidArgumentError naming the known policies
    return lambda: make_policy(name)


def available_policies() -> list[str]:
    """Names of the shipped eviction policies, in registry order."""
    return list(POLICIES)


@dataclass(frozen=True)
class ReplayConfig:
    """What to simulate. Capacities are in blocks of ``kv.block_tokens`` tokens.

    ``local_policies``: also run ``instances`` local caches of ``capacity // instances`` blocks
    for each of these policies and each capacity, routed by ``local_router`` (default LRU only:
    the global-vs-local comparison is the paper's for LRU, and every policy would double the
    sweep's time). ``strategies``: routing strategies for
    ``instances`` prefill instances of ``instance_capacity`` blocks each, with the
    ``schedule_policy`` eviction policy. ``belady``: also run Belady's offline optimum
    (:mod:`mooncake.replay.belady`) at every capacity, the reference the policies are
    measured against. ``admissions``: also run a DRAM cache of each capacity over an SSD
    of ``ssd_ratio`` times it, per admission mode (:mod:`mooncake.replay.tiers`: SSD
    writes beside hit rates).
    """

    policies: tuple[str, ...] = ("lru",)
    capacities: tuple[int, ...] = DEFAULT_CAPACITIES
    local_policies: tuple[str, ...] = ("lru",)
    instances: int = 10
    local_router: Router = "round_robin"
    strategies: tuple[str, ...] = STRATEGIES
    instance_capacity: int = 5859
    schedule_policy: str = "lru"
    balance_threshold: float = 1.0
    seed: int = 0
    belady: bool = True
    admissions: tuple[str, ...] = ()
    ssd_ratio: int = 4
    kv: KVModel = field(default_factory=KVModel)
    model: PrefillModel = field(default_factory=PrefillModel)

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise InvalidArgumentError(f"instances must be >= 1, got {self.instances}")
        for c in (*self.capacities, self.instance_capacity):
            if c < 0:
                raise InvalidArgumentError(f"capacities must be >= 0 blocks, got {c}")
        if self.ssd_ratio < 0:
            raise InvalidArgumentError(f"ssd_ratio must be >= 0, got {self.ssd_ratio}")
        for s in self.strategies:
            if s not in STRATEGIES:
                raise InvalidArgumentError(
                    f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}"
                )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceSummary:
    """Shape of the trace as replayed (good requests only)."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    block_refs: int = 0
    max_blocks: int = 0
    first_ms: float = 0.0
    last_ms: float = 0.0
    unique_blocks: int = 0

    def add(self, req: TraceRequest) -> None:
        if self.requests == 0:
            self.first_ms = req.timestamp_ms
        self.requests += 1
        self.input_tokens += req.input_length
        self.output_tokens += req.output_length
        self.block_refs += len(req.hash_ids)
        self.max_blocks = max(self.max_blocks, len(req.hash_ids))
        self.last_ms = req.timestamp_ms

    def to_dict(self) -> dict[str, Any]:
        n = self.requests or 1
        return {
            **asdict(self),
            "mean_input": self.input_tokens / n,
            "mean_output": self.output_tokens / n,
            "duration_s": (self.last_ms - self.first_ms) / 1000.0,
        }


@dataclass
class ReplayReport:
    """Everything a replay measured; :meth:`to_dict` is the ``--json`` document."""

    config: ReplayConfig
    trace: TraceSummary
    max_hit: MaxHitSim
    caches: list[HitRateSim]
    schedules: list[ScheduleSim]
    #: per request: (index, line_no, timestamp_ms, input_length, output_length, blocks)
    requests: list[tuple[int, int, float, int, int, int]]
    #: Belady's optimum per capacity (empty if the config turned it off)
    belady: list[BeladySim] = field(default_factory=list)
    #: DRAM + SSD runs per (admission, capacity) (empty unless the config asked for them)
    tiers: list[TierSim] = field(default_factory=list)

    def cache(self, scope: str, policy: str, capacity: int) -> HitRateSim:
        """The hit-rate simulator of ``(scope, policy, capacity)``; ``KeyError`` if not run."""
        for sim in self.caches:
            if sim.scope == scope and sim.policy == policy and sim.capacity == capacity:
                return sim
        raise KeyError((scope, policy, capacity))

    def schedule(self, strategy: str) -> ScheduleSim:
        for sim in self.schedules:
            if sim.strategy == strategy:
                return sim
        raise KeyError(strategy)

    def columns(self) -> list[str]:
        cols = [
            "index",
            "line",
            "timestamp_ms",
            "input_length",
            "output_length",
            "blocks",
            "max_hit_blocks",
        ]
        cols += [f"hit_blocks[{sim.name}]" for sim in self.caches]
        cols += [f"hit_blocks[{sim.name}]" for sim in self.belady]
        for s in self.schedules:
            cols += [
                f"{s.name}.instance",
                f"{s.name}.hit_blocks",
                f"{s.name}.queue_s",
                f"{s.name}.transfer_s",
                f"{s.name}.prefill_s",
                f"{s.name}.ttft_s",
            ]
        return cols

    def request_rows(self) -> Iterator[list[int | float]]:
        """One row per request, in :meth:`columns` order."""
        for i, meta in enumerate(self.requests):
            row: list[int | float] = [*meta, self.max_hit.hits[i]]
            row += [sim.hits[i] for sim in self.caches]
            row += [sim.hits[i] for sim in self.belady]
            for s in self.schedules:
                row += [
                    s.instance[i],
                    s.hits[i],
                    s.queue_s[i],
                    s.transfer_s[i],
                    s.prefill_s[i],
                    s.ttft_s[i],
                ]
            yield row

    def to_dict(self, *, requests: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config.to_dict(),
            "trace": {**self.trace.to_dict(), "unique_blocks": self.max_hit.unique_blocks},
            "max": self.max_hit.summary(),
            "caches": [sim.summary() for sim in self.caches],
            "schedules": [sim.summary() for sim in self.schedules],
            "belady": [sim.summary() for sim in self.belady],
            "tiers": [sim.summary() for sim in self.tiers],
        }
        if requests:
            out["requests"] = {"columns": self.columns(), "rows": list(self.request_rows())}
        return out


def replay(
    requests: Iterable[TraceRequest],
    config: ReplayConfig | None = None,
    *,
    factories: dict[str, PolicyFactory] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Read ``requests`` once, then run every simulator ``config`` asks for over them.

    ``requests`` is consumed once (a streaming reader works) into an in-memory list; each
    simulator then replays the whole list in order, one simulator after the other (several
    times faster than interleaving them request by request: one cache's working set stays in
    the CPU caches). ``factories`` maps policy names to factories (default: the production
    registry, :func:`mooncake._core.policies.make_policy`). ``progress(done, total)`` is called
    now and then with simulator-request steps done so far (Belady's runs included).
    """
    cfg = config if config is not None else ReplayConfig()
    names = {*cfg.policies, *cfg.local_policies, cfg.schedule_policy}
    fac: dict[str, PolicyFactory] = dict(factories or {})
    for name in names:
        if name not in fac:
            fac[name] = policy_factory(name)
    kv, model = cfg.kv, cfg.model
    reqs = list(requests)
    trace = TraceSummary()
    for req in reqs:
        trace.add(req)
    max_hit = MaxHitSim(kv=kv, model=model)
    caches: list[HitRateSim] = []
    runs: list[tuple[Scope, str]] = [("global", p) for p in cfg.policies]
    if cfg.instances > 1:
        runs += [("local", p) for p in cfg.local_policies]
    for scope, policy in runs:
        for capacity in cfg.capacities:
            caches.append(
                HitRateSim(
                    policy,
                    fac[policy],
                    capacity,
                    scope=scope,
                    instances=cfg.instances,
                    router=cfg.local_router,
                    seed=cfg.seed,
                    kv=kv,
                    model=model,
                )
            )
    schedules = [
        ScheduleSim(
            strategy,
            fac[cfg.schedule_policy],
            policy=cfg.schedule_policy,
            instances=cfg.instances,
            capacity=cfg.instance_capacity,
            balance_threshold=cfg.balance_threshold,
            seed=cfg.seed,
            kv=kv,
            model=model,
        )
        for strategy in cfg.strategies
    ]
    tiers = [
        TierSim(a, c, c * cfg.ssd_ratio, kv=kv, model=model)
        for a in cfg.admissions
        for c in cfg.capacities
    ]
    sims: list[MaxHitSim | HitRateSim | ScheduleSim | TierSim] = [
        max_hit,
        *caches,
        *schedules,
        *tiers,
    ]
    belady = [BeladySim(c, kv=kv, model=model) for c in cfg.capacities] if cfg.belady else []
    total = (len(sims) + len(belady)) * len(reqs)
    done = 0
    step = 2048
    for sim in sims:
        feed = sim.feed
        for start in range(0, len(reqs), step):
            for req in reqs[start : start + step]:
                feed(req)
            if progress is not None:
                progress(done + min(start + step, len(reqs)), total)
        done += len(reqs)
        if not isinstance(sim, MaxHitSim):
            sim.release()  # a policy object of a big cache holds ~100 B per block
    if belady:
        nexts = next_references([r.hash_ids for r in reqs])
        for b in belady:
            b.run(reqs, nexts)
            done += len(reqs)
            if progress is not None:
                progress(done, total)
    trace.unique_blocks = max_hit.unique_blocks
    meta = [
        (r.index, r.line_no, r.timestamp_ms, r.input_length, r.output_length, len(r.hash_ids))
        for r in reqs
    ]
    return ReplayReport(cfg, trace, max_hit, caches, schedules, meta, belady, tiers)
