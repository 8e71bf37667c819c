"""``mc_store_rest_server`` (``mooncake.mooncake_store_service``) against a real master: the
service in its own process on a free port, real HTTP requests, its answers to bad requests, the
prefill/decode switch over a real shared-memory file, and its exit on SIGTERM. Also the
bounds of the HTTP server under it (:mod:`mooncake._restserver`), in-process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake._restserver import Request, Response, RestServer
from mooncake.mooncake_store_service import MooncakeStoreService, sync_main
from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_procs import ROOT, STARTUP_S, Master

MIB = 1 << 20
_READY = re.compile(r"REST API started on http://([\d.]+):(\d+)")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


class Service:
    """``python -m mooncake.mooncake_store_service --port 0`` for ``master``; its log in a file."""

    def __init__(self, master: str, tmp: Path, *extra: str, from_env: bool = False) -> None:
        """``from_env``: configured by ``MOONCAKE_*`` variables instead of ``--config``."""
        env = _env()
        for k in list(env):
            if k.startswith("MOONCAKE_"):
                del env[k]
        cfg = tmp / "mooncake.json"
        cfg.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        self.log = tmp / f"service-{uuid.uuid4().hex[:8]}.log"
        cmd = [
            sys.executable,
            "-m",
            "mooncake.mooncake_store_service",
            "--port",
            "0",
            *extra,
        ]
        if from_env:  # as the Kubernetes guides upstream run it
            env["MOONCAKE_MASTER"] = master
            env["MOONCAKE_LOCAL_HOSTNAME"] = "127.0.0.1"
            env["MOONCAKE_TE_META_DATA_SERVER"] = "P2PHANDSHAKE"
            env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = "32mb"
            env["MOONCAKE_LOCAL_BUFFER_SIZE"] = str(16 * MIB)
        else:
            cmd += ["--config", str(cfg), "-Dglobal_segment_size=32mb", "-Dlocal_buffer_size=16mb"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_S
        while True:
            m = _READY.search(self.log.read_text(errors="replace"))
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"service did not come up:\n{self.log.read_text()}")
            time.sleep(0.1)
        self.http = httpx.Client(base_url=f"http://{self.host}:{self.port}", timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        if hasattr(self, "http"):
            self.http.close()
        self.kill()


@pytest.fixture
def master() -> Iterator[str]:
    m = Master()
    try:
        yield m.address
    finally:
        m.stop()


@pytest.fixture
def service(master: str, tmp_path: Path) -> Iterator[Service]:
    s = Service(master, tmp_path)
    try:
        yield s
    finally:
        s.close()


def _other_client(master: str) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master)
    assert rc == 0
    return store


def test_put_get_exist_remove_over_http(service: Service, master: str) -> None:
    h = service.http
    assert h.get("/api/exist/k1").json() == {"exists": False}
    r = h.get("/api/get/k1")
    assert (r.status_code, r.json()) == (404, {"error": "Key not found"})

    # (removals first: a read or an exist check leases an object for a few seconds, and a
    # leased object is not removed without force, as published)
    for key in ("a", "b", "gone"):
        r = h.put("/api/put", json={"key": key, "value": key * 10})
        assert (r.status_code, r.json()) == (200, {"status": "success"})
    r = h.delete("/api/remove/gone")
    assert (r.status_code, r.json()) == (200, {"status": "success"})
    assert h.get("/api/exist/gone").json() == {"exists": False}
    r = h.delete("/api/remove/gone")  # already gone: the published 500, with the code
    assert r.status_code == 500 and r.json()["error"] == "Remove operation failed"
    assert r.json()["ret"] < 0
    r = h.delete("/api/remove_all")
    assert (r.status_code, r.json()) == (200, {"status": "success removed 2 keys"})
    assert h.get("/api/exist/a").json() == {"exists": False}

    r = h.put("/api/put", json={"key": "k1", "value": "hello wörld"})
    assert (r.status_code, r.json()) == (200, {"status": "success"})
    assert h.get("/api/exist/k1").json() == {"exists": True}
    r = h.get("/api/get/k1")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.content == "hello wörld".encode()

    # the objects are in the store, not in the service: another client reads and writes them
    other = _other_client(master)
    try:
        assert other.get("k1") == "hello wörld".encode()
        assert other.put("k/2 x", b"x" * 1000) == 0
        r = h.get("/api/get/k%2F2%20x")  # a key that is not one path segment, percent-encoded
        assert r.content == b"x" * 1000
        assert other.is_exist("a") == 0
    finally:
        other.close()


def test_bad_requests_are_4xx_naming_what_is_wrong(service: Service) -> None:
    h = service.http
    r = h.put("/api/put", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("Malformed JSON body")
    r = h.put("/api/put", json=["k", "v"])
    assert (r.status_code, r.json()) == (400, {"error": "Request body must be a JSON object"})
    r = h.put("/api/put", json={"value": "v"})
    assert (r.status_code, r.json()) == (400, {"error": "Missing key or value"})
    r = h.put("/api/put", json={"key": "k", "value": 7})
    assert r.status_code == 400 and "must be strings" in r.json()["error"]
    r = h.post("/api/put", json={"key": "k", "value": "v"})
    assert r.status_code == 405 and "takes PUT, not POST" in r.json()["error"]
    r = h.get("/api/nothing")
    assert r.status_code == 404 and "/api/nothing" in r.json()["error"]
    r = h.post("/api/mount", json={"size": "1024"})
    assert r.status_code == 400 and "Invalid size" in r.json()["error"]
    r = h.post("/api/mount_shm", json={"name": "../etc/passwd", "size": 4096})
    assert r.status_code == 400 and "name or size" in r.json()["error"]
    r = h.post("/api/unmount_local_disk", json={"grace_period_seconds": 3601})
    assert r.status_code == 400 and "3600" in r.json()["error"]
    r = h.post("/api/reconfigure", json={"mode": "sideways"})
    assert r.status_code == 400 and "Invalid mode" in r.json()["error"]
    r = h.post("/api/unmount", json={"segment_ids": [1, 2]})
    assert r.status_code == 400 and "segment_ids" in r.json()["error"]
    assert h.get("/api/exist/k").json() == {"exists": False}  # still serving


def test_reconfigure_decode_mounts_a_shm_file_and_prefill_unmounts_it(
    service: Service, master: str
) -> None:
    name = f"mc-svc-test-{uuid.uuid4().hex[:12]}"
    path = Path("/dev/shm") / name
    with path.open("wb") as f:
        f.truncate(16 * MIB)
    other = _other_client(master)
    try:
        h = service.http
        r = h.post("/api/reconfigure", json={"mode": "decode", "path": str(path), "size": 16 * MIB})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["mode"] == "decode" and len(body["segment_ids"]) == 1
        first = body["segment_ids"]
        # remount, make before break: a new segment id replaces the old one
        r = h.post("/api/reconfigure", json={"mode": "decode", "path": str(path), "size": 8 * MIB})
        assert r.status_code == 200 and r.json()["segment_ids"] != first
        r = h.post("/api/reconfigure", json={"mode": "decode", "path": str(path) + "-missing"})
        assert r.status_code == 400 and "Missing path or size" in r.json()["error"]
        r = h.post(
            "/api/reconfigure", json={"mode": "decode", "path": str(path) + "-x", "size": 4096}
        )
        assert r.status_code == 500 and r.json()["mode"] == "decode"  # kept the segment
        assert "keeping previous decode segments" in r.json()["error"]
        r = h.post("/api/reconfigure", json={"mode": "prefill"})
        assert (r.status_code, r.json()) == (200, {"status": "success", "mode": "prefill"})

        r = h.post("/api/mount_shm", json={"name": "/" + name, "size": 16 * MIB})
        assert r.status_code == 200
        ids = r.json()["segment_ids"]
        r = h.post("/api/unmount_shm", json={"segment_ids": ids})
        assert (r.status_code, r.json()) == (200, {"status": "success"})
        r = h.post("/api/unmount_shm", json={"segment_ids": ids})  # not mounted any more
        assert r.status_code == 500 and r.json()["failed_segment_ids"] == ids

        r = h.post("/api/mount", json={"size": 1})
        assert r.status_code == 200 and r.json()["allocated_size"] == 16 * MIB
        ids = r.json()["segment_ids"]
        assert h.post("/api/unmount", json={"segment_ids": ids}).json() == {"status": "success"}
        assert other.put("after", b"y" * 4096) == 0  # the store is sound
        assert h.get("/api/get/after").content == b"y" * 4096
    finally:
        other.close()
        path.unlink()


def test_sigterm_closes_the_store_and_exits_0(master: str, tmp_path: Path) -> None:
    s = Service(master, tmp_path, from_env=True)
    try:
        assert s.http.put("/api/put", json={"key": "held", "value": "v" * 100}).is_success
        other = _other_client(master)
        try:
            assert other.is_exist("held") == 1
            os.kill(s.proc.pid, signal.SIGTERM)
            assert s.proc.wait(120) == 0
            log = s.log.read_text()
            assert "shutting down" in log and "Mooncake service stopped" in log
            # its segment was unmounted with it: the object it held is gone
            assert other.is_exist("held") == 0
        finally:
            other.close()
        with pytest.raises(httpx.ConnectError):
            s.http.get("/api/exist/held")
    finally:
        s.close()


def test_a_busy_port_is_one_line_and_exit_1(master: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master,
                "global_segment_size": "16mb",
                "local_buffer_size": "16mb",
            }
        )
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "mooncake.mooncake_store_service", "--config", str(cfg)]
        out = subprocess.run(
            [*cmd, "--port", str(port)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=STARTUP_S,
        )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("mc_store_rest_server: Failed to start HTTP service: cannot listen on")
    assert f"127.0.0.1:{port}" in last
    assert "Traceback" not in out.stderr and "Mooncake service stopped" in out.stderr


def test_startup_errors_are_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sync_main(["--config", str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "127.0.0.1:1",
            }
        )
    )
    assert sync_main(["--config", str(cfg), "-Dglobal_segment_size=lots"]) == 1
    err = capsys.readouterr().err
    assert "global_segment_size='lots'" in err


async def _until_idle(server: RestServer) -> None:
    while server.served:  # noqa: ASYNC110 (the server has no event for it: polled)
        await asyncio.sleep(0.01)


async def _echo_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"POST /echo/z HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    return await reader.readexactly(length)


def test_rest_server_bounds_and_routes() -> None:
    seen: list[dict[str, str]] = []

    async def echo(request: Request) -> Response:
        seen.append(request.match_info)
        return Response(body=await request.read())

    async def boom(request: Request) -> Response:
        raise RuntimeError("handler broke")

    async def run() -> None:
        server = RestServer(
            [("POST", "/echo/{key}", echo), ("GET", "/boom", boom)],
            max_body=1024,
            max_connections=2,
        )
        port = await server.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.post("/echo/a%2Fb%20c", content=b"x" * 1024)
                assert (r.status_code, r.content) == (200, b"x" * 1024)
                assert seen == [{"key": "a/b c"}]
                r = await c.post("/echo/k", content=b"x" * 1025)
                assert r.status_code == 413 and "exceeds 1024 bytes" in r.json()["error"]
                r = await c.get("/echo/k")
                assert r.status_code == 405 and "takes POST" in r.json()["error"]
                r = await c.get("/boom")
                assert r.status_code == 500 and r.json() == {"error": "RuntimeError: handler broke"}
                r = await c.post("/echo/", content=b"")
                assert r.status_code == 404
            # a request that is not HTTP: 400, then the connection ends
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 400") and b"bad request" in answer
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(_until_idle(server), 60)  # the server saw those closes
            # over the connection cap: answered 503, the held ones keep working
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for reader, writer in held:  # each served once: both are being served now
                assert await _echo_raw(reader, writer) == b"hi"
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.get("/boom")
                assert r.status_code == 503 and "2 connections" in r.json()["error"]
            assert await _echo_raw(*held[0]) == b"hi"
            for _, w in held:
                w.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_a_handler_that_raises_is_logged_and_answered_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store call that raises: the published ``"<OP> error: ..."`` log line and 500
    ``{"error": str(exception)}``; a returned answer passes through unchanged."""

    class Broken:
        def remove(self, key: str) -> int:
            raise RuntimeError(f"no store for {key}")

        def remove_all(self) -> int:
            return 3

    class Req:
        match_info = {"key": "k1"}

    svc = object.__new__(MooncakeStoreService)
    svc.store = Broken()
    with caplog.at_level("ERROR"):
        r = asyncio.run(svc.handle_remove(Req()))
    assert (r.status, json.loads(r.text)) == (500, {"error": "no store for k1"})
    logged = [m.getMessage() for m in caplog.records if m.name == "root"]
    assert logged == ["REMOVE error: no store for k1"]
    r = asyncio.run(svc.handle_remove_all(Req()))
    assert (r.status, json.loads(r.text)) == (200, {"status": "success removed 3 keys"})
