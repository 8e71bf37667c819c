"""The one exception tree of the project, and Mooncake's integer error codes.

Every error the package raises on purpose derives from :class:`MooncakeError`. Each class carries
the Mooncake ``ErrorCode`` it maps to (``code``), so the sync facades, which speak the published
API's int return codes, translate exceptions in exactly one place (:func:`to_code`).

Whose fault it is follows trio's naming: ``*Refused`` / ``Invalid*`` is the caller's request,
``Peer*`` is the other side, ``ProtocolError`` is bytes that do not parse.
"""

from __future__ import annotations

import enum


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


# -- metadata / discovery ---------------------------------------------------------------------


class SegmentNotFoundError(MooncakeError):
    """No segment of that name is known to the metadata service, or it is malformed."""

    code = ErrorCode.SEGMENT_NOT_FOUND


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


class ProtocolError(MooncakeError):
    """Bytes from a peer violate the wire protocol (bad frame, bad length, bad JSON)."""

    code = ErrorCode.RPC_FAIL


def to_code(exc: BaseException) -> int:
    """Map an exception to the published API's int return code (one table for all facades)."""
    if isinstance(exc, MooncakeError):
        return int(exc.code)
    if isinstance(exc, (ValueError, TypeError)):
        return int(ErrorCode.INVALID_PARAMS)
    return int(ErrorCode.INTERNAL_ERROR)


__all__ = [
    "AddressOverlapError",
    "ClosedError",
    "ErrorCode",
    "InvalidArgumentError",
    "MetadataError",
    "MooncakeError",
    "NotRegisteredError",
    "NotSupportedError",
    "PeerDiedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RegionBusyError",
    "RegistrationError",
    "RemoteAccessError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "TraceFormatError",
    "TransferError",
    "to_code",
]
