"""Graceful drain across real processes: SIGTERM on a holder drains it and exits 0; a rolling
restart of three holders under reads (replicas = 2) fails no get of a replicated key.

Every process is real: ``python -m mooncake master``, holder processes running the sync facade
(tests/helpers/store_client_driver.py, whose SIGTERM is the facade's drain handler), and the
test process as a pure client reading all the time.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import ROOT, Client, Master, _env, _readline

MIB = 1 << 20
SIZE = 64 << 10


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master("--client-ttl", "5")
    try:
        yield m
    finally:
        m.stop()


def reader(address: str) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", address)
    assert rc == 0
    return s


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def wait_until(pred, what: str, limit: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def sigterm(c: Client) -> int:
    os.kill(c.proc.pid, signal.SIGTERM)
    try:
        return c.proc.wait(60)
    except subprocess.TimeoutExpired:
        c.kill()
        pytest.fail("a holder did not exit after SIGTERM")


def test_sigterm_moves_sole_copies_and_releases_replicated_ones(master: Master) -> None:
    a, b = Client(master.address, 16), Client(master.address, 16)
    me = reader(master.address)
    try:
        digests: dict[str, str] = {}
        for i in range(8):  # sole copies on a
            key = f"sole{i}"
            assert a.cmd("put", key=key, seed=i, size=SIZE, preferred=[a.hostname])["rc"] == 0
            digests[key] = sha(value(i, SIZE))
        for i in range(8):  # one copy on a, one on b
            key = f"rep{i}"
            assert a.cmd("put", key=key, seed=100 + i, size=SIZE, replicas=2)["rc"] == 0
            digests[key] = sha(value(100 + i, SIZE))
        for key in digests:
            names = {
                r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for r in me.get_replica_desc(key)
            }
            assert a.hostname in names
        assert sigterm(a) == 0
        for key, digest in digests.items():  # every object survived on b
            assert sha(me.get(key)) == digest, key
            names = {
                r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for r in me.get_replica_desc(key)
            }
            assert names == {b.hostname}
    finally:
        me.close()
        for c in (a, b):
            c.stop()


def test_the_mooncake_client_process_drains_on_sigterm(master: Master) -> None:
    holder = Client(master.address, 16)
    me = reader(master.address)
    port = 20000 + os.getpid() % 20000
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake._cli.real_client",
            "--host=127.0.0.1",
            f"--port={port}",
            "--metadata_server=P2PHANDSHAKE",
            f"--master_server_address={master.address}",
            "--global_segment_size=16MB",
            "--drain_timeout=5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        line = _readline(proc, 120)
        name = line.split("segment ", 1)[1].split()[0]
        for i in range(6):
            assert holder.cmd("put", key=f"m{i}", seed=i, size=SIZE, preferred=[name])["rc"] == 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        for i in range(6):
            assert sha(me.get(f"m{i}")) == sha(value(i, SIZE))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        me.close()
        holder.stop()


def test_rolling_restart_of_three_holders_fails_no_get(master: Master) -> None:
    holders = [Client(master.address, 16) for _ in range(3)]
    me = reader(master.address)
    keys = {f"r{i}": sha(value(i, SIZE)) for i in range(24)}
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    for i, key in enumerate(keys):
        assert me.put(key, value(i, SIZE), cfg) == 0
    stop = threading.Event()
    failures: list[str] = []
    gets = [0]

    def read_all() -> None:
        while not stop.is_set():
            for key, digest in keys.items():
                got = me.get(key)
                gets[0] += 1
                if sha(got) != digest:
                    failures.append(key)

    def replicated() -> bool:
        return all(len(me.get_replica_desc(k)) == 2 for k in keys)

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    try:
        for i in range(3):
            assert sigterm(holders[i]) == 0
            holders[i].stop()
            holders[i] = Client(master.address, 16)
            wait_until(replicated, "every key back at 2 replicas")
        wait_until(lambda: gets[0] > 3 * len(keys), "the reader to have read")
    finally:
        stop.set()
        t.join(60)
        me.close()
        for c in holders:
            c.stop()
    assert failures == []


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_async_client_drains_on_sigterm(master: Master, backend: str) -> None:
    me = reader(master.address)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/helpers/async_holder.py"), master.address, backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    other = Client(master.address, 16)
    try:
        name = json.loads(_readline(proc, 120))["hostname"]
        for i in range(4):
            assert other.cmd("put", key=f"a{i}", seed=i, size=SIZE, preferred=[name])["rc"] == 0
        os.kill(proc.pid, signal.SIGTERM)
        report = json.loads(_readline(proc, 60))
        assert report == {"settled": True, "moves": 4}
        assert proc.wait(60) == 0
        for i in range(4):
            assert sha(me.get(f"a{i}")) == sha(value(i, SIZE))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        me.close()
        other.stop()
