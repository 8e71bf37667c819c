"""The master server: real sockets, in-process (trio, MockClock) and as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import trio
import trio.testing

from mooncake._cli.master import parse_duration, parse_gflags
from mooncake._core import rpc
from mooncake._core.master import MasterConfig
from mooncake._core.store_types import ClientStatus, ReplicateConfig, Segment, TaskStatus
from mooncake._store.master import MasterServer, MasterServerConfig, serve_master
from mooncake.errors import (
    InvalidArgumentError,
    NotSupportedError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
)

ROOT = Path(__file__).resolve().parent.parent


class Client:
    """A minimal blocking-per-call RPC client for tests."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.dec = rpc.MessageDecoder()
        self.next_id = 1

    async def call(self, method: str, params: msgspec.Struct) -> Any:
        rid = self.next_id
        self.next_id += 1
        await self.stream.send(rpc.encode_request(rid, method, params))
        while True:
            msg = self.dec.next_message()
            if msg is not None:
                assert isinstance(msg, rpc.Response) and msg.id == rid
                return rpc.decode_result(method, msg)
            self.dec.feed(await self.stream.receive())


@asynccontextmanager
async def running_master(**state: Any) -> AsyncIterator[MasterServer]:
    cfg = MasterServerConfig(rpc_port=0, metrics_port=0, state=MasterConfig(seed=0, **state))
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield server
        tg.cancel_scope.cancel()


@asynccontextmanager
async def client(server: MasterServer) -> AsyncIterator[Client]:
    stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
    async with stream:
        yield Client(stream)


def seg(i: int, size: int = 1 << 20) -> Segment:
    return Segment(id=f"seg{i}", name=f"127.0.0.1:{2000 + i}", base=1 << 32, size=size)


def run_trio(fn: Any, *, mock: bool = True) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0) if mock else None
    trio.run(fn, clock=clock)


def test_put_get_remove_over_the_wire() -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as c:
            assert await c.call("ServiceReady", rpc.Empty()) == rpc.VERSION
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="a", segment=seg(0)))
            reps = await c.call("PutStart", rpc.PutStartParams(client_id="a", key="k", size=1000))
            assert len(reps) == 1 and reps[0].segment_name == seg(0).name
            await c.call("PutEnd", rpc.KeyClientParams(client_id="a", key="k"))
            got = await c.call("GetReplicaList", rpc.KeyParams(key="k"))
            assert got.replicas[0].addr == reps[0].addr and got.lease_ttl_ms == 10000
            with pytest.raises(ObjectHasLeaseError):
                await c.call("Remove", rpc.RemoveParams(key="k"))
            await c.call("Remove", rpc.RemoveParams(key="k", force=True))
            with pytest.raises(ObjectNotFoundError):
                await c.call("GetReplicaList", rpc.KeyParams(key="k"))
            items = await c.call(
                "BatchPutStart",
                rpc.BatchPutStartParams(client_id="a", keys=["x", "y"], sizes=[10, 0]),
            )
            assert [i.code for i in items] == [0, -600]
            assert server.requests["PutStart"] == 1 and server.failures["Remove"] == 1

    run_trio(main)


def test_pipelined_requests_answered_in_order() -> None:
    async def main() -> None:
        async with running_master() as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                frames = [
                    rpc.encode_request(i, "ExistKey", rpc.KeyParams(key=f"k{i}")) for i in range(50)
                ]
                await stream.send(b"".join(frames))
                dec = rpc.MessageDecoder()
                got: list[int] = []
                while len(got) < 50:
                    dec.feed(await stream.receive())
                    got.extend(m.id for m in dec)
                assert got == list(range(50))

    run_trio(main)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # length far over the bound
        b"\x00\x00\x00\x00",  # zero length
        b"\x00\x00\x00\x03\x93\x07\x07",  # a well-framed body that is no message
        rpc.HEADER.pack(3) + msgspec.msgpack.encode([1, 5, 0]),  # framed, wrong shape
    ],
)
def test_garbage_drops_that_connection_only(garbage: bytes) -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as good:
            await good.call("Ping", rpc.ClientParams(client_id="g"))
            bad = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with bad:
                await bad.send(garbage)
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    with anyio.fail_after(5):
                        while True:
                            await bad.receive()
            # the server and the other connection carry on
            assert (await good.call("Ping", rpc.ClientParams(client_id="g"))).client_status == (
                ClientStatus.OK
            )
            assert server.connections_dropped >= 1

    run_trio(main)


