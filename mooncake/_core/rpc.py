"""The master RPC: the wire format and its sans-I/O frame codec.

Wire format
-----------
One TCP connection carries any number of frames in both directions. A frame is::

    u32 length (big-endian, bytes of body; 1 <= length <= max_frame)  |  body (msgpack)

The body is a msgpack array, first element a tag:

* request  ``[0, id, method, params]`` or ``[0, id, method, params, rid]`` -- ``id`` a
  client-chosen unsigned int (unique among the connection's outstanding requests), ``method`` one
  of :data:`METHODS`, ``params`` the method's params Struct encoded as a msgpack map. ``rid``
  (optional, msgpack bin of :data:`RID_BYTES` bytes) is the request id: 8 random bytes naming the
  client instance, then a big-endian u64 sequence number (>= 1) unique within that instance. A
  client sends it on every :data:`MUTATING` call and resends the *same* ``rid`` when it retries
  the call on another connection (or another master after a failover); the master answers a
  ``rid`` it has already applied from its dedup ledger (:mod:`mooncake._core.dedup`) instead of
  applying it again. A 4-element request is valid (no deduplication); a master that predates
  ``rid`` ignores the 5th element. Non-mutating calls carry no ``rid`` (one sent is ignored).
* response ``[1, id, code, message, result]`` -- ``code`` 0 and ``result`` the method's result
  type, or ``code`` a negative Mooncake ``ErrorCode`` (:class:`mooncake.errors.ErrorCode`),
  ``message`` a human-readable reason and ``result`` nil.

Requests may be pipelined; the server may answer them out of order (match by ``id``).

A master that is not the leader of an HA cluster answers every call but ``ServiceReady`` with
``UNAVAILABLE_IN_CURRENT_MODE`` (-1011, :class:`~mooncake.errors.NotLeaderError`), applying
nothing; the client re-resolves the leader and retries.

Errors: a frame whose header announces more than ``max_frame`` bytes, or whose body is not a
request/response array, raises :class:`~mooncake.errors.ProtocolError` from the decoder; the
driver then drops that connection (the server keeps serving the others). A well-formed request
with an unknown method is answered ``NOT_SUPPORTED`` (-1012); one whose params do not match the
method's Struct is answered ``INVALID_PARAMS`` (-600). Both keep the connection.

Methods (names as in Mooncake's ``WrappedMasterService``; ``->`` the result type):

====================== ================================ ==========================================
method                 params                           result
====================== ================================ ==========================================
ServiceReady           Empty                            int (protocol version, :data:`VERSION`)
Ping                   ClientParams                     PingResponse
MountSegment           MountSegmentParams               None
ReMountSegment         ReMountSegmentParams             None
UnmountSegment         UnmountSegmentParams             None
DrainSegment           UnmountSegmentParams             DrainStatus (stop allocating there, plan moves)
PutStart               PutStartParams                   list[ReplicaDescriptor]
PutEnd                 PutEndParams                     None
PutRevoke              KeyClientParams                  None
UpsertStart            PutStartParams                   list[ReplicaDescriptor]
UpsertEnd              PutEndParams                     None
UpsertRevoke           KeyClientParams                  None
BatchPutStart          BatchPutStartParams              list[Item[list[ReplicaDescriptor]]]
BatchPutEnd            BatchPutEndParams                list[int]  (0 or an error code per key)
BatchPutRevoke         BatchKeyClientParams             list[int]
BatchUpsertStart       BatchPutStartParams              list[Item[list[ReplicaDescriptor]]]
BatchUpsertEnd         BatchPutEndParams                list[int]
BatchUpsertRevoke      BatchKeyClientParams             list[int]
GetReplicaList         KeyParams                        GetReplicaListResponse (grants a lease)
BatchGetReplicaList    KeysParams                       list[Item[GetReplicaListResponse]]
GetReplicaListByRegex  RegexParams                      dict[str, list[ReplicaDescriptor]]
ExistKey               KeyParams                        bool (grants a lease when true)
BatchExistKey          KeysParams                       list[int]  (1 exists, 0 not, <0 error)
Remove                 RemoveParams                     None
BatchRemove            BatchRemoveParams                list[int]
RemoveByRegex          RegexParams                      int (objects removed)
RemoveAll              ForceParams                      int (objects removed)
QueryKey               KeyParams                        ObjectInfo (admin: no lease)
GetAllKeys             Empty                            list[str] (admin: complete objects)
GetAllSegments         Empty                            list[SegmentInfo]
GetAllKeysPage         PageParams                       KeysPage (keys from cursor; next cursor)
GetAllSegmentsPage     PageParams                       SegmentsPage
BatchReplicaClear      ReplicaClearParams               list[str] (keys cleared)
CreateCopyTask         CopyTaskParams                   str (task id)
CreateMoveTask         MoveTaskParams                   str (task id)
QueryTask              TaskIdParams                     ReplicaTask
FetchTasks             ClientParams                     list[ReplicaTask] (now PROCESSING)
TaskStart              TaskParams                       TaskStartResponse (allocates targets)
TaskEnd                TaskParams                       None (targets become replicas)
TaskRevoke             TaskRevokeParams                 None (targets freed, task FAILED)
MountLocalDisk         LocalDiskParams                  None (the client has an SSD tier)
FetchTierTasks         ClientParams                     TierTasks (demotions to do, copies to drop)
DemoteEnd / -Revoke    TierKeyParams                    None
PromoteStart           TierKeyParams                    list[ReplicaDescriptor]
PromoteEnd / -Revoke   TierKeyParams                    None
EvictDiskReplica       EvictDiskParams                  None
PutLocal               PutLocalParams                   int (version id of the re-announced object)
ExplainMiss            KeyParams                        MissInfo (no miss counted)
GetTierStats           Empty                            dict[str, dict[str, int]] (per tier)
GetSegmentTiers        Empty                            dict[str, dict[str, int]] (dram/gpu)
ReportSegmentFailure   SegmentFailureParams             bool (the segment is quarantined now)
ReportCorruptReplica   CorruptReplicaParams             int (readable replicas left; 0: removed)
AuthHello              AuthHelloParams                  AuthChallenge (cluster secret only)
AuthProve              AuthProveParams                  None (cluster secret only)
====================== ================================ ==========================================

``AuthHello``/``AuthProve`` run :mod:`mooncake._core.auth`'s challenge-response on channel
``rpc``; a master with a cluster secret answers nothing else until they succeed (anything else
gets ``RPC_FAIL`` "authentication required" and the connection is closed).

Semantics of each call are the master's (:mod:`mooncake._core.master`); this module only
frames and decodes. The shapes (params and result Structs, request ids) live in
:mod:`mooncake._core.rpc_types` and the method table (each method's codec, durability, dedup,
scan, auth and handler) in :mod:`mooncake._core.methods`; both are re-exported here.
:class:`Item` carries per-key results of batch calls: ``code`` 0 and ``value``, or ``code`` < 0
and no value.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from mooncake._core.methods import AUTH_METHODS, METHODS, MUTATING, MethodSpec
from mooncake._core.rpc_types import MAX_ID as _MAX_ID
from mooncake._core.rpc_types import (
    RID_BYTES,
    RID_FIRST,
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
    check_rid,
    first_attempt,
    make_rid,
)
from mooncake.errors import (
    ErrorCode,
    InvalidArgumentError,
    MooncakeError,
    NotSupportedError,
    ProtocolError,
    error_from_code,
)

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 64 << 20
"""Default bound on one frame's body (64 MiB: a batch of ~10k keys of 4 KiB each fits)."""


