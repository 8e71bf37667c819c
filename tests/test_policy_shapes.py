"""The rarer shapes of check_policy's schedule: k-object sums, uniform sizes, re-evictions.

Each planted bug (``mooncake/testing/_planted.py``) is a plausible LRU shortcut that is wrong
only under one of those conditions; the main schedule and hypothesis' default search let them
through, so the shape schedule has to reject each one, on every run.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import pytest

from mooncake.policies import CanEvict, LRUPolicy
from mooncake.testing import _mutation
from mooncake.testing._planted import PLANTED
from mooncake.testing.policy import WIDE_KEYS, check_policy, lru_oracle
from mooncake.testing.policy._schedule import _explore


@pytest.mark.parametrize("name", list(PLANTED))
def test_schedule_rejects_planted_bug(name: str) -> None:
    with pytest.raises(AssertionError) as info:
        check_policy(PLANTED[name], oracle=lru_oracle, max_examples=1)
    notes = getattr(info.value, "__notes__", [])
    assert any("schedule" in n for n in notes), notes  # found by the schedule, not by chance
    assert any("To reproduce, paste" in n for n in notes)


def test_planted_bugs_are_mutants_of_the_benchmark() -> None:
    got = _mutation.planted()
    assert [m.func for m in got] == list(PLANTED)
    out = _mutation.run_mutant(got[0], timeout=120)
    assert out.status == "killed", out
    assert "[schedule]" in out.detail


class _Recorder(LRUPolicy):
    """LRU that records what each eviction round saw: tracked keys, sizes, nbytes."""

    __slots__ = ()
    rounds: list[tuple[int, tuple[int, ...], int, tuple[bool, ...]]] = []

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Hashable]:
        sizes = tuple(self._order.values())
        evictable = tuple(can_evict(k) for k in self._order)
        type(self).rounds.append((len(self._order), sizes, nbytes, evictable))
        return super().victims(nbytes, can_evict)


def test_shape_schedule_reaches_its_shapes() -> None:
    _Recorder.rounds = []
    for seed in range(2 * 10**6, 2 * 10**6 + 75):
        assert _explore(_Recorder, lru_oracle, seed, 32, False, True) is None
    rounds = _Recorder.rounds
    assert max(n for n, *_ in rounds) > 32  # the wider pool is in use
    # Uniform pages above one byte, asked for exactly k >= 2 of them.
    uniform = {s[0] for n, s, nb, _ in rounds if n >= 2 and len(set(s)) == 1 and s[0] >= 2}
    assert {2, 4, 16, 64} <= uniform
    assert any(
        len(set(s)) == 1 and s[0] >= 2 and nb % s[0] == 0 and nb // s[0] >= 2
        for n, s, nb, _ in rounds
    )
    # Re-evictions: the same round asked twice in a row at 10+ keys, a lease changed between.
    again = [
        (a, b)
        for a, b in itertools.pairwise(rounds)
        if a[0] == b[0] >= 10 and a[1] == b[1] and a[2] == b[2] and a[3] != b[3]
    ]
    assert len(again) >= 20
    assert len(WIDE_KEYS) == 64
