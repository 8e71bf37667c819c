"""The master RPC codec: round trips, any chunking, bounded frames, garbage -> ProtocolError."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core import rpc
from mooncake._core.store_types import (
    GetReplicaListResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    Segment,
)
from mooncake.errors import (
    ErrorCode,
    InvalidArgumentError,
    NotSupportedError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ProtocolError,
    StoreError,
    error_from_code,
)

keys = st.text(min_size=1, max_size=40)


def test_request_round_trip() -> None:
    params = rpc.PutStartParams(
        client_id="c1",
        key="k",
        size=4096,
        config=ReplicateConfig(replica_num=2, with_hard_pin=True),
    )
    frame = rpc.encode_request(7, "PutStart", params)
    dec = rpc.MessageDecoder()
    dec.feed(frame)
    msg = dec.next_message()
    assert isinstance(msg, rpc.Request)
    assert (msg.id, msg.method) == (7, "PutStart")
    assert rpc.decode_params(msg) == params
    assert dec.next_message() is None
    assert dec.buffered == 0


def test_result_and_error_round_trip() -> None:
    reps = [ReplicaDescriptor(segment_name="127.0.0.1:1234", addr=4096, length=10)]
    dec = rpc.MessageDecoder()
    dec.feed(rpc.encode_result(1, GetReplicaListResponse(replicas=reps, lease_ttl_ms=10000)))
    dec.feed(rpc.encode_error(2, ObjectHasLeaseError("leased")))
    dec.feed(rpc.encode_error(3, -12345, "weird"))
    r1, r2, r3 = list(dec)
    assert isinstance(r1, rpc.Response)
    out = rpc.decode_result("GetReplicaList", r1)
    assert out.replicas == reps and out.lease_ttl_ms == 10000
    assert reps[0].status is ReplicaStatus.COMPLETE
    assert isinstance(r2, rpc.Response)
    with pytest.raises(ObjectHasLeaseError, match="leased"):
        rpc.decode_result("Remove", r2)
    assert isinstance(r3, rpc.Response)
    with pytest.raises(StoreError) as ei:
        rpc.decode_result("Remove", r3)
    assert ei.value.code == ErrorCode.INTERNAL_ERROR


def test_error_codes_map_to_classes() -> None:
    assert isinstance(error_from_code(-704), ObjectNotFoundError)
    assert isinstance(error_from_code(-600, "x"), InvalidArgumentError)
    e = error_from_code(-708, "")
    assert e.code == ErrorCode.OBJECT_HAS_REPLICATION_TASK


def test_unknown_method_and_bad_params_are_answerable_errors() -> None:
    body = msgspec.msgpack.encode([0, 1, "Nope", {}])
    dec = rpc.MessageDecoder()
    dec.feed(rpc.HEADER.pack(len(body)) + body)
    msg = dec.next_message()
    assert isinstance(msg, rpc.Request)
    with pytest.raises(NotSupportedError):
        rpc.decode_params(msg)
    body = msgspec.msgpack.encode([0, 2, "PutStart", {"key": 5}])
    dec.feed(rpc.HEADER.pack(len(body)) + body)
    msg = dec.next_message()
    assert isinstance(msg, rpc.Request)
    with pytest.raises(InvalidArgumentError, match="PutStart"):
        rpc.decode_params(msg)


def test_encode_refuses_wrong_params_type() -> None:
    with pytest.raises(InvalidArgumentError):
        rpc.encode_request(1, "PutEnd", rpc.KeyParams(key="k"))
    with pytest.raises(InvalidArgumentError):
        rpc.encode_request(1, "Bogus", rpc.Empty())


def test_oversized_frame_refused_from_header_alone() -> None:
    dec = rpc.MessageDecoder(max_frame=100)
    dec.feed(rpc.HEADER.pack(101))
    with pytest.raises(ProtocolError, match="frame length"):
        dec.next_message()
    with pytest.raises(ProtocolError):
        dec.feed(b"x")


def test_zero_length_frame_refused() -> None:
    dec = rpc.MessageDecoder()
    dec.feed(b"\0\0\0\0")
    with pytest.raises(ProtocolError):
        dec.next_message()


def test_truncated_frame_detected_at_eof() -> None:
    frame = rpc.encode_request(1, "Ping", rpc.ClientParams(client_id="c"))
    dec = rpc.MessageDecoder()
    dec.feed(frame[:-1])
    assert dec.next_message() is None
    with pytest.raises(ProtocolError, match="inside a frame"):
        dec.check_eof()


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    out = []
    for i in range(draw(st.integers(1, 5))):
        kind = draw(st.integers(0, 2))
        if kind == 0:
            seg = Segment(id="s", name=draw(keys), base=draw(st.integers(0, 2**48)), size=4096)
            out.append(
                rpc.encode_request(
                    i, "MountSegment", rpc.MountSegmentParams(client_id="c", segment=seg)
                )
            )
        elif kind == 1:
            out.append(rpc.encode_result(i, draw(st.lists(keys, max_size=5))))
        else:
            out.append(rpc.encode_error(i, -704, draw(st.text(max_size=20))))
    return out


@given(frames(), st.lists(st.integers(1, 64), min_size=1, max_size=20))
@settings(max_examples=200)
def test_any_chunking_gives_the_same_messages(fs: list[bytes], cuts: list[int]) -> None:
    whole = b"".join(fs)
    ref = rpc.MessageDecoder()
    ref.feed(whole)
    expected = [msgspec.msgpack.encode(m) for m in ref]
    dec = rpc.MessageDecoder()
    got: list[bytes] = []
    pos = 0
    i = 0
    while pos < len(whole):
        n = cuts[i % len(cuts)]
        dec.feed(whole[pos : pos + n])
        pos += n
        i += 1
        got.extend(msgspec.msgpack.encode(m) for m in dec)
    assert got == expected
    assert len(got) == len(fs)
    dec.check_eof()


@given(frames(), st.lists(st.integers(1, 200), min_size=1, max_size=20))
@settings(max_examples=200)
def test_feed_messages_matches_feed_and_iterate(fs: list[bytes], cuts: list[int]) -> None:
    """``feed_messages`` (frames decoded straight from the chunk when nothing is buffered)
    gives the messages feeding and iterating gives, for any chunking, the chunk taken from a
    buffer that is overwritten after each call (as a receive buffer is; what a message's raw
    part points into is used before that)."""
    whole = b"".join(fs)
    ref = rpc.MessageDecoder()
    ref.feed(whole)
    expected = [msgspec.msgpack.encode(m) for m in ref]
    dec = rpc.MessageDecoder()
    scratch = bytearray(256)
    got: list[bytes] = []
    pos = 0
    i = 0
    while pos < len(whole):
        chunk = whole[pos : pos + cuts[i % len(cuts)]]
        scratch[: len(chunk)] = chunk
        got.extend(
            msgspec.msgpack.encode(m) for m in dec.feed_messages(memoryview(scratch)[: len(chunk)])
        )
        scratch[:] = b"\xee" * len(scratch)  # the next recv overwrites the buffer
        pos += len(chunk)
        i += 1
    assert got == expected
    dec.check_eof()


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_feed_messages_garbage_raises_protocol_error_like_iterating(data: bytes) -> None:
    def outcome(step: Any) -> list[bytes] | str:
        dec = rpc.MessageDecoder(max_frame=256)
        try:
            return [msgspec.msgpack.encode(m) for m in step(dec)]
        except ProtocolError:
            return "protocol error"

    def iterate(dec: rpc.MessageDecoder) -> list[rpc.Message]:
        dec.feed(data)
        return list(dec)

    assert outcome(lambda d: d.feed_messages(data)) == outcome(iterate)


@given(st.binary(max_size=300))
@settings(max_examples=500)
def test_garbage_parses_or_raises_protocol_error(data: bytes) -> None:
    dec = rpc.MessageDecoder(max_frame=256)
    try:
        for b in data:
            dec.feed(bytes([b]))
            for m in dec:
                assert isinstance(m, (rpc.Request, rpc.Response))
    except ProtocolError:
        pass


@given(st.binary(min_size=1, max_size=200))
def test_framed_garbage_body_raises_protocol_error_or_parses(body: bytes) -> None:
    dec = rpc.MessageDecoder()
    dec.feed(rpc.HEADER.pack(len(body)) + body)
    try:
        m = dec.next_message()
    except ProtocolError:
        return
    assert isinstance(m, (rpc.Request, rpc.Response))


def test_batch_items_round_trip() -> None:
    reps = [
        ReplicaDescriptor(segment_name="a:1", addr=0, length=8, status=ReplicaStatus.PROCESSING)
    ]
    items = [rpc.Item(code=0, value=reps), rpc.Item(code=-705)]
    dec = rpc.MessageDecoder()
    dec.feed(rpc.encode_result(9, items))
    (msg,) = list(dec)
    assert isinstance(msg, rpc.Response)
    out = rpc.decode_result("BatchPutStart", msg)
    assert out[0].code == 0 and out[0].value == reps
    assert out[1].code == -705 and out[1].value is None
