"""A holder or writer process dies (SIGKILL): exist agrees with get, and success means stored.

Real processes: ``python -m mooncake master`` (with a client TTL far longer than the tests
wait, so nothing here is explained by expiry), client processes running the sync facade
(tests/helpers/store_client_driver.py), and this process as one more client. The master sees a
client's death when its heartbeat connection closes: the client's segments are quarantined
and its writes in flight discarded at once.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

MIB = 1 << 20
NOT_READY = int(ErrorCode.REPLICA_IS_NOT_READY)
#: generous: the master notices a death within milliseconds; the TTL below is 120 s
NOTICE_S = 30.0


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master("--client-ttl", "120")
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def me(master: Master) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address)
    assert rc == 0
    try:
        yield s
    finally:
        s.close()


def _until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + NOTICE_S
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def test_exist_agrees_with_get_after_the_only_holder_dies(
    master: Master, me: MooncakeDistributedStore
) -> None:
    holder = Client(master.address, 32)
    try:
        on_holder = ReplicateConfig()
        on_holder.preferred_segment = holder.hostname
        v = value(1, 65536)
        assert me.put("k", v, on_holder) == 0
        assert me.is_exist("k") == 1 and me.get("k") == v
        holder.kill()
        # old code: 1 until the client TTL (120 s), while every read failed
        _until(lambda: me.is_exist("k") == 0, "exist to answer 0 after the holder died")
        buf = np.zeros(65536, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        assert me.register_buffer(addr, buf.nbytes) == 0
        try:
            for _ in range(10):
                ex, bex = me.is_exist("k"), me.batch_is_exist(["k"])
                got = me.get_into("k", addr, buf.nbytes)
                assert bex == [ex]
                assert (ex == 1) == (got >= 0), (ex, got)
                assert ex == 0
        finally:
            me.unregister_buffer(addr)
    finally:
        holder.kill()
        holder.stop()  # closes its pipes


def test_a_put_after_the_writer_died_mid_put_is_stored(
    master: Master, me: MooncakeDistributedStore
) -> None:
    writer = Client(master.address, 32)
    try:
        started = writer.cmd("put_partial", key="w", size=65536)
        assert started["started"]
        writer.kill()  # between PutStart and PutEnd
        v = value(2, 4096)
        # old code: 0 (the zombie write "exists") with nothing stored, for 30 s
        assert me.put("w", v) == 0
        assert me.get("w") == v
        assert me.is_exist("w") == 1
    finally:
        writer.kill()
        writer.stop()  # closes its pipes


def test_a_put_beside_a_write_in_flight_never_answers_0_with_nothing_stored(
    master: Master, me: MooncakeDistributedStore
) -> None:
    writer = Client(master.address, 32)
    try:
        assert writer.cmd("put_partial", key="c", size=65536)["started"]
        v = value(3, 4096)
        rc = me.put("c", v)  # waits for the other write (bounded), which never ends
        assert rc == NOT_READY, rc  # old code: 0, and nothing readable
        assert me.is_exist("c") == 0
        assert me.put_batch(["c"], [v]) == NOT_READY
        writer.kill()  # its write is discarded at once: the next put stores its own bytes
        assert me.put("c", v) == 0
        assert me.get("c") == v
        h = me.get_buffer("c")
        assert h is not None and ctypes.string_at(h.ptr(), h.size()) == v
    finally:
        writer.kill()
        writer.stop()  # closes its pipes
