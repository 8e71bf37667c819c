"""HTTP endpoints in the published wire shapes: the client-local server
(``enable_client_http_server``), the master's drain routes and the metadata server's
``/health``."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_procs import _env, _readline
from tests.services import free_port

MIB = 1 << 20


def _get(
    port: int, path: str, method: str = "GET", body: bytes | None = None
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


@pytest.fixture
def master() -> Iterator[tuple[str, int, int]]:
    """A master with its admin port and the HTTP metadata server: (rpc address, admin port,
    metadata port)."""
    meta = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake",
            "master",
            "--rpc-port",
            "0",
            "--metrics-port",
            "0",
            "--enable-http-metadata-server",
            "--http-metadata-server-port",
            str(meta),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        line = _readline(proc, 120)
        rpc = line.split("rpc=", 1)[1].split()[0]
        admin = int(line.split("metrics=", 1)[1].split()[0].rsplit(":", 1)[1])
        yield rpc, admin, meta
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


def _setup(rpc: str, **kw: object) -> tuple[MooncakeDistributedStore, int]:
    s = MooncakeDistributedStore()
    rc = s.setup(
        local_hostname="127.0.0.1",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=16 * MIB,
        local_buffer_size=16 * MIB,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=rpc,
        **kw,
    )
    return s, rc


def test_client_http_server_serves_health_and_metrics(master: tuple[str, int, int]) -> None:
    rpc, _, _ = master
    port = free_port()
    s, rc = _setup(rpc, enable_client_http_server=True, client_http_port=port)
    assert rc == 0
    try:
        assert s.put("k", b"v" * 100) == 0 and s.get("k") == b"v" * 100
        status, ctype, body = _get(port, "/health")
        assert (status, ctype) == (200, "application/json")
        assert body == b'{"status":"healthy","code":0}'
        status, ctype, body = _get(port, "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert b"mooncake_" in body
        status, _, summary = _get(port, "/metrics/summary")
        assert status == 200
        lines = summary.decode().strip().splitlines()
        assert lines and all(ln.startswith("mooncake_") for ln in lines)
        assert all(float(ln.rsplit(" ", 1)[1]) >= 0 for ln in lines)
        assert _get(port, "/nope")[0] == 404
        assert _get(port, "/health", "POST", b"{}")[0] == 405
    finally:
        assert s.close() == 0
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # closed with the client


def test_client_http_port_is_checked_and_a_busy_port_is_survived(
    master: tuple[str, int, int],
) -> None:
    rpc, _, _ = master
    for bad in (0, -1, 70000):
        s, rc = _setup(rpc, enable_client_http_server=True, client_http_port=bad)
        assert rc == int(ErrorCode.INVALID_PARAMS), bad
        s.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        s, rc = _setup(rpc, enable_client_http_server=True, client_http_port=busy.getsockname()[1])
        try:
            assert rc == 0 and s.put("k2", b"x") == 0  # as published: continues without HTTP
        finally:
            s.close()
    s, rc = _setup(rpc, client_http_port=free_port())  # off unless enabled
    assert rc == 0 and s._http is None
    s.close()


def test_master_drain_routes_speak_the_published_shapes(master: tuple[str, int, int]) -> None:
    rpc, admin, _ = master
    s, rc = _setup(rpc)
    assert rc == 0
    try:
        seg = s.get_hostname()
        assert _get(admin, "/health")[0] == 200
        status, ctype, body = _get(admin, f"/api/v1/segments/status?segment={seg}")
        assert status == 200 and ctype.startswith("application/json")
        assert json.loads(body) == {
            "success": True,
            "segment": seg,
            "status": 1,
            "status_name": "OK",
            "error_code": 0,
            "error_message": "",
        }
        status, _, body = _get(admin, "/api/v1/segments/status?segment=10.0.0.9:1")
        assert status == 404 and json.loads(body)["error_code"] == int(ErrorCode.SEGMENT_NOT_FOUND)
        status, _, body = _get(admin, "/api/v1/segments/status")
        assert status == 400 and json.loads(body) == {
            "success": False,
            "error_code": -600,
            "error_message": "Missing segment query parameter",
        }
        # a malformed drain request is refused as published ...
        for bad in (
            b"not json",
            b"[]",
            b'{"segments": "a"}',
            b'{"segments": []}',
            b'{"segments": ["a"], "max_concurrency": 0}',
        ):
            status, _, body = _get(admin, "/api/v1/drain_jobs", "POST", bad)
            assert status == 400 and json.loads(body)["success"] is False, bad
        for path in ("/api/v1/drain_jobs/query", "/api/v1/drain_jobs/query?job_id=nope"):
            status, _, body = _get(admin, path)
            assert (
                status == 400 and json.loads(body)["error_message"] == "Missing or invalid job_id"
            )
        assert _get(admin, "/api/v1/drain_jobs")[0] == 405  # GET on the POST route
        # ... an unknown job is 404 JOB_NOT_FOUND (the drain jobs: tests/test_drain_jobs.py)
        job = uuid.uuid4()
        status, _, body = _get(admin, f"/api/v1/drain_jobs/cancel?job_id={job}", "POST", b"")
        assert status == 404 and json.loads(body)["error_code"] == int(ErrorCode.JOB_NOT_FOUND)
        assert _get(admin, "/metrics")[0] == 200  # the other admin routes are untouched
    finally:
        s.close()


def test_metadata_server_answers_health(master: tuple[str, int, int]) -> None:
    _, _, meta = master
    assert _get(meta, "/health")[:1] == (200,)
    assert _get(meta, "/health")[2] == b"OK"
    assert _get(meta, "/metadata")[0] == 400  # still needs a key
