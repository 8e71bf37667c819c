"""``P2PHANDSHAKE``: no metadata server; a peer's descriptor comes from its handshake port.

The segment name is ``host:rpc_port``. Looking one up sends a ``Metadata`` (type 1) frame
carrying our own descriptor and takes the peer's descriptor from the reply, as the published
engine does.
"""

from __future__ import annotations

from typing import Any

from mooncake._core.descriptor import decode_descriptor
from mooncake._core.handshake import FrameType
from mooncake._engine import handshake
from mooncake._engine.metadata.base import MetadataBackend, SegmentRecord
from mooncake.errors import InvalidArgumentError, ProtocolError, SegmentNotFoundError


def split_segment(segment: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``; IPv6 as ``"[::1]:port"``."""
    host, sep, port = segment.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(
            f"segment name {segment!r} is not 'host:port' (P2P segment names carry the rpc port)"
        )
    return host.strip("[]"), int(port)


class P2PMetadata(MetadataBackend):
    p2p = True

    async def lookup(self, segment: str, own_descriptor: dict[str, Any]) -> SegmentRecord:
        host, port = split_segment(segment)
        reply = await handshake.request(host, port, FrameType.METADATA, own_descriptor)
        obj = reply.json()
        if isinstance(obj, dict) and obj.get("reply_msg") and "buffers" not in obj:
            raise SegmentNotFoundError(f"{segment}: peer refused metadata: {obj['reply_msg']}")
        try:
            desc = decode_descriptor(obj)
        except ProtocolError as e:
            raise ProtocolError(f"{segment}: bad descriptor in handshake reply: {e}") from None
        return SegmentRecord(desc, host, port)
