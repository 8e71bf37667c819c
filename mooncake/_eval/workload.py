"""A FAST'25 trace cut down to a tiny model: which requests, when, and which tokens.

Contracts:

* :func:`select` picks ``n`` trace requests. ``mode="window"`` takes ``n`` consecutive good
  lines from ``start``; ``mode="sessions"`` (the default of ``mooncake eval``) takes whole
  multi-turn sessions (requests sharing their first *distinctive* block id: the first id that
  at most half the trace's requests carry, so a system prompt shared by everyone does not
  make one session of the whole trace) with at least ``min_turns`` requests each, in the order
  the sessions start, until ``n`` requests are taken; the result is sorted by timestamp.
  Consecutive windows of the conversation trace reuse almost nothing (a session's next turn
  comes minutes later); sessions keep the reuse the trace has.
* :func:`scale` maps each request to a :class:`ScaledRequest`: arrival
  ``(t - t_first) / time_scale`` seconds (``time_scale`` from :func:`time_scale_for` when a
  target duration is given), prompt length ``ceil(input_length * block_tokens / trace_block)``
  capped at ``max_prompt``, output length ``ceil(output_length * block_tokens / trace_block)``
  clamped to ``[min_tokens, max_tokens]``.
* :func:`block_tokens` gives each trace block id ``block_tokens`` token ids, a pure function of
  ``(seed, hash_id, vocab)`` in ``[first_token, vocab)``; a prompt is the concatenation of its
  blocks' tokens cut to its length. So two requests whose ``hash_ids`` share a prefix of ``k``
  ids share their first ``min(k * block_tokens, len_a, len_b)`` tokens, and requests that share
  no first id share no first token block.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mooncake.errors import InvalidArgumentError
from mooncake.replay.trace import BLOCK_TOKENS, TraceRequest

__all__ = [
    "ScaledRequest",
    "WorkloadConfig",
    "block_tokens",
    "build_prompt",
    "control_prompt",
    "scale",
    "select",
    "time_scale_for",
]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """How a trace is cut down (see the module docstring)."""

    requests: int = 32
    mode: str = "sessions"
    start: int = 0
    min_turns: int = 3
    block_tokens: int = 32
    max_prompt: int = 768
    min_tokens: int = 2
    max_tokens: int = 12
    duration_s: float | None = 60.0
    time_scale: float | None = None
    vocab: int = 1024
    first_token: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InvalidArgumentError("requests must be >= 1")
        if self.mode not in ("sessions", "window"):
            raise InvalidArgumentError(f"mode must be 'sessions' or 'window', not {self.mode!r}")
        if self.block_tokens < 1 or self.max_prompt < 1:
            raise InvalidArgumentError("block_tokens and max_prompt must be >= 1")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError("need 1 <= min_tokens <= max_tokens")
        if not 0 <= self.first_token < self.vocab:
            raise InvalidArgumentError("need 0 <= first_token < vocab")
        if self.time_scale is not None and self.time_scale <= 0:
            raise InvalidArgumentError("time_scale must be > 0")
        if self.duration_s is not None and self.duration_s < 0:
            raise InvalidArgumentError("duration_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """One request as the evaluation sends it."""

    index: int
    """Position in the evaluation (0-based, arrival order)."""
    trace_line: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    """The trace block ids the prompt is built from (cut to the blocks it covers)."""
    prompt: tuple[int, ...]
    max_tokens: int
    trace_input_length: int
    trace_output_length: int


def _session_keys(requests: Sequence[TraceRequest]) -> list[int | None]:
    counts: Counter[int] = Counter()
    for r in requests:
        counts.update(r.hash_ids)
    limit = len(requests) / 2
    keys: list[int | None] = []
    for r in requests:
        keys.append(next((h for h in r.hash_ids if counts[h] <= limit), None))
    return keys


def select(trace: Iterable[TraceRequest], cfg: WorkloadConfig) -> list[TraceRequest]:
    """The ``cfg.requests`` trace requests of ``cfg.mode`` (see the module docstring), sorted
    by timestamp (stable). Fewer when the trace has fewer."""
    every = list(trace)
    if cfg.mode == "window":
        return every[cfg.start : cfg.start + cfg.requests]
    every = every[cfg.start :]
    sessions: dict[int, list[TraceRequest]] = {}
    for key, r in zip(_session_keys(every), every, strict=True):
        if key is not None:
            sessions.setdefault(key, []).append(r)
    chosen: list[TraceRequest] = []
    for members in sessions.values():  # dicts keep first-appearance order
        if len(members) < cfg.min_turns:
            continue
        chosen.extend(members[: cfg.requests - len(chosen)])
        if len(chosen) >= cfg.requests:
            break
    chosen.sort(key=lambda r: r.timestamp_ms)
    return chosen


def time_scale_for(requests: Sequence[TraceRequest], duration_s: float) -> float:
    """The compression that makes the requests' arrivals span ``duration_s`` seconds (1.0 when
    they span nothing or ``duration_s`` is 0)."""
    if not requests or duration_s <= 0:
        return 1.0
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    return span / duration_s if span > 0 else 1.0


def block_tokens(hash_id: int, cfg: WorkloadConfig) -> list[int]:
    """The ``cfg.block_tokens`` token ids of one trace block (a pure function, see above)."""
    rng = random.Random(cfg.seed * 1_000_003 + hash_id)
    return [rng.randrange(cfg.first_token, cfg.vocab) for _ in range(cfg.block_tokens)]


def build_prompt(hash_ids: Sequence[int], length: int, cfg: WorkloadConfig) -> list[int]:
    """The first ``length`` tokens of the concatenated blocks of ``hash_ids`` (fewer only when
    the blocks run out)."""
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= length:
            break
        out.extend(block_tokens(h, cfg))
    return out[:length]


def control_prompt(prompt: Sequence[int], cfg: WorkloadConfig) -> list[int]:
    """``prompt`` with its first token changed (to the next id in ``[first_token, vocab)``): a
    model whose weights matter must answer it differently."""
    if not prompt:
        raise InvalidArgumentError("empty prompt")
    span = cfg.vocab - cfg.first_token
    first = cfg.first_token + (prompt[0] - cfg.first_token + 1) % span
    return [first, *prompt[1:]]


def scale(
    requests: Sequence[TraceRequest], cfg: WorkloadConfig, trace_block: int = BLOCK_TOKENS
) -> list[ScaledRequest]:
    """The scaled requests (see the module docstring), in the order given."""
    if not requests:
        return []
    if cfg.time_scale is not None:
        ts = cfg.time_scale
    elif cfg.duration_s is not None:
        ts = time_scale_for(requests, cfg.duration_s)
    else:
        ts = 1.0
    t0 = requests[0].timestamp_ms
    ratio = cfg.block_tokens / trace_block
    out: list[ScaledRequest] = []
    for i, r in enumerate(requests):
        length = min(cfg.max_prompt, max(1, math.ceil(r.input_length * ratio)))
        blocks = r.hash_ids[: math.ceil(length / cfg.block_tokens)]
        prompt = build_prompt(blocks, length, cfg)
        want = math.ceil(r.output_length * ratio)
        out.append(
            ScaledRequest(
                index=i,
                trace_line=r.line_no,
                arrival_s=(r.timestamp_ms - t0) / 1000.0 / ts,
                hash_ids=tuple(blocks),
                prompt=tuple(prompt),
                max_tokens=min(cfg.max_tokens, max(cfg.min_tokens, want)),
                trace_input_length=r.input_length,
                trace_output_length=r.output_length,
            )
        )
    return out
