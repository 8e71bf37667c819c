"""Re-adoption with real processes: objects on a holder's SSD tier survive a master restart,
then a restart of the holder itself (same SSD directory), under load.

A holder process with a small segment and an SSD tier keeps objects a writer placed on it;
eviction demotes most of them to its SSD. The master is SIGKILLed and restarted on the same
port (it forgets everything; the holder's heartbeat gets NEED_REMOUNT, it re-mounts and
re-announces its SSD objects), then the holder is SIGKILLed and started again on the same
directory while the master still lists its old instance (it re-announces what it recovered,
and the master hands it the old instance's SSD copies). Another client keeps putting and
reading its own keys throughout. Every object on the SSD before stays readable with its bytes.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

import pytest

from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

MIB = 1 << 20
SIZE = 256 << 10


def store(address: str, segment_mib: int) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment_mib * MIB, 16 * MIB, "tcp", "", address)
    assert rc == 0
    return s


def wait_until(pred, what: str, limit: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


class Load(threading.Thread):
    """Upserts and gets of its own keys until stopped; counts wrong values read."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.s = store(address, 8)
        self.stop_ = threading.Event()
        self.ops = 0
        self.wrong = 0
        self.failed = 0

    def run(self) -> None:
        i = 0
        while not self.stop_.is_set():
            key = f"load-{i % 64}"
            rc = self.s.upsert(key, value(10_000 + i, 4096))
            got = self.s.get(key)
            # after a successful upsert a read gets that value (or nothing: evicted, or the
            # master restarted in between), never another one
            if rc == 0 and got and got != value(10_000 + i, 4096):
                self.wrong += 1
            self.failed += rc != 0
            self.ops += 1
            i += 1

    def close(self) -> None:
        self.stop_.set()
        self.join(30)
        self.s.close()


def on_ssd(me: MooncakeDistributedStore, keys: list[str]) -> list[str]:
    """Keys readable with no memory replica: held only by an SSD tier (their descriptors are
    the LOCAL_DISK replicas of the holders' SSD copies)."""
    exist = me.batch_is_exist(keys)
    return [
        k
        for k, e in zip(keys, exist, strict=True)
        if e == 1 and not any(r.is_memory_replica() for r in me.get_replica_desc(k))
    ]


def readable_with_bytes(holder: Client, keys: list[str]) -> list[str]:
    """Keys the holder reads with the bytes written (an SSD copy is read by its owner)."""
    want = {k: hashlib.sha256(value(int(k[1:]), SIZE)).hexdigest() for k in keys}
    return [k for k in keys if holder.cmd("digest", key=k) == {"len": SIZE, "sha": want[k]}]


@pytest.mark.slow
def test_ssd_objects_survive_a_master_restart_then_a_holder_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", str(256 * MIB))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ssd = str(tmp_path / "ssd")
    masters = [Master("--rpc-port", str(port), "--client-ttl", "3")]
    holder: Client | None = None
    me: MooncakeDistributedStore | None = None
    load: Load | None = None
    try:
        holder = Client(masters[0].address, 4, 16, ssd=ssd)
        me = store(masters[0].address, 0)  # a pure client: everything lands on the holder
        keys = [f"k{i}" for i in range(40)]
        for i, k in enumerate(keys):
            # a full segment frees space as its demotions to the SSD are confirmed
            def put(k: str = k, i: int = i) -> bool:
                got = holder.cmd("put", key=k, seed=i, size=SIZE, preferred=[holder.hostname])
                return bool(got["rc"] == 0)

            wait_until(put, f"room for {k}")
        wait_until(lambda: len(on_ssd(me, keys)) >= 20, "eviction to demote objects to the SSD")
        time.sleep(0.5)  # let demotions in flight settle
        before = on_ssd(me, keys)
        assert readable_with_bytes(holder, before) == before
        load = Load(masters[0].address)
        load.start()

        # 1. the master dies and comes back empty: the holder re-announces its SSD objects
        masters[0].proc.kill()
        masters[0].proc.wait()
        masters.append(Master("--rpc-port", str(port), "--client-ttl", "3"))
        wait_until(
            lambda: len(readable_with_bytes(holder, before)) == len(before),
            "the SSD objects to be re-announced to the new master",
        )

        # 2. the holder dies and comes back on the same directory, before its old instance
        # expired at the master: its recovered objects are re-adopted, not dropped
        holder.kill()
        holder.stop()  # closes its pipes
        holder = Client(masters[1].address, 4, 16, ssd=ssd)
        wait_until(
            lambda: len(readable_with_bytes(holder, before)) == len(before),
            "the restarted holder's SSD objects to be readable",
        )
        time.sleep(4)  # past the old instance's TTL: its expiry takes nothing with it
        assert readable_with_bytes(holder, before) == before
        assert load.ops > 0 and load.wrong == 0
    finally:
        if load is not None:
            load.close()
        if me is not None:
            me.close()
        if holder is not None:
            holder.stop()
        for m in masters:
            m.stop()