def test_unknown_method_and_bad_params_answered_connection_kept() -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as c:
            body = msgspec.msgpack.encode([0, 1, "Frobnicate", {}])
            await c.stream.send(rpc.HEADER.pack(len(body)) + body)
            body = msgspec.msgpack.encode([0, 2, "PutStart", {"key": 1}])
            await c.stream.send(rpc.HEADER.pack(len(body)) + body)
            msgs: list[rpc.Response] = []
            while len(msgs) < 2:
                c.dec.feed(await c.stream.receive())
                msgs.extend(m for m in c.dec if isinstance(m, rpc.Response))
            with pytest.raises(NotSupportedError):
                rpc.decode_result("Frobnicate", msgs[0])
            with pytest.raises(InvalidArgumentError):
                rpc.decode_result("PutStart", msgs[1])
            c.next_id = 3
            assert await c.call("ServiceReady", rpc.Empty()) == rpc.VERSION

    run_trio(main)


def test_truncated_frame_then_close_leaves_server_serving() -> None:
    async def main() -> None:
        async with running_master() as server:
            bad = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            frame = rpc.encode_request(1, "Ping", rpc.ClientParams(client_id="x"))
            await bad.send(frame[:-3])
            await bad.aclose()
            async with client(server) as c:
                assert await c.call("ServiceReady", rpc.Empty()) == rpc.VERSION

    run_trio(main)


def test_silent_client_expires_pinging_client_survives() -> None:
    """Liveness on the MockClock: B stops pinging; after client_ttl its segment and objects go."""

    async def main() -> None:
        async with (
            running_master(client_ttl=10.0) as server,
            client(server) as a,
            client(server) as b,
        ):
            await a.call("MountSegment", rpc.MountSegmentParams(client_id="A", segment=seg(0)))
            await b.call("MountSegment", rpc.MountSegmentParams(client_id="B", segment=seg(1)))
            cfg_b = ReplicateConfig(preferred_segments=[seg(1).name])
            await b.call(
                "PutStart", rpc.PutStartParams(client_id="B", key="kb", size=64, config=cfg_b)
            )
            await b.call("PutEnd", rpc.KeyClientParams(client_id="B", key="kb"))
            cfg_a = ReplicateConfig(preferred_segments=[seg(0).name])
            await a.call(
                "PutStart", rpc.PutStartParams(client_id="A", key="ka", size=64, config=cfg_a)
            )
            await a.call("PutEnd", rpc.KeyClientParams(client_id="A", key="ka"))
            t0 = anyio.current_time()
            for _ in range(8):  # 8 s of A pinging each second: B still within its TTL
                await anyio.sleep(1.0)
                await a.call("Ping", rpc.ClientParams(client_id="A"))
            assert await a.call("ExistKey", rpc.KeyParams(key="kb")) is True
            for _ in range(8):
                await anyio.sleep(1.0)
                await a.call("Ping", rpc.ClientParams(client_id="A"))
            assert anyio.current_time() - t0 >= 16
            assert await a.call("ExistKey", rpc.KeyParams(key="kb")) is False
            assert await a.call("ExistKey", rpc.KeyParams(key="ka")) is True
            segs = await a.call("GetAllSegments", rpc.Empty())
            assert [s.segment.id for s in segs] == ["seg0"]
            pong = await b.call("Ping", rpc.ClientParams(client_id="B"))
            assert pong.client_status == ClientStatus.NEED_REMOUNT
            await b.call(
                "ReMountSegment", rpc.ReMountSegmentParams(client_id="B", segments=[seg(1)])
            )
            assert len(await a.call("GetAllSegments", rpc.Empty())) == 2
            assert server.state.stats.clients_expired == 1

    run_trio(main)


def test_metrics_and_health() -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as c:
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="a", segment=seg(0)))
            await c.call("PutStart", rpc.PutStartParams(client_id="a", key="k", size=100))
            await c.call("PutEnd", rpc.KeyClientParams(client_id="a", key="k"))
            async with httpx.AsyncClient() as http:
                base = f"http://127.0.0.1:{server.metrics_port}"
                r = await http.get(f"{base}/metrics")
                assert r.status_code == 200
                assert "master_key_count 1.0" in r.text
                assert 'master_rpc_requests_total{method="PutStart"} 1.0' in r.text
                r = await http.get(f"{base}/health")
                assert r.status_code == 200 and r.text.strip() == "OK"
                r = await http.get(f"{base}/query_key", params={"key": "k"})
                assert r.json()["data"]["size"] == 100
                r = await http.get(f"{base}/query_key", params={"key": "nope"})
                assert r.status_code == 404 and r.json()["error_code"] == -704
                assert (await http.get(f"{base}/nope")).status_code == 404
                assert (await http.post(f"{base}/metrics", content=b"x")).status_code == 405
            # garbage on the HTTP port costs only that connection
            assert server.metrics_port is not None
            bad = await anyio.connect_tcp("127.0.0.1", server.metrics_port)
            async with bad:
                await bad.send(b"\x00\x01 not http at all\r\n\r\n")
                with anyio.fail_after(5):
                    try:
                        while await bad.receive():
                            pass
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{base}/health")).status_code == 200

    run_trio(main, mock=False)


