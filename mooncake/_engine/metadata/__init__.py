"""Metadata backends: where segment descriptors are published and looked up.

A backend is chosen by Mooncake's connection strings (:func:`parse_metadata`):
``P2PHANDSHAKE`` / ``p2p`` (default: no server, descriptors pulled from the peer's handshake
port), ``http://host:port/metadata``, ``etcd://host:port[;host:port...]`` (also a bare
``host:port``), ``redis://host:port``.

Key layout for the key-value backends (prefix ``mooncake/`` plus an optional cluster id):
``mooncake/ram/<segment>`` holds the descriptor JSON, ``mooncake/rpc_meta/<segment>`` holds
``{"ip_or_host_name": ..., "rpc_port": ...}``. See :mod:`mooncake._engine.metadata.kv`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from mooncake._engine.metadata.base import MetadataBackend, SegmentRecord, parse_metadata
from mooncake._engine.metadata.kv import KeyLayout, KVMetadata, KVStore
from mooncake._groups import unwrapped

__all__ = [
    "KVMetadata",
    "KVStore",
    "KeyLayout",
    "MetadataBackend",
    "SegmentRecord",
    "make_kv",
    "open_backend",
    "open_kv",
    "parse_metadata",
]


def make_kv(conn: str, *, lease_ttl: int | None = None) -> KVStore:
    """The (unopened) key-value client for a non-P2P connection string."""
    scheme, rest = parse_metadata(conn)
    if scheme == "http":
        from mooncake._engine.metadata.http import HttpKV

        return HttpKV(rest)
    if scheme == "etcd":
        from mooncake._engine.metadata.etcd import EtcdKV, parse_endpoints

        return EtcdKV(parse_endpoints(rest), lease_ttl=lease_ttl)
    if scheme == "redis":
        from mooncake._engine.metadata.redis import RedisKV

        return RedisKV(rest, lease_ttl=lease_ttl)
    from mooncake.errors import InvalidArgumentError

    raise InvalidArgumentError(f"{conn!r} is not a key-value metadata service")


def open_backend(conn: str, *, cluster_id: str | None = None) -> MetadataBackend:
    """Create (not start) the backend named by a connection string."""
    scheme, _ = parse_metadata(conn)
    if scheme == "p2p":
        from mooncake._engine.metadata.p2p import P2PMetadata

        return P2PMetadata()
    return KVMetadata(make_kv(conn), KeyLayout(cluster_id))


@asynccontextmanager
async def open_kv(conn: str, *, lease_ttl: int | None = None) -> AsyncIterator[KVStore]:
    """A connected key-value client for ``conn`` (its lease, if any, revoked on exit)."""
    kv = make_kv(conn, lease_ttl=lease_ttl)
    try:
        with unwrapped():  # the block's exception and setup errors leave as themselves
            async with anyio.create_task_group() as tg:
                await kv.open(tg)
                try:
                    yield kv
                finally:
                    tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await kv.aclose()
