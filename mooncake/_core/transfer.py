"""Transfer requests and per-request results (sans-I/O value types).

Opcodes and status values are Mooncake's: ``READ=0`` pulls remote bytes into local memory,
``WRITE=1`` pushes local bytes to the remote; ``TransferStatus`` has the published enum order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mooncake.errors import MooncakeError


class Opcode(enum.IntEnum):
    READ = 0
    WRITE = 1


class TransferStatus(enum.IntEnum):
    """Mooncake's ``TransferStatusEnum`` (also the C API's ``STATUS_*`` values)."""

    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Move ``length`` bytes between local ``local_addr`` and the peer's ``remote_addr``.

    ``remote_addr`` is a virtual address inside one of the peer's registered buffers, exactly as
    in Mooncake (``target_offset``); ``local_addr`` must lie inside one locally registered region.
    """

    opcode: Opcode
    local_addr: int
    remote_addr: int
    length: int

    @classmethod
    def read(cls, local_addr: int, remote_addr: int, length: int) -> TransferRequest:
        return cls(Opcode.READ, local_addr, remote_addr, length)

    @classmethod
    def write(cls, local_addr: int, remote_addr: int, length: int) -> TransferRequest:
        return cls(Opcode.WRITE, local_addr, remote_addr, length)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one request: ``COMPLETED`` with every byte moved, or ``FAILED`` with the error."""

    status: TransferStatus
    transferred: int = 0
    error: MooncakeError | None = None

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.COMPLETED


def completed(length: int) -> TransferResult:
    return TransferResult(TransferStatus.COMPLETED, length)


def failed(error: MooncakeError) -> TransferResult:
    return TransferResult(TransferStatus.FAILED, 0, error)
