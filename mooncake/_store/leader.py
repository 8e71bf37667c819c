"""Finding the leader of an HA master cluster: ``etcd://host:port[;host:port...]`` addresses.

The published master address forms are ``host:port`` (one master) and, for a cluster of masters
run with ``--enable_ha --ha_backend_type=etcd``, ``etcd://`` followed by the etcd members
(``;``-separated, ``,`` accepted too). The leader publishes its RPC address ``host:port`` as the
value of ``mooncake-store/<cluster_id>/master_view`` (a key bound to its election lease), where
``cluster_id`` is the masters' ``--cluster_id``; clients take it from ``MC_STORE_CLUSTER_ID``
(default ``mooncake_cluster``, the master's default).

:class:`LeaderResolver` reads that key (waiting while it is absent: an election is under way)
and watches it (:meth:`LeaderResolver.watch`); it uses the etcd v3 client of
:mod:`mooncake._engine.metadata.etcd`, so an etcd member that fails is skipped for the next.
:class:`~mooncake._store.master_conn.MasterConnection` calls it on every (re)connection.

Malformed addresses raise :class:`~mooncake.errors.InvalidArgumentError` naming the part that is
wrong; other HA backends' forms (``redis://``, ``k8s://``) raise
:class:`~mooncake.errors.NotSupportedError`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

import anyio

from mooncake._engine.metadata.etcd import EtcdKV, parse_endpoints
from mooncake.errors import InvalidArgumentError, MetadataError, NotSupportedError

log = logging.getLogger("mooncake.store")

DEFAULT_CLUSTER_ID = "mooncake_cluster"
DEFAULT_FAILOVER_TIMEOUT_S = 30.0
_POLL_S = 0.1
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); raises InvalidArgumentError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgumentError(f"master address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def is_ha_address(address: str) -> bool:
    """True for ``etcd://...``; NotSupportedError for another ``scheme://`` form."""
    m = _SCHEME.match(address.strip())
    if m is None:
        return False
    scheme = m.group(1).lower()
    if scheme == "etcd":
        return True
    raise NotSupportedError(
        f"master address {address!r}: only etcd:// HA clusters are supported "
        f"(not {scheme}://); or give one master as host:port"
    )


def parse_ha_address(address: str) -> list[str]:
    """``etcd://h1:p1;h2:p2`` -> the etcd base URLs (``http://h1:p1``, ...)."""
    a = address.strip()
    if not is_ha_address(a):
        raise InvalidArgumentError(f"master address {address!r} is not etcd://host:port[;...]")
    rest = a.split("://", 1)[1]
    if not any(p.strip() for p in rest.replace(",", ";").split(";")):
        raise InvalidArgumentError(
            f"master address {address!r} names no etcd endpoint (etcd://host:port[;host:port])"
        )
    try:
        return parse_endpoints(rest)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"master address {address!r}: {e}") from None


def cluster_id_from_env() -> str:
    """``MC_STORE_CLUSTER_ID`` (stripped of a trailing ``/``), else ``mooncake_cluster``."""
    cid = (os.environ.get("MC_STORE_CLUSTER_ID") or "").strip().rstrip("/")
    return cid or DEFAULT_CLUSTER_ID


def failover_timeout_from_env() -> float:
    """``MC_STORE_FAILOVER_TIMEOUT`` seconds (default 30): how long a call waits for a leader."""
    raw = os.environ.get("MC_STORE_FAILOVER_TIMEOUT", "")
    if not raw:
        return DEFAULT_FAILOVER_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"MC_STORE_FAILOVER_TIMEOUT={raw!r} is not a number") from None
    if not v > 0:
        raise InvalidArgumentError(f"MC_STORE_FAILOVER_TIMEOUT={raw!r} must be > 0")
    return v


def master_view_key(cluster_id: str) -> str:
    """The key the leader publishes its address under (the published layout)."""
    return f"mooncake-store/{cluster_id}/master_view"


class LeaderResolver:
    """Reads and watches the leader key of one HA cluster (see the module docstring)."""

    def __init__(self, address: str, cluster_id: str | None = None) -> None:
        self.endpoints = parse_ha_address(address)
        self.cluster_id = (cluster_id or "").strip().rstrip("/") or cluster_id_from_env()
        self.key = master_view_key(self.cluster_id)
        self.kv = EtcdKV(self.endpoints)
        self.current: str | None = None
        """The leader address last read or seen by the watch (None: unknown or none)."""
        self.last_error = ""
        self.resolutions = 0

    def describe(self) -> str:
        hosts = ";".join(e.split("://", 1)[1] for e in self.endpoints)
        return f"cluster {self.cluster_id!r} (etcd {hosts})"

    async def resolve(self) -> str:
        """The leader's ``host:port``: read from etcd, waiting (polling) while there is none.

        Never returns without an answer; callers bound it (``anyio.move_on_after``). A value
        that is not ``host:port`` is logged and waited out like an absent one.
        """

        while True:
            try:
                raw = await self.kv.get(self.key)
            except MetadataError as e:
                self.last_error = str(e)
                raw = b""
            if raw is None:
                self.last_error = f"{self.key} is absent (no leader)"
            elif raw:
                addr = raw.decode("utf-8", "replace").strip()
                try:
                    parse_address(addr)
                except InvalidArgumentError:
                    self.last_error = f"{self.key} holds {addr!r}, not host:port"
                    log.warning("%s: %s", self.describe(), self.last_error)
                else:
                    self.current = addr
                    self.resolutions += 1
                    return addr
            await anyio.sleep(_POLL_S)

    def forget(self, addr: str) -> None:
        """``addr`` answered that it is not the leader: do not trust a cached view of it."""
        if self.current == addr:
            self.current = None

    async def watch(self, on_change: Callable[[str | None], None]) -> None:
        """Call ``on_change(address or None)`` on every change of the leader key; runs until
        cancelled (the etcd client resumes the watch on another member when one fails)."""

        async def cb(key: str, value: bytes | None) -> None:
            if key != self.key:
                return
            addr = value.decode("utf-8", "replace").strip() if value else None
            self.current = addr
            on_change(addr)

        while True:
            try:
                await self.kv.watch(self.key, cb)
            except MetadataError as e:  # no member answered: keep trying, calls re-resolve
                self.last_error = str(e)
                log.warning("%s: leader watch failed: %s", self.describe(), e)
                await anyio.sleep(1.0)

    async def aclose(self) -> None:
        await self.kv.aclose()


__all__ = [
    "DEFAULT_CLUSTER_ID",
    "DEFAULT_FAILOVER_TIMEOUT_S",
    "LeaderResolver",
    "cluster_id_from_env",
    "failover_timeout_from_env",
    "is_ha_address",
    "master_view_key",
    "parse_ha_address",
]
