"""The master's RPC methods: one row per method, every fact about it in that row.

Each :class:`MethodSpec` holds a method's wire codec (its params Struct and result type, with
their cached msgpack decoders), its :class:`Durability`, whether the client sends a request id
with it (``dedup``), its handler, its key-scan handler (the regex methods) and whether the
connection answers it itself (``auth``). Everything else that asks about a method reads this
table: the codec (:mod:`mooncake._core.rpc`), the commands (:mod:`mooncake._core.commands`),
the server, its RPC threads and the client. The sets below are views computed from it, never
kept by hand.

Adding a master method: one row here (and its params Struct in :mod:`mooncake._core.rpc_types`
if it needs a new one), the :class:`~mooncake._core.master.MasterState` method the handler
calls, and the client call. Tenant scoping of its keys, if any, is
:mod:`mooncake._core.tenantscope`'s.

Durability (how a call is replicated under HA):

* **mutating**: logged; the reply is sent only after its log entry is durable; the client sends
  a request id and the master deduplicates by it (``dedup``);
* **lease-only** (read leases, pings, hints): logged, but the reply does not wait for its own
  entry; harmless to repeat, so no request id;
* **pure read**: changes nothing, never logged (a standby could answer, but refuses: it may
  lag).

Handlers are ``handler(state, params, now)``; a scan handler is ``scan(state, params, keys,
now)``, applied to the keys the leader matched off its loop (:mod:`mooncake._store.keyscan`).
Neither does I/O; the state settles after each (:func:`mooncake._core.commands.apply`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from mooncake._core.rpc_types import (
    VERSION,
    AuthChallenge,
    AuthHelloParams,
    AuthProveParams,
    BatchKeyClientParams,
    BatchPutEndParams,
    BatchPutStartParams,
    BatchRemoveParams,
    ClientParams,
    CopyTaskParams,
    CorruptReplicaParams,
    Empty,
    EvictDiskParams,
    ForceParams,
    Item,
    KeyClientParams,
    KeyParams,
    KeysPage,
    KeysParams,
    LocalDiskParams,
    MountSegmentParams,
    MoveTaskParams,
    PageParams,
    PutEndParams,
    PutLocalParams,
    PutStartParams,
    RegexParams,
    ReMountSegmentParams,
    RemoveParams,
    ReplicaClearParams,
    SegmentFailureParams,
    SegmentsPage,
    TaskIdParams,
    TaskParams,
    TaskRevokeParams,
    TierKeyParams,
    UnmountSegmentParams,
)
from mooncake._core.store_types import (
    DrainStatus,
    GetReplicaListResponse,
    MissInfo,
    ObjectInfo,
    PingResponse,
    ReplicaDescriptor,
    ReplicaTask,
    SegmentInfo,
    TaskStartResponse,
    TierTasks,
)

if TYPE_CHECKING:
    from mooncake._core.master import MasterState
    from mooncake._miss import Miss

__all__ = [
    "AUTH_METHODS",
    "LEASE_ONLY",
    "METHODS",
    "MUTATING",
    "PURE_READS",
    "SCAN_METHODS",
    "TENANT_SCOPED",
    "Durability",
    "Handler",
    "MethodSpec",
    "ScanHandler",
    "Scope",
]


class Durability(enum.Enum):
    """How a call is replicated (see the module docstring)."""

    MUTATING = "mutating"
    LEASE_ONLY = "lease-only"
    PURE_READ = "pure-read"


Scope = Literal["", "key", "keys", "listing"]
"""Which keys of a call are the caller's, scoped by its tenant (:mod:`mooncake._core.tenantscope`):
``"key"`` its params' ``key``, ``"keys"`` its ``keys``, ``"listing"`` the keys it lists or
matches (only the caller's tenant's), ``""`` none (tier and task calls name internal keys)."""
KEY: Scope = "key"
KEYS: Scope = "keys"
LISTING: Scope = "listing"

Handler = Callable[["MasterState", Any, float], Any]
"""``handler(state, decoded params, now)`` -> the call's result."""
ScanHandler = Callable[["MasterState", Any, list[str], float], Any]
"""``scan(state, decoded params, matched keys, now)`` -> the regex call's result."""


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One RPC method: its wire codec, how it is replicated, and what applies it.

    ``handler`` is None only for the ``auth`` methods (the connection answers them, the state
    never sees them); ``scan`` is set only for the regex methods. ``dedup`` is true exactly for
    the mutating, non-auth methods: the client sends a request id with each call and the
    master answers a retry from its dedup ledger."""

    name: str
    params: type[msgspec.Struct]
    result: Any
    params_decoder: msgspec.msgpack.Decoder[Any]
    result_decoder: msgspec.msgpack.Decoder[Any]
    durability: Durability
    handler: Handler | None
    scan: ScanHandler | None = None
    auth: bool = False
    dedup: bool = False
    scope: Scope = ""


def _m(
    name: str,
    params: type[msgspec.Struct],
    result: Any,
    durability: Durability,
    handler: Handler | None = None,
    *,
    scan: ScanHandler | None = None,
    auth: bool = False,
    scope: Scope = "",
) -> MethodSpec:
    if (handler is None) is not auth:
        raise AssertionError(f"{name}: a handler unless answered by the connection")
    return MethodSpec(
        name,
        params,
        result,
        msgspec.msgpack.Decoder(params),
        msgspec.msgpack.Decoder(result),
        durability,
        handler,
        scan,
        auth,
        durability is Durability.MUTATING and not auth,
        scope,
    )


def _miss_info(miss: Miss) -> MissInfo:
    return MissInfo(
        reason=miss.reason.value,
        policy=miss.policy,
        tier=miss.tier,
        owner=miss.owner,
        at=miss.at or 0.0,
    )


M = Durability.MUTATING
L = Durability.LEASE_ONLY
R = Durability.PURE_READ
_PUT_ITEMS = list[Item[list[ReplicaDescriptor]]]
_REPLICA_MAP = dict[str, list[ReplicaDescriptor]]
_TIER_MAP = dict[str, dict[str, int]]

# fmt: off
METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        _m("ServiceReady", Empty, int, R, lambda s, p, now: VERSION),
        _m("Ping", ClientParams, PingResponse, L, lambda s, p, now: s.ping(p.client_id, now)),
        _m("MountSegment", MountSegmentParams, None, M,
           lambda s, p, now: s.mount_segment(p.client_id, p.segment, now)),
        _m("ReMountSegment", ReMountSegmentParams, None, M,
           lambda s, p, now: s.remount_segments(p.client_id, p.segments, now)),
        _m("UnmountSegment", UnmountSegmentParams, None, M,
           lambda s, p, now: s.unmount_segment(p.client_id, p.segment_id, now)),
        _m("DrainSegment", UnmountSegmentParams, DrainStatus, M,
           lambda s, p, now: s.drain_segment(p.client_id, p.segment_id, now)),
        _m("PutStart", PutStartParams, list[ReplicaDescriptor], M,
           lambda s, p, now: s.put_start(p.client_id, p.key, p.size, p.config, now), scope=KEY),
        _m("PutEnd", PutEndParams, None, M,
           lambda s, p, now: s.put_end_crc(p.client_id, p.key, p.crc, now), scope=KEY),
        _m("PutRevoke", KeyClientParams, None, M,
           lambda s, p, now: s.put_revoke(p.client_id, p.key, now), scope=KEY),
        _m("UpsertStart", PutStartParams, list[ReplicaDescriptor], M,
           lambda s, p, now: s.upsert_start(p.client_id, p.key, p.size, p.config, now), scope=KEY),
        _m("UpsertEnd", PutEndParams, None, M,
           lambda s, p, now: s.put_end_crc(p.client_id, p.key, p.crc, now), scope=KEY),
        _m("UpsertRevoke", KeyClientParams, None, M,
           lambda s, p, now: s.upsert_revoke(p.client_id, p.key, now), scope=KEY),
        _m("BatchPutStart", BatchPutStartParams, _PUT_ITEMS, M, scope=KEYS,
           handler=lambda s, p, now: s.batch_put_start(
               p.client_id, p.keys, p.sizes, p.config, now
           )),
        _m("BatchPutEnd", BatchPutEndParams, list[int], M,
           lambda s, p, now: s.batch_put_end_crc(p.client_id, p.keys, p.crcs, now), scope=KEYS),
        _m("BatchPutRevoke", BatchKeyClientParams, list[int], M,
           lambda s, p, now: s.batch_put_revoke(p.client_id, p.keys, now), scope=KEYS),
        _m("BatchUpsertStart", BatchPutStartParams, _PUT_ITEMS, M,
           lambda s, p, now: s.batch_put_start(
               p.client_id, p.keys, p.sizes, p.config, now, upsert=True
           ), scope=KEYS),
        _m("BatchUpsertEnd", BatchPutEndParams, list[int], M,
           lambda s, p, now: s.batch_put_end_crc(p.client_id, p.keys, p.crcs, now), scope=KEYS),
        _m("BatchUpsertRevoke", BatchKeyClientParams, list[int], M,
           lambda s, p, now: s.batch_put_revoke(p.client_id, p.keys, now), scope=KEYS),
        _m("GetReplicaList", KeyParams, GetReplicaListResponse, L,
           lambda s, p, now: s.get_replica_list(p.key, now, for_read=p.for_read), scope=KEY),
        _m("BatchGetReplicaList", KeysParams, list[Item[GetReplicaListResponse]], L, scope=KEYS,
           handler=lambda s, p, now: s.batch_get_replica_list(p.keys, now, for_read=p.for_read)),
        _m("GetReplicaListByRegex", RegexParams, _REPLICA_MAP, L,
           lambda s, p, now: s.get_replica_list_by_regex(p.regex, now),
           scan=lambda s, p, keys, now: s.replica_lists_of(keys, now), scope=LISTING),
        _m("ExistKey", KeyParams, bool, L, lambda s, p, now: s.exist_key(p.key, now), scope=KEY),
        _m("BatchExistKey", KeysParams, list[int], L,
           lambda s, p, now: s.batch_exist_key(p.keys, now), scope=KEYS),
        _m("Remove", RemoveParams, None, M, scope=KEY,
           handler=lambda s, p, now: s.remove(p.key, p.force, now)),
        _m("BatchRemove", BatchRemoveParams, list[int], M,
           lambda s, p, now: s.batch_remove(p.keys, p.force, now), scope=KEYS),
        _m("RemoveByRegex", RegexParams, int, M,
           lambda s, p, now: s.remove_by_regex(p.regex, p.force, now),
           scan=lambda s, p, keys, now: s.remove_keys(keys, p.force, now), scope=LISTING),
        _m("RemoveAll", ForceParams, int, M, scope=LISTING,
           handler=lambda s, p, now: s.remove_all(p.force, now)),
        _m("QueryKey", KeyParams, ObjectInfo, R, lambda s, p, now: s.query_key(p.key), scope=KEY),
        _m("GetAllKeys", Empty, list[str], R, scope=LISTING,
           handler=lambda s, p, now: s.all_keys_bounded()),
        _m("GetAllSegments", Empty, list[SegmentInfo], R,
           lambda s, p, now: s.all_segments_bounded()),
        _m("GetAllKeysPage", PageParams, KeysPage, R,
           lambda s, p, now: KeysPage(*s.all_keys_page(p.cursor, p.limit)), scope=LISTING),
        _m("GetAllSegmentsPage", PageParams, SegmentsPage, R,
           lambda s, p, now: SegmentsPage(*s.all_segments_page(p.cursor, p.limit))),
        _m("BatchReplicaClear", ReplicaClearParams, list[str], M, scope=KEYS,
           handler=lambda s, p, now: s.batch_replica_clear(
               p.client_id, p.keys, p.segment_name, now
           )),
        _m("CreateCopyTask", CopyTaskParams, str, M,
           lambda s, p, now: s.create_copy_task(p.key, p.targets, now), scope=KEY),
        _m("CreateMoveTask", MoveTaskParams, str, M,
           lambda s, p, now: s.create_move_task(p.key, p.source, p.target, now), scope=KEY),
        _m("QueryTask", TaskIdParams, ReplicaTask, R, lambda s, p, now: s.query_task(p.task_id)),
        _m("FetchTasks", ClientParams, list[ReplicaTask], M,
           lambda s, p, now: s.fetch_tasks(p.client_id, now)),
        _m("TaskStart", TaskParams, TaskStartResponse, M,
           lambda s, p, now: s.task_start(p.client_id, p.task_id, now)),
        _m("TaskEnd", TaskParams, None, M,
           lambda s, p, now: s.task_end(p.client_id, p.task_id, now)),
        _m("TaskRevoke", TaskRevokeParams, None, M,
           lambda s, p, now: s.task_revoke(p.client_id, p.task_id, p.message, now)),
        _m("MountLocalDisk", LocalDiskParams, None, M,
           lambda s, p, now: s.mount_local_disk(p.client_id, p.capacity, now, tier_id=p.tier_id)),
        _m("FetchTierTasks", ClientParams, TierTasks, M,
           lambda s, p, now: s.fetch_tier_tasks(p.client_id, now)),
        _m("DemoteEnd", TierKeyParams, None, M,
           lambda s, p, now: s.demote_end(p.client_id, p.key, p.vid, now)),
        _m("DemoteRevoke", TierKeyParams, None, M,
           lambda s, p, now: s.demote_revoke(p.client_id, p.key, p.vid, now)),
        _m("PromoteStart", TierKeyParams, list[ReplicaDescriptor], M,
           lambda s, p, now: s.promote_start(p.client_id, p.key, p.vid, now)),
        _m("PromoteEnd", TierKeyParams, None, M,
           lambda s, p, now: s.promote_end(p.client_id, p.key, p.vid, now)),
        _m("PromoteRevoke", TierKeyParams, None, M,
           lambda s, p, now: s.promote_revoke(p.client_id, p.key, p.vid, now)),
        _m("EvictDiskReplica", EvictDiskParams, None, M,
           lambda s, p, now: s.evict_disk_replica(p.client_id, p.key, p.vid, p.policy, now)),
        _m("PutLocal", PutLocalParams, int, M,
           lambda s, p, now: s.put_local(p.client_id, p.key, p.size, now)),
        _m("ExplainMiss", KeyParams, MissInfo, R,
           lambda s, p, now: _miss_info(s.explain_miss(p.key)), scope=KEY),
        _m("GetTierStats", Empty, _TIER_MAP, R,
           lambda s, p, now: {t: c.as_dict() for t, c in s.tiers.items()}),
        _m("GetSegmentTiers", Empty, _TIER_MAP, R, lambda s, p, now: s.segment_tiers()),
        # a hint: lost with a failover, the next failure reports again
        _m("ReportSegmentFailure", SegmentFailureParams, bool, L,
           lambda s, p, now: s.report_segment_failure(p.client_id, p.segment_name, p.reason, now)),
        _m("ReportCorruptReplica", CorruptReplicaParams, int, M,
           lambda s, p, now: s.report_corrupt_replica(
               p.client_id, p.key, p.vid, p.segment_name, p.addr, now
           )),
        _m("AuthHello", AuthHelloParams, AuthChallenge, R, None, auth=True),
        _m("AuthProve", AuthProveParams, None, R, None, auth=True),
    )
}
# fmt: on

# -- views of the table (computed, never edited) ------------------------------------------

AUTH_METHODS = frozenset(n for n, s in METHODS.items() if s.auth)
"""Methods the connection itself answers (authentication), not the master's state."""
MUTATING = frozenset(n for n, s in METHODS.items() if s.dedup)
"""Methods that change the master's state: the client sends a ``rid`` with each and the
master deduplicates them by it (a retry is answered, not applied twice). Everything else is a
read, a lease grant or a heartbeat, harmless to repeat."""
LEASE_ONLY = frozenset(
    n for n, s in METHODS.items() if s.durability is Durability.LEASE_ONLY and not s.auth
)
"""Logged, but the reply does not wait for the entry to be durable."""
PURE_READS = frozenset(
    n for n, s in METHODS.items() if s.durability is Durability.PURE_READ and not s.auth
)
"""Change nothing: never logged."""
SCAN_METHODS = frozenset(n for n, s in METHODS.items() if s.scan is not None)
"""The regex methods: matched off the loop (:mod:`mooncake._store.keyscan`), then applied."""
TENANT_SCOPED = frozenset(n for n, s in METHODS.items() if s.scope)
"""Every method whose keys are scoped by the caller's tenant (:attr:`MethodSpec.scope`)."""