# -- envelopes --------------------------------------------------------------------------------


class Request(msgspec.Struct, tag=0, array_like=True, frozen=True):
    """A decoded request; ``params`` still raw (decode with :func:`decode_params`).

    ``rid``: the request id of a mutating call (None in a 4-element frame)."""

    id: int
    method: str
    params: msgspec.Raw
    rid: bytes | None = None


class Response(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """A decoded response; ``result`` still raw (decode with :func:`decode_result`)."""

    id: int
    code: int
    message: str
    result: msgspec.Raw


class _OutRequest(msgspec.Struct, tag=0, array_like=True):
    id: int
    method: str
    params: Any


class _OutRequestRid(msgspec.Struct, tag=0, array_like=True):
    id: int
    method: str
    params: Any
    rid: bytes


class _OutResponse(msgspec.Struct, tag=1, array_like=True):
    id: int
    code: int
    message: str
    result: Any


Message = Request | Response

_encoder = msgspec.msgpack.Encoder()
_message_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)  # type: ignore[arg-type]


def _frame(body: bytes, max_frame: int) -> bytes:
    if len(body) > max_frame:
        raise InvalidArgumentError(f"message of {len(body)} bytes exceeds max frame {max_frame}")
    return HEADER.pack(len(body)) + body


def encode_request(
    req_id: int,
    method: str,
    params: msgspec.Struct,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    rid: bytes | None = None,
) -> bytes:
    """One framed request. ``params`` must be the method's params Struct; ``rid`` (a
    :data:`RID_BYTES`-byte request id, see :func:`make_rid`) makes it a 5-element frame."""
    spec = METHODS.get(method)
    if spec is None:
        raise InvalidArgumentError(f"unknown master RPC method {method!r}")
    # (a params Struct that only added trailing defaults still takes its base: the same wire)
    if type(params) is not spec.params and type(params) is not spec.params.__base__:
        raise InvalidArgumentError(
            f"{method} takes {spec.params.__name__}, not {type(params).__name__}"
        )
    if not 0 <= req_id <= _MAX_ID:
        raise InvalidArgumentError(f"request id {req_id} out of range")
    if rid is None:
        return _frame(_encoder.encode(_OutRequest(req_id, method, params)), max_frame)
    check_rid(rid)
    return _frame(_encoder.encode(_OutRequestRid(req_id, method, params, rid)), max_frame)


