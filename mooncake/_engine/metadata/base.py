"""The metadata backend interface."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from mooncake._core.descriptor import SegmentDescriptor
from mooncake.errors import InvalidArgumentError


@dataclass(frozen=True)
class SegmentRecord:
    """A looked-up segment: its descriptor and the address of its handshake (RPC) port."""

    descriptor: SegmentDescriptor
    rpc_host: str
    rpc_port: int


def parse_metadata(conn: str) -> tuple[str, str]:
    """Split a Mooncake metadata connection string into ``(scheme, rest)``.

    ``P2PHANDSHAKE``/``p2p`` -> ``("p2p", "")``; ``http(s)://...`` -> ``("http", url)``;
    ``etcd://a;b`` or a bare ``host:port`` -> ``("etcd", "a;b")``; ``redis://h:p`` ->
    ``("redis", "h:p")``. Anything else is an :class:`InvalidArgumentError` naming the scheme.
    """
    if not isinstance(conn, str) or not conn.strip():
        raise InvalidArgumentError(f"metadata connection string must be non-empty, got {conn!r}")
    c = conn.strip()
    if c.upper() in ("P2PHANDSHAKE", "P2P"):
        return "p2p", ""
    if "://" not in c:
        return "etcd", c
    scheme, rest = c.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("http", "https"):
        return "http", c
    if scheme in ("etcd", "redis", "rediss"):
        if not rest:
            raise InvalidArgumentError(f"metadata connection string {conn!r} names no host")
        return ("redis" if scheme.startswith("redis") else scheme), rest
    raise InvalidArgumentError(
        f"unknown metadata scheme {scheme!r} in {conn!r} "
        "(expected P2PHANDSHAKE, http://, https://, etcd:// or redis://)"
    )


class MetadataBackend(abc.ABC):
    """Publishes this engine's descriptor and looks up others'.

    ``p2p`` is special: the segment name is ``host:rpc_port`` and descriptors come from the
    peer itself, so nothing is published. Key-value backends publish on every change.
    """

    #: True when segment names must be ``host:rpc_port`` (the P2P convention)
    p2p: bool = False

    async def start(self, engine: Any) -> None:
        """Connect; called once inside the engine's task group."""

    async def publish(
        self, segment: str, descriptor: dict[str, Any], rpc_host: str, rpc_port: int
    ) -> None:
        """Make ``descriptor`` (and the rpc address) visible under ``segment``."""

    async def unpublish(self, segment: str) -> None:
        """Remove this engine's keys (called on close)."""

    @abc.abstractmethod
    async def lookup(self, segment: str, own_descriptor: dict[str, Any]) -> SegmentRecord:
        """Fetch ``segment``'s current descriptor (:class:`SegmentNotFoundError` if unknown)."""

    async def aclose(self) -> None:
        """Release connections."""
