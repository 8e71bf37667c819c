"""End to end: replicated masters (``--enable-ha``) behind an ``etcd://`` address, the leader
SIGKILLed while clients write; every put the client was told succeeded is readable through the
new leader, and no call in flight was dropped or failed."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator

import pytest
import trio

import mooncake
from mooncake._core import rpc
from mooncake._store.master_conn import MasterConnection
from tests import services
from tests.helpers.ha_procs import HaMaster, wait_leader

pytestmark = pytest.mark.etcd

CLUSTER = "ha-client-e2e"


def value(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest() * 64  # 2 KiB, a digest of the key


@pytest.fixture
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as cluster:
        yield cluster


def _in_sync(leader: HaMaster, n: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while leader.ha().get("in_sync", 0) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leader.ha()["in_sync"] == n


@pytest.mark.parametrize("ack", ["etcd", "replica"])
@pytest.mark.parametrize("writers", [4])
def test_leader_sigkill_under_load_loses_no_acknowledged_put(
    etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch, writers: int, ack: str
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    flags = ("--ha-lease-ttl", "2", "--ha-ack-mode", ack)
    masters = [HaMaster(etcd1.conn, *flags, cluster=CLUSTER) for _ in range(2)]
    try:
        leader = wait_leader(masters)
        if ack == "replica":
            _in_sync(leader, 1)

        async def main() -> None:
            async with mooncake.open_store(etcd1.conn, segment_size=32 << 20) as store:
                acked: list[str] = []
                stop = trio.Event()

                async def writer(w: int) -> None:
                    i = 0
                    while not stop.is_set():
                        key = f"w{w}-{i}"
                        i += 1
                        await store.put(key, value(key))  # raising here fails the test
                        acked.append(key)

                async with trio.open_nursery() as n:
                    for w in range(writers):
                        n.start_soon(writer, w)
                    with trio.fail_after(60):
                        while len(acked) < 40:  # noqa: ASYNC110 (load builds up)
                            await trio.sleep(0.05)
                    os.kill(leader.proc.pid, signal.SIGKILL)
                    at_kill = len(acked)
                    with trio.fail_after(60):
                        while len(acked) < at_kill + 80:  # noqa: ASYNC110 (puts resume)
                            await trio.sleep(0.05)
                    stop.set()
                live = [m for m in masters if m.proc.poll() is None]
                new = await trio.to_thread.run_sync(wait_leader, live)
                assert new is not leader and store.master.leader == new.address
                assert store.master.retries > 0  # calls were in flight across the failover
                for key in acked:
                    assert await store.get(key) == value(key), key
                direct = MasterConnection(new.address)
                try:
                    keys = set(await direct.call("GetAllKeys", rpc.Empty()))
                finally:
                    direct.close()
                assert set(acked) <= keys

        trio.run(main)
    finally:
        for m in masters:
            m.stop()


def test_a_retry_at_the_new_leader_is_answered_from_the_replicated_ledger(
    etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PutStart applied and acknowledged by the leader, which then dies; the same request id
    sent to the new leader gets the same descriptors back and allocates nothing again."""
    from mooncake._core.store_types import Segment

    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    masters = [HaMaster(etcd1.conn, "--ha-lease-ttl", "2", cluster=CLUSTER) for _ in range(2)]
    try:
        leader = wait_leader(masters)

        async def main() -> None:
            conn = MasterConnection(etcd1.conn)
            try:
                seg = Segment(id="s1", name="holder", base=1 << 30, size=1 << 20, te_endpoint="h")
                await conn.call("MountSegment", rpc.MountSegmentParams(client_id="h", segment=seg))
                put = rpc.PutStartParams(client_id="h", key="once", size=4096)
                rid = conn.next_rid()
                first = await conn.call("PutStart", put, rid)
                os.kill(leader.proc.pid, signal.SIGKILL)
                again = await conn.call("PutStart", put, rid)  # waits out the failover
                assert conn.leader != leader.address
                assert again == first
                segs = await conn.call("GetAllSegments", rpc.Empty())
                assert [s.used for s in segs] == [4096]  # allocated once
                with pytest.raises(mooncake.errors.StoreError):  # a new id is applied: refused
                    await conn.call("PutStart", put)
            finally:
                await conn.aclose()

        trio.run(main)
    finally:
        for m in masters:
            m.stop()


@pytest.mark.parametrize("ack", ["etcd", "replica"])
def test_stopped_leader_does_not_hold_caller_thread_puts(
    etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch, ack: str
) -> None:
    """The sync facade's caller-thread path (a blocking socket per thread) blocked in a call to
    a leader that is then SIGSTOPped: the leader change shuts that socket, the call resumes at
    the new leader, and every acknowledged put is readable there. The blocking socket's own
    timeout is raised to an hour, so only the leader change can free the thread."""
    import threading

    from mooncake._store import sync_master
    from mooncake.store import MooncakeDistributedStore

    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    monkeypatch.setattr(sync_master, "RPC_TIMEOUT_S", 3600.0)
    flags = ("--ha-lease-ttl", "2", "--ha-ack-mode", ack)
    masters = [HaMaster(etcd1.conn, *flags, cluster=CLUSTER) for _ in range(2)]
    store = MooncakeDistributedStore()
    try:
        leader = wait_leader(masters)
        if ack == "replica":
            _in_sync(leader, 1)
        assert (
            store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", etcd1.conn) == 0
        )
        assert store._fast is not None
        acked: list[str] = []
        failed: list[int] = []
        stop = threading.Event()
        more = threading.Condition()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                key = f"sync-{i}"
                i += 1
                rc = store.put(key, value(key))
                with more:
                    (acked.append(key) if rc == 0 else failed.append(rc))
                    more.notify_all()

        def wait_for(n: int) -> None:
            with more:
                assert more.wait_for(lambda: len(acked) >= n or failed, timeout=120), acked[-1:]
            assert not failed

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            wait_for(20)
            hits = store._fast.hits
            assert hits > 0  # the puts take the caller-thread path
            leader.signal(signal.SIGSTOP)
            at_stop = len(acked)
            wait_for(at_stop + 20)  # resumed at the new leader (old code: held an hour)
        finally:
            stop.set()
            t.join(120)
        assert not t.is_alive()
        live = [m for m in masters if m is not leader]
        new = wait_leader(live)
        assert store.get_hostname()
        for key in acked:
            assert store.get(key) == value(key), key
        assert new.address != leader.address
    finally:
        store.close()
        for m in masters:
            m.stop()
