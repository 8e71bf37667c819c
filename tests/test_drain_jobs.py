"""Master-run drain jobs over the admin HTTP port, across real processes: a ``python -m mooncake
master`` with its admin port, store-client processes holding the data
(tests/helpers/store_client_driver.py) and the test process reading as a pure client."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, _env, _readline

MIB = 1 << 20
SIZE = 64 << 10


def call(port: int, path: str, method: str = "GET", doc: Any = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = None if doc is None else json.dumps(doc).encode()
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        out: dict[str, Any] = json.loads(resp.read())
        return resp.status, out
    finally:
        conn.close()


@pytest.fixture
def master() -> Iterator[tuple[str, int]]:
    """A master process: (rpc address, admin HTTP port)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        line = _readline(proc, 120)
        rpc = line.split("rpc=", 1)[1].split()[0]
        admin = int(line.split("metrics=", 1)[1].split()[0].rsplit(":", 1)[1])
        yield rpc, admin
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stdout:
            proc.stdout.close()


def reader(address: str) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", address) == 0
    return s


def holders(me: MooncakeDistributedStore, key: str) -> set[str]:
    return {
        r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for r in me.get_replica_desc(key)
        if r.is_memory_replica
    }


def segment_status(admin: int, name: str) -> str:
    status, doc = call(admin, f"/api/v1/segments/status?segment={name}")
    assert status == 200 and doc["success"] is True and doc["segment"] == name, doc
    return str(doc["status_name"])


def wait_job(admin: int, job_id: str, want: str, limit: float = 120.0) -> dict[str, Any]:
    end = time.monotonic() + limit
    while True:
        status, doc = call(admin, f"/api/v1/drain_jobs/query?job_id={job_id}")
        assert status == 200 and doc["success"] is True, doc
        if doc["status_name"] == want:
            return doc
        assert doc["status_name"] in ("CREATED", "PLANNING", "RUNNING"), doc
        if time.monotonic() > end:
            pytest.fail(f"drain job never reached {want}: {doc}")
        time.sleep(0.05)


def test_a_drain_job_moves_everything_off_a_segment_and_reads_keep_working(
    master: tuple[str, int],
) -> None:
    rpc, admin = master
    a, b, c = Client(rpc, 16), Client(rpc, 16), Client(rpc, 16)
    me = reader(rpc)
    try:
        digests: dict[str, str] = {}
        for i in range(12):  # sole copies on a
            key = f"sole{i}"
            assert a.cmd("put", key=key, seed=i, size=SIZE, preferred=[a.hostname])["rc"] == 0
            digests[key] = hashlib.sha256(value(i, SIZE)).hexdigest()
        for i in range(4):  # one copy on a, one on c
            key = f"rep{i}"
            rc = a.cmd(
                "put",
                key=key,
                seed=50 + i,
                size=SIZE,
                replicas=2,
                preferred=[a.hostname, c.hostname],
            )
            assert rc["rc"] == 0
            digests[key] = hashlib.sha256(value(50 + i, SIZE)).hexdigest()
            assert holders(me, key) == {a.hostname, c.hostname}
        assert segment_status(admin, a.hostname) == "OK"
        req = {"segments": [a.hostname], "target_segments": [b.hostname], "max_concurrency": 2}
        status, doc = call(admin, "/api/v1/drain_jobs", "POST", req)
        assert status == 200 and doc["success"] is True and doc["status"] == "CREATED", doc
        job_id = str(uuid.UUID(doc["job_id"]))
        assert segment_status(admin, a.hostname) in ("DRAINING", "DRAINED")
        # nothing new lands on a draining segment, even where the writer prefers it
        assert a.cmd("put", key="late", seed=99, size=SIZE, preferred=[a.hostname])["rc"] == 0
        digests["late"] = hashlib.sha256(value(99, SIZE)).hexdigest()
        assert a.hostname not in holders(me, "late")

        final = wait_job(admin, job_id, "SUCCEEDED")
        assert final["job_id"] == job_id and final["type_name"] == "DRAIN"
        assert final["segments"] == [a.hostname] and final["active_units"] == 0
        assert final["succeeded_units"] == 16 and final["failed_units"] == 0
        assert final["migrated_bytes"] == 16 * SIZE
        assert final["last_updated_at_ms_epoch"] >= final["created_at_ms_epoch"] > 0
        assert segment_status(admin, a.hostname) == "DRAINED"
        for key, digest in digests.items():
            assert hashlib.sha256(me.get(key)).hexdigest() == digest, key
            assert a.hostname not in holders(me, key), key
        for i in range(12):  # the sole copies went to the named target only
            assert holders(me, f"sole{i}") == {b.hostname}
        for i in range(4):  # the replicated ones keep two copies, the new one on the target
            assert holders(me, f"rep{i}") == {b.hostname, c.hostname}
        a.stop()  # the drained holder leaves: nothing is lost
        for key, digest in digests.items():
            assert hashlib.sha256(me.get(key)).hexdigest() == digest, key
        status, doc = call(admin, f"/api/v1/segments/status?segment={a.hostname}")
        assert status == 404 and doc["error_code"] == int(ErrorCode.SEGMENT_NOT_FOUND)
    finally:
        me.close()
        for x in (a, b, c):
            x.stop()


