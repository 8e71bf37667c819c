"""Harnesses users run on their own code inside their test suites.

:func:`check_policy` property-tests an eviction policy (see :mod:`mooncake.testing.policy`);
:mod:`mooncake.testing.metadata` is the conformance suite for metadata backends;
:func:`check_transport` the one for transports (:mod:`mooncake.testing.transport`: it needs
nothing beyond the package itself).
The harnesses need the ``test`` extra (``pip install mooncake-py[test]``: hypothesis); they
are imported on first use, so ``import mooncake.testing`` itself does not need it.

:mod:`mooncake.testing.fake_cuda` (``FakeCudaRuntime``) is a test double of the CUDA runtime
backed by host memory, for logic tests of GPU paths on machines without a GPU (never a measure of
the real thing).

:func:`local_master` runs a store master in this process for the block and yields its address
(:mod:`mooncake.testing.master`); it needs nothing beyond the package itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mooncake.testing.master import local_master, local_master_server
    from mooncake.testing.policy import (
        ORACLES,
        PolicyModel,
        check_policy,
        fifo_oracle,
        lfu_oracle,
        lru_oracle,
        prefix_lru_oracle,
        s3fifo_oracle,
        sieve_oracle,
    )
    from mooncake.testing.transport import check_transport

__all__ = [
    "ORACLES",
    "PolicyModel",
    "check_policy",
    "check_transport",
    "fifo_oracle",
    "lfu_oracle",
    "local_master",
    "local_master_server",
    "lru_oracle",
    "prefix_lru_oracle",
    "s3fifo_oracle",
    "sieve_oracle",
]

_LAZY = {name: "mooncake.testing.policy" for name in __all__}
_LAZY["local_master"] = _LAZY["local_master_server"] = "mooncake.testing.master"
_LAZY["check_transport"] = "mooncake.testing.transport"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mooncake.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
