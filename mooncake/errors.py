"""The one exception tree of the project, and Mooncake's integer error codes.

Every error the package raises on purpose derives from :class:`MooncakeError`. Each class carries
the Mooncake ``ErrorCode`` it maps to (``code``), so the sync facades, which speak the published
API's int return codes, translate exceptions in exactly one place (:func:`to_code`).

Whose fault it is follows trio's naming: ``*Refused`` / ``Invalid*`` is the caller's request,
``Peer*`` is the other side, ``ProtocolError`` is bytes that do not parse.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake._miss import Miss


class ErrorCode(enum.IntEnum):
    """Mooncake's ``ErrorCode`` values, as the published Python API returns them (negative)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    REPLICA_NOT_FOUND = -710
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    NOT_SUPPORTED = -1012
    JOB_NOT_FOUND = -1402
    TENANT_QUOTA_EXCEEDED = -1700


class MooncakeError(Exception):
    """Root of every error this package raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR


# -- caller's fault ---------------------------------------------------------------------------


class InvalidArgumentError(MooncakeError, ValueError):
    """An argument is malformed (wrong type, negative length, mismatched list lengths...)."""

    code = ErrorCode.INVALID_PARAMS


class TraceFormatError(InvalidArgumentError):
    """A request trace line is malformed; ``line_no`` (1-based) and ``reason`` say which and why."""

    def __init__(self, source: str, line_no: int, reason: str) -> None:
        super().__init__(f"{source}:{line_no}: {reason}")
        self.source = source
        self.line_no = line_no
        self.reason = reason


class NotSupportedError(MooncakeError):
    """The request is well-formed but this build, backend or peer cannot do it."""

    code = ErrorCode.NOT_SUPPORTED


class NoGpuError(NotSupportedError):
    """No usable GPU: the CUDA runtime is missing, sees no device, or the driver is too old."""


class ClosedError(MooncakeError):
    """The engine, store or connection was closed by this process."""

    code = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS


class RegistrationError(MooncakeError):
    """Local memory registration failed."""

    code = ErrorCode.INVALID_PARAMS


class AddressOverlapError(RegistrationError):
    """The region overlaps one that is already registered."""


class NotRegisteredError(RegistrationError):
    """A local address range is not inside one registered region."""

    code = ErrorCode.INVALID_PARAMS


class RegionBusyError(RegistrationError):
    """The region is in use by in-flight transfers and cannot be unregistered yet."""


# -- RDMA verbs ------------------------------------------------------------------------------


class VerbsUnavailableError(NotSupportedError):
    """libibverbs (or the provider named by ``MOONCAKE_IBVERBS``) cannot be loaded or has no device."""


class VerbsError(MooncakeError):
    """A libibverbs call failed. ``errno`` is the code the library returned; ``what`` the call.

    ``posted`` is set by ``ibv_post_send`` failures: how many work requests of the batch were
    posted before the one refused (those will complete normally).
    """

    code = ErrorCode.INTERNAL_ERROR

    def __init__(self, errno: int, what: str, posted: int = 0) -> None:
        import os

        self.errno = errno
        self.what = what
        self.posted = posted
        super().__init__(
            f"{what} failed: [errno {errno}] {os.strerror(errno) if errno else 'unknown'}"
        )


# -- metadata / discovery ---------------------------------------------------------------------


class SegmentNotFoundError(MooncakeError):
    """No segment of that name is known to the metadata service, or it is malformed."""

    code = ErrorCode.SEGMENT_NOT_FOUND


class JobNotFoundError(MooncakeError):
    """No drain job of that id is known to the master (never created, or forgotten)."""

    code = ErrorCode.JOB_NOT_FOUND


class MetadataError(MooncakeError):
    """The metadata service failed or answered something unusable."""

    code = ErrorCode.RPC_FAIL


class SegmentExistsError(MooncakeError):
    """Another live engine already publishes a segment of that name."""

    code = ErrorCode.SEGMENT_ALREADY_EXISTS


# -- the other side ---------------------------------------------------------------------------


class TransferError(MooncakeError):
    """A transfer did not complete. Subclasses say why."""

    code = ErrorCode.TRANSFER_FAIL


class RemoteAccessError(TransferError):
    """The peer refused the range: it is not inside one of its registered buffers."""


class PeerUnreachableError(TransferError):
    """Could not connect to the peer (refused, no route, timed out)."""


class PeerDiedError(TransferError):
    """The peer closed or reset the connection while a transfer was in flight."""


class TransferTimeoutError(TransferError):
    """Posted work did not complete within the configured limit (``MC_SLICE_TIMEOUT``)."""


class ProtocolError(MooncakeError):
    """Bytes from a peer violate the wire protocol (bad frame, bad length, bad JSON)."""

    code = ErrorCode.RPC_FAIL


class AuthError(ProtocolError):
    """The cluster-secret authentication failed: a peer without the secret, a wrong proof, or
    one side configured with ``MOONCAKE_CLUSTER_SECRET`` and the other not."""


class CudaError(MooncakeError):
    """A CUDA runtime call failed; ``status`` is the ``cudaError_t`` value."""

    code = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


# -- store ------------------------------------------------------------------------------------


class StoreError(MooncakeError):
    """A Mooncake Store operation was refused by the master or failed. Subclasses say why.

    Travels over the master RPC as its integer ``code`` plus a message; the receiving side
    rebuilds the same class with :func:`error_from_code`.
    """

    code = ErrorCode.INTERNAL_ERROR


class ObjectNotFoundError(StoreError):
    """No readable object of that key (never written, removed, evicted, or not yet PutEnd)."""

    code = ErrorCode.OBJECT_NOT_FOUND
    miss: Miss | None = None
    """Why, when the master said: reason, policy, tier (:class:`mooncake._miss.Miss`)."""


class ObjectAlreadyExistsError(StoreError):
    """PutStart of a key that already exists (or is being written by someone else)."""

    code = ErrorCode.OBJECT_ALREADY_EXISTS


class ObjectHasLeaseError(StoreError):
    """Remove refused: a reader holds a lease on the object (pass ``force`` to override)."""

    code = ErrorCode.OBJECT_HAS_LEASE


class LeaseExpiredError(StoreError):
    """A read finished after its lease ran out: the bytes read may belong to a newer object."""

    code = ErrorCode.LEASE_EXPIRED


class ObjectHasReplicationTaskError(StoreError):
    """The object has a copy/move task in flight."""

    code = ErrorCode.OBJECT_HAS_REPLICATION_TASK


class ReplicaNotReadyError(StoreError):
    """The object (or one of its replicas) is still being written: not COMPLETE yet."""

    code = ErrorCode.REPLICA_IS_NOT_READY


class ReplicaNotFoundError(StoreError):
    """No replica of the requested kind exists for the object."""

    code = ErrorCode.REPLICA_NOT_FOUND


class NoAvailableHandleError(StoreError):
    """No space: no mounted segment could hold even one replica (after eviction)."""

    code = ErrorCode.NO_AVAILABLE_HANDLE


class TenantQuotaExceededError(StoreError):
    """A write would take its tenant over its quota of bytes or objects (refused before
    anything is allocated or evicted; upstream's ``TENANT_QUOTA_EXCEEDED``, -1700)."""

    code = ErrorCode.TENANT_QUOTA_EXCEEDED


class InvalidKeyError(StoreError, ValueError):
    """The key is not acceptable (empty, or a malformed regular expression)."""

    code = ErrorCode.INVALID_KEY


class IllegalClientError(StoreError):
    """The operation names an object or segment owned by another client (e.g. PutEnd by a stranger)."""

    code = ErrorCode.ILLEGAL_CLIENT


class InvalidWriteError(StoreError):
    """PutEnd/PutRevoke of an object that is not being written."""

    code = ErrorCode.INVALID_WRITE


class InvalidReadError(StoreError):
    """A read could not be served as requested."""

    code = ErrorCode.INVALID_READ


class InvalidReplicaError(StoreError):
    """A replica descriptor is malformed or no longer valid."""

    code = ErrorCode.INVALID_REPLICA


class SegmentAlreadyExistsError(StoreError):
    """MountSegment of a segment id or name that is already mounted (by another client)."""

    code = ErrorCode.SEGMENT_ALREADY_EXISTS


class ClientNotFoundError(StoreError):
    """The master does not know that client id (never mounted, or expired)."""

    code = ErrorCode.CLIENT_NOT_FOUND


class BufferOverflowError(StoreError):
    """A destination buffer is smaller than the object."""

    code = ErrorCode.BUFFER_OVERFLOW


class ChecksumMismatchError(StoreError):
    """An object's bytes failed its CRC32C (verified reads): no bytes were returned.

    From a read: every replica's bytes differed from the CRC its writer recorded; each was
    reported to the master, which dropped it, so the object is gone (a later read answers
    ``OBJECT_NOT_FOUND``). Code ``-801``, the published ``CHECKSUM_MISMATCH``."""

    code = ErrorCode.CHECKSUM_MISMATCH


class TierDataError(ChecksumMismatchError):
    """An object's bytes in a storage tier (SSD file) are missing, truncated or fail their
    checksum. The object has been dropped from that tier; no bytes were returned."""

    code = ErrorCode.CHECKSUM_MISMATCH


class UnavailableError(StoreError):
    """The master cannot serve this now (shutting down, not ready)."""

    code = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS


class RpcError(StoreError):
    """The master RPC failed: connection refused or lost, or the answer did not parse."""

    code = ErrorCode.RPC_FAIL


class MasterUnreachableError(RpcError):
    """No answer came from the master: it could not be reached, or the connection broke
    before the answer arrived (the call may or may not have been applied; a retry with the
    same request id is answered once). Also: no leader appeared in an HA cluster in time."""


class NotLeaderError(StoreError):
    """This master is a standby of an HA cluster, not its leader: it applied nothing."""

    code = ErrorCode.UNAVAILABLE_IN_CURRENT_MODE


_BY_CODE: dict[int, type[MooncakeError]] = {
    int(cls.code): cls
    for cls in (
        ObjectNotFoundError,
        ObjectAlreadyExistsError,
        ObjectHasLeaseError,
        LeaseExpiredError,
        ObjectHasReplicationTaskError,
        ReplicaNotReadyError,
        ReplicaNotFoundError,
        NoAvailableHandleError,
        TenantQuotaExceededError,
        InvalidKeyError,
        IllegalClientError,
        InvalidWriteError,
        InvalidReadError,
        InvalidReplicaError,
        SegmentAlreadyExistsError,
        ClientNotFoundError,
        BufferOverflowError,
        UnavailableError,
        RpcError,
        NotLeaderError,
        ChecksumMismatchError,
        SegmentNotFoundError,
        JobNotFoundError,
        InvalidArgumentError,
        NotSupportedError,
        TransferError,
    )
}


def error_from_code(code: int, message: str = "") -> MooncakeError:
    """Rebuild the exception for a Mooncake ``ErrorCode`` received over the wire.

    Known codes give their own class (``-704`` -> :class:`ObjectNotFoundError`); an unknown or
    unmapped code gives a :class:`StoreError` whose instance ``code`` is that value (an unknown
    integer becomes ``INTERNAL_ERROR``).
    """
    cls = _BY_CODE.get(int(code))
    if cls is not None:
        if not message and cls.__doc__:
            message = cls.__doc__.splitlines()[0]
        return cls(message)
    err = StoreError(message or f"error code {code}")
    try:
        err.code = ErrorCode(int(code))
    except ValueError:
        err.code = ErrorCode.INTERNAL_ERROR
    return err


def to_code(exc: BaseException) -> int:
    """Map an exception to the published API's int return code (one table for all facades)."""
    if isinstance(exc, MooncakeError):
        return int(exc.code)
    if isinstance(exc, (ValueError, TypeError)):
        return int(ErrorCode.INVALID_PARAMS)
    return int(ErrorCode.INTERNAL_ERROR)


__all__ = [
    "AddressOverlapError",
    "BufferOverflowError",
    "ChecksumMismatchError",
    "ClientNotFoundError",
    "ClosedError",
    "CudaError",
    "ErrorCode",
    "IllegalClientError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidReadError",
    "InvalidReplicaError",
    "InvalidWriteError",
    "JobNotFoundError",
    "LeaseExpiredError",
    "MasterUnreachableError",
    "MetadataError",
    "MooncakeError",
    "NoAvailableHandleError",
    "NoGpuError",
    "NotLeaderError",
    "NotRegisteredError",
    "NotSupportedError",
    "ObjectAlreadyExistsError",
    "ObjectHasLeaseError",
    "ObjectHasReplicationTaskError",
    "ObjectNotFoundError",
    "PeerDiedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RegionBusyError",
    "RegistrationError",
    "RemoteAccessError",
    "ReplicaNotFoundError",
    "ReplicaNotReadyError",
    "RpcError",
    "SegmentAlreadyExistsError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "StoreError",
    "TenantQuotaExceededError",
    "TierDataError",
    "TraceFormatError",
    "TransferError",
    "TransferTimeoutError",
    "UnavailableError",
    "VerbsError",
    "VerbsUnavailableError",
    "error_from_code",
    "to_code",
]
