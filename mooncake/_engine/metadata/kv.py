"""Key-value metadata: the layout every server-backed backend shares, and the engine glue.

A :class:`KVStore` is a small async key-value client (HTTP, etcd, Redis). :class:`KVMetadata`
turns one into a :class:`MetadataBackend` with Mooncake's key layout::

    mooncake/[<cluster_id>/]ram/<segment>       segment descriptor JSON
    mooncake/[<cluster_id>/]rpc_meta/<segment>  {"ip_or_host_name": ..., "rpc_port": ...}

(a segment name containing ``/`` maps to ``mooncake/[<cluster_id>/]<segment>``, as in Mooncake).

Contracts:

* ``publish`` is serialized and always writes the newest descriptor it was given: concurrent
  ``register`` calls can finish in any order, the key ends up holding the last one.
* The ``rpc_meta`` entry is claimed once per engine. If another entry is there, its owner is
  probed on its handshake port: alive -> :class:`SegmentExistsError`; dead -> replaced.
* On stores with leases (etcd, Redis) both keys are tied to the engine's lease, so they vanish
  when the engine dies without unpublishing. If the lease is lost (a partition longer than its
  TTL), the store grants a new one and the keys are written again.
* ``lookup`` validates everything before returning (JSON, descriptor fields, name, buffer ranges,
  the rpc entry) and raises :class:`MetadataError` naming the key and what is wrong; nothing is
  cached from a bad reply (the engine caches only what ``lookup`` returns).
* On stores with watches (etcd), a changed descriptor of a cached peer updates the engine's
  cache in place; a deleted or unusable one drops the peer (:meth:`Engine.forget`).
"""

from __future__ import annotations

import abc
import json
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from mooncake._core.descriptor import SegmentDescriptor, decode_descriptor
from mooncake._engine.metadata.base import MetadataBackend, SegmentRecord
from mooncake.errors import (
    InvalidArgumentError,
    MetadataError,
    MooncakeError,
    ProtocolError,
    SegmentExistsError,
    SegmentNotFoundError,
)

if TYPE_CHECKING:
    from mooncake._engine.transports.base import EngineHost

log = logging.getLogger("mooncake.metadata")

#: No user-space address on any 64-bit Linux (5-level paging included) reaches 2**57.
MAX_USER_ADDR = 1 << 57
#: Default lease TTL (seconds) for stores with leases; ``MC_METADATA_LEASE_TTL`` overrides.
DEFAULT_LEASE_TTL = 10
#: How long the owner of an existing rpc_meta entry gets to answer a probe.
PROBE_S = 2.0

WatchCallback = Callable[[str, "bytes | None"], Awaitable[None]]


def lease_ttl_from_env() -> int:
    raw = os.environ.get("MC_METADATA_LEASE_TTL", "")
    if not raw:
        return DEFAULT_LEASE_TTL
    try:
        ttl = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"MC_METADATA_LEASE_TTL={raw!r} is not an integer") from None
    if not 1 <= ttl <= 3600:
        raise InvalidArgumentError(f"MC_METADATA_LEASE_TTL={ttl} outside [1, 3600] seconds")
    return ttl


class KeyLayout:
    """Mooncake's metadata keys, with an optional cluster id (``MC_METADATA_CLUSTER_ID``)."""

    def __init__(self, cluster_id: str | None = None) -> None:
        if cluster_id is None:
            cluster_id = os.environ.get("MC_METADATA_CLUSTER_ID", "")
        cluster_id = cluster_id.strip("/")
        self.cluster_id = cluster_id
        self.prefix = f"mooncake/{cluster_id}/" if cluster_id else "mooncake/"

    def ram(self, segment: str) -> str:
        if "/" in segment:
            return self.prefix + segment
        return f"{self.prefix}ram/{segment}"

    def rpc_meta(self, segment: str) -> str:
        return f"{self.prefix}rpc_meta/{segment}"

    @property
    def ram_prefix(self) -> str:
        return f"{self.prefix}ram/"

    def segment_of_ram(self, key: str) -> str | None:
        p = self.ram_prefix
        return key[len(p) :] if key.startswith(p) and len(key) > len(p) else None


