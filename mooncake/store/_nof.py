"""``MooncakeDistributedNoFRegister``: NVMe-over-Fabrics SSD registration with the master.

The published class registers an NVMe-oF namespace (``nqn``, ``nsid``, target address and
service id) as a store tier through SPDK; that needs an SPDK build and an NVMe-oF target, which
this package does not drive. The class exists so that importing it works; each call raises
:class:`~mooncake.errors.NotSupportedError` saying so.
"""

from __future__ import annotations

from mooncake.errors import NotSupportedError

__all__ = ["MooncakeDistributedNoFRegister"]

_WHY = (
    "NVMe-oF SSD registration needs an SPDK build and an NVMe-oF target; this Mooncake "
    "does not support it (mount SSD tiers with the store's local SSD options instead)"
)


class MooncakeDistributedNoFRegister:
    """Published NVMe-oF registration entry point; every call raises ``NotSupportedError``."""

    def real_register(
        self,
        nqn: str,
        nsid: int,
        traddr: str,
        trsvcid: int,
        offset: int,
        size: int,
        master_server_address: str,
    ) -> int:
        """Register namespace ``nsid`` of ``nqn`` at ``traddr:trsvcid`` (not supported)."""
        raise NotSupportedError(f"real_register: {_WHY}")

    def real_unregister_by_endpoint(
        self, nqn: str, nsid: int, traddr: str, trsvcid: int, master_server_address: str
    ) -> int:
        """Unregister what real_register registered (not supported)."""
        raise NotSupportedError(f"real_unregister_by_endpoint: {_WHY}")
