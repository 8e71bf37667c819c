"""Checks on the addresses a master hands out, before this client copies to or from them.

The master is trusted to allocate, not to be right: a replica it names may be stale, or the
answer corrupt or hostile. Every copy this client does by itself (``memcpy`` into its own
segment or a mapped same-host one, rather than through the engine, whose peers check requests
against their registered ranges) first checks that the extent lies inside the segment it is
copied from or to, and that the lengths the answer claims are consistent. A failed check is a
:class:`~mooncake.errors.TransferError` naming the extent, never a wild memory access.
"""

from __future__ import annotations

from mooncake._core import store_types as st
from mooncake.errors import TransferError

__all__ = ["check_replica_list", "own_extent"]


def own_extent(base: int, size: int, addr: int, length: int, what: str = "replica") -> int:
    """``addr`` if ``[addr, addr+length)`` lies in ``[base, base+size)`` (``length >= 0``)."""
    if length < 0 or addr < base or addr + length > base + size:
        raise TransferError(
            f"{what} [{addr:#x}, +{length}) is outside this client's segment [{base:#x}, +{size})"
        )
    return addr


def check_replica_list(key: str, resp: st.GetReplicaListResponse) -> st.GetReplicaListResponse:
    """``resp`` if its size and replicas are consistent: size >= 0, every replica's address
    >= 0 and its length at least the object's size (a read of ``size`` bytes stays inside it)."""
    size = resp.size if resp.size else (resp.replicas[0].length if resp.replicas else 0)
    if size < 0:
        raise TransferError(f"the master answered size {size} for {key!r}")
    for r in resp.replicas:
        if r.addr < 0 or r.length < size:
            raise TransferError(
                f"the master answered replica [{r.addr:#x}, +{r.length}) on {r.segment_name} "
                f"for the {size}-byte object {key!r}"
            )
    return resp