def test_a_blocked_drain_job_is_cancelled_and_its_segment_takes_writes_again(
    master: tuple[str, int],
) -> None:
    rpc, admin = master
    a, b = Client(rpc, 16), Client(rpc, 1)  # b is too small for a's objects
    me = reader(rpc)
    big = 2 * MIB
    try:
        for i in range(2):
            assert a.cmd("put", key=f"big{i}", seed=i, size=big, preferred=[a.hostname])["rc"] == 0
        req = {"segments": [a.hostname], "target_segments": [b.hostname], "max_concurrency": 1}
        status, doc = call(admin, "/api/v1/drain_jobs", "POST", req)
        assert status == 200, doc
        job_id = doc["job_id"]
        running = wait_job(admin, job_id, "RUNNING")
        assert running["blocked_units"] == 2 and running["active_units"] == 0
        assert running["succeeded_units"] == 0 and running["message"] == "Drain job running"
        assert segment_status(admin, a.hostname) == "DRAINING"
        # a second job on a draining segment is refused as published (409)
        status, doc = call(admin, "/api/v1/drain_jobs", "POST", req)
        assert status == 409 and doc["error_code"] == int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)

        status, doc = call(admin, f"/api/v1/drain_jobs/cancel?job_id={job_id}", "POST")
        assert status == 200 and doc == {
            "success": True,
            "job_id": job_id,
            "status": "CANCELED",
            "error_code": 0,
            "error_message": "",
        }
        assert wait_job(admin, job_id, "CANCELED")["message"] == "Drain job canceled"
        assert segment_status(admin, a.hostname) == "OK"
        status, doc = call(admin, f"/api/v1/drain_jobs/cancel?job_id={job_id}", "POST")
        assert status == 409 and doc["error_code"] == int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
        for i in range(2):  # nothing was lost, and a takes allocations again
            assert me.get(f"big{i}") == value(i, big)
            assert holders(me, f"big{i}") == {a.hostname}
        assert a.cmd("put", key="again", seed=7, size=SIZE, preferred=[a.hostname])["rc"] == 0
        assert holders(me, "again") == {a.hostname}
    finally:
        me.close()
        for x in (a, b):
            x.stop()


def test_bad_drain_requests_get_the_published_errors(master: tuple[str, int]) -> None:
    rpc, admin = master
    a, b = Client(rpc, 4), Client(rpc, 4)
    try:
        seg, other = a.hostname, b.hostname
        cases: list[tuple[dict[str, Any], int, ErrorCode]] = [
            ({"segments": [seg, seg]}, 400, ErrorCode.INVALID_PARAMS),
            ({"segments": [seg], "target_segments": [seg]}, 400, ErrorCode.INVALID_PARAMS),
            ({"segments": ["10.0.0.9:1"]}, 404, ErrorCode.SEGMENT_NOT_FOUND),
            (
                {"segments": [seg], "target_segments": ["10.0.0.9:1"]},
                404,
                ErrorCode.SEGMENT_NOT_FOUND,
            ),
            ({"segments": [seg], "max_concurrency": -1}, 400, ErrorCode.INVALID_PARAMS),
            ({"segments": [seg], "target_segments": "x"}, 400, ErrorCode.INVALID_PARAMS),
        ]
        for req, want_status, want_code in cases:
            status, doc = call(admin, "/api/v1/drain_jobs", "POST", req)
            assert (status, doc["success"], doc["error_code"]) == (
                want_status,
                False,
                int(want_code),
            ), req
            assert doc["error_message"], req
        assert segment_status(admin, seg) == "OK"  # a refused request marks nothing
        unknown = uuid.uuid4()
        for path, method in (
            (f"/api/v1/drain_jobs/query?job_id={unknown}", "GET"),
            (f"/api/v1/drain_jobs/cancel?job_id={unknown}", "POST"),
        ):
            status, doc = call(admin, path, method)
            assert status == 404 and doc["error_code"] == int(ErrorCode.JOB_NOT_FOUND), doc
        # an empty segment drains at once; a target that is draining is refused
        status, doc = call(admin, "/api/v1/drain_jobs", "POST", {"segments": [other]})
        assert status == 200, doc
        assert wait_job(admin, doc["job_id"], "SUCCEEDED")["succeeded_units"] == 0
        assert segment_status(admin, other) == "DRAINED"
        req = {"segments": [seg], "target_segments": [other]}
        status, doc = call(admin, "/api/v1/drain_jobs", "POST", req)
        assert status == 409 and doc["error_code"] == int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
    finally:
        for x in (a, b):
            x.stop()


