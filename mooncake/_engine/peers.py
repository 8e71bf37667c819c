"""The engine's peers: the cache of remote segments' descriptors and connection state.

A peer is looked up in the metadata on first contact (or on ``refresh``, when a request falls
outside the cached descriptor), one lookup per segment at a time; :meth:`PeerCache.forget`
drops the descriptor and every transport's state for it (connections, mapped segments), so the
next contact starts afresh. :meth:`PeerCache.pick` is the transport choice for a peer.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from mooncake._engine.metadata import MetadataBackend
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake.errors import NotSupportedError


class PeersHost(Protocol):
    """What :class:`PeerCache` asks of its engine."""

    @property
    def metadata(self) -> MetadataBackend:
        """Where peers are looked up."""

    @property
    def transports(self) -> Sequence[Transport]:
        """The installed transports, highest priority first."""

    def check_open(self) -> None:
        """Raise :class:`~mooncake.errors.ClosedError` once the engine is closed."""

    def descriptor_json(self) -> dict[str, Any]:
        """This engine's descriptor (sent along with a P2P lookup)."""


class PeerCache:
    """The cached :class:`PeerInfo` of every segment this engine has talked to."""

    def __init__(self, host: PeersHost) -> None:
        self._host = host
        self.table: dict[str, PeerInfo] = {}
        """Segment name -> peer. Read-only outside this class."""
        self._locks: dict[str, anyio.Lock] = collections.defaultdict(anyio.Lock)

    async def get(self, segment: str, *, refresh: bool = False) -> PeerInfo:
        """The (cached) descriptor and connection state of ``segment``."""
        self._host.check_open()
        peer = self.table.get(segment)
        if peer is not None and not refresh:
            return peer
        async with self._locks[segment]:
            peer = self.table.get(segment)
            if peer is not None and not refresh:
                return peer
            rec = await self._host.metadata.lookup(segment, self._host.descriptor_json())
            if peer is None:
                peer = PeerInfo(segment, rec.descriptor, rec.rpc_host, rec.rpc_port)
                self.table[segment] = peer
            else:
                peer.descriptor = rec.descriptor
                peer.rpc_host, peer.rpc_port = rec.rpc_host, rec.rpc_port
            return peer

    def forget(self, segment: str) -> None:
        """Drop the cached descriptor and connections of ``segment``."""
        peer = self.table.pop(segment, None)
        if peer is not None:
            for t in self._host.transports:
                t.forget_peer(peer)

    def forget_all_state(self) -> None:
        """Have every transport drop its state for every peer (at engine close)."""
        for peer in self.table.values():
            for t in self._host.transports:
                t.forget_peer(peer)

    def pick(self, peer: PeerInfo, name: str | None) -> Transport:
        """The transport named ``name`` (it must reach ``peer``), or the highest-priority one
        that reaches it; :class:`NotSupportedError` if there is none."""
        transports = self._host.transports
        if name:
            for t in transports:
                if t.name == name:
                    if not t.can_reach(peer):
                        raise NotSupportedError(f"transport {name!r} cannot reach {peer.segment}")
                    return t
            raise NotSupportedError(
                f"transport {name!r} is not installed (have {[t.name for t in transports]})"
            )
        for t in transports:
            if t.can_reach(peer):
                return t
        raise NotSupportedError(f"no installed transport reaches {peer.segment}")
