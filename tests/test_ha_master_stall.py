"""A master stopped (SIGSTOP) for three client TTLs while a client writes, then resumed, erases
nothing: no key removed, no segment unmounted, no client expired, and the client carries on.
Plain and replicated masters (a replicated one loses its lease meanwhile and leads again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import services
from tests.helpers.ha_procs import HaMaster, wait_leader
from tests.helpers.store_procs import Client, _env, _readline

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

TTL = 2
CLUSTER = "stall"


class PlainMaster:
    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0"]
        cmd += ["--metrics-port", "0", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
        )
        line = _readline(self.proc, 30)
        self.address = line.split("rpc=", 1)[1].split()[0]
        self.metrics = line.split("metrics=", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        if self.proc.stdout:
            self.proc.stdout.close()


def _status(metrics: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{metrics}/status", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@pytest.fixture
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as cluster:
        yield cluster


@pytest.mark.parametrize("kind", ["plain", "ha-etcd", "ha-replica"])
def test_a_master_stopped_for_three_client_ttls_erases_nothing(
    etcd1: services.EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    masters: list[Any] = []
    client: Client | None = None
    try:
        if kind == "plain":
            m: Any = PlainMaster("--client-ttl", str(TTL))
            masters.append(m)
            address = m.address
        else:
            ack = kind.split("-", 1)[1]
            flags = ("--client-ttl", str(TTL), "--ha-ack-mode", ack)
            m = HaMaster(etcd1.conn, *flags, cluster=CLUSTER, log=tmp_path / "m0.log")
            masters.append(m)
            wait_leader([m])
            address = etcd1.conn
        client = Client(address, 32)
        acked: list[str] = []
        failed: list[tuple[str, Any]] = []
        stop = threading.Event()
        done = threading.Condition()

        def writer() -> None:
            assert client is not None
            i = 0
            while not stop.is_set():
                key = f"k{i}"
                r = client.cmd("put", key=key, seed=i, size=4096)
                with done:
                    if r.get("rc") == 0:
                        acked.append(key)
                    else:
                        failed.append((key, r))
                    done.notify_all()
                i += 1

        def wait_acked(n: int) -> None:
            with done:
                assert done.wait_for(lambda: len(acked) >= n or bool(failed), timeout=120)
            assert not failed, failed

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            wait_acked(20)
            os.kill(m.proc.pid, signal.SIGSTOP)
            time.sleep(3 * TTL)  # the stimulus: three client TTLs without the master running
            at_resume = len(acked)
            os.kill(m.proc.pid, signal.SIGCONT)
            wait_acked(at_resume + 20)  # the client carries on
        finally:
            stop.set()
            t.join(120)
        assert not t.is_alive()
        if kind != "plain":
            wait_leader([m])
        st = _status(m.metrics)
        assert st["counters"]["clients_expired"] == 0, st["counters"]
        assert st["clients"] == 1 and st["segments"] == 1, st
        assert st["objects"] == len(acked), (st["objects"], len(acked))
        for i, key in enumerate(acked[:: max(1, len(acked) // 10)]):
            assert client.cmd("exist", key=key)["rc"] == 1, (i, key)
    finally:
        if client is not None:
            client.stop()
        for m in masters:
            m.stop()
