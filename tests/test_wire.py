"""Wire codecs, byte by byte: they parse or raise ProtocolError, nothing else."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core import handshake, tcpwire
from mooncake._core.descriptor import decode_descriptor
from mooncake._core.transfer import Opcode
from mooncake.errors import ProtocolError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@given(
    frames=st.lists(st.tuples(st.sampled_from(list(handshake.FrameType)), json_values), max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_frames_roundtrip_in_any_chunking(frames: list, cuts: list[int]) -> None:
    data = b"".join(handshake.encode_frame(t, p) for t, p in frames)
    dec = handshake.FrameDecoder()
    got = []
    for chunk in _chunks(data, cuts):
        dec.feed(chunk)
        while (f := dec.next_frame()) is not None:
            got.append(f)
    assert [(f.type, f.json()) for f in got] == [(t, p) for t, p in frames]
    assert dec.pending == 0


@given(st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=10))
def test_frame_decoder_garbage_parses_or_raises_protocol_error(
    data: bytes, cuts: list[int]
) -> None:
    dec = handshake.FrameDecoder(max_length=64)
    try:
        for chunk in _chunks(data, cuts):
            dec.feed(chunk)
            while (f := dec.next_frame()) is not None:
                try:
                    f.json()
                except ProtocolError:
                    pass
    except ProtocolError:
        pass
    assert dec.pending <= 9 + 64


def test_frame_limits_are_named() -> None:
    dec = handshake.FrameDecoder(max_length=100)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        dec.feed(struct.pack("<QB", 1000, 1))
    with pytest.raises(ProtocolError, match="unknown handshake frame type 9"):
        handshake.FrameDecoder().feed(struct.pack("<QB", 3, 9))
    with pytest.raises(ProtocolError, match="length 0"):
        handshake.FrameDecoder().feed(struct.pack("<QB", 0, 1))


def test_deep_json_is_refused_without_recursion() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ProtocolError, match="nested deeper"):
        handshake.parse_json(deep)
    with pytest.raises(ProtocolError, match="not valid JSON"):
        handshake.parse_json(b"\xff\xfe")
    assert handshake.parse_json(b'{"a": "[[[[["}') == {"a": "[[[[["}


def test_published_frame_bytes() -> None:
    # as captured from the published engine: u64 LE (payload + 1), type, JSON with a newline
    f = handshake.encode_frame(handshake.FrameType.PROBE, {"status": "success"})
    assert f[:9] == struct.pack("<QB", len(f) - 8, 3)
    assert f.endswith(b"\n") and json.loads(f[9:]) == {"status": "success"}


@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.sampled_from(list(Opcode)),
    st.booleans(),
)
def test_tcp_header_roundtrip(size: int, addr: int, op: Opcode, v2: bool) -> None:
    raw = tcpwire.encode_header(op, addr, size, v2)
    assert len(raw) == 24
    h = tcpwire.decode_header(raw)
    assert (h.size, h.addr, h.opcode, h.v2) == (size, addr, op, v2)


@given(st.binary(min_size=24, max_size=24))
def test_tcp_header_garbage(raw: bytes) -> None:
    try:
        h = tcpwire.decode_header(raw)
    except ProtocolError:
        assert raw[16] & 0x7F not in (0, 1)
    else:
        assert h.opcode in (Opcode.READ, Opcode.WRITE)


def test_status_frame_matches_published_bytes() -> None:
    assert tcpwire.encode_status(0) == b"\x00\x00\x00\x00VTCM"
    assert tcpwire.encode_status(1) == b"\x01\x00\x00\x00VTCM"
    assert tcpwire.decode_status(b"\x01\x00\x00\x00VTCM") == 1
    with pytest.raises(ProtocolError, match="MCTV"):
        tcpwire.decode_status(b"\x00" * 8)


PUBLISHED_DESC = {
    "buffers": [{"addr": 139646305554448, "length": 1048576, "name": "127.0.0.1:16997"}],
    "name": "127.0.0.1:16997",
    "protocol": "tcp",
    "rdma_server_name": "",
    "tcp_data_host": "127.0.0.1",
    "tcp_data_port": 16686,
    "tcp_proto_version": 2,
    "timestamp": "2026-11-29 19:44:02.981322",
}


def test_descriptor_decodes_published_and_roundtrips() -> None:
    d = decode_descriptor(PUBLISHED_DESC)
    assert d.tcp_data_port == 16686 and d.buffers[0].length == 1 << 20
    assert d.find_buffer(139646305554448 + 10, 100) is d.buffers[0]
    assert d.find_buffer(139646305554448 + (1 << 20) - 1, 2) is None
    again = decode_descriptor(json.loads(json.dumps(d.to_json())))
    assert again == d


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda d: d.update(buffers=[{"addr": 0, "length": 10}, {"addr": 5, "length": 10}]),
            "overlap",
        ),
        (lambda d: d.update(buffers=[{"addr": 2**64 - 5, "length": 10}]), "past the 64-bit"),
        (lambda d: d.update(buffers=[{"addr": -1, "length": 10}]), "outside"),
        (lambda d: d.update(buffers=[{"addr": "x", "length": 10}]), "must be an integer"),
        (lambda d: d.update(buffers=[{"addr": 0, "length": 0}]), "outside"),
        (lambda d: d.update(buffers="nope"), "must be a list"),
        (lambda d: d.update(tcp_data_port=70000), "tcp_data_port"),
        (lambda d: d.pop("name"), "'name' must be a string"),
    ],
)
def test_descriptor_bad_input_is_named(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(json.dumps(PUBLISHED_DESC))
    mutate(d)
    with pytest.raises(ProtocolError, match=match):
        decode_descriptor(d)


@settings(max_examples=200)
@given(json_values)
def test_descriptor_decoder_never_crashes(obj: object) -> None:
    try:
        decode_descriptor(obj)
    except ProtocolError:
        pass
