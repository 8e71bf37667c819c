"""Mooncake's P2P handshake frames.

A frame is ``u64 length`` (little-endian, payload bytes + 1), ``u8 type``, then ``length - 1``
bytes of JSON text. The published engine writes the JSON with a trailing newline and serves one
request per connection: it replies with a frame of the same type, shuts down its write side and
waits for the client to close.

:class:`FrameDecoder` is the sans-I/O parser: feed it bytes in any chunking, take frames out. It
either yields frames or raises :class:`ProtocolError`; it never buffers more than ``max_length``
payload bytes (bounded memory whatever the peer sends).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from mooncake.errors import ProtocolError

HEADER = struct.Struct("<QB")
DEFAULT_MAX_LENGTH = 1 << 20  # MC_HANDSHAKE_MAX_LENGTH default
MAX_JSON_DEPTH = 64


class FrameType(enum.IntEnum):
    """Handshake frame types (``HandShakeRequestType``)."""

    CONNECTION = 0
    METADATA = 1
    NOTIFY = 2
    PROBE = 3
    #: ours, only with a cluster secret set: the challenge-response before the request frame
    AUTH = 16


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its type and the raw JSON payload."""

    type: FrameType
    payload: bytes

    def json(self) -> Any:
        """The payload parsed as JSON (:class:`ProtocolError` if it is not JSON, or too deep)."""
        return parse_json(self.payload)


def parse_json(payload: bytes) -> Any:
    """Parse JSON from a peer, refusing non-UTF-8, bad syntax and nesting deeper than 64."""
    depth = 0
    deepest = 0
    in_str = False
    esc = False
    for b in payload:  # cheap pre-scan: json.loads would recurse (RecursionError) on deep input
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise ProtocolError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif b in (0x5D, 0x7D):
            depth -= 1
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"handshake payload is not valid JSON: {e}") from None


def encode_frame(ftype: FrameType | int, payload: Any) -> bytes:
    """Encode one frame; ``payload`` is JSON-serialisable (or already ``bytes``)."""
    if isinstance(payload, bytes):
        body = payload
    else:
        body = (json.dumps(payload, separators=(",", ":"), sort_keys=True) + "\n").encode()
    return HEADER.pack(len(body) + 1, int(ftype)) + body


class FrameDecoder:
    """Incremental frame parser. ``feed(data)`` then ``next_frame()`` until it returns None."""

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self.max_length = max_length
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= HEADER.size:
            self._check_header()

    def _check_header(self) -> tuple[int, int]:
        length, ftype = HEADER.unpack_from(self._buf)
        if length == 0:
            raise ProtocolError("handshake frame with length 0 (must count the type byte)")
        if length - 1 > self.max_length:
            raise ProtocolError(
                f"handshake frame of {length - 1} bytes exceeds the limit of {self.max_length}"
            )
        if ftype not in _TYPES:
            raise ProtocolError(f"unknown handshake frame type {ftype}")
        return length, ftype

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        if len(self._buf) < HEADER.size:
            return None
        length, ftype = self._check_header()
        end = HEADER.size + length - 1
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return Frame(FrameType(ftype), payload)

    def needed(self) -> int:
        """How many more bytes the current frame needs (at least 1 when nothing is buffered)."""
        if len(self._buf) < HEADER.size:
            return HEADER.size - len(self._buf)
        length, _ = self._check_header()
        return max(HEADER.size + length - 1 - len(self._buf), 0)


_TYPES = frozenset(int(t) for t in FrameType)
