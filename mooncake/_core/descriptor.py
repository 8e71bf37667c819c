"""Segment descriptors: the JSON a segment publishes about its registered buffers.

Field names and shapes follow the published engine (``encodeSegmentDesc``), e.g. for TCP::

    {"name": "127.0.0.1:16997", "protocol": "tcp", "tcp_data_host": "127.0.0.1",
     "tcp_data_port": 16686, "tcp_proto_version": 2, "rdma_server_name": "",
     "timestamp": "2026-11-29 19:44:02.981322",
     "buffers": [{"name": "127.0.0.1:16997", "addr": 139646305554448, "length": 1048576}]}

Fields we do not know are kept (``extra``) and re-emitted, so a descriptor round-trips. Decoding
validates everything a transfer later relies on: integer addresses inside the 64-bit space,
positive lengths, no two buffers overlapping. A descriptor that fails is never cached.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mooncake.errors import ProtocolError

U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class BufferDesc:
    """One remotely accessible buffer of a segment."""

    name: str
    addr: int
    length: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update(name=self.name, addr=self.addr, length=self.length)
        return out


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    """A segment's published description; buffers are sorted by address and disjoint."""

    name: str
    protocol: str
    buffers: tuple[BufferDesc, ...] = ()
    tcp_data_host: str = ""
    tcp_data_port: int = 0
    tcp_proto_version: int = 2
    timestamp: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        starts = [b.addr for b in self.buffers]
        if starts != sorted(starts):
            object.__setattr__(self, "buffers", tuple(sorted(self.buffers, key=lambda b: b.addr)))
        for a, b in zip(self.buffers, self.buffers[1:], strict=False):
            if b.addr < a.end:
                raise ProtocolError(
                    f"segment {self.name!r}: buffers [{a.addr:#x}, +{a.length}) and "
                    f"[{b.addr:#x}, +{b.length}) overlap"
                )

    def find_buffer(self, addr: int, length: int) -> BufferDesc | None:
        """The buffer holding all of ``[addr, addr+length)``, or None."""
        i = bisect.bisect_right(self.buffers, addr, key=lambda b: b.addr) - 1
        if i >= 0 and self.buffers[i].covers(addr, length):
            return self.buffers[i]
        return None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update(
            name=self.name,
            protocol=self.protocol,
            tcp_data_host=self.tcp_data_host,
            tcp_data_port=self.tcp_data_port,
            tcp_proto_version=self.tcp_proto_version,
            timestamp=self.timestamp or now_timestamp(),
            buffers=[b.to_json() for b in self.buffers],
        )
        out.setdefault("rdma_server_name", "")
        return out

    def replace(self, **changes: Any) -> SegmentDescriptor:
        return dataclasses.replace(self, **changes)


def now_timestamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _int(obj: Mapping[str, Any], key: str, what: str, lo: int = 0, hi: int = U64 - 1) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{what}: field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(f"{what}: field {key!r} = {v} outside [{lo}, {hi}]")
    return v


def _str(obj: Mapping[str, Any], key: str, what: str, default: str | None = None) -> str:
    v = obj.get(key, default)
    if not isinstance(v, str):
        raise ProtocolError(f"{what}: field {key!r} must be a string")
    return v


def decode_buffers(raw: Any, what: str) -> tuple[BufferDesc, ...]:
    if not isinstance(raw, list):
        raise ProtocolError(f"{what}: 'buffers' must be a list")
    out = []
    for i, b in enumerate(raw):
        if not isinstance(b, dict):
            raise ProtocolError(f"{what}: buffers[{i}] must be an object")
        bw = f"{what} buffers[{i}]"
        addr = _int(b, "addr", bw)
        length = _int(b, "length", bw, lo=1)
        if addr + length > U64:
            raise ProtocolError(f"{bw}: [{addr:#x}, +{length}) runs past the 64-bit address space")
        extra = {k: v for k, v in b.items() if k not in ("name", "addr", "length")}
        out.append(BufferDesc(_str(b, "name", bw, ""), addr, length, extra))
    return tuple(out)


_KNOWN = frozenset(
    (
        "name",
        "protocol",
        "buffers",
        "tcp_data_host",
        "tcp_data_port",
        "tcp_proto_version",
        "timestamp",
    )
)


def decode_descriptor(obj: Any) -> SegmentDescriptor:
    """Validate a parsed descriptor JSON object (:class:`ProtocolError` naming what is wrong)."""
    if not isinstance(obj, dict):
        raise ProtocolError("segment descriptor must be a JSON object")
    name = _str(obj, "name", "segment descriptor")
    what = f"segment descriptor {name!r}"
    proto = obj.get("protocol", "tcp")
    if isinstance(proto, list):  # multi-protocol form
        if not all(isinstance(p, str) for p in proto):
            raise ProtocolError(f"{what}: 'protocol' list must hold strings")
        protocol = ",".join(proto)
    elif isinstance(proto, str):
        protocol = proto
    else:
        raise ProtocolError(f"{what}: 'protocol' must be a string")
    buffers = decode_buffers(obj.get("buffers", []), what)
    port = obj.get("tcp_data_port", 0)
    version = obj.get("tcp_proto_version", 1)
    return SegmentDescriptor(
        name=name,
        protocol=protocol,
        buffers=buffers,
        tcp_data_host=_str(obj, "tcp_data_host", what, ""),
        tcp_data_port=_int({"p": port}, "p", f"{what} tcp_data_port", hi=65535),
        tcp_proto_version=_int({"v": version}, "v", f"{what} tcp_proto_version", hi=255),
        timestamp=str(obj.get("timestamp", "")),
        extra={k: v for k, v in obj.items() if k not in _KNOWN},
    )


def buffers_of(regions: Iterable[tuple[str, int, int]]) -> tuple[BufferDesc, ...]:
    """Build buffer entries from ``(name, addr, length)`` triples."""
    return tuple(BufferDesc(n, a, ln) for n, a, ln in regions)
