"""The etcd implementations of :class:`~mooncake._store.ha_base.Election` and
:class:`~mooncake._store.ha_base.CommandLog` (the key layout is in :mod:`mooncake._store.ha`).

All of it is etcd v3 JSON over :class:`~mooncake._engine.metadata.etcd.EtcdKV`, one instance
shared by the pair (:func:`etcd_backend`); every write of the log is one txn comparing the
``master_view`` key's create revision with the writer's term (the **fence**).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from mooncake._engine.metadata.etcd import EtcdKV, _b64, _unb64, prefix_end
from mooncake._store.ha_base import HaConfig, view_key
from mooncake._store.ha_stream import read_isr
from mooncake._store.snapshots import EtcdSnapshots, Snapshot
from mooncake.errors import MetadataError

log = logging.getLogger("mooncake.master.ha")

__all__ = ["EtcdCommandLog", "EtcdElection", "etcd_backend"]

#: seconds a lease revoke may take before it is given up (it then expires by its TTL)
_REVOKE_S = 2.0


def _fence(view: str, term: int) -> list[dict[str, Any]]:
    return [
        {"key": _b64(view), "target": "CREATE", "result": "EQUAL", "create_revision": str(term)}
    ]


class EtcdElection:
    """The view key ``master_view`` (the leader's address) bound to a lease; its create
    revision is the term."""

    def __init__(self, etcd: EtcdKV, view: str) -> None:
        self.etcd = etcd
        self.view_key = view
        self.lease_id: str | None = None

    @property
    def holds_lease(self) -> bool:
        return self.lease_id is not None

    async def campaign(self, address: str, ttl: int) -> int | None:
        obj = await self.etcd.call("/v3/lease/grant", {"TTL": ttl})
        if "ID" not in obj:
            raise MetadataError(f"etcd lease grant refused: {obj}")
        lid = str(obj["ID"])
        # held from here: if the txn's answer is lost (it may have won), the HA loop releases
        # the lease, so this master does not follow itself until the lease ends
        self.lease_id = lid
        vk = _b64(self.view_key)
        r = await self.etcd.call(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": vk, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [{"request_put": {"key": vk, "value": _b64(address), "lease": lid}}],
            },
        )
        if not r.get("succeeded"):
            self.lease_id = None
            await self._revoke(lid)
            return None
        return int(r["header"]["revision"])

    async def keepalive(self) -> bool:
        lid = self.lease_id
        if lid is None:
            return False
        obj = await self.etcd.call("/v3/lease/keepalive", {"ID": lid})
        result = obj.get("result", obj)
        return int(result.get("TTL", 0) or 0) > 0

    async def release(self) -> None:
        lid, self.lease_id = self.lease_id, None
        if lid is not None:
            await self._revoke(lid)

    async def _revoke(self, lid: str) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REVOKE_S):
            try:
                await self.etcd.call("/v3/lease/revoke", {"ID": lid})
            except MetadataError as e:
                log.info("master HA: revoking lease %s: %s", lid, e)

    async def _view(self) -> dict[str, Any] | None:
        obj = await self.etcd.call("/v3/kv/range", {"key": _b64(self.view_key)})
        kvs = obj.get("kvs") or []
        return kvs[0] if kvs else None

    async def leader(self) -> tuple[str, int] | None:
        kv = await self._view()
        if kv is None:
            return None
        addr = _unb64(kv.get("value", "")).decode("utf-8", "replace")
        return addr, int(kv.get("create_revision", 0) or 0)

    async def watch(self, on_change: Callable[[bool], Awaitable[None]]) -> None:
        async def on_event(_key: str, value: bytes | None) -> None:
            await on_change(value is not None)

        await self.etcd.watch(self.view_key, on_event)

    async def revoke_term(self, term: int, address: str) -> bool:
        kv = await self._view()
        if kv is None or int(kv.get("create_revision", 0) or 0) != term:
            return False  # gone already, or a newer leader: nothing of ours to revoke
        lid = str(kv.get("lease", "0") or "0")
        if lid == "0":
            return False  # not bound to a lease (not written by a master): leave it
        log.warning(
            "master HA: leader %s (term %d) refuses connections: revoking its lease %s",
            address,
            term,
            lid,
        )
        # lease ids are unique: this deletes the key of that term only
        try:
            await self.etcd.call("/v3/lease/revoke", {"ID": lid})
        except MetadataError as e:
            if "not found" not in str(e):
                raise
            return False  # another standby (or the expiry) was first
        return True

    async def aclose(self) -> None:
        await self.etcd.aclose()


class EtcdCommandLog:
    """``log/<20-digit seq>`` entries, ``snapshot/...``, the ``isr`` and ``stream`` keys."""

    def __init__(self, etcd: EtcdKV, prefix: str, view: str, retention: int) -> None:
        self.etcd = etcd
        self.view_key = view
        self.log_prefix = prefix + "log/"
        self.stream_key = prefix + "stream"
        self.isr_key = prefix + "isr"
        self.snapshots = EtcdSnapshots(etcd, prefix + "snapshot/", retention)

    def _key(self, seq: int) -> str:
        return self.log_prefix + f"{seq:020d}"

    async def append(self, entries: list[tuple[int, bytes]], term: int) -> bool:
        keys = [_b64(self._key(s)) for s, _ in entries]
        data = entries[0][1]
        body = {
            "compare": [
                *_fence(self.view_key, term),
                *(
                    {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                    for k in keys
                ),
            ],
            "success": [
                {"request_put": {"key": k, "value": _b64(d)}}
                for k, (_, d) in zip(keys, entries, strict=True)
            ],
            "failure": [
                {"request_range": {"key": _b64(self.view_key)}},
                {"request_range": {"key": keys[0]}},
            ],
        }
        r = await self.etcd.call("/v3/kv/txn", body)
        if r.get("succeeded"):
            return True
        # an earlier attempt may have committed (its answer was lost)
        resp = r.get("responses") or []
        try:
            view = resp[0]["response_range"].get("kvs") or []
            entry = resp[1]["response_range"].get("kvs") or []
        except (IndexError, KeyError, AttributeError):
            return False
        mine = bool(view) and int(view[0].get("create_revision", 0)) == term
        return mine and bool(entry) and _unb64(entry[0].get("value", "")) == data

    async def read(self, first: int, limit: int) -> tuple[list[tuple[int, bytes]], bool]:
        end = prefix_end(self.log_prefix.encode())
        obj = await self.etcd.call(
            "/v3/kv/range",
            {"key": _b64(self._key(first).encode()), "range_end": _b64(end), "limit": limit},
        )
        kvs = obj.get("kvs") or []
        out: list[tuple[int, bytes]] = []
        for kv in kvs:
            key = _unb64(kv["key"]).decode()
            try:
                seq = int(key.rsplit("/", 1)[1])
            except ValueError:
                continue
            out.append((seq, _unb64(kv.get("value", ""))))
        return out, len(kvs) >= limit

    async def watch(self, on_entry: Callable[[int, bytes | None], Awaitable[None]]) -> None:
        async def on_event(key: str, value: bytes | None) -> None:
            try:
                seq = int(key.rsplit("/", 1)[1])
            except ValueError:
                if value is not None:
                    return  # not an entry
                seq = 0
            await on_entry(seq, value)

        await self.etcd.watch(self.log_prefix, on_event)

    async def write_replicas(self, term: int, members: frozenset[str], stream: str | None) -> bool:
        isr = json.dumps({"term": term, "members": sorted(members)})
        ops = [{"request_put": {"key": _b64(self.isr_key), "value": _b64(isr)}}]
        if stream is not None:
            spec = json.dumps({"addr": stream, "term": term})
            ops.append({"request_put": {"key": _b64(self.stream_key), "value": _b64(spec)}})
        r = await self.etcd.call(
            "/v3/kv/txn", {"compare": _fence(self.view_key, term), "success": ops}
        )
        return bool(r.get("succeeded"))

    async def _get(self, key: str) -> bytes | None:
        obj = await self.etcd.call("/v3/kv/range", {"key": _b64(key)})
        kvs = obj.get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else None

    async def read_isr(self) -> list[str]:
        return read_isr(await self._get(self.isr_key))

    async def read_stream(self) -> tuple[str, int] | None:
        value = await self._get(self.stream_key)
        if value is None:
            return None
        try:
            spec = json.loads(value)
            return str(spec["addr"]), int(spec["term"])
        except (ValueError, KeyError, TypeError):
            return None

    async def newest_snapshot(self) -> Snapshot | None:
        return await self.snapshots.newest()

    async def write_snapshot(self, snap: Snapshot, term: int) -> bool:
        return await self.snapshots.write(snap, _fence(self.view_key, term))

    async def compact(self, upto: int) -> None:
        await self.snapshots.prune()
        end = self._key(upto + 1).encode()
        await self.etcd.call(
            "/v3/kv/deleterange",
            {"key": _b64(self.log_prefix.encode()), "range_end": _b64(end)},
        )

    async def aclose(self) -> None:
        await self.etcd.aclose()


def etcd_backend(config: HaConfig) -> tuple[EtcdKV, EtcdElection, EtcdCommandLog]:
    """The etcd client of ``config`` and the election and log on it (sharing the client)."""
    etcd = EtcdKV(list(config.endpoints), lease_ttl=config.lease_ttl)
    pre = f"mooncake-store/{config.cluster_id}/"
    view = view_key(config.cluster_id)
    return (
        etcd,
        EtcdElection(etcd, view),
        EtcdCommandLog(etcd, pre, view, config.snapshot_retention),
    )
