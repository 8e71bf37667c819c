"""GPU memory in segment descriptors (sans-I/O): locations and CUDA IPC handles.

A device buffer is published the way the published ``nvlink_intra`` transport publishes it::

    {"name": "cuda:0", "addr": 139872438648832, "length": 1048576,
     "shm_name": "0F1A...(128 upper-case hex digits: the 64-byte cudaIpcMemHandle_t)"}

``name`` is the buffer's *location* (``cuda:N``), ``shm_name`` the serialized IPC handle of the
allocation holding it. A handle names a whole ``cudaMalloc`` allocation and opens at that
allocation's base, so a buffer registered at an interior pointer also carries ``ipc_offset``
(``addr`` minus the allocation base), a field of our own that is omitted when 0: a published peer
ignores it and, like its own encoder, assumes the buffer starts its allocation.

The segment-level fields ``cuda_host`` (the kernel boot id: processes that share it share the GPUs)
and ``cuda_process`` (a random token per process: a handle cannot be opened in the process that
exported it, whose pointers are usable as they are) tell a peer whether IPC applies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake.errors import InvalidArgumentError, ProtocolError

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
_LOCATION = re.compile(r"^(cuda|cpu):(\d{1,4})$")
_HEX = re.compile(r"^[0-9A-Fa-f]*$")


def parse_location(location: str) -> tuple[str, int]:
    """Split ``"cuda:N"`` / ``"cpu:N"`` into ``(kind, index)``; anything else is refused."""
    if not isinstance(location, str):
        raise InvalidArgumentError(f"location must be a string, got {type(location).__name__}")
    m = _LOCATION.match(location)
    if m is None:
        raise InvalidArgumentError(
            f"bad memory location {location!r}: expected 'cpu:<numa node>' or 'cuda:<device>'"
        )
    return m.group(1), int(m.group(2))


def device_of(location: str) -> int | None:
    """The CUDA device index of a location, or None for host memory (never raises)."""
    if location.startswith("cuda:"):
        tail = location[5:]
        if tail.isdigit():
            return int(tail)
    return None


def encode_ipc_handle(handle: bytes) -> str:
    """Serialize a 64-byte IPC handle as the published engine does (upper-case hex)."""
    if len(handle) != IPC_HANDLE_SIZE:
        raise InvalidArgumentError(f"IPC handle must be {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
    return handle.hex().upper()


def decode_ipc_handle(text: Any, what: str = "shm_name") -> bytes:
    """Parse a serialized IPC handle (:class:`ProtocolError` naming what is wrong)."""
    if not isinstance(text, str):
        raise ProtocolError(f"{what}: IPC handle must be a string, got {type(text).__name__}")
    if len(text) != 2 * IPC_HANDLE_SIZE or not _HEX.match(text):
        raise ProtocolError(
            f"{what}: IPC handle must be {2 * IPC_HANDLE_SIZE} hex digits, got {len(text)} chars"
        )
    return bytes.fromhex(text)


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """What a peer needs to reach one published device buffer over CUDA IPC."""

    device: int
    addr: int
    length: int
    handle: bytes
    offset: int  # addr - allocation base; the opened pointer + offset is ``addr``'s twin

    @property
    def key(self) -> tuple[int, bytes]:
        """Identity in a handle cache: a re-registration at the same address has a new handle."""
        return (self.addr - self.offset, self.handle)


def buffer_fields(handle: bytes, offset: int) -> dict[str, Any]:
    """The extra buffer fields a device region publishes."""
    if offset < 0:
        raise InvalidArgumentError(f"ipc_offset must be >= 0, got {offset}")
    out: dict[str, Any] = {"shm_name": encode_ipc_handle(handle)}
    if offset:
        out["ipc_offset"] = offset
    return out


def device_buffer(
    name: str, addr: int, length: int, extra: Mapping[str, Any]
) -> DeviceBuffer | None:
    """Decode a descriptor buffer entry as an IPC-reachable device buffer, or None if it is not one.

    A buffer is one when its name is a ``cuda:N`` location and it carries ``shm_name``; a
    malformed handle or offset raises :class:`ProtocolError`.
    """
    dev = device_of(name)
    if dev is None or "shm_name" not in extra:
        return None
    what = f"buffer [{addr:#x}, +{length})"
    handle = decode_ipc_handle(extra["shm_name"], f"{what} shm_name")
    off = extra.get("ipc_offset", 0)
    if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off <= addr:
        raise ProtocolError(f"{what}: ipc_offset must be an integer in [0, addr], got {off!r}")
    return DeviceBuffer(dev, addr, length, handle, off)


__all__ = [
    "IPC_HANDLE_SIZE",
    "DeviceBuffer",
    "buffer_fields",
    "decode_ipc_handle",
    "device_buffer",
    "device_of",
    "encode_ipc_handle",
    "parse_location",
]
