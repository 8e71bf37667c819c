"""Mutation score of the policy harness: ``check_policy`` at its default settings must reject
at least 95 % of the non-equivalent mutants of every shipped policy (an AST mutator over the
policy sources: ``mooncake/testing/_mutation.py``), with the schedule alone (so on every run).

The full score takes ten minutes or more of CPU (every mutant of six policies, each in its own
process), so it runs when ``MOONCAKE_MUTATION=1`` (or as ``python benchmarks/policy_mutation.py``);
the quick checks of the mutator run always.
"""

from __future__ import annotations

import os

import pytest

from mooncake.testing import _mutation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def every_mutant() -> dict[str, list[_mutation.Mutant]]:
    """The mutants of every target, generated once for the tests of this file (tens of s)."""
    return {name: _mutation.mutants(name) for name in _mutation.TARGETS}


def test_mutants_are_generated_for_every_operator_family(
    every_mutant: dict[str, list[_mutation.Mutant]],
) -> None:
    seen = {m.operator for ms in every_mutant.values() for m in ms}
    assert seen == set(_mutation.OPERATORS)


def test_every_equivalent_mutant_exists(every_mutant: dict[str, list[_mutation.Mutant]]) -> None:
    """A stale entry (the source changed under it) must not hide a survivor silently."""
    idents = {m.ident for ms in every_mutant.values() for m in ms}
    stale = (set(_mutation.EQUIVALENT) | set(_mutation.OUT_OF_REACH)) - idents
    assert not stale, stale


def test_a_mutant_changes_the_policy(every_mutant: dict[str, list[_mutation.Mutant]]) -> None:
    """The mutator really rebuilds the class from mutated source (not the shipped one)."""
    m = next(
        m
        for m in every_mutant["lru"]
        if m.func == "select_victims" and m.operator == "pin" and "HARD" in m.original
    )
    out = _mutation.run_mutant(m, timeout=120)
    assert out.status == "killed", out
    assert "[schedule]" in out.detail


@pytest.mark.skipif(
    os.environ.get("MOONCAKE_MUTATION") != "1",
    reason="the full mutation score is opt-in (MOONCAKE_MUTATION=1; ~10+ CPU minutes), "
    "or run benchmarks/policy_mutation.py",
)
@pytest.mark.timeout(1800)  # up to ~300 mutants, a few of them run out their CPU allowance
@pytest.mark.parametrize("name", list(_mutation.TARGETS))
def test_mutation_score(name: str) -> None:
    outcomes = [_mutation.run_mutant(m, timeout=120) for m in _mutation.mutants(name)]
    killed, counted, score = _mutation.score(outcomes)
    survivors = [o.mutant.ident for o in outcomes if o.status == "survived"]
    assert score >= 0.95, (f"{name}: {killed}/{counted}", survivors)
    by_hypothesis = [o.mutant.ident for o in outcomes if "[hypothesis]" in o.detail]
    # Killed by the fixed schedule, hence on every run (hypothesis' search is random).
    assert (killed - len(by_hypothesis)) / counted >= 0.95, by_hypothesis
