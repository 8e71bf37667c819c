"""Fault injection for verified reads: flip bytes where a store keeps an object's bytes.

:func:`flip_replica` flips bits of one byte of a replica inside the segment of the store client
that holds it (a *holder*, in this process), as a bad DIMM or a stray write by another process
into a shared segment would: nothing in the store is told. :func:`flip_file` does the same to a
file (an SSD tier's copy of an object). :func:`replicas_of` finds where a key's bytes are.

With verified reads on, the next read of such a replica fails its CRC32C: the reader reads
another replica (or fails with ``CHECKSUM_MISMATCH``) and the master drops the bad one.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._store.client import Store

__all__ = ["flip_file", "flip_replica", "replicas_of"]


async def replicas_of(store: Store, key: str) -> st.GetReplicaListResponse:
    """The master's replica list of ``key`` (a descriptor query: no read window opened)."""
    resp: st.GetReplicaListResponse = await store.master.call(
        "GetReplicaList", rpc.KeyParams(key=key, for_read=False)
    )
    return resp


def flip_replica(holder: Store, replica: st.ReplicaDescriptor, offset: int, mask: int = 1) -> int:
    """XOR ``mask`` (1..255) into byte ``offset`` of ``replica``, which must lie in the host
    segment of ``holder`` (a store client of this process); returns the byte's new value.
    :class:`InvalidArgumentError` naming what is wrong otherwise."""
    seg = holder.segment
    if seg is None or replica.segment_name != holder.segment_name:
        raise InvalidArgumentError(
            f"flip_replica: the replica is in segment {replica.segment_name!r}, not in the "
            f"host segment of this holder ({holder.segment_name!r})"
        )
    if not 0 <= offset < replica.length:
        raise InvalidArgumentError(
            f"flip_replica: offset {offset} outside the {replica.length}-byte replica"
        )
    if not 1 <= mask <= 255:
        raise InvalidArgumentError(f"flip_replica: mask {mask} must be 1..255")
    addr = replica.addr + offset
    if not seg.addr <= addr < seg.addr + seg.size:
        raise InvalidArgumentError(
            f"flip_replica: {addr:#x} is outside the holder's segment [{seg.addr:#x}, +{seg.size})"
        )
    cell = ctypes.c_uint8.from_address(addr)
    cell.value ^= mask
    return int(cell.value)


def flip_file(path: str | os.PathLike[str], offset: int, mask: int = 1) -> int:
    """XOR ``mask`` into byte ``offset`` of the file at ``path`` (in place, flushed to the
    file); returns the byte's new value."""
    if not 1 <= mask <= 255:
        raise InvalidArgumentError(f"flip_file: mask {mask} must be 1..255")
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if not 0 <= offset < size:
            raise InvalidArgumentError(f"flip_file: offset {offset} outside the {size}-byte file")
        f.seek(offset)
        b = f.read(1)[0] ^ mask
        f.seek(offset)
        f.write(bytes([b]))
        f.flush()
        os.fsync(f.fileno())
    return b
