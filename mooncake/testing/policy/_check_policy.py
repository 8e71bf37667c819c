""":func:`check_policy`: the fixed schedule, then hypothesis' stateful search."""

from __future__ import annotations

import re
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from mooncake._core.policies.base import EvictionPolicy
from mooncake.testing.policy._machine import PolicyMachine
from mooncake.testing.policy._model import Oracle
from mooncake.testing.policy._schedule import _run_schedule
from mooncake.testing.policy._swarm import DEFAULT_SCHEDULE


def check_policy(
    policy_factory: Callable[[], EvictionPolicy],
    *,
    oracle: Oracle | None = None,
    max_examples: int = 100,
    stateful_step_count: int = 50,
    derandomize: bool = False,
    settings_: settings | None = None,
    schedule: int = DEFAULT_SCHEDULE,
) -> None:
    """Property-test the policy that ``policy_factory()`` builds (a class works).

    First runs the fixed schedule (``schedule`` generated sequences of up to 60 rounds,
    identical on every run; ``0`` skips it), then hypothesis' search: ``max_examples`` random
    sequences of up to ``stateful_step_count`` steps. Raises ``AssertionError`` on the first
    violation of the contract (see the module docstring), after shrinking it: the error's
    ``__notes__`` (printed by pytest) list the steps as ``state.insert(...)`` calls, and the
    schedule's failures add a script to paste. ``oracle(model, nbytes)`` adds a
    policy-specific exact check (:func:`lru_oracle` ...). ``derandomize=True`` makes
    hypothesis' part repeatable; ``settings_`` replaces every hypothesis setting.
    """
    if not __debug__:
        # The checks are assert statements: under -O they would all pass vacuously.
        raise RuntimeError("check_policy needs assertions enabled (do not run python -O)")
    if schedule:
        _run_schedule(policy_factory, oracle, schedule, 60)
        # The rarer shapes: k-object sums, uniform sizes, re-evictions at 10-64 keys.
        _run_schedule(
            policy_factory, oracle, max(1, schedule // 4), 32, shapes=True, first_seed=2 * 10**6
        )
        # Input checks after the contract: a contract bug is reported before a missing
        # size check.
        _run_schedule(
            policy_factory, oracle, max(1, schedule // 6), 30, bad_sizes=True, first_seed=10**6
        )
    label = re.sub(r"\W", "_", getattr(policy_factory, "__name__", "Policy"))
    machine = type(
        f"{label}Machine",
        (PolicyMachine,),
        {
            "factory": staticmethod(policy_factory),
            "oracle": staticmethod(oracle) if oracle else None,
        },
    )
    if settings_ is None:
        settings_ = settings(
            max_examples=max_examples,
            stateful_step_count=stateful_step_count,
            deadline=None,
            derandomize=derandomize,
            suppress_health_check=[HealthCheck.too_slow],
            report_multiple_bugs=False,
            # The explain phase costs more than the search and shrink together here, and a
            # shrunk sequence of steps already says what went wrong.
            phases=[p for p in Phase if p is not Phase.explain],
        )
    run_state_machine_as_test(machine, settings=settings_)