def test_serves_under_asyncio_too() -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as c:
            assert await c.call("ServiceReady", rpc.Empty()) == rpc.VERSION

    anyio.run(main, backend="asyncio")


# -- CLI ---------------------------------------------------------------------------------------


def test_gflags_spellings() -> None:
    warnings: list[str] = []
    p = parse_gflags(
        [
            "--rpc_address=127.0.0.2",
            "--rpc_port",
            "6000",
            "-metrics_port=7000",
            "--enable_http_metadata_server=true",
            "--noallow_evict_soft_pinned_objects",
            "--default_kv_lease_ttl=5s",
            "--client_ttl=3",
            "--eviction_high_watermark_ratio=0.8",
            "--rpc_thread_num",
            "8",
            "--enable_ha=false",
            "--enable_oplog=false",
        ],
        warn=warnings.append,
    )
    s = p.server
    assert (s.rpc_address, s.rpc_port, s.metrics_port) == ("127.0.0.2", 6000, 7000)
    assert s.enable_http_metadata_server is True
    assert s.state.allow_evict_soft_pinned_objects is False
    assert s.state.default_kv_lease_ttl == 5.0 and s.state.client_ttl == 3.0
    assert s.state.eviction_high_watermark_ratio == 0.8
    assert len(warnings) == 2 and "rpc_thread_num" in warnings[0] and "enable_oplog" in warnings[1]
    assert s.ha is None  # --enable_ha=false is understood
    assert parse_gflags(["--rpc_port=0", "--port=1234"]).server.rpc_port == 1234
    with pytest.raises(InvalidArgumentError, match="eviction_ratio"):
        parse_gflags(["--eviction_ratio=2"])
    with pytest.raises(InvalidArgumentError, match="client_ttl"):
        parse_gflags(["--client_ttl=soon"])


def test_duration_parsing() -> None:
    assert parse_duration("10000", "ms") == 10.0
    assert parse_duration("30m", "ms") == 1800.0
    assert parse_duration("1.5h", "s") == 5400.0
    with pytest.raises(InvalidArgumentError):
        parse_duration("10 parsecs", "s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mooncake_master_subprocess_published_flags() -> None:
    """Started the way the anchor's store bench starts the published binary."""
    rpc_port, metrics_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake._cli.master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--max_threads=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert f"rpc=127.0.0.1:{rpc_port}" in line, line
        with socket.create_connection(("127.0.0.1", rpc_port), timeout=10) as s:
            s.sendall(rpc.encode_request(1, "Ping", rpc.ClientParams(client_id="p")))
            dec = rpc.MessageDecoder()
            msg = None
            while msg is None:
                dec.feed(s.recv(65536))
                msg = dec.next_message()
            assert isinstance(msg, rpc.Response)
            assert rpc.decode_result("Ping", msg).client_status == ClientStatus.NEED_REMOUNT
        r = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert "master_active_clients 1.0" in r.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert "max_threads is not supported" in err


def test_bad_flag_value_is_a_clear_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "mooncake._cli.master", "--eviction_ratio=7"],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2
    assert b"eviction_ratio" in r.stderr


def test_embedded_http_metadata_server() -> None:
    async def main() -> None:
        cfg = MasterServerConfig(
            rpc_port=0,
            metrics_port=0,
            enable_http_metadata_server=True,
            http_metadata_server_port=0,
        )
        async with anyio.create_task_group() as tg:
            server = await tg.start(serve_master, cfg)
            assert server.http_metadata_port
            url = f"http://127.0.0.1:{server.http_metadata_port}/metadata"
            async with httpx.AsyncClient() as http:
                r = await http.put(url, params={"key": "mooncake/ram/x"}, content=b'{"a": 1}')
                assert r.status_code == 200
                r = await http.get(url, params={"key": "mooncake/ram/x"})
                assert r.json() == {"a": 1}
            tg.cancel_scope.cancel()

    run_trio(main, mock=False)


