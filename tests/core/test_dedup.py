"""The dedup ledger (mooncake._core.dedup) and request ids on the RPC wire."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake._core import rpc
from mooncake._core.dedup import ENTRY_OVERHEAD, DedupLedger, StaleRequestError
from mooncake._core.master import MasterState
from mooncake._store.master import MasterServer, MasterServerConfig
from mooncake.errors import InvalidArgumentError, ProtocolError

INSTANCES = [bytes([i]) * 8 for i in range(1, 6)]


def rid(inst: int, seq: int) -> bytes:
    return rpc.make_rid(INSTANCES[inst], seq)


# -- the wire ---------------------------------------------------------------------------------


def test_request_without_rid_is_the_old_four_element_frame() -> None:
    p = rpc.KeyClientParams(client_id="c", key="k")
    frame = rpc.encode_request(7, "PutEnd", p)
    body = msgspec.msgpack.decode(frame[4:])
    assert len(body) == 4
    (msg,) = list(_feed(frame))
    assert isinstance(msg, rpc.Request) and msg.rid is None


def test_request_with_rid_round_trips() -> None:
    r = rid(0, 42)
    frame = rpc.encode_request(7, "PutEnd", rpc.KeyClientParams(client_id="c", key="k"), rid=r)
    assert len(msgspec.msgpack.decode(frame[4:])) == 5
    (msg,) = list(_feed(frame))
    assert isinstance(msg, rpc.Request) and msg.rid == r and msg.id == 7


def test_five_element_frame_with_a_bad_rid_type_is_a_protocol_error() -> None:
    body = msgspec.msgpack.encode([0, 1, "PutEnd", {"client_id": "c", "key": "k"}, 5])
    dec = rpc.MessageDecoder()
    dec.feed(rpc.HEADER.pack(len(body)) + body)
    with pytest.raises(ProtocolError):
        dec.next_message()


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17, b"x" * 8 + bytes(8)])
def test_malformed_rids_are_refused_by_name(bad: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="request id"):
        rpc.encode_request(1, "PutEnd", rpc.KeyClientParams(client_id="c", key="k"), rid=bad)
    with pytest.raises(InvalidArgumentError, match="request id"):
        DedupLedger().lookup(bad)


def test_encode_reply_keeps_code_message_and_result_under_a_new_id() -> None:
    ok = rpc.encode_result(3, ["a", "b"])
    again = next(iter(_feed(rpc.encode_reply(99, ok))))
    assert isinstance(again, rpc.Response) and again.id == 99 and again.code == 0
    assert msgspec.msgpack.decode(again.result) == ["a", "b"]
    err = rpc.encode_error(3, -704, "gone")
    again = next(iter(_feed(rpc.encode_reply(5, err))))
    assert isinstance(again, rpc.Response)
    assert (again.id, again.code, again.message) == (5, -704, "gone")


def test_canonical_replies_are_the_id_zero_encodings() -> None:
    """What the leader records from its framed reply equals what a replica applying the same
    command records from the result: the ledgers agree byte for byte."""
    from mooncake.errors import ObjectNotFoundError

    assert rpc.canonical_reply(rpc.encode_result(77, [1, "x"])) == rpc.encode_result(0, [1, "x"])
    err = ObjectNotFoundError("k")
    assert rpc.canonical_reply(rpc.encode_error(300, err)) == rpc.encode_error(0, err)


def test_every_mutating_method_is_a_method() -> None:
    assert set(rpc.METHODS) >= rpc.MUTATING
    for read in ("Ping", "GetReplicaList", "ExistKey", "QueryKey", "GetAllKeys", "ServiceReady"):
        assert read not in rpc.MUTATING


def _feed(frame: bytes) -> list[rpc.Message]:
    dec = rpc.MessageDecoder()
    dec.feed(frame)
    return list(dec)


# -- the ledger: bounds -----------------------------------------------------------------------


def test_per_client_bound_evicts_oldest_and_refuses_their_retry() -> None:
    led = DedupLedger(per_client=3)
    for seq in range(1, 6):
        led.record(rid(0, seq), b"r%d" % seq)
    assert len(led) == 3
    for seq in (1, 2):
        with pytest.raises(StaleRequestError, match="cannot tell"):
            led.lookup(rid(0, seq))
    assert [led.lookup(rid(0, s)) for s in (3, 4, 5)] == [b"r3", b"r4", b"r5"]
    assert led.lookup(rid(0, 6)) is None  # newer than anything seen: new
    assert led.lookup(rid(1, 1)) is None  # another client is unaffected


def test_client_bound_forgets_the_least_recently_active_client() -> None:
    led = DedupLedger(max_clients=2)
    led.record(rid(0, 1), b"a")
    led.record(rid(1, 1), b"b")
    led.record(rid(0, 2), b"a2")  # client 0 active again: client 1 is the oldest now
    led.record(rid(2, 1), b"c")
    assert led.clients == 2
    assert led.lookup(rid(1, 1)) is None  # forgotten entirely (documented: looks new)
    assert led.lookup(rid(0, 1)) == b"a" and led.lookup(rid(2, 1)) == b"c"


def test_byte_bound_evicts_from_the_least_recently_active_client() -> None:
    led = DedupLedger(max_bytes=3 * (ENTRY_OVERHEAD + 10))
    led.record(rid(0, 1), b"x" * 10)
    led.record(rid(1, 1), b"y" * 10)
    led.record(rid(1, 2), b"y" * 10)
    led.record(rid(1, 3), b"y" * 10)
    assert led.nbytes <= led.max_bytes
    with pytest.raises(StaleRequestError):
        led.lookup(rid(0, 1))
    assert led.lookup(rid(1, 1)) == b"y" * 10


def test_a_reply_larger_than_the_byte_bound_is_not_kept_and_its_retry_refused() -> None:
    led = DedupLedger(max_bytes=100)
    led.record(rid(0, 1), b"z" * 1000)
    assert led.nbytes == 0
    with pytest.raises(StaleRequestError):
        led.lookup(rid(0, 1))


def test_restore_rejects_garbage() -> None:
    with pytest.raises(InvalidArgumentError, match="snapshot"):
        DedupLedger.restore(b"\x01\x02garbage")


# -- the ledger: a model ----------------------------------------------------------------------


class LedgerModel(RuleBasedStateMachine):
    """Random records and lookups against a plain model: what the ledger answers is exactly
    what was recorded, or (once evicted) a refusal or nothing -- never another reply; the
    bounds always hold; a snapshot restores an identical ledger."""

    def __init__(self) -> None:
        super().__init__()
        self.led = DedupLedger(per_client=4, max_clients=3, max_bytes=6 * (ENTRY_OVERHEAD + 8))
        self.recorded: dict[bytes, bytes] = {}
        self.next_seq = [1] * len(INSTANCES)

    @rule(inst=hs.integers(0, len(INSTANCES) - 1), size=hs.integers(0, 16))
    def record_new(self, inst: int, size: int) -> None:
        r = rid(inst, self.next_seq[inst])
        self.next_seq[inst] += 1
        assert self.led.lookup(r) is None  # a fresh rid is new
        reply = r[-1:] * size
        self.led.record(r, reply)
        self.recorded[r] = reply

    @rule(inst=hs.integers(0, len(INSTANCES) - 1), back=hs.integers(0, 12))
    def lookup(self, inst: int, back: int) -> None:
        seq = self.next_seq[inst] - 1 - back
        if seq < 1:
            return
        r = rid(inst, seq)
        try:
            got = self.led.lookup(r)
        except StaleRequestError:
            return  # evicted and known to be: refused
        if got is not None:
            assert got == self.recorded[r]
        # None: its instance was forgotten (the documented hole) -- never a wrong reply

    @rule()
    def snapshot_round_trip(self) -> None:
        again = DedupLedger.restore(self.led.snapshot())
        assert again.state() == self.led.state()
        assert again.nbytes == self.led.nbytes
        assert (again.per_client, again.max_clients, again.max_bytes) == (4, 3, self.led.max_bytes)
        self.led = again

    @invariant()
    def bounds(self) -> None:
        assert self.led.clients <= self.led.max_clients
        assert self.led.nbytes <= self.led.max_bytes
        for _, _, replies in self.led.state():
            assert len(replies) <= self.led.per_client
        assert self.led.nbytes == sum(
            len(r) + ENTRY_OVERHEAD for _, _, rs in self.led.state() for _, r in rs
        )

    @invariant()
    def newest_of_each_client_kept(self) -> None:
        # the most recent reply of the most recently active client is always answerable
        st = self.led.state()
        if st and st[-1][2]:
            inst, _, replies = st[-1]
            seq, reply = replies[-1]
            assert self.led.lookup(inst + seq.to_bytes(8, "big")) == reply


TestLedgerModel = LedgerModel.TestCase
TestLedgerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(
    hs.lists(hs.tuples(hs.integers(0, 4), hs.integers(1, 50), hs.binary(max_size=40)), max_size=60)
)
@settings(deadline=None)
def test_same_records_give_the_same_ledger(ops: list[tuple[int, int, bytes]]) -> None:
    """Determinism: two ledgers fed the same records are equal (replicas agree)."""
    a, b = DedupLedger(per_client=5, max_clients=3), DedupLedger(per_client=5, max_clients=3)
    for inst, seq, reply in ops:
        a.record(rid(inst, seq), reply)
        b.record(rid(inst, seq), reply)
    assert a.state() == b.state() and a.snapshot() == b.snapshot()


# -- the server's request path ----------------------------------------------------------------


def _server() -> MasterServer:
    return MasterServer(MasterServerConfig(), MasterState())


def _answer(server: MasterServer, frame: bytes, now: float = 1.0) -> rpc.Response:
    (req,) = _feed(frame)
    assert isinstance(req, rpc.Request)
    (resp,) = _feed(server.handle_request(req, now))
    assert isinstance(resp, rpc.Response)
    return resp


def test_a_repeated_rid_is_answered_from_the_ledger_not_applied_again() -> None:
    from mooncake._core.store_types import Segment

    srv = _server()
    seg = Segment(id="s1", name="n1", base=0, size=1 << 20, te_endpoint="n1")
    mount = rpc.MountSegmentParams(client_id="c1", segment=seg)
    assert _answer(srv, rpc.encode_request(1, "MountSegment", mount, rid=rid(0, 1))).code == 0
    put = rpc.PutStartParams(client_id="c1", key="k", size=100)
    first = _answer(srv, rpc.encode_request(2, "PutStart", put, rid=rid(0, 2)))
    assert first.code == 0
    used = srv.state.used_bytes
    # the retry (new connection, new id, same rid): same descriptors, nothing allocated again
    again = _answer(srv, rpc.encode_request(9, "PutStart", put, rid=rid(0, 2)))
    assert (again.id, again.code, bytes(again.result)) == (9, 0, bytes(first.result))
    assert srv.state.used_bytes == used and srv.deduplicated == 1
    # without the ledger the same call is applied: a second PutStart of a pending key fails
    other = _answer(srv, rpc.encode_request(3, "PutStart", put, rid=rid(0, 3)))
    assert other.code != 0
    # an error answer is recorded too, and answered the same way again
    assert _answer(srv, rpc.encode_request(4, "PutStart", put, rid=rid(0, 3))).code == other.code
    end = rpc.KeyClientParams(client_id="c1", key="k")
    assert _answer(srv, rpc.encode_request(5, "PutEnd", end, rid=rid(0, 4))).code == 0
    assert _answer(srv, rpc.encode_request(6, "PutEnd", end, rid=rid(0, 4))).code == 0
    # a repeated remove is answered "removed" twice (applied once), not "not found"
    rm = rpc.RemoveParams(key="k")
    assert _answer(srv, rpc.encode_request(7, "Remove", rm, rid=rid(0, 5))).code == 0
    assert _answer(srv, rpc.encode_request(8, "Remove", rm, rid=rid(0, 5))).code == 0
    assert _answer(srv, rpc.encode_request(8, "Remove", rm, rid=rid(0, 6))).code == -704


def test_reads_ignore_rids_and_stale_rids_are_refused() -> None:
    srv = _server()
    srv.state.dedup = DedupLedger(per_client=1)
    q = rpc.KeyParams(key="nope")
    assert _answer(srv, rpc.encode_request(1, "ExistKey", q, rid=rid(0, 1))).code == 0
    assert len(srv.state.dedup) == 0  # a read is not recorded
    rm = rpc.RemoveParams(key="nope")
    _answer(srv, rpc.encode_request(2, "Remove", rm, rid=rid(0, 1)))
    _answer(srv, rpc.encode_request(3, "Remove", rm, rid=rid(0, 2)))
    stale = _answer(srv, rpc.encode_request(4, "Remove", rm, rid=rid(0, 1)))
    assert stale.code == -900 and "cannot tell" in stale.message


# -- first attempts are never stale ---------------------------------------------------------------


def test_a_first_attempt_below_the_floor_is_new_and_its_retry_is_answered() -> None:
    led = DedupLedger(per_client=4)
    for seq in range(2, 12):  # other threads' calls, recorded while seq 1 was descheduled
        led.record(rpc.first_attempt(rid(0, seq)), b"r%d" % seq)
    with pytest.raises(StaleRequestError):  # an unmarked id (a retry) below the floor
        led.lookup(rid(0, 1))
    assert led.lookup(rpc.first_attempt(rid(0, 1))) is None  # old ledger: refused (-900)
    led.record(rpc.first_attempt(rid(0, 1)), b"r1")
    assert led.lookup(rid(0, 1)) == b"r1"  # its retry: the recorded reply, not applied again
    assert led.lookup(rpc.first_attempt(rid(0, 11))) == b"r11"


@settings(max_examples=200, deadline=None)
@given(
    order=hs.permutations(list(range(1, 41))),
    retries=hs.lists(hs.integers(1, 40), max_size=40),
    per_client=hs.integers(1, 8),
    max_bytes=hs.integers(200, 4000),
)
def test_first_attempts_in_any_order_are_never_refused_and_never_applied_twice(
    order: list[int], retries: list[int], per_client: int, max_bytes: int
) -> None:
    """Threads draw sequence numbers from one counter and send them in any order: every first
    attempt is applied exactly once; a retry of an applied call gets its recorded reply or is
    refused (never applied again); a retry of a call never applied looks new."""
    led = DedupLedger(per_client=per_client, max_clients=2, max_bytes=max_bytes)
    applied: dict[int, bytes] = {}
    for i, seq in enumerate(order):
        assert led.lookup(rpc.first_attempt(rid(0, seq))) is None
        applied[seq] = b"reply-%d" % seq
        led.record(rpc.first_attempt(rid(0, seq)), applied[seq])
        for r in retries[i : i + 1]:
            try:
                got = led.lookup(rid(0, r))
            except StaleRequestError:
                assert r in applied or r <= max(applied)
                continue
            if r in applied:
                assert got == applied[r]  # never None: that would apply it twice
            else:
                assert got is None
        if i % 7 == 0:  # another instance's traffic shares the byte bound
            led.record(rpc.first_attempt(rid(1, i + 1)), b"x" * 50)
