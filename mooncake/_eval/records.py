"""The per-request record of a serving run and the statistics the report is made of (pure).

Times in a :class:`RequestRecord` are seconds on the client's monotonic clock from the run's
start (the first request's scheduled arrival is 0). ``first_token_s`` is when the first chunk
carrying an output token arrived, ``last_token_s`` when the last one did; ``ttft = first -
sent``, ``e2e = last - sent``, ``tpot = (last - first) / (output_tokens - 1)`` (``None`` with
fewer than two output tokens). ``cached_tokens`` is what vLLM reports in
``usage.prompt_tokens_details.cached_tokens`` (prefix tokens not computed by this request:
local prefix cache plus tokens loaded by a connector).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RequestRecord", "compare_outputs", "percentile", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    """One request of one scenario (see the module docstring for the times)."""

    index: int
    instance: str
    arrival_s: float
    sent_s: float = 0.0
    first_token_s: float | None = None
    last_token_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None or len(self.tokens) < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (len(self.tokens) - 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: Iterable[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    return {
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs) if xs else None,
    }


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT/TPOT/E2E distributions, throughput and the cached share of prompt tokens."""
    ok = [r for r in records if not r.error and r.last_token_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out_tokens = sum(len(r.tokens) for r in ok)
    span = (max(r.last_token_s or 0.0 for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_s": _dist(r.ttft for r in ok),
        "tpot_s": _dist(r.tpot for r in ok),
        "e2e_s": _dist(r.e2e for r in ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "output_tokens": out_tokens,
        "span_s": span,
        "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "requests_per_s": len(ok) / span if span > 0 else None,
    }


def compare_outputs(
    reference: Sequence[RequestRecord], other: Sequence[RequestRecord]
) -> list[int]:
    """Indexes of the requests whose output tokens differ (or that are missing/failed in either)."""
    ref = {r.index: r for r in reference}
    oth = {r.index: r for r in other}
    bad = []
    for i in sorted(ref.keys() | oth.keys()):
        a, b = ref.get(i), oth.get(i)
        if a is None or b is None or a.error or b.error or a.tokens != b.tokens:
            bad.append(i)
    return bad
