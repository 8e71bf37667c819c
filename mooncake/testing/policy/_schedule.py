"""Running the fixed schedule: each seed's sequence, the first failure shrunk."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mooncake._core.policies.base import EvictionPolicy
from mooncake.testing.policy._driver import Op, _Driver
from mooncake.testing.policy._shrink import _script, _shrink, _step_note
from mooncake.testing.policy._swarm import _ShapeSwarm, _Swarm

_SHRINK = True  # the mutation run turns it off: it only needs to know that a failure exists


def _explore(
    factory: Callable[[], EvictionPolicy],
    oracle: Any,
    seed: int,
    length: int,
    bad_sizes: bool,
    shapes: bool = False,
) -> tuple[list[Op], BaseException] | None:
    """Run the schedule's sequence ``seed`` (of the shape schedule if ``shapes``); the steps
    and the failure, or ``None``."""
    rng = random.Random(seed)
    swarm = _ShapeSwarm(rng) if shapes else _Swarm(rng, bad_sizes)
    ops: list[Op] = []
    try:
        driver = _Driver(factory(), oracle)
        driver.check()
        for _ in range(rng.randint(length // 3, length)):
            for op in swarm.steps(driver.model):
                op = swarm.resolve(op, driver.model, driver.last_nbytes, driver.last_victims)
                ops.append(op)
                driver.apply(op)
                driver.check()
    except Exception as exc:
        return ops, exc
    return None


def _run_schedule(
    factory: Callable[[], EvictionPolicy],
    oracle: Any,
    count: int,
    length: int,
    *,
    bad_sizes: bool = False,
    shapes: bool = False,
    first_seed: int = 0,
) -> None:
    """Run the fixed schedule (the shape schedule if ``shapes``); raise the first failure,
    shrunk, as ``AssertionError``."""
    for seed in range(first_seed, first_seed + count):
        found = _explore(factory, oracle, seed, length, bad_sizes, shapes)
        if found is None:
            continue
        ops, exc = _shrink(factory, oracle, *found) if _SHRINK else found
        message = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
        err = AssertionError(message)
        # __notes__ as hypothesis writes them (pytest and Python >= 3.11 print them).
        err.__notes__ = [
            f"Failing sequence of check_policy's schedule (seed {seed}), shrunk:",
            "state = PolicyMachine()",
            *(_step_note(op) for op in ops),
            "To reproduce, paste:\n" + _script(factory, ops, message),
        ]
        raise err from (None if isinstance(exc, AssertionError) else exc)