class KVStore(abc.ABC):
    """An async key-value client. Values are bytes; keys are ``str``.

    ``open`` connects and starts background work (lease keep-alive) in ``tg``; ``aclose``
    releases the lease (deleting leased keys) and connections. Every method raises
    :class:`MetadataError` naming the server when the store cannot be reached or answers
    nonsense; ``get`` returns None for a missing key and ``delete`` False.
    """

    #: keys written with ``leased=True`` vanish when this client stops renewing its lease
    leases: bool = False
    #: ``watch`` is implemented
    watches: bool = False
    #: called (in the background) after a lost lease was replaced: re-write leased keys
    on_lease_lost: Callable[[], Coroutine[Any, Any, None]] | None = None

    @abc.abstractmethod
    def describe(self) -> str:
        """The server(s), for error messages."""

    async def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Connect (and grant a lease where supported)."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, leased: bool = False) -> None: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> bool: ...

    async def watch(
        self,
        prefix: str,
        callback: WatchCallback,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``callback(key, value or None)`` for every change under ``prefix``; forever."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release the lease and connections (idempotent)."""


def _parse_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise MetadataError(f"{where}: value is not valid JSON ({e})") from None


def validate_descriptor(segment: str, raw: bytes, where: str) -> SegmentDescriptor:
    """Decode a published descriptor and check it is plausible for ``segment``."""
    obj = _parse_json(raw, where)
    try:
        desc = decode_descriptor(obj)
    except ProtocolError as e:
        raise MetadataError(f"{where}: bad segment descriptor: {e}") from None
    if desc.name and desc.name != segment:
        raise MetadataError(f"{where}: descriptor names segment {desc.name!r}, not {segment!r}")
    for b in desc.buffers:
        if b.addr == 0 or b.end > MAX_USER_ADDR:
            raise MetadataError(
                f"{where}: buffer [{b.addr:#x}, +{b.length}) lies outside any user-space "
                f"address range (0, {MAX_USER_ADDR:#x})"
            )
    return desc


def validate_rpc_meta(raw: bytes, where: str) -> tuple[str, int]:
    obj = _parse_json(raw, where)
    if not isinstance(obj, dict):
        raise MetadataError(f"{where}: rpc_meta must be a JSON object")
    host = obj.get("ip_or_host_name")
    port = obj.get("rpc_port")
    if not isinstance(host, str) or not host:
        raise MetadataError(f"{where}: rpc_meta 'ip_or_host_name' must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise MetadataError(f"{where}: rpc_meta 'rpc_port' = {port!r} is not a port number")
    return host, port


def rpc_meta_json(host: str, port: int) -> bytes:
    return json.dumps({"ip_or_host_name": host, "rpc_port": port}).encode()


class KVMetadata(MetadataBackend):
    """A :class:`MetadataBackend` over any :class:`KVStore` (see the module docstring)."""

    def __init__(self, kv: KVStore, layout: KeyLayout | None = None) -> None:
        self.kv = kv
        self.keys = layout or KeyLayout()
        self.engine: EngineHost | None = None
        self._lock = anyio.Lock()
        self._latest: tuple[str, bytes, str, int] | None = None
        self._written: bytes | None = None
        self._claimed: str | None = None
        self._opened = False
        self._closed = False
        self.watch_events = 0

    def __repr__(self) -> str:
        return f"<KVMetadata {self.kv.describe()}>"

    async def start(self, engine: Any) -> None:
        self.engine = engine
        await self.kv.open(engine.task_group)
        self._opened = True
        self.kv.on_lease_lost = self._republish
        if self.kv.watches:
            await engine.task_group.start(self.kv.watch, self.keys.ram_prefix, self._on_change)

    async def publish(
        self, segment: str, descriptor: dict[str, Any], rpc_host: str, rpc_port: int
    ) -> None:
        value = json.dumps(descriptor, separators=(",", ":")).encode()
        self._latest = (segment, value, rpc_host, rpc_port)
        async with self._lock:
            latest = self._latest
            if self._closed or latest is None:
                return
            seg, value, host, port = latest
            if self._claimed != seg:
                await self._claim(seg, host, port)
            if self._written is not value:
                await self.kv.put(self.keys.ram(seg), value, leased=True)
                self._written = value

    async def _claim(self, segment: str, host: str, port: int) -> None:
        key = self.keys.rpc_meta(segment)
        mine = rpc_meta_json(host, port)
        old = await self.kv.get(key)
        if old is not None and old != mine:
            alive = False
            try:
                ohost, oport = validate_rpc_meta(old, f"{self.kv.describe()} key {key}")
            except MetadataError:
                ohost, oport = "", 0
            if (ohost, oport) == (host, port):
                alive = False  # our own address, written with other formatting
            elif oport:
                alive = await _probe(ohost, oport)
            if alive:
                raise SegmentExistsError(
                    f"segment {segment!r} is already published by a live engine at "
                    f"{ohost}:{oport} ({self.kv.describe()} key {key})"
                )
            log.info("replacing stale %s (was %r)", key, old)
            await self.kv.delete(key)
        if old != mine:
            await self.kv.put(key, mine, leased=True)
        self._claimed = segment

    async def _republish(self) -> None:
        """Write both keys again (after a lost lease), retrying until the store answers.

        Runs in the engine's task group, so it must not raise: a failure here would take the
        engine down with the metadata service.
        """
        delay = 0.5
        while True:
            async with self._lock:
                if self._closed or self._latest is None:
                    return
                seg, value, host, port = self._latest
                try:
                    rpc = rpc_meta_json(host, port)
                    await self.kv.put(self.keys.rpc_meta(seg), rpc, leased=True)
                    await self.kv.put(self.keys.ram(seg), value, leased=True)
                except MetadataError as e:
                    log.warning("republishing %s failed (retrying in %.1f s): %s", seg, delay, e)
                else:
                    self._claimed, self._written = seg, value
                    log.info("republished %s after a lost lease", seg)
                    return
            await anyio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def unpublish(self, segment: str) -> None:
        async with self._lock:
            self._closed = True
            if self._claimed is None:
                return
            await self.kv.delete(self.keys.ram(segment))
            await self.kv.delete(self.keys.rpc_meta(segment))
            self._claimed = None

    async def lookup(self, segment: str, own_descriptor: dict[str, Any]) -> SegmentRecord:
        ram_key, rpc_key = self.keys.ram(segment), self.keys.rpc_meta(segment)
        raw = await self.kv.get(ram_key)
        if raw is None:
            raise SegmentNotFoundError(
                f"segment {segment!r} is not published in {self.kv.describe()} (no key {ram_key})"
            )
        rpc = await self.kv.get(rpc_key)
        if rpc is None:
            raise SegmentNotFoundError(
                f"segment {segment!r} has a descriptor but no rpc entry in "
                f"{self.kv.describe()} (no key {rpc_key})"
            )
        desc = validate_descriptor(segment, raw, f"{self.kv.describe()} key {ram_key}")
        host, port = validate_rpc_meta(rpc, f"{self.kv.describe()} key {rpc_key}")
        return SegmentRecord(desc, host, port)

    async def _on_change(self, key: str, value: bytes | None) -> None:
        """A watched descriptor changed: refresh or drop the engine's cached copy."""
        self.watch_events += 1
        engine = self.engine
        segment = self.keys.segment_of_ram(key)
        if engine is None or segment is None or segment == engine.segment_name:
            return
        peer = engine.cached_peer(segment)
        if peer is None:
            return
        if value is None:
            log.info("segment %s was unpublished; dropping its cached descriptor", segment)
            engine.forget(segment)
            return
        try:
            desc = validate_descriptor(segment, value, f"{self.kv.describe()} key {key}")
        except MetadataError as e:
            log.warning("dropping cached %s: %s", segment, e)
            engine.forget(segment)
            return
        old = peer.descriptor
        if (desc.tcp_data_host, desc.tcp_data_port) != (old.tcp_data_host, old.tcp_data_port):
            engine.forget(segment)  # restarted elsewhere: its connections are stale
        else:
            peer.descriptor = desc

    async def aclose(self) -> None:
        if self._opened:
            self._opened = False
            with anyio.CancelScope(shield=True):
                await self.kv.aclose()


async def _probe(host: str, port: int) -> bool:
    from mooncake._core.handshake import FrameType
    from mooncake._engine import handshake

    with anyio.move_on_after(PROBE_S):
        try:
            reply = await handshake.request(host, port, FrameType.PROBE, {})
            obj = reply.json()
            return isinstance(obj, dict) and obj.get("status") == "success"
        except MooncakeError:
            return False
    return False
