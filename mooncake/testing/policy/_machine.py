"""The hypothesis state machine :func:`check_policy` runs after the fixed schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake._core.policies.base import EvictionPolicy, Pin
from mooncake.testing.policy._driver import _Driver
from mooncake.testing.policy._model import KEYS


class PolicyMachine(RuleBasedStateMachine):
    """The state machine :func:`check_policy` runs; subclassed per policy factory."""

    factory: Callable[[], EvictionPolicy]
    oracle: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.driver = _Driver(type(self).factory(), type(self).oracle)
        self.policy = self.driver.policy
        self.model = self.driver.model

    @rule(key=st.sampled_from(KEYS), size=st.integers(0, 64), chained=st.booleans())
    def insert(self, key: str, size: int, chained: bool) -> None:
        self.driver.insert(key, size, chained)

    @rule(key=st.sampled_from(KEYS))
    def access(self, key: str) -> None:
        self.driver.access(key)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        self.driver.remove(key)

    @rule(key=st.sampled_from(KEYS), pin=st.sampled_from(Pin))
    def set_pin(self, key: str, pin: Pin) -> None:
        self.driver.set_pin(key, pin)

    @rule(key=st.sampled_from(KEYS), busy=st.booleans())
    def set_busy(self, key: str, busy: bool) -> None:
        """A lease granted or expired, or a put started or completed: ``can_evict`` flips."""
        self.driver.set_busy(key, busy)

    @rule(nbytes=st.integers(-1, 300), evict=st.sampled_from(("all", "none", "first")))
    def victims(self, nbytes: int, evict: str) -> None:
        self.driver.victims(nbytes, evict)

    @invariant()
    def bookkeeping(self) -> None:
        self.driver.check()