def canonical_reply(frame: bytes) -> bytes:
    """A framed response with its id set to 0: the form a dedup ledger records, the same bytes
    on every replica (``encode_result(0, r)`` / ``encode_error(0, e)`` give it directly)."""
    msg = _message_decoder.decode(memoryview(frame)[HEADER.size :])
    if not isinstance(msg, Response):
        raise InvalidArgumentError("not a framed response")
    if msg.id == 0:
        return bytes(frame)
    return _frame(_encoder.encode(_OutResponse(0, msg.code, msg.message, msg.result)), 1 << 32)


def encode_reply(req_id: int, recorded: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """A recorded framed response (the dedup ledger's value) re-sent under ``req_id``: same
    code, message and result, the id of the request it now answers."""
    msg = _message_decoder.decode(memoryview(recorded)[HEADER.size :])
    if not isinstance(msg, Response):
        raise InvalidArgumentError("a recorded reply must be a framed response")
    return _frame(
        _encoder.encode(_OutResponse(req_id, msg.code, msg.message, msg.result)), max_frame
    )


def encode_result(req_id: int, result: Any, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One framed success response carrying ``result``."""
    return _frame(_encoder.encode(_OutResponse(req_id, 0, "", result)), max_frame)


def encode_error(
    req_id: int,
    error: BaseException | int,
    message: str = "",
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """One framed error response: from an exception (its ``code``, its text) or a bare code."""
    if isinstance(error, BaseException):
        code = (
            int(error.code) if isinstance(error, MooncakeError) else int(ErrorCode.INTERNAL_ERROR)
        )
        message = message or str(error) or type(error).__name__
    else:
        code = int(error)
    if code >= 0:
        raise InvalidArgumentError(f"error code must be negative, got {code}")
    return _frame(_encoder.encode(_OutResponse(req_id, code, message[:4096], None)), max_frame)


def decode_params(request: Request) -> msgspec.Struct:
    """The request's params as its method's Struct.

    Raises :class:`NotSupportedError` (unknown method) or :class:`InvalidArgumentError` (params
    of the wrong shape): errors to answer, not reasons to drop the connection.
    """
    spec = METHODS.get(request.method)
    if spec is None:
        raise NotSupportedError(f"unknown method {request.method!r}")
    try:
        params: msgspec.Struct = spec.params_decoder.decode(request.params)
    except msgspec.DecodeError as e:
        raise InvalidArgumentError(f"bad params for {request.method}: {e}") from None
    return params


def decode_result(method: str, response: Response) -> Any:
    """The response's result as ``method``'s result type, or raise the error it carries.

    A negative ``code`` raises the matching :mod:`mooncake.errors` class
    (:func:`~mooncake.errors.error_from_code`); a result that does not fit the type raises
    :class:`ProtocolError`.
    """
    if response.code != 0:
        raise error_from_code(response.code, response.message)
    spec = METHODS.get(method)
    if spec is None:
        raise InvalidArgumentError(f"unknown master RPC method {method!r}")
    try:
        return spec.result_decoder.decode(response.result)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad result for {method}: {e}") from None


class MessageDecoder:
    """Sans-I/O parser for one direction of a connection: feed bytes, take messages out.

    ``feed(data)`` appends; ``next_message()`` returns the next complete :class:`Request` or
    :class:`Response`, or ``None`` if more bytes are needed; iterating yields all complete ones.
    Any chunking of the input gives the same messages. Bad input raises :class:`ProtocolError`
    (a zero or oversized length prefix, a body that is not a tagged request/response array);
    after that the decoder is unusable and the connection should be dropped.

    Memory is bounded by ``max_frame`` plus what one ``feed`` adds, provided the driver drains
    messages after each ``feed`` (the length prefix is checked as soon as 4 bytes are in).
    """

    __slots__ = ("_broken", "_buf", "_pos", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1 or max_frame > 0xFFFFFFFF:
            raise InvalidArgumentError(f"max_frame must be in [1, 2**32), got {max_frame}")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        self._broken = False

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as messages."""
        return len(self._buf) - self._pos

    @property
    def pending_length(self) -> int:
        """The body length the partial frame buffered announced (0: under 4 bytes in)."""
        if len(self._buf) - self._pos < 4:
            return 0
        length: int = HEADER.unpack_from(self._buf, self._pos)[0]
        return length

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes received from the peer."""
        if self._broken:
            raise ProtocolError("decoder already failed on earlier input")
        self._buf += data

    def feed_messages(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """``feed(data)`` and every message complete now, in order (the same messages and
        errors as feeding and iterating). With nothing buffered, the frames whole in
        ``data`` are decoded straight from it (no copy into the buffer); only a trailing
        partial frame is kept."""
        if self._broken:
            raise ProtocolError("decoder already failed on earlier input")
        if self._buf:
            self._buf += data
            return list(self)
        view = memoryview(data)
        end = len(view)
        pos = 0
        out: list[Message] = []
        unpack = HEADER.unpack_from
        decode = _message_decoder.decode
        max_frame = self.max_frame
        while end - pos >= 4:
            (length,) = unpack(view, pos)
            if length == 0 or length > max_frame:
                self._broken = True
                raise ProtocolError(f"frame length {length} outside [1, {max_frame}]")
            stop = pos + 4 + length
            if stop > end:
                break
            try:
                msg: Message = decode(view[pos + 4 : stop])
            except (msgspec.DecodeError, RecursionError) as e:
                self._broken = True
                raise ProtocolError(f"malformed RPC frame: {e}") from None
            if not 0 <= msg.id <= _MAX_ID:
                self._broken = True
                raise ProtocolError(f"RPC id {msg.id} out of range")
            out.append(msg)
            pos = stop
        if pos < end:
            self._buf += view[pos:]
        return out

    def next_message(self) -> Message | None:
        """The next complete message, or ``None`` until more bytes arrive."""
        if self._broken:
            raise ProtocolError("decoder already failed on earlier input")
        avail = len(self._buf) - self._pos
        if avail < 4:
            return None
        (length,) = HEADER.unpack_from(self._buf, self._pos)
        if length == 0 or length > self.max_frame:
            self._broken = True
            raise ProtocolError(f"frame length {length} outside [1, {self.max_frame}]")
        if avail < 4 + length:
            return None
        start = self._pos + 4
        end = start + length
        body = bytes(memoryview(self._buf)[start:end])
        self._pos = end
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > 65536 and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        try:
            msg: Message = _message_decoder.decode(body)
        except (msgspec.DecodeError, RecursionError) as e:
            self._broken = True
            raise ProtocolError(f"malformed RPC frame: {e}") from None
        if not 0 <= msg.id <= _MAX_ID:
            self._broken = True
            raise ProtocolError(f"RPC id {msg.id} out of range")
        return msg

    def __iter__(self) -> MessageDecoder:
        return self

    def __next__(self) -> Message:
        msg = self.next_message()
        if msg is None:
            raise StopIteration
        return msg

    def check_eof(self) -> None:
        """Call when the peer closed: raises :class:`ProtocolError` if a frame was cut short."""
        if self.buffered:
            raise ProtocolError(f"connection closed inside a frame ({self.buffered} bytes pending)")


__all__ = [
    "AUTH_METHODS",
    "DEFAULT_MAX_FRAME",
    "HEADER",
    "METHODS",
    "MUTATING",
    "RID_BYTES",
    "RID_FIRST",
    "VERSION",
    "AuthChallenge",
    "AuthHelloParams",
    "AuthProveParams",
    "BatchKeyClientParams",
    "BatchPutEndParams",
    "BatchPutStartParams",
    "BatchRemoveParams",
    "ClientParams",
    "CopyTaskParams",
    "CorruptReplicaParams",
    "Empty",
    "EvictDiskParams",
    "ForceParams",
    "Item",
    "KeyClientParams",
    "KeyParams",
    "KeysPage",
    "KeysParams",
    "LocalDiskParams",
    "Message",
    "MessageDecoder",
    "MethodSpec",
    "MountSegmentParams",
    "MoveTaskParams",
    "PageParams",
    "PutEndParams",
    "PutLocalParams",
    "PutStartParams",
    "ReMountSegmentParams",
    "RegexParams",
    "RemoveParams",
    "ReplicaClearParams",
    "Request",
    "Response",
    "SegmentFailureParams",
    "SegmentsPage",
    "TaskIdParams",
    "TaskParams",
    "TaskRevokeParams",
    "TierKeyParams",
    "UnmountSegmentParams",
    "canonical_reply",
    "check_rid",
    "decode_params",
    "decode_result",
    "encode_error",
    "encode_reply",
    "encode_request",
    "encode_result",
    "first_attempt",
    "make_rid",
]
