"""Replica mode: standbys apply the leader's log from the replication stream, not etcd.

Real masters on a real etcd. While a standby's stream is up it applies the entries it holds
once the leader says etcd has them, and does not watch the etcd log (etcd then carries only
the three masters' watches of the view key); in ``etcd`` mode the standbys keep watching the
log. Either way, a SIGKILLed leader's successor serves every acknowledged object and the
remaining standby follows it.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import services
from tests.helpers.ha_procs import HaMaster, all_keys, mount, put, wait_leader

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as cluster:
        yield cluster


def _watchers(endpoint: str) -> int:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd reports no watcher gauge")


def _until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.mark.parametrize("ack", ["replica", "etcd"])
def test_standbys_apply_from_the_stream_and_a_successor_has_every_object(
    etcd1: services.EtcdCluster, tmp_path: Path, ack: str
) -> None:
    flags = ("--ha-ack-mode", ack)
    ms = [HaMaster(etcd1.conn, *flags, cluster=f"sa-{ack}", log=tmp_path / "m0.log")]
    try:
        leader = wait_leader(ms)
        for i in (1, 2):
            ms.append(HaMaster(etcd1.conn, *flags, cluster=f"sa-{ack}", log=tmp_path / f"m{i}.log"))
        standbys = ms[1:]
        if ack == "replica":
            _until(lambda: leader.ha()["in_sync"] == 2, "both standbys in sync")
        mount(leader.address, mib=64)
        keys = [f"k{i}" for i in range(40)]
        for k in keys:
            assert put(leader.address, k), k
        top = leader.ha()["applied_seq"]
        _until(
            lambda: all(m.ha()["applied_seq"] >= top for m in standbys),
            f"standbys applied the leader's log to {top}",
        )
        endpoint = etcd1.members[0].endpoint
        if ack == "replica":
            # applied from memory, and the log is not watched: only the view-key watches (a
            # standby the loaded host leaves behind reads the entries it lacks from the log,
            # so not every entry need have come through the stream)
            assert all(m.ha()["stream_applied"] > 0 for m in standbys), [m.ha() for m in standbys]
            _until(lambda: _watchers(endpoint) == 3, "only the three view-key watches")
            _until(lambda: all(m.ha()["held"] == 0 for m in standbys), "nothing held unapplied")
        else:
            assert all(m.ha()["stream_applied"] == 0 for m in standbys)
            # the leader does not watch its own log; each standby watches the log and the view
            _until(lambda: _watchers(endpoint) == 5, "two log watches and three view watches")
        leader.signal(signal.SIGKILL)
        new = wait_leader(standbys, timeout=30)
        lost = sorted(set(keys) - all_keys(new.address))
        assert not lost, f"acknowledged objects lost: {lost}"
        assert put(new.address, "after-failover")
        other = next(m for m in standbys if m is not new)
        top = new.ha()["applied_seq"]
        _until(
            lambda: other.ha()["leader"] == new.address and other.ha()["applied_seq"] >= top,
            "the remaining standby follows the new leader",
        )
        assert other.ha()["apply_errors"] == 0 and new.ha()["apply_errors"] == 0
    finally:
        for m in ms:
            m.stop()
