"""Eviction policies: the pluggable objects the store master and the trace replay drive.

Public re-export of :mod:`mooncake._core.policies`. The contract every policy keeps is in
:mod:`mooncake._core.policies.base`; ``docs/policies.md`` describes each shipped policy, and
:func:`mooncake.testing.check_policy` property-tests your own.
"""

from __future__ import annotations

from mooncake._core.policies import *  # noqa: F403
from mooncake._core.policies import __all__ as __all__
