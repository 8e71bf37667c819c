"""Dead, stopped and slandered holders, with real processes: quarantine through the master.

A holder (``tests/helpers/store_client_driver.py`` in its own process) keeps objects in its
segment; the test process is a reader. The master's client TTL is long (60 s) so nothing here
can be explained by the holder's expiry: what the reader sees comes from the quarantine that
the holder's closed heartbeat connection or the first failed transfer started
(``ReportSegmentFailure``), and from its end when the holder is heard from again.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mooncake._core import rpc
from mooncake.errors import ClientNotFoundError, ErrorCode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

MIB = 1 << 20
UNREACHABLE = int(ErrorCode.REPLICA_NOT_FOUND)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
SIZE = 65536


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica through the engine's TCP transport, as between hosts (a stopped holder
    then really cannot answer; same-host mappings would read its memory regardless)."""
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    monkeypatch.setenv("MC_STORE_MEMCPY", "0")


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master("--client-ttl", "60")
    try:
        yield m
    finally:
        m.stop()


def reader(address: str) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", address) == 0
    return s


def wait_until(pred, what: str, limit: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


class RawClient:
    """A bare blocking RPC connection to the master (no store client behind it)."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.dec = rpc.MessageDecoder()
        self.ids = itertools.count(1)

    def call(self, method: str, params: Any) -> Any:
        rid = next(self.ids)
        self.sock.sendall(rpc.encode_request(rid, method, params))
        while True:
            msg = self.dec.next_message()
            if msg is None:
                data = self.sock.recv(1 << 16)
                assert data, "the master closed the connection"
                self.dec.feed(data)
            elif isinstance(msg, rpc.Response) and msg.id == rid:
                return rpc.decode_result(method, msg)

    def close(self) -> None:
        self.sock.close()


def fill(holder: Client, n: int) -> list[str]:
    keys = [f"h{i}" for i in range(n)]
    for i, k in enumerate(keys):
        assert holder.cmd("put", key=k, seed=i, size=SIZE, preferred=[holder.hostname])["rc"] == 0
    return keys


class Buf:
    def __init__(self, store: MooncakeDistributedStore) -> None:
        self.store = store
        self.a = np.zeros(SIZE, dtype=np.uint8)
        assert store.register_buffer(self.a.ctypes.data, SIZE) == 0

    def read(self, key: str) -> int:
        return int(self.store.get_into(key, self.a.ctypes.data, SIZE))

    def close(self) -> None:
        self.store.unregister_buffer(self.a.ctypes.data)


def test_a_killed_holders_keys_answer_unreachable_at_once_and_new_puts_avoid_it(
    master: Master, tcp_only: None
) -> None:
    holder = Client(master.address, 16)
    me = reader(master.address)
    buf = Buf(me)
    try:
        keys = fill(holder, 8)
        assert buf.read(keys[0]) == SIZE
        holder.kill()
        rcs = [buf.read(k) for k in keys]
        # the master saw its connection close (a read racing that fails its transfer and
        # reports it): every key answers REPLICA_NOT_FOUND
        assert set(rcs) <= {TRANSFER_FAIL, UNREACHABLE}, rcs
        wait_until(
            lambda: all(buf.read(k) == UNREACHABLE for k in keys),
            "every key of the dead holder to answer REPLICA_NOT_FOUND",
        )
        # not dropped (the holder's TTL is far off), only unreachable: exist agrees with get
        assert me.batch_is_exist(keys) == [0] * len(keys)
        assert all(me.is_exist(k) == 0 for k in keys)
        cfg = ReplicateConfig()
        cfg.preferred_segment = holder.hostname
        for i in range(8):
            assert me.put(f"new{i}", b"n" * 1000, cfg) == 0
            (desc,) = me.get_replica_desc(f"new{i}")
            endpoint = desc.get_memory_descriptor().buffer_descriptor.transport_endpoint
            assert endpoint != holder.hostname
            assert me.get(f"new{i}") == b"n" * 1000
    finally:
        buf.close()
        me.close()
        holder.stop()


def test_a_stopped_holder_is_quarantined_then_readmitted_with_its_bytes(
    master: Master, tcp_only: None
) -> None:
    holder = Client(master.address, 16)
    me = reader(master.address)
    buf = Buf(me)
    try:
        keys = fill(holder, 8)
        os.kill(holder.proc.pid, signal.SIGSTOP)
        try:
            # the first read waits out its read window (the holder cannot answer), fails, and
            # is reported; the others are answered at once
            first = buf.read(keys[0])
            assert first < 0 and first != UNREACHABLE, first
            wait_until(
                lambda: all(buf.read(k) == UNREACHABLE for k in keys),
                "the stopped holder's keys to answer REPLICA_NOT_FOUND",
            )
        finally:
            os.kill(holder.proc.pid, signal.SIGCONT)
        # its heartbeat lifts the quarantine; every byte is the one written
        wait_until(lambda: buf.read(keys[0]) == SIZE, "the holder to be readmitted")
        for i, k in enumerate(keys):
            assert buf.read(k) == SIZE
            assert buf.a.tobytes() == value(i, SIZE), k
    finally:
        buf.close()
        me.close()
        holder.stop()


def test_a_hostile_report_costs_a_live_holder_one_heartbeat_and_is_not_heard_again(
    master: Master,
) -> None:
    holder = Client(master.address, 16)
    me = reader(master.address)
    buf = Buf(me)
    liar = RawClient(master.address)
    try:
        keys = fill(holder, 4)
        report = rpc.SegmentFailureParams(
            client_id="11111111-2222-3333-4444-555555555555", segment_name=holder.hostname
        )
        with pytest.raises(ClientNotFoundError):  # a stranger is not heard
            liar.call("ReportSegmentFailure", report)
        assert buf.read(keys[0]) == SIZE
        liar.call("Ping", rpc.ClientParams(client_id=report.client_id))  # now it is known
        assert liar.call("ReportSegmentFailure", report) is True
        assert buf.read(keys[0]) == UNREACHABLE
        # the holder is alive: its next heartbeat (1 s) ends the slander
        wait_until(lambda: buf.read(keys[0]) == SIZE, "the holder's heartbeat to lift it", 10)
        # the refuted reporter is not heard on that segment for a while
        assert liar.call("ReportSegmentFailure", report) is False
        assert [buf.read(k) for k in keys] == [SIZE] * len(keys)
        digest = holder.cmd("digest", key=keys[1])
        assert digest == {"len": SIZE, "sha": hashlib.sha256(value(1, SIZE)).hexdigest()}
    finally:
        liar.close()
        buf.close()
        me.close()
        holder.stop()
