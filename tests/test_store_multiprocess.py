"""Store clients in separate processes around a real master: bytes, replicas, crashes, fullness.

Every process is real: ``python -m mooncake master`` and client processes running the sync
``MooncakeDistributedStore`` (tests/helpers/store_client_driver.py); the test process is one more
client. Values are deterministic per (seed, size) and checked by SHA-256 across processes.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

MIB = 1 << 20
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
NO_HANDLE = int(ErrorCode.NO_AVAILABLE_HANDLE)
UNREACHABLE = int(ErrorCode.REPLICA_NOT_FOUND)


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master("--client-ttl", "2")
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def clients(master: Master) -> Iterator[list[Client]]:
    cs = [Client(master.address, 32), Client(master.address, 32)]
    try:
        yield cs
    finally:
        for c in cs:
            c.stop()


def local_store(
    address: str, segment_mib: int = 32, buffer_mib: int = 32
) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert (
        s.setup(
            "127.0.0.1", "P2PHANDSHAKE", segment_mib * MIB, buffer_mib * MIB, "tcp", "", address
        )
        == 0
    )
    return s


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def wait_until(pred, what: str, limit: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


def test_three_clients_exchange_verified_bytes(master: Master, clients: list[Client]) -> None:
    a, b = clients
    me = local_store(master.address)
    try:
        sizes = [1, 4096, 65536 + 7, 3 * MIB + 5]
        # every writer puts on every segment; every reader checks every value
        for w, writer in enumerate((a, b)):
            for i, n in enumerate(sizes):
                for seg in (a.hostname, b.hostname, me.get_hostname()):
                    key = f"w{w}-{i}-{seg}"
                    assert writer.cmd("put", key=key, seed=i, size=n, preferred=[seg])["rc"] == 0
        for i, n in enumerate(sizes):
            cfg = ReplicateConfig()
            cfg.preferred_segment = a.hostname
            assert me.put(f"me-{i}", value(i, n), cfg) == 0
        for w in (0, 1):
            for i, n in enumerate(sizes):
                for seg in (a.hostname, b.hostname, me.get_hostname()):
                    key = f"w{w}-{i}-{seg}"
                    assert sha(me.get(key)) == sha(value(i, n)), key
                    for reader in (a, b):
                        assert reader.cmd("digest", key=key) == {"len": n, "sha": sha(value(i, n))}
                    assert (
                        me.get_replica_desc(key)[0]
                        .get_memory_descriptor()
                        .buffer_descriptor.transport_endpoint
                        == seg
                    )
        for i, n in enumerate(sizes):
            assert b.cmd("digest", key=f"me-{i}") == {"len": n, "sha": sha(value(i, n))}
    finally:
        me.close()


def test_replicas_on_distinct_segments_survive_a_sigkill(
    master: Master, clients: list[Client]
) -> None:
    a, b = clients
    me = local_store(master.address)
    try:
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        cfg.preferred_segments = [a.hostname, b.hostname]
        keys = [f"r{i}" for i in range(16)]
        for i, k in enumerate(keys):
            assert me.put(k, value(i, 100_000 + i), cfg) == 0
            eps = {
                d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for d in me.get_replica_desc(k)
            }
            assert eps == {a.hostname, b.hostname}
        a.kill()
        for i, k in enumerate(keys):  # before and after the master notices
            assert me.get(k) == value(i, 100_000 + i)
        wait_until(
            lambda: all(len(me.get_replica_desc(k)) == 1 for k in keys),
            "the master to drop the dead client's replicas",
        )
        for i, k in enumerate(keys):
            assert b.cmd("digest", key=k) == {"len": 100_000 + i, "sha": sha(value(i, 100_000 + i))}
    finally:
        me.close()


def test_client_killed_mid_put_leaves_nothing_readable(
    master: Master, clients: list[Client]
) -> None:
    a, b = clients
    me = local_store(master.address)
    try:
        victim = Client(master.address, 8)
        try:
            started = victim.cmd("put_partial", key="half", size=4 * MIB, preferred=[a.hostname])
            assert started == {"started": True, "segments": [a.hostname]}
            # the object is being written: not readable, not listed
            assert me.is_exist("half") == 0
            assert me.get("half") == b""
            victim.kill()
        finally:
            victim.stop()
        assert me.is_exist("half") == 0
        assert me.get("half") == b""
        wait_until(
            lambda: me.put("half", b"whole", ReplicateConfig()) == 0 and me.get("half") == b"whole",
            "the key to become writable again (writer expired)",
        )
        assert b.cmd("digest", key="half") == {"len": 5, "sha": sha(b"whole")}
    finally:
        me.close()


def test_reads_of_a_dead_clients_keys_fail_then_the_keys_are_gone(
    master: Master, clients: list[Client]
) -> None:
    a, b = clients
    me = local_store(master.address)
    buf = np.zeros(MIB, dtype=np.uint8)
    try:
        assert me.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        keys = [f"d{i}" for i in range(8)]
        for i, k in enumerate(keys):
            assert a.cmd("put", key=k, seed=i, size=65536, preferred=[a.hostname])["rc"] == 0
        assert me.get_into(keys[0], buf.ctypes.data, buf.nbytes) == 65536
        a.kill()
        # the master still lists them (client TTL not over), but it saw the holder's connection
        # close (or a failed read reported it): its keys answer "no reachable replica" and do
        # not exist, at once (a read racing that notice fails its transfer instead)
        rcs = [me.get_into(k, buf.ctypes.data, buf.nbytes) for k in keys]
        assert set(rcs) <= {TRANSFER_FAIL, NOT_FOUND, UNREACHABLE} and UNREACHABLE in rcs, rcs
        assert me.batch_is_exist(keys) == [0] * len(keys)
        wait_until(
            lambda: (
                [me.get_into(k, buf.ctypes.data, buf.nbytes) for k in keys]
                == [NOT_FOUND] * len(keys)
            ),
            "the dead client's keys to go",
        )
        assert me.batch_is_exist(keys) == [0] * len(keys)
        # the survivors' segments still take new objects
        assert me.put("after", b"x" * 1000) == 0
        assert b.cmd("digest", key="after") == {"len": 1000, "sha": sha(b"x" * 1000)}
    finally:
        me.unregister_buffer(buf.ctypes.data)
        me.close()


def test_full_store_evicts_under_the_watermark_and_puts_succeed(master: Master) -> None:
    me = local_store(master.address, segment_mib=16)
    src = np.arange(MIB, dtype=np.uint8)
    try:
        assert me.register_buffer(src.ctypes.data, src.nbytes) == 0
        keys = [f"f{i}" for i in range(48)]  # 3x the capacity
        assert [me.put_from(k, src.ctypes.data, MIB) for k in keys] == [0] * 48
        alive = [k for k, e in zip(keys, me.batch_is_exist(keys), strict=True) if e == 1]
        assert 0 < len(alive) * MIB <= 0.9 * 16 * MIB
        assert alive == keys[-len(alive) :]  # oldest evicted first
        assert me.get(alive[-1]) == src.tobytes()
    finally:
        me.unregister_buffer(src.ctypes.data)
        me.close()


def test_hard_pinned_full_store_answers_no_available_handle(master: Master) -> None:
    me = local_store(master.address, segment_mib=8)
    src = np.ones(MIB, dtype=np.uint8)
    try:
        assert me.register_buffer(src.ctypes.data, src.nbytes) == 0
        pin = ReplicateConfig()
        pin.with_hard_pin = True
        rcs = [me.put_from(f"p{i}", src.ctypes.data, MIB, pin) for i in range(12)]
        ok = rcs.index(NO_HANDLE)
        assert ok >= 7 and rcs[:ok] == [0] * ok and set(rcs[ok:]) == {NO_HANDLE}, rcs
        assert me.batch_is_exist([f"p{i}" for i in range(ok)]) == [1] * ok  # nothing evicted
        assert me.remove_all(True) == ok
        assert me.put_from("p-again", src.ctypes.data, MIB, pin) == 0
    finally:
        me.unregister_buffer(src.ctypes.data)
        me.close()


def test_clients_remount_after_a_master_restart() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    m1 = Master("--rpc-port", str(port))
    a = Client(m1.address, 16)
    me = local_store(m1.address)
    try:
        assert me.put("before", b"1" * 100) == 0
        m1.proc.kill()
        m1.proc.wait()
        assert me.get("before") == b""  # the master (and its metadata) is gone
        m2 = Master("--rpc-port", str(port))
        try:
            assert m2.address == m1.address
            on_a = ReplicateConfig()
            on_a.preferred_segment = a.hostname

            tries = iter(range(10**6))
            landed: list[str] = []

            def a_is_back() -> bool:
                key = f"after-{next(tries)}"
                if me.put(key, b"2" * 100, on_a) != 0:
                    return False
                desc = me.get_replica_desc(key)
                if (
                    desc[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                    != a.hostname
                ):
                    return False  # preference is best effort: a's segment not mounted yet
                landed.append(key)
                return True

            # heartbeats get NEED_REMOUNT from the new master and remount both segments
            wait_until(a_is_back, "the client to remount its segment at the new master")
            assert a.cmd("digest", key=landed[0]) == {"len": 100, "sha": sha(b"2" * 100)}
            assert (
                me.is_exist("before") == 0
            )  # lost with the old master's metadata, not resurrected
        finally:
            me.close()
            a.stop()
            m2.stop()
    finally:
        me.close()
        a.stop()
        m1.stop()


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-memcpy", "network"])
def test_sync_fast_path_and_loop_path_give_the_same_bytes(
    master: Master, clients: list[Client], memcpy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)
    a, _ = clients
    me = local_store(master.address)
    buf = np.zeros(2 * MIB, dtype=np.uint8)
    try:
        assert me._fast is not None
        assert me.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        on_a, on_me = ReplicateConfig(), ReplicateConfig()
        on_a.preferred_segment = a.hostname
        on_me.preferred_segment = me.get_hostname()
        for i, n in enumerate((1, 4096, MIB, MIB + 1)):  # MIB + 1: above the fast path's limit
            v = value(i, n)
            for cfg, where in ((on_me, "me"), (on_a, "a")):
                key = f"{where}-{i}"
                assert me.put(key, v, cfg) == 0
                assert me.get(key) == v
                assert me.get_into(key, buf.ctypes.data, buf.nbytes) == n
                assert buf[:n].tobytes() == v
                assert a.cmd("digest", key=key) == {"len": n, "sha": sha(v)}
                buf[:n] = np.frombuffer(value(i + 100, n), dtype=np.uint8)
                assert me.put_from(key + "-z", buf.ctypes.data, n, cfg) == 0
                assert me.get(key + "-z") == value(i + 100, n)
        assert me.upsert("me-0", b"new", on_me) == 0 and me.get("me-0") == b"new"
        h = me.get_buffer("a-1")
        assert h is not None and h.size() == 4096 and bytes(memoryview(h)) == value(1, 4096)
        assert ctypes.string_at(h.ptr(), 4096) == value(1, 4096)
        assert me.get_buffer("missing") is None
        # own-segment values always, same-host ones once mapped, take the caller-thread path
        assert me._fast.hits > 0
        assert me.get_into("missing", buf.ctypes.data, 16) == NOT_FOUND
        assert me.get_into("me-1", buf.ctypes.data, 16) == int(ErrorCode.INVALID_PARAMS)
    finally:
        me.unregister_buffer(buf.ctypes.data)
        me.close()


def test_sync_fast_path_read_outliving_its_window_fails_closed(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncake._store import fastpath

    me = local_store(master.address)
    buf = np.zeros(4096, dtype=np.uint8)
    try:
        assert me.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert me.put("k", b"v" * 4096) == 0
        assert me.get("k") == b"v" * 4096
        real = time.monotonic
        stalls = {"n": 0}

        class SlowClock:
            @staticmethod
            def monotonic() -> float:
                # every copy stalls 60 s: each reading after it is 60 s later
                return real() + 60.0 * stalls["n"]

        copy_out = fastpath.FastPath._copy_out

        def stalled_copy(self: fastpath.FastPath, *args: Any) -> bytes | None:
            try:
                return copy_out(self, *args)
            finally:
                stalls["n"] += 1

        monkeypatch.setattr(fastpath, "time", SlowClock)
        monkeypatch.setattr(fastpath.FastPath, "_copy_out", stalled_copy)
        assert me.get("k") == b""  # fenced, tried once more with a fresh lease, fenced again
        assert stalls["n"] == 2
        assert me.get_into("k", buf.ctypes.data, 4096) == int(ErrorCode.LEASE_EXPIRED)
        monkeypatch.setattr(fastpath.FastPath, "_copy_out", copy_out)
        assert me._store is not None and me._store.lease_fences == 3
        monkeypatch.setattr(fastpath, "time", time)
        assert me.get("k") == b"v" * 4096
    finally:
        me.unregister_buffer(buf.ctypes.data)
        me.close()