def test_the_jobs_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process (a master server object, no ports): finished jobs are forgotten oldest
    first to make room; when every kept job is still running a new one is refused."""
    import anyio

    from mooncake._core.store_types import ReplicateConfig, Segment
    from mooncake._store import drain_jobs
    from mooncake._store.master import MasterServer, MasterServerConfig
    from mooncake.errors import JobNotFoundError, UnavailableError

    monkeypatch.setattr(drain_jobs, "MAX_JOBS", 2)

    async def go() -> None:
        server = MasterServer(MasterServerConfig())
        state, now = server.state, server.now()
        for i in range(5):
            seg = Segment(id=f"s{i}", name=f"127.0.0.1:{2000 + i}", base=1 << 30, size=MIB)
            state.mount_segment(f"c{i}", seg, now)
        jobs = server.drain_jobs
        done = [jobs.create(server, [f"127.0.0.1:{2000 + i}"], [], 1) for i in range(2)]
        assert [j.status for j in done] == [drain_jobs.SUCCEEDED] * 2  # empty: drained at once
        third = jobs.create(server, ["127.0.0.1:2002"], [], 1)
        with pytest.raises(JobNotFoundError):
            jobs.query(done[0].id)  # the oldest finished one made room
        assert set(jobs.jobs) == {done[1].id, third.id}
        # a sole copy under its move (nobody runs the task here) keeps its job running
        state.put_start("c3", "k", 4096, ReplicateConfig(preferred_segment="127.0.0.1:2003"), now)
        state.put_end("c3", "k", now)
        state.settle()
        running = jobs.create(server, ["127.0.0.1:2003"], ["127.0.0.1:2004"], 1)
        assert running.status == drain_jobs.RUNNING and running.active_units == 1
        assert set(jobs.jobs) == {third.id, running.id}
        monkeypatch.setattr(drain_jobs, "MAX_JOBS", 1)
        with pytest.raises(UnavailableError, match="1 drain jobs are running"):
            jobs.create(server, ["127.0.0.1:2004"], [], 1)
        assert set(jobs.jobs) == {running.id}  # the finished one went, the running one stays
        assert state.segment_draining("127.0.0.1:2004") is False  # the refusal marked nothing

    anyio.run(go)


@pytest.mark.etcd
@pytest.mark.slow
def test_a_drain_job_on_a_replicated_master_survives_failover(tmp_path: Any) -> None:
    """On an HA pair: a standby refuses drain jobs (409, -1011); the leader's job logs its
    steps, so after the leader is SIGKILLed the new leader has the segment draining and the
    moved objects where the job put them."""
    from tests import services
    from tests.helpers.ha_procs import HaMaster, wait_leader

    with services.etcd_cluster(1) as etcd:
        ms = [HaMaster(etcd.conn, cluster="dj", log=tmp_path / "m0.log")]
        wait_leader(ms)
        ms.append(HaMaster(etcd.conn, cluster="dj", log=tmp_path / "m1.log"))
        holders_: list[Client] = []
        me = None
        try:
            leader = wait_leader(ms)
            standby = next(m for m in ms if m is not leader)
            port = int(leader.metrics.rsplit(":", 1)[1])
            a, b = Client(leader.address, 16), Client(leader.address, 16)
            holders_ += [a, b]
            for i in range(6):
                assert (
                    a.cmd("put", key=f"k{i}", seed=i, size=SIZE, preferred=[a.hostname])["rc"] == 0
                )
            req = {"segments": [a.hostname]}
            end = time.monotonic() + 30  # the standby knows the segment once it applied it
            while True:
                status, doc = call(
                    int(standby.metrics.rsplit(":", 1)[1]), "/api/v1/drain_jobs", "POST", req
                )
                if status == 409 or time.monotonic() > end:
                    break
                time.sleep(0.1)
            assert status == 409 and doc["error_code"] == int(ErrorCode.UNAVAILABLE_IN_CURRENT_MODE)
            status, doc = call(port, "/api/v1/drain_jobs", "POST", req)
            assert status == 200, doc
            done = wait_job(port, doc["job_id"], "SUCCEEDED")
            assert done["succeeded_units"] == 6
            target = leader.ha()["applied_seq"]  # the job's steps reach the standby
            end = time.monotonic() + 30
            while standby.ha()["applied_seq"] < target and time.monotonic() < end:
                time.sleep(0.05)
            st = standby.ha()
            assert st["applied_seq"] >= target and st["apply_errors"] == 0, st
            leader.signal(signal.SIGKILL)
            new = wait_leader([standby], timeout=30)
            me = reader(new.address)
            for i in range(6):
                assert me.get(f"k{i}") == value(i, SIZE)
                assert holders(me, f"k{i}") == {b.hostname}
            new_port = int(new.metrics.rsplit(":", 1)[1])
            assert segment_status(new_port, a.hostname) == "DRAINED"
        finally:
            if me is not None:
                me.close()
            for c in holders_:
                c.kill()
                c.stop()
            for m in ms:
                m.stop()
