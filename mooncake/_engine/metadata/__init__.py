"""Metadata backends: where segment descriptors are published and looked up.

A backend is chosen by Mooncake's connection strings (:func:`parse_metadata`):
``P2PHANDSHAKE`` / ``p2p`` (default: no server, descriptors pulled from the peer's handshake
port), ``http://host:port/metadata``, ``etcd://host:port[;host:port...]`` (also a bare
``host:port``), ``redis://host:port``.

Key layout for the key-value backends (prefix ``mooncake/`` plus an optional cluster id):
``mooncake/ram/<segment>`` holds the descriptor JSON, ``mooncake/rpc_meta/<segment>`` holds
``{"ip_or_host_name": ..., "rpc_port": ...}``.
"""

from __future__ import annotations

from mooncake._engine.metadata.base import MetadataBackend, SegmentRecord, parse_metadata

__all__ = ["MetadataBackend", "SegmentRecord", "open_backend", "parse_metadata"]


def open_backend(conn: str) -> MetadataBackend:
    """Create (not start) the backend named by a connection string."""
    scheme, _ = parse_metadata(conn)
    if scheme == "p2p":
        from mooncake._engine.metadata.p2p import P2PMetadata

        return P2PMetadata()
    from mooncake.errors import NotSupportedError

    raise NotSupportedError(
        f"metadata backend {scheme!r} ({conn!r}) is not supported yet; use 'P2PHANDSHAKE'"
    )
