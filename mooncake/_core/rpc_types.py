"""The master RPC's message shapes: every method's params and result Structs, and request ids.

A leaf of the sans-I/O core (it imports only :mod:`mooncake._core.store_types` and
:mod:`mooncake.errors`): the codec (:mod:`mooncake._core.rpc`), the method table
(:mod:`mooncake._core.methods`) and the master's state all use these shapes, and none of
them is imported here. The wire format they travel in is described in :mod:`mooncake._core.rpc`,
which re-exports every name of this module.

Params Structs encode as msgpack maps (``omit_defaults``: a field at its default is not sent;
unknown fields are ignored, so newer clients' extra fields do not break older masters);
:class:`Item`, :class:`KeysPage` and :class:`SegmentsPage` encode as arrays.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from mooncake._core.store_types import ReplicateConfig, Segment, SegmentInfo
from mooncake.errors import InvalidArgumentError

VERSION = 1
"""The protocol version ``ServiceReady`` answers."""
RID_BYTES = 16
"""Length of a request id: 8 bytes of client instance, 8 bytes of big-endian sequence number."""
MAX_ID = (1 << 64) - 1
"""The largest request (frame) id and request-id sequence number: a u64."""

T = TypeVar("T")


# -- params -----------------------------------------------------------------------------------


class _Params(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    tenant: str = ""
    """The caller's tenant (``""``: the default tenant, never sent); it scopes the keys of
    the calls in :data:`~mooncake._core.tenantscope.TENANT_SCOPED`. On ``AuthHello``:
    the tenant whose derived key the connection authenticates with (binding it)."""


class Empty(_Params):
    """No parameters."""


class ClientParams(_Params):
    client_id: str


class MountSegmentParams(_Params):
    client_id: str
    segment: Segment


class ReMountSegmentParams(_Params):
    client_id: str
    segments: list[Segment]


class UnmountSegmentParams(_Params):
    client_id: str
    segment_id: str


class PutStartParams(_Params):
    client_id: str
    key: str
    size: int
    config: ReplicateConfig = msgspec.field(default_factory=ReplicateConfig)


class KeyClientParams(_Params):
    client_id: str
    key: str


class PutEndParams(KeyClientParams):
    """PutEnd/UpsertEnd: ``crc`` is the CRC32C of the whole value as the writer had it
    (``-1``, the default and absent on the wire: none, e.g. an older writer's or one with
    verification off); the master hands it to readers in ``GetReplicaListResponse.crc``."""

    crc: int = -1


class CorruptReplicaParams(_Params):
    """``client_id`` read the replica at ``addr`` in segment ``segment_name`` of version ``vid``
    of ``key`` and its bytes failed the version's CRC32C: the master drops that replica."""

    client_id: str
    key: str
    vid: int
    segment_name: str
    addr: int


class SegmentFailureParams(_Params):
    """``client_id`` failed a transfer to the segment named ``segment_name`` (its transfer
    engine segment name, as in ``ReplicaDescriptor.segment_name``); ``reason`` for the log."""

    client_id: str
    segment_name: str
    reason: str = ""


class BatchPutStartParams(_Params):
    client_id: str
    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig = msgspec.field(default_factory=ReplicateConfig)


class BatchKeyClientParams(_Params):
    client_id: str
    keys: list[str]


class BatchPutEndParams(BatchKeyClientParams):
    """BatchPutEnd/BatchUpsertEnd: ``crcs[i]`` for ``keys[i]`` as :class:`PutEndParams`
    (absent or shorter than ``keys``: none for the rest)."""

    crcs: list[int] = msgspec.field(default_factory=list)


class KeyParams(_Params):
    key: str
    for_read: bool = True  # GetReplicaList only: False = descriptor query, no read window


class KeysParams(_Params):
    keys: list[str]
    for_read: bool = True


class LocalDiskParams(_Params):
    client_id: str
    capacity: int
    tier_id: str = ""
    """The SSD directory's identity: the same directory seen again (the client restarted on
    it) takes over what the master lists on its previous instance's tier."""


class TierKeyParams(_Params):
    client_id: str
    key: str
    vid: int


class EvictDiskParams(_Params):
    client_id: str
    key: str
    vid: int
    policy: str = ""


class PutLocalParams(_Params):
    client_id: str
    key: str
    size: int


class RegexParams(_Params):
    regex: str
    force: bool = False


class RemoveParams(_Params):
    key: str
    force: bool = False


class BatchRemoveParams(_Params):
    keys: list[str]
    force: bool = False


class ForceParams(_Params):
    force: bool = False


class PageParams(_Params):
    """A page of a listing: from ``cursor`` (0 first), at most ``limit`` items
    (:mod:`mooncake._core.paging`)."""

    cursor: int = 0
    limit: int = 10_000


class KeysPage(msgspec.Struct, array_like=True):
    """One page of ``GetAllKeysPage``: its keys and the next cursor (-1 after the last)."""

    keys: list[str]
    cursor: int


class SegmentsPage(msgspec.Struct, array_like=True):
    """One page of ``GetAllSegmentsPage``: its segments and the next cursor (-1: done)."""

    segments: list[SegmentInfo]
    cursor: int


class CopyTaskParams(_Params):
    key: str
    targets: list[str]


class ReplicaClearParams(_Params):
    client_id: str
    keys: list[str]
    segment_name: str = ""


class MoveTaskParams(_Params):
    key: str
    source: str
    target: str


class TaskIdParams(_Params):
    task_id: str


class TaskParams(_Params):
    client_id: str
    task_id: str


class TaskRevokeParams(_Params):
    client_id: str
    task_id: str
    message: str = ""


class AuthHelloParams(_Params):
    nonce: bytes


class AuthProveParams(_Params):
    proof: bytes


class AuthChallenge(msgspec.Struct, kw_only=True):
    """The master's half of the challenge-response: its nonce and its proof."""

    nonce: bytes
    proof: bytes


class Item(msgspec.Struct, Generic[T], array_like=True, omit_defaults=True):
    """One key's result in a batch answer: ``code`` 0 with ``value``, or an error code."""

    code: int
    value: T | None = None


# -- request ids ----------------------------------------------------------------------------


def make_rid(instance: bytes, seq: int) -> bytes:
    """The request id for call number ``seq`` (>= 1) of client instance ``instance`` (8 bytes)."""
    if len(instance) != 8 or not 1 <= seq <= MAX_ID:
        raise InvalidArgumentError(
            "a request id is an 8-byte instance and a sequence in [1, 2**64)"
        )
    return instance + seq.to_bytes(8, "big")


RID_FIRST = 1 << 63
"""Set in a request id's sequence number on the *first* attempt of a call (:func:`first_attempt`):
the master then knows it was never sent before, so it is never refused as stale
(:mod:`mooncake._core.dedup`); retries resend the id without it. Sequence numbers stay below."""


def first_attempt(rid: bytes) -> bytes:
    """``rid`` marked as the first attempt of its call (:data:`RID_FIRST`)."""
    return rid[:8] + (int.from_bytes(rid[8:], "big") | RID_FIRST).to_bytes(8, "big")


def check_rid(rid: bytes) -> None:
    """Raise :class:`InvalidArgumentError` unless ``rid`` is a well-formed request id."""
    if len(rid) != RID_BYTES or int.from_bytes(rid[8:], "big") & ~RID_FIRST == 0:
        raise InvalidArgumentError(
            f"request id must be {RID_BYTES} bytes (8 instance + u64 sequence >= 1), "
            f"got {len(rid)} bytes"
        )
