"""Every server is bounded: connection caps, deadlines from accept, per-request progress
deadlines, and ``unregister()`` ending what a silent peer holds.

Real engines over real sockets; the hostile peers are raw sockets sending partial frames.
Timeouts here are hang guards (a failure is a hang on the old code), never speed assertions.
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from unittest import mock

import anyio
import anyio.lowlevel
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mooncake
from mooncake._core import auth, rpc
from mooncake._core.handshake import Frame, FrameDecoder, FrameType, encode_frame
from mooncake._core.transfer import TransferRequest
from mooncake._engine import handshake
from mooncake._engine.engine import Engine, open_engine
from mooncake._engine.handshake import HandshakeServer
from mooncake._engine.metadata import http as metadata_http
from mooncake._engine.metadata import server as metadata_server_mod
from mooncake._engine.metadata.http import HttpKV
from mooncake._engine.metadata.p2p import split_segment
from mooncake._engine.metadata.server import HttpMetadataServer, http_auth_bound
from mooncake._engine.transports.tcp import TcpTransport
from mooncake._store.master import MasterServer, MasterServerConfig, serve_master
from mooncake._store.master_conn import MasterConnection
from mooncake.errors import AuthError, MooncakeError
from mooncake.testing.fake_cuda import FakeCudaRuntime

pytestmark = pytest.mark.anyio

R = TransferRequest
V2_WRITE = 0x81
V2_READ = 0x80
MODES = ["thread", "loop"]


def tcp_of(engine: Engine) -> TcpTransport:
    (t,) = [t for t in engine.transports if isinstance(t, TcpTransport)]
    return t


def set_mode(t: TcpTransport, mode: str) -> None:
    """Pick how the next connections are served: the state machine on a thread of its own,
    or stepped on the loop."""
    t.serve_threads = mode == "thread"


@asynccontextmanager
async def raw_conn(host: str, port: int) -> AsyncIterator[anyio.abc.SocketStream]:
    s = await anyio.connect_tcp(host, port)
    async with s:
        yield s


async def closed_by_server(s: anyio.abc.SocketStream) -> bool:
    """Wait (hang-guarded) until the server closes ``s``; True if it did."""
    with anyio.move_on_after(30):
        try:
            while True:
                if not await s.receive():
                    return True
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return True
    return False


def data_addr(engine: Engine) -> tuple[str, int]:
    host, _ = split_segment(engine.segment_name)
    return host, engine.descriptor().tcp_data_port


def flood(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` idle connections, opened without blocking (past the listen backlog the kernel
    keeps retrying their SYNs; they connect as the server accepts)."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((host, port))
        out.append(s)
    return out


async def wait_for(cond: Any, what: str) -> None:
    with anyio.fail_after(30):
        while not cond():  # noqa: ASYNC110 (polls server state)
            await anyio.sleep(0.01)


# -- a silent peer cannot pin a region -------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_unregister_drops_a_peer_silent_mid_write(mode: str) -> None:
    async with mooncake.open_engine(transports=["tcp"]) as target:
        t = tcp_of(target)
        t.progress_timeout = 3600.0  # only unregister's abort can end this in time
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        host, port = data_addr(target)
        async with raw_conn(host, port) as s:
            await s.send(struct.pack("<QQB7x", 1 << 20, buf.addr, V2_WRITE) + b"x" * 300_000)
            await wait_for(lambda: any(not c.idle for c in t._live), "server inside the write")
            with anyio.fail_after(30):  # on the old code: blocks until the peer closes
                await target.unregister(buf)
            assert await closed_by_server(s)
        assert t.aborted_connections >= 1


@pytest.mark.parametrize("mode", MODES)
async def test_unregister_drops_a_reader_that_stops_reading(mode: str) -> None:
    async with mooncake.open_engine(transports=["tcp"]) as target:
        t = tcp_of(target)
        t.progress_timeout = 3600.0
        set_mode(t, mode)
        buf = await target.allocate(64 << 20)
        host, port = data_addr(target)
        sock = socket.create_connection((host, port))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(struct.pack("<QQB7x", 64 << 20, buf.addr, V2_READ))  # never read
            await wait_for(lambda: any(not c.idle for c in t._live), "server inside the read")
            with anyio.fail_after(30):
                await target.unregister(buf)
        finally:
            sock.close()


# -- per-request progress deadline -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", ["header", "payload"])
async def test_slowloris_partial_frame_is_dropped(mode: str, cut: str) -> None:
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        t.progress_timeout = 0.3
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        host, port = data_addr(target)
        frame = struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE) + b"y" * 4096
        async with raw_conn(host, port) as s:
            await s.send(frame[:10] if cut == "header" else frame[:2000])
            assert await closed_by_server(s)
        # and the server still serves a well-behaved client
        (res,) = await initiator.transfer(target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)])
        assert res.ok, res


# -- connection cap --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_idle_flood_past_the_cap_evicts_idle_connections(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_TCP_MAX_CONNECTIONS", "16")
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        ibuf.numpy()[:] = 7
        host, port = data_addr(target)
        flood_ = flood(host, port, 40)
        try:
            await wait_for(lambda: t._slots.evicted > 0, "cap reached")
            for _ in range(20):  # the rest wait in the listen backlog, idle ones give way
                assert len(t._slots) <= 16
                await anyio.sleep(0.01)
            with anyio.fail_after(30):
                (res,) = await initiator.transfer(
                    target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)]
                )
            assert res.ok, res
            assert (buf.numpy()[:4096] == 7).all()
            assert t._slots.evicted > 0
            assert len(t._slots) <= 16
        finally:
            for f in flood_:
                f.close()


@pytest.mark.parametrize("mode", MODES)
async def test_busy_flood_at_the_cap_waits_for_the_progress_deadline(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_TCP_MAX_CONNECTIONS", "8")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT", "0.5")
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        host, port = data_addr(target)
        # mid-request connections are never evicted; their progress deadline frees the slots
        flood_ = [socket.create_connection((host, port)) for _ in range(8)]
        try:
            for f in flood_:
                f.sendall(struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE) + b"z" * 100)
            with anyio.fail_after(30):
                (res,) = await initiator.transfer(
                    target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)]
                )
            assert res.ok, res
        finally:
            for f in flood_:
                f.close()


async def test_idle_lane_closed_by_the_server_is_retried() -> None:
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        t.idle_timeout = 0.2
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        for _ in range(3):
            (res,) = await initiator.transfer(
                target.segment_name, [R.read(ibuf.addr, buf.addr, 4096)]
            )
            assert res.ok, res
            await wait_for(lambda: len(t._slots) == 0, "idle lane closed by the server")


# -- P2P handshake server --------------------------------------------------------------------


@asynccontextmanager
async def handshake_server(**kw: Any) -> AsyncIterator[tuple[HandshakeServer, int]]:
    server = HandshakeServer(**kw)

    async def probe(frame: Frame) -> Any:
        return {"status": "success"}

    async def notify(frame: Frame) -> Any:
        obj = frame.json()
        return {"name": "", "notify_msg": obj["notify_msg"]}  # KeyError/TypeError on junk

    server.handlers[FrameType.PROBE] = probe
    server.handlers[FrameType.NOTIFY] = notify
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve, "127.0.0.1", 0)
        yield server, port
        tg.cancel_scope.cancel()


async def test_handshake_idle_flood_past_the_cap_then_a_probe_is_served() -> None:
    async with handshake_server() as (server, port):
        cap = server.slots.cap
        flood_ = flood("127.0.0.1", port, cap + 44)
        try:
            await wait_for(lambda: server.slots.evicted > 0, "cap reached")
            assert len(server.slots) <= cap
            with anyio.fail_after(30):  # old code: the probe timed out behind the idle sockets
                reply = await handshake.request("127.0.0.1", port, FrameType.PROBE, {})
            assert reply.json() == {"status": "success"}
            assert len(server.slots) <= cap
        finally:
            for f in flood_:
                f.close()


async def test_handshake_partial_frame_is_dropped_and_handler_errors_stay_local() -> None:
    async with handshake_server(max_connections=4, request_timeout=0.3) as (server, port):
        async with raw_conn("127.0.0.1", port) as s:
            await s.send(struct.pack("<QB", 100, int(FrameType.PROBE)) + b'{"a":')
            assert await closed_by_server(s)
        for junk in (b"[1,2]", b'{"notify_msg": 1}', b"{}", b'"x"'):
            async with raw_conn("127.0.0.1", port) as s:
                await s.send(struct.pack("<QB", len(junk) + 1, int(FrameType.NOTIFY)) + junk)
                assert await closed_by_server(s)
        reply = await handshake.request("127.0.0.1", port, FrameType.PROBE, {})
        assert reply.json() == {"status": "success"}
        assert server.rejected >= 4


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ("name", "notify_msg", "status", "reply_msg", "local_nic_path", "qp_num", "nonce")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ftype=st.sampled_from([0, 1, 2, 3, 16]),
    obj=st.one_of(json_any, st.fixed_dictionaries({}, optional=dict.fromkeys(FIELDS, json_any))),
    raw=st.booleans(),
    cut=st.integers(min_value=0, max_value=200),
)
def test_handshake_fuzz_one_byte_at_a_time(ftype: int, obj: Any, raw: bool, cut: int) -> None:
    """Any JSON in any field of any frame type, sent a byte at a time (whole or cut short):
    the engine drops or answers that connection and keeps serving."""

    async def main() -> None:
        async with mooncake.open_engine(transports=["tcp"]) as engine:
            host, port = split_segment(engine.segment_name)
            body = json.dumps(obj).encode()
            frame = struct.pack("<QB", len(body) + 1, ftype) + body
            if raw:
                frame = frame[: cut % (len(frame) + 1)]
            with socket.create_connection((host, port)) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for b in frame:
                    try:
                        s.send(bytes([b]))
                    except OSError:
                        break
                s.shutdown(socket.SHUT_WR)
                with anyio.fail_after(30):
                    await anyio.to_thread.run_sync(s.recv, 65536)
            assert await engine.probe(engine.segment_name)

    anyio.run(main, backend="trio")


# -- cluster secret on the handshake ---------------------------------------------------------


async def test_handshake_cluster_secret() -> None:
    async with handshake_server(secret="s3cret") as (_server, port):
        reply = await handshake.request("127.0.0.1", port, FrameType.PROBE, {}, secret="s3cret")
        assert reply.json() == {"status": "success"}
        with pytest.raises(AuthError, match="requires the cluster secret"):
            await handshake.request("127.0.0.1", port, FrameType.PROBE, {}, secret="")
        with pytest.raises(AuthError, match="does not know the cluster secret"):
            await handshake.request("127.0.0.1", port, FrameType.PROBE, {}, secret="other")
    async with handshake_server(secret="") as (_server, port):
        with pytest.raises(AuthError, match="does not take the cluster secret"):
            await handshake.request("127.0.0.1", port, FrameType.PROBE, {}, secret="s3cret")


async def test_handshake_proof_is_bound_to_the_request() -> None:
    """A client proof replayed in front of another request is refused."""
    key = b"k"
    async with handshake_server(secret=key) as (_server, port):
        with socket.create_connection(("127.0.0.1", port)) as s:
            cn = auth.new_nonce()
            s.sendall(encode_frame(FrameType.AUTH, {"nonce": cn.hex()}))
            dec = FrameDecoder()
            while (f := dec.next_frame()) is None:
                dec.feed(await anyio.to_thread.run_sync(s.recv, 4096))
            sn = bytes.fromhex(f.json()["nonce"])
            signed = encode_frame(FrameType.PROBE, {})
            other = encode_frame(FrameType.NOTIFY, {"name": "x", "notify_msg": "y"})
            proof = auth.client_proof(key, "handshake", cn, sn, signed)
            s.sendall(encode_frame(FrameType.AUTH, {"proof": proof.hex()}) + other)
            while (f := dec.next_frame()) is None:
                dec.feed(await anyio.to_thread.run_sync(s.recv, 4096))
            assert f.json() == {"reply_msg": "authentication failed"}


# -- HTTP metadata server --------------------------------------------------------------------


@asynccontextmanager
async def metadata_server(**kw: Any) -> AsyncIterator[tuple[HttpMetadataServer, str]]:
    server = HttpMetadataServer(**kw)
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(server.serve, "127.0.0.1", 0)
        yield server, f"http://{host}:{port}/metadata"
        tg.cancel_scope.cancel()


async def test_metadata_idle_flood_past_the_cap_then_a_client_is_served() -> None:
    async with metadata_server() as (server, url):
        cap = server.slots.cap
        flood_ = flood("127.0.0.1", int(url.split(":")[2].split("/")[0]), cap + 50)
        try:
            await wait_for(lambda: server.evicted > 0, "cap reached")
            assert server.active <= cap
            kv = HttpKV(url)
            with anyio.fail_after(30):  # old code: 503 past the cap
                await kv.put("k", b'"v"')
                assert await kv.get("k") == b'"v"'
            await kv.aclose()
            assert server.active <= cap
        finally:
            for f in flood_:
                f.close()


@pytest.mark.parametrize(
    "partial",
    [
        b"GET /metadata?key=k HTTP/1.1\r\nHo",
        b"PUT /metadata?key=k HTTP/1.1\r\nContent-Length: 9\r\n\r\n{",
    ],
)
async def test_metadata_slowloris_is_dropped(
    partial: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metadata_server_mod, "REQUEST_S", 0.3)
    async with metadata_server() as (server, url):
        port = int(url.split(":")[2].split("/")[0])
        async with raw_conn("127.0.0.1", port) as s:
            await s.send(partial)
            assert await closed_by_server(s)
        async with raw_conn("127.0.0.1", port) as s:  # nothing at all, from accept
            assert await closed_by_server(s)
        assert server.store.get("k") is None


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from([b"GET", b"PUT", b"DELETE", b"POST", b"\x00", b"G\xffT"]),
    key=st.binary(max_size=20),
    body=st.one_of(st.binary(max_size=60), json_any.map(lambda o: json.dumps(o).encode())),
    headers=st.lists(
        st.tuples(st.binary(min_size=1, max_size=10), st.binary(max_size=20)), max_size=3
    ),
    cut=st.integers(min_value=0, max_value=400),
)
def test_metadata_fuzz_one_byte_at_a_time(
    method: bytes, key: bytes, body: bytes, headers: list[tuple[bytes, bytes]], cut: int
) -> None:
    async def main() -> None:
        async with metadata_server() as (_server, url):
            port = int(url.split(":")[2].split("/")[0])
            head = method + b" /metadata?key=" + key + b" HTTP/1.1\r\nHost: x\r\n"
            for name, value in headers:
                head += name + b": " + value + b"\r\n"
            req = head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            req = req[: cut % (len(req) + 1)] if cut % 3 == 0 else req
            with socket.create_connection(("127.0.0.1", port)) as s:
                for b in req:
                    try:
                        s.send(bytes([b]))
                    except OSError:
                        break
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                with anyio.fail_after(30):
                    out = await anyio.to_thread.run_sync(s.recv, 65536)
            assert out == b"" or out.startswith(b"HTTP/1.1 "), out[:80]
            # a generous connect timeout: the server shares this (possibly starved) process
            with mock.patch.object(metadata_http, "CONNECT_S", 60.0):
                kv = HttpKV(url)
                assert await kv.get("surely-absent") is None  # and it still serves
                await kv.aclose()

    anyio.run(main, backend="trio")


async def test_metadata_cluster_secret() -> None:
    async with metadata_server(secret="s3cret") as (_server, url):
        good = HttpKV(url, secret="s3cret")
        await good.put("k", b'{"a": 1}')
        assert await good.get("k") == b'{"a": 1}'
        assert await good.delete("k")
        for secret, match in (("", "refused"), ("other", "does not know")):
            kv = HttpKV(url, secret=secret)
            with pytest.raises(AuthError, match=match):
                await kv.get("k")
            await kv.aclose()
        # a captured proof is single use
        cn = auth.new_nonce()
        async with httpx.AsyncClient() as c:
            ch = (await c.get(url, params={"auth_challenge": cn.hex()})).json()
            sn = bytes.fromhex(ch["nonce"])
            req = c.build_request("GET", url, params={"key": "k"})
            bound = http_auth_bound(b"GET", req.url.raw_path, b"")
            proof = auth.client_proof(b"s3cret", "http", cn, sn, bound)
            req.headers["X-Mooncake-Auth"] = f"{cn.hex()}:{sn.hex()}:{proof.hex()}"
            assert (await c.send(req)).status_code == 404  # authenticated; key gone
            req2 = c.build_request("GET", url, params={"key": "k"}, headers=dict(req.headers))
            assert (await c.send(req2)).status_code == 401
        await good.aclose()
    async with metadata_server() as (_server, url):
        kv = HttpKV(url, secret="s3cret")
        with pytest.raises(AuthError, match="does not take"):
            await kv.get("k")
        await kv.aclose()


# -- store master RPC ------------------------------------------------------------------------


@asynccontextmanager
async def master(**kw: Any) -> AsyncIterator[tuple[MasterServer, str]]:
    cfg = MasterServerConfig(rpc_port=0, enable_metric_reporting=False, **kw)
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield server, f"127.0.0.1:{server.rpc_port}"
        tg.cancel_scope.cancel()


async def test_master_idle_flood_past_the_cap_then_a_client_is_served() -> None:
    async with master(max_connections=16) as (server, address):
        flood_ = flood("127.0.0.1", server.rpc_port, 40)
        try:
            await wait_for(lambda: server.slots.evicted > 0, "cap reached")
            assert len(server.slots) <= 16
            conn = MasterConnection(address)
            with anyio.fail_after(30):  # old code: closed on accept past the cap
                assert await conn.call("ServiceReady", rpc.Empty()) == rpc.VERSION
            conn.close()
            assert len(server.slots) <= 16
        finally:
            for f in flood_:
                f.close()


async def test_master_deadlines_from_accept_and_inside_a_frame() -> None:
    async with master(request_timeout=0.3, progress_timeout=0.3, idle_timeout=0.5) as (server, _):
        async with raw_conn("127.0.0.1", server.rpc_port) as s:  # nothing at all
            assert await closed_by_server(s)
        frame = rpc.encode_request(1, "ServiceReady", rpc.Empty())
        async with raw_conn("127.0.0.1", server.rpc_port) as s:  # slowloris: a cut frame
            await s.send(frame[:3])
            assert await closed_by_server(s)
        async with raw_conn("127.0.0.1", server.rpc_port) as s:  # served, then idle
            await s.send(frame)
            assert await s.receive()
            assert await closed_by_server(s)
        assert server.connections_dropped >= 3


def _garbage() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
        st.floats(),
        st.text(max_size=10),
        st.binary(max_size=10),
    )
    return st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
        ),
        max_leaves=8,
    )


def _params_for(method: str) -> st.SearchStrategy[Any]:
    fields = rpc.METHODS[method].params.__struct_fields__
    return st.one_of(
        _garbage(), st.fixed_dictionaries({}, optional=dict.fromkeys(fields, _garbage()))
    )


@st.composite
def rpc_frames(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(sorted(rpc.METHODS)) | st.text(max_size=8))
    params = draw(_params_for(method) if method in rpc.METHODS else _garbage())
    envelope = draw(
        st.sampled_from(["ok", "id", "method", "tag", "short", "long"]),
    )
    msg: list[Any] = [0, draw(st.integers(0, 1000)), method, params]
    if envelope == "id":
        msg[1] = draw(_garbage())
    elif envelope == "method":
        msg[2] = draw(_garbage())
    elif envelope == "tag":
        msg[0] = draw(_garbage())
    elif envelope == "short":
        msg = msg[: draw(st.integers(0, 3))]
    elif envelope == "long":
        msg.append(draw(_garbage()))
    body = msgspec.msgpack.encode(msg)
    return struct.pack(">I", len(body)) + body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(rpc_frames(), min_size=1, max_size=3), onebyte=st.booleans())
def test_master_fuzz_every_field_of_every_method(frames: list[bytes], onebyte: bool) -> None:
    """Garbage of every msgpack type in every params field of every method (and in the
    envelope), one byte at a time or whole: each frame gets an error/result answer or drops
    the connection, and the master keeps serving."""

    async def main() -> None:
        async with master() as (server, address):
            data = b"".join(frames)
            with socket.create_connection(("127.0.0.1", server.rpc_port)) as s:
                chunks = [data[i : i + 1] for i in range(len(data))] if onebyte else [data]
                for c in chunks:
                    try:
                        s.sendall(c)
                    except OSError:
                        break
                s.shutdown(socket.SHUT_WR)
                got = b""
                with anyio.fail_after(30):
                    while chunk := await anyio.to_thread.run_sync(s.recv, 65536):
                        got += chunk
            dec = rpc.MessageDecoder()
            dec.feed(got)
            for msg in dec:
                assert isinstance(msg, rpc.Response)
            conn = MasterConnection(address)
            assert await conn.call("ServiceReady", rpc.Empty()) == rpc.VERSION
            conn.close()

    anyio.run(main, backend="trio")


async def test_master_cluster_secret() -> None:
    async with master(cluster_secret="s3cret") as (server, address):
        good = MasterConnection(address, secret="s3cret")
        assert await good.call("ServiceReady", rpc.Empty()) == rpc.VERSION
        good.close()
        plain = MasterConnection(address, secret="")
        with pytest.raises(MooncakeError, match="authentication required"):
            await plain.call("ServiceReady", rpc.Empty())
        plain.close()
        wrong = MasterConnection(address, secret="other")
        with pytest.raises(AuthError, match="does not know"):
            await wrong.call("ServiceReady", rpc.Empty())
        wrong.close()
        assert server.auth_failures >= 1
    async with master(cluster_secret="") as (_server, address):
        conn = MasterConnection(address, secret="s3cret")
        with pytest.raises(AuthError, match="takes no cluster secret"):
            await conn.call("ServiceReady", rpc.Empty())
        conn.close()


async def test_master_admin_http_idle_flood_then_health() -> None:
    cfg = MasterServerConfig(rpc_port=0, metrics_port=0)
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        assert server.metrics_port
        flood_ = flood("127.0.0.1", server.metrics_port, server.http_slots.cap + 30)
        try:
            await wait_for(lambda: server.http_slots.evicted > 0, "cap reached")
            async with httpx.AsyncClient() as c:
                with anyio.fail_after(30):  # old code: closed on accept past the cap
                    r = await c.get(f"http://127.0.0.1:{server.metrics_port}/health")
            assert r.status_code == 200
            assert len(server.http_slots) <= server.http_slots.cap
        finally:
            for f in flood_:
                f.close()
        tg.cancel_scope.cancel()


# -- cluster secret, end to end --------------------------------------------------------------


async def test_engines_with_a_cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", "s3cret")
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        ibuf.numpy()[:] = 9
        (res,) = await initiator.transfer(target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)])
        assert res.ok, res
        assert (buf.numpy()[:4096] == 9).all()
        assert await initiator.probe(target.segment_name)
        # a client without the secret reaches neither port
        host, rpc_port = split_segment(target.segment_name)
        with pytest.raises(AuthError):
            await handshake.request(host, rpc_port, FrameType.PROBE, {}, secret="")
        async with raw_conn(*data_addr(target)) as s:
            await s.send(struct.pack("<QQB7x", 16, buf.addr, V2_READ))
            assert await closed_by_server(s)
        async with mooncake.open_engine(transports=["tcp"]) as other:
            tcp_of(other).secret = None  # its data client without the secret
            obuf = await other.allocate(4096)
            (res,) = await other.transfer(target.segment_name, [R.read(obuf.addr, buf.addr, 16)])
            assert isinstance(res.error, AuthError) and "requires the cluster secret" in str(
                res.error
            )
        assert tcp_of(target).auth_failures >= 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["write", "read"])
async def test_unregister_drops_a_silent_peer_on_device_memory(
    op: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging of device regions (here the fake CUDA runtime's) under a peer that stops
    mid-WRITE or stops reading a READ: unregister ends it and returns."""
    monkeypatch.setenv("MC_CUDA_STAGING_CHUNK", "4096")
    rt = FakeCudaRuntime()
    try:
        async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=rt) as target:
            t = tcp_of(target)
            set_mode(t, mode)
            t.progress_timeout = 3600.0
            size = 4 << 20
            dev = await target.allocate(size, location="cuda:0")
            host, port = data_addr(target)
            sock = socket.create_connection((host, port))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                opcode = V2_WRITE if op == "write" else V2_READ
                sock.sendall(struct.pack("<QQB7x", size, dev.addr, opcode))
                if op == "write":
                    sock.sendall(b"d" * 100_000)
                await wait_for(lambda: t._staging, "server inside the request")
                with anyio.fail_after(30):
                    await target.unregister(dev)
                assert t.aborted_connections >= 1
            finally:
                sock.close()
    finally:
        rt.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 0x80, 0x81]) | st.integers(0, 255),
            st.integers(-8192, 1 << 21) | st.integers(0, (1 << 64) - 1),
            st.integers(0, 70_000) | st.integers(0, (1 << 64) - 1),
        ),
        min_size=1,
        max_size=4,
    ),
    mode=st.sampled_from(MODES),
    cut=st.integers(0, 1 << 20),
)
def test_tcp_data_fuzz_one_byte_at_a_time(
    reqs: list[tuple[int, int, int]], mode: str, cut: int
) -> None:
    """Any opcode byte, address (around the registered buffer, or anywhere) and size, with or
    without payload, a byte at a time: the data server answers, refuses or drops the connection
    and keeps serving."""

    async def main() -> None:
        async with mooncake.open_engine(transports=["tcp"]) as target:
            t = tcp_of(target)
            t.progress_timeout = 2.0
            set_mode(t, mode)
            buf = await target.allocate(1 << 20)
            data = b""
            for op, off, size in reqs:
                addr = (buf.addr + off) % (1 << 64) if off < (1 << 21) else off
                data += struct.pack("<QQB7x", size % (1 << 64), addr, op)
                if op & 0x7F == 1:
                    data += b"p" * min(size, 600)
            data = data[: cut % (len(data) + 1)] if cut % 2 else data
            with socket.create_connection(data_addr(target)) as s:
                for i in range(len(data)):
                    try:
                        s.send(data[i : i + 1])
                    except OSError:
                        break
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                with anyio.fail_after(30):
                    while True:
                        try:
                            got = await anyio.to_thread.run_sync(s.recv, 1 << 20)
                        except OSError:
                            break
                        if not got:
                            break
            async with mooncake.open_engine(transports=["tcp"]) as ini:
                ib = await ini.allocate(4096)
                (res,) = await ini.transfer(target.segment_name, [R.read(ib.addr, buf.addr, 4096)])
                assert res.ok, res

    anyio.run(main, backend="trio")


