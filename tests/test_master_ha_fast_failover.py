"""Fast failover with real masters on a real etcd: a standby revokes the lease of a leader whose
RPC port refuses connections (the process is gone) and leads long before that lease would have
expired; a stopped leader, or a dead one whose port another process took over, is deposed only
by its lease; with ``--ha-fast-failover false`` nobody revokes anything early.

Each test reads the view key's lease in etcd (``/v3/lease/timetolive``) and asserts on state
and ordering (who held the key while the lease still had TTL left), never on small durations.
"""

from __future__ import annotations

import base64
import json
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import services
from tests.helpers.ha_procs import HaMaster, all_keys, mount, put, wait_leader

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

CLUSTER = "ff"
VIEW = f"mooncake-store/{CLUSTER}/master_view"


@pytest.fixture
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as c:
        yield c


def _post(cluster: services.EtcdCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    ep = cluster.members[0].endpoint
    req = urllib.request.Request(
        f"http://{ep}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _view(cluster: services.EtcdCluster) -> tuple[int, str, str] | None:
    """(create_revision, lease id, value) of the view key, or None when absent."""
    obj = _post(cluster, "/v3/kv/range", {"key": base64.b64encode(VIEW.encode()).decode()})
    kvs = obj.get("kvs") or []
    if not kvs:
        return None
    kv = kvs[0]
    return int(kv["create_revision"]), str(kv["lease"]), base64.b64decode(kv["value"]).decode()


def _ttl(cluster: services.EtcdCluster, lease: str) -> int:
    return int(_post(cluster, "/v3/lease/timetolive", {"ID": lease}).get("TTL", -1))


def _masters(conn: str, tmp: Path, *flags: str) -> list[HaMaster]:
    first = HaMaster(conn, *flags, cluster=CLUSTER, log=tmp / "m0.log")
    wait_leader([first])
    return [
        first,
        *(HaMaster(conn, *flags, cluster=CLUSTER, log=tmp / f"m{i}.log") for i in (1, 2)),
    ]


def _wait_following(standbys: list[HaMaster], leader: HaMaster) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(m.ha()["leader"] == leader.address for m in standbys):
            return
        time.sleep(0.1)
    raise AssertionError(f"standbys do not follow {leader.address}: {[m.ha() for m in standbys]}")


def _settled(ms: list[HaMaster]) -> tuple[HaMaster, list[HaMaster]]:
    """The leader of ``ms`` and the others, once every one of those follows it."""
    leader = wait_leader(ms)
    rest = [m for m in ms if m is not leader]
    _wait_following(rest, leader)
    return leader, rest


def _wait_new_term(cluster: services.EtcdCluster, old: int, budget: float) -> tuple[int, str, str]:
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        v = _view(cluster)
        if v is not None and v[0] != old:
            return v
        time.sleep(0.05)
    raise AssertionError(f"no new term within {budget} s (view {_view(cluster)})")


def test_killed_leader_is_replaced_before_its_long_lease_expires(
    etcd1: services.EtcdCluster, tmp_path: Path
) -> None:
    ms = _masters(etcd1.conn, tmp_path, "--ha-lease-ttl", "30")
    try:
        leader, rest = _settled(ms)
        mount(leader.address)
        assert put(leader.address, "before")
        view = _view(etcd1)
        assert view is not None and view[2] == leader.address
        term, lease, _ = view
        left = _ttl(etcd1, lease)
        assert left > 20  # a fresh 30 s lease (kept alive every 6 s)
        sampled = time.monotonic()
        leader.signal(signal.SIGKILL)
        leader.proc.wait(10)
        # the old lease still had `left` s to run: a new term well inside that is early
        new_view = _wait_new_term(etcd1, term, budget=left - 8)
        assert time.monotonic() - sampled < left  # ordering: the old lease had not run out
        new = wait_leader(rest, timeout=10)
        assert new_view[2] == new.address
        assert _ttl(etcd1, lease) == -1  # the dead leader's lease is gone (revoked)
        assert sum(m.ha()["early_revokes"] for m in rest) == 1
        assert "before" in all_keys(new.address)
        assert put(new.address, "after")
        # the other standby follows the new leader and never revokes its lease
        other = next(m for m in rest if m is not new)
        _wait_following([other], new)
        time.sleep(1.0)
        assert _view(etcd1) == new_view and new.ha()["role"] == "leader"
    finally:
        for m in ms:
            m.stop()


def test_stopped_leader_is_not_revoked_early(etcd1: services.EtcdCluster, tmp_path: Path) -> None:
    ms = _masters(etcd1.conn, tmp_path, "--ha-lease-ttl", "5")
    try:
        old, rest = _settled(ms)
        view = _view(etcd1)
        assert view is not None
        term, lease, _ = view
        old.signal(signal.SIGSTOP)  # its kernel still accepts connects (the backlog)
        left = _ttl(etcd1, lease)  # no keep-alive from here on: it only runs down
        sampled = time.monotonic()
        new_view = _wait_new_term(etcd1, term, budget=30)
        # not before the lease ran out (etcd's TTL is whole seconds: allow 1 s of rounding)
        assert time.monotonic() - sampled >= left - 1
        assert all(m.ha()["early_revokes"] == 0 for m in rest)
        new = wait_leader(rest, timeout=10)
        assert new_view[2] == new.address
        old.signal(signal.SIGCONT)  # steps down through the normal fence path
        deadline = time.monotonic() + 20
        while old.ha()["role"] != "standby" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert old.ha()["role"] == "standby"
        assert _view(etcd1) == new_view
    finally:
        for m in ms:
            m.stop()


def test_port_taken_over_by_another_process_is_not_revoked(
    etcd1: services.EtcdCluster, tmp_path: Path
) -> None:
    ms = _masters(etcd1.conn, tmp_path, "--ha-lease-ttl", "5")
    squatter: socket.socket | None = None
    try:
        old, rest = _settled(ms)
        view = _view(etcd1)
        assert view is not None
        term, _lease, _ = view
        host, port = old.address.rsplit(":", 1)
        old.signal(signal.SIGKILL)
        old.proc.wait(10)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen(64)  # someone else listens there now: connects are accepted
        new_view = _wait_new_term(etcd1, term, budget=30)
        assert all(m.ha()["early_revokes"] == 0 for m in rest)
        assert new_view[2] in {m.address for m in rest}
    finally:
        if squatter is not None:
            squatter.close()
        for m in ms:
            m.stop()


def test_fast_failover_off_leaves_a_dead_leader_to_its_lease(
    etcd1: services.EtcdCluster, tmp_path: Path
) -> None:
    ms = _masters(etcd1.conn, tmp_path, "--ha-lease-ttl", "30", "--ha-fast-failover", "false")
    try:
        leader, rest = _settled(ms)
        view = _view(etcd1)
        assert view is not None
        _term, lease, _ = view
        leader.signal(signal.SIGKILL)
        leader.proc.wait(10)
        # many times what fast failover needs (3 refusals 0.2 s apart): nothing happens
        time.sleep(5.0)
        assert _view(etcd1) == view
        assert _ttl(etcd1, lease) > 0
        assert all(m.ha()["early_revokes"] == 0 and not m.ha()["fast_failover"] for m in rest)
        assert all(m.ha()["role"] == "standby" for m in rest)
    finally:
        for m in ms:
            m.stop()


def test_live_leader_whose_lease_is_revoked_steps_down_through_the_fence(
    etcd1: services.EtcdCluster, tmp_path: Path
) -> None:
    # what a wrongly revoked lease would do (e.g. a firewall starting to reject with resets):
    # the same as an expired one, never two leaders acknowledging writes
    ms = _masters(etcd1.conn, tmp_path, "--ha-lease-ttl", "30")
    try:
        old, _ = _settled(ms)
        mount(old.address)
        assert put(old.address, "before")
        view = _view(etcd1)
        assert view is not None
        _post(etcd1, "/v3/lease/revoke", {"ID": view[1]})
        new_view = _wait_new_term(etcd1, view[0], budget=20)
        deadline = time.monotonic() + 20
        while old.ha()["role"] != "standby" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert old.ha()["role"] == "standby" and old.ha()["stepdowns"] >= 1
        new = wait_leader(ms, timeout=20)
        # a new term (the old master may win it after rebuilding: that is a new term too)
        assert new.ha()["term"] == new_view[0] != view[0]
        assert put(new.address, "after")
        assert "before" in all_keys(new.address)
        if new is not old:
            assert not put(old.address, "to-the-deposed")
            assert "to-the-deposed" not in all_keys(new.address)
    finally:
        for m in ms:
            m.stop()
