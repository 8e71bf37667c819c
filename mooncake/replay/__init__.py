"""Trace replay: FAST'25 request traces against the production eviction policies and the
scheduling strategies, on a virtual clock (``mooncake replay TRACE.jsonl``; docs/replay.md).

Pure computation (no I/O except :func:`load_trace` and the plots): read requests with
:func:`iter_trace`, run them with :func:`replay` and a :class:`ReplayConfig`, inspect the
:class:`ReplayReport`. The caches call the same policy objects the master uses
(:mod:`mooncake._core.policies`).
"""

from __future__ import annotations

from mooncake.replay.cache import BlockCache, InfiniteCache
from mooncake.replay.model import LLAMA3_70B_KV_BYTES_PER_TOKEN, KVModel, PrefillModel
from mooncake.replay.run import (
    DEFAULT_CAPACITIES,
    ReplayConfig,
    ReplayReport,
    available_policies,
    replay,
)
from mooncake.replay.sim import STRATEGIES, HitRateSim, MaxHitSim, ScheduleSim
from mooncake.replay.trace import BLOCK_TOKENS, TraceRequest, TraceStats, iter_trace, load_trace

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_CAPACITIES",
    "LLAMA3_70B_KV_BYTES_PER_TOKEN",
    "STRATEGIES",
    "BlockCache",
    "HitRateSim",
    "InfiniteCache",
    "KVModel",
    "MaxHitSim",
    "PrefillModel",
    "ReplayConfig",
    "ReplayReport",
    "ScheduleSim",
    "TraceRequest",
    "TraceStats",
    "available_policies",
    "iter_trace",
    "load_trace",
    "replay",
]