def test_mooncake_master_subcommand_dashed_flags() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; from mooncake._cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "master",
            "--rpc-port",
            "0",
            "--metrics-port",
            "0",
            "--client-ttl",
            "2s",
            "--eviction-policy",
            "lru",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("mooncake master: rpc=127.0.0.1:"), line
        port = int(line.split("rpc=127.0.0.1:")[1].split()[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(rpc.encode_request(1, "ServiceReady", rpc.Empty()))
            dec = rpc.MessageDecoder()
            msg = None
            while msg is None:
                dec.feed(s.recv(65536))
                msg = dec.next_message()
            assert isinstance(msg, rpc.Response)
            assert rpc.decode_result("ServiceReady", msg) == rpc.VERSION
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def test_unknown_eviction_policy_is_refused() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; from mooncake._cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run(
        [sys.executable, "-c", code, "master", "--eviction-policy", "clairvoyant"],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2
    assert b"clairvoyant" in r.stderr


def test_copy_task_over_the_wire() -> None:
    async def main() -> None:
        async with running_master() as server, client(server) as c:
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="a", segment=seg(0)))
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="b", segment=seg(1)))
            cfg = ReplicateConfig(preferred_segments=[seg(0).name])
            await c.call(
                "PutStart", rpc.PutStartParams(client_id="a", key="k", size=64, config=cfg)
            )
            await c.call("PutEnd", rpc.KeyClientParams(client_id="a", key="k"))
            tid = await c.call("CreateCopyTask", rpc.CopyTaskParams(key="k", targets=[seg(1).name]))
            (task,) = await c.call("FetchTasks", rpc.ClientParams(client_id="a"))
            assert task.id == tid and task.targets == [seg(1).name]
            start = await c.call("TaskStart", rpc.TaskParams(client_id="a", task_id=tid))
            assert start.size == 64 and start.targets[0].segment_name == seg(1).name
            await c.call("TaskEnd", rpc.TaskParams(client_id="a", task_id=tid))
            info = await c.call("QueryTask", rpc.TaskIdParams(task_id=tid))
            assert info.status == TaskStatus.SUCCESS
            got = await c.call("GetReplicaList", rpc.KeyParams(key="k"))
            assert len(got.replicas) == 2

    run_trio(main)


_GC_PROBE = """
import gc, os, threading, time
from mooncake._cli.master import _NO_FULL_GC, run_master
from mooncake._store.master import MasterServerConfig

def watch():
    for _ in range(1200):
        if gc.get_threshold()[2] == _NO_FULL_GC:
            print("frozen", gc.get_freeze_count(), flush=True)
            os._exit(0)
        time.sleep(0.05)
    os._exit(3)

threading.Thread(target=watch, daemon=True).start()
run_master(MasterServerConfig(rpc_port=0, enable_metric_reporting=False))
"""


def test_master_process_runs_no_automatic_full_collections() -> None:
    """Once serving, the master process never starts a full collection on its own (one walks
    every object of the state and stalls all calls) and has frozen its start-up objects."""
    proc = subprocess.run(
        [sys.executable, "-c", _GC_PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # (the master's own ready line may come before or after the probe's)
    (frozen,) = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("frozen ")]
    assert int(frozen) > 0


def test_answers_larger_than_the_socket_buffer_arrive_whole_on_every_connection() -> None:
    """Pipelined answers (MBs) that a slow reader leaves in the kernel: the master finishes
    each one once the reader drains (a partial send resumes where it stopped), while another
    connection sharing the receive buffer is answered meanwhile."""

    async def main() -> None:
        async with running_master() as server, client(server) as c:
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="a", segment=seg(0)))
            keys = [f"key-{i:05d}-" + "x" * 180 for i in range(1500)]
            items = await c.call(
                "BatchPutStart",
                rpc.BatchPutStartParams(client_id="a", keys=keys, sizes=[64] * len(keys)),
            )
            assert all(i.code == 0 for i in items)
            assert await c.call(
                "BatchPutEnd", rpc.BatchKeyClientParams(client_id="a", keys=keys)
            ) == [0] * len(keys)
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                n = 20  # ~300 KB per answer, ~6 MB in all
                await stream.send(
                    b"".join(rpc.encode_request(i, "GetAllKeys", rpc.Empty()) for i in range(n))
                )
                await anyio.sleep(0.2)  # the master fills the socket buffers and waits
                async with client(server) as other:  # served while the first is stuck
                    assert await other.call("ExistKey", rpc.KeyParams(key=keys[7])) is True
                dec = rpc.MessageDecoder()
                got: list[int] = []
                while len(got) < n:
                    dec.feed(await stream.receive())
                    for msg in dec:
                        assert isinstance(msg, rpc.Response)
                        assert sorted(rpc.decode_result("GetAllKeys", msg)) == keys
                        got.append(msg.id)
                assert got == list(range(n))

    run_trio(main, mock=False)
