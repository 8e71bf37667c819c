"""The replay's progress callback covers every simulator, Belady's runs included."""

from __future__ import annotations

from pathlib import Path

from mooncake.replay.run import ReplayConfig, replay
from mooncake.replay.trace import load_trace

TRACE = Path(__file__).parent / "data" / "traces" / "synthetic_trace.jsonl.gz"


def test_progress_reaches_the_total_after_belady() -> None:
    reqs = load_trace(str(TRACE))[:400]
    calls: list[tuple[int, int]] = []
    cfg = ReplayConfig(
        policies=("lru", "fifo"),
        capacities=(100, 300),
        local_policies=(),
        strategies=(),
        admissions=("tinylfu",),
    )
    report = replay(reqs, cfg, progress=lambda done, total: calls.append((done, total)))
    # max + 2 policies x 2 capacities + 1 admission x 2 capacities, then 2 Belady runs.
    total = (1 + 4 + 2 + 2) * len(reqs)
    assert {t for _, t in calls} == {total}
    assert calls[-1] == (total, total)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones)
    assert len(report.belady) == 2 and len(report.tiers) == 2