@pytest.mark.parametrize("mode", MODES)
async def test_device_requests_pipelined_with_host_ones(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One connection, one send: host READ, device WRITE (its payload arriving with the
    headers, so partly already taken in by the server), device READ, host READ. The replies
    come back in order and the device bytes round-trip through the staging."""
    monkeypatch.setenv("MC_CUDA_STAGING_CHUNK", "4096")
    rt = FakeCudaRuntime()
    try:
        async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=rt) as target:
            t = tcp_of(target)
            set_mode(t, mode)
            host_buf = await target.allocate(4096)
            ctypes.memmove(host_buf.addr, b"h" * 64, 64)
            dev = await target.allocate(1 << 20, location="cuda:0")
            payload = bytes(range(256)) * 40  # 10240 B: three staging chunks
            hdr = struct.Struct("<QQB7x")
            msg = (
                hdr.pack(64, host_buf.addr, V2_READ)
                + hdr.pack(len(payload), dev.addr + 100, V2_WRITE)
                + payload
                + hdr.pack(len(payload), dev.addr + 100, V2_READ)
                + hdr.pack(64, host_buf.addr, V2_READ)
            )
            ok = struct.pack("<Q", 0x4D43545600000000)
            want = ok + b"h" * 64 + ok + ok + payload + ok + b"h" * 64
            host, port = data_addr(target)

            def client() -> bytes:  # blocking, on a thread: the server runs on this loop
                with socket.create_connection((host, port), timeout=30) as sock:
                    sock.sendall(msg)
                    got = b""
                    while len(got) < len(want):
                        chunk = sock.recv(len(want) - len(got))
                        if not chunk:
                            break
                        got += chunk
                    return got

            assert await anyio.to_thread.run_sync(client) == want
            assert not t._staging
    finally:
        rt.close()
