"""The HTTP metadata server (protocol, bad and slow clients, bounds) and the bad-input paths of
the metadata client side (unknown schemes, unreachable servers, bad replies, name clashes)."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake
from mooncake._engine.metadata import parse_metadata
from mooncake._engine.metadata.kv import KeyLayout
from mooncake._engine.metadata.server import HttpMetadataServer, MetadataStore
from mooncake.errors import (
    InvalidArgumentError,
    MetadataError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from tests import services

Body = Callable[[str, HttpMetadataServer], Awaitable[None]]


def run_with_server(body: Body, **kw: int) -> None:
    async def main() -> None:
        server = HttpMetadataServer(
            MetadataStore(**{k: v for k, v in kw.items() if k == "max_total_bytes"}),
            **{k: v for k, v in kw.items() if k != "max_total_bytes"},
        )
        async with trio.open_nursery() as n:
            host, port = await n.start(partial(server.serve, "127.0.0.1", 0))
            await body(f"http://{host}:{port}/metadata", server)
            n.cancel_scope.cancel()

    trio.run(main)


async def raw(url: str, data: bytes, *, read: bool = True) -> bytes:
    u = httpx.URL(url)
    assert u.port is not None
    async with await anyio.connect_tcp(u.host, u.port) as s:
        await s.send(data)
        if not read:
            return b""
        out = b""
        with anyio.fail_after(10):
            while True:
                try:
                    out += await s.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return out
                if b"\r\n\r\n" in out:
                    head, _, rest = out.partition(b"\r\n\r\n")
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:") and len(rest) >= int(
                            line.split(b":")[1]
                        ):
                            return out


def test_protocol() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.get(url, params={"key": "mooncake/ram/x"})
            assert r.status_code == 404
            r = await c.put(url, params={"key": "mooncake/ram/x"}, content=b'{"a": 1}')
            assert r.status_code == 200
            r = await c.get(url, params={"key": "mooncake/ram/x"})
            assert (r.status_code, r.content) == (200, b'{"a": 1}')
            assert r.headers["content-type"] == "application/json"
            # rpc_meta: a second PUT of an existing key is refused, as Mooncake's servers do
            assert (
                await c.put(url, params={"key": "mooncake/rpc_meta/x"}, content=b"{}")
            ).status_code == 200
            r = await c.put(url, params={"key": "mooncake/rpc_meta/x"}, content=b"{}")
            assert r.status_code == 400 and b"Duplicate" in r.content
            r = await c.put(url, params={"key": "k"}, content=b"{not json")
            assert r.status_code == 400 and b"not valid JSON" in r.content
            assert (await c.get(url)).status_code == 400  # no key
            assert (
                await c.get(url.replace("/metadata", "/other"), params={"key": "k"})
            ).status_code == 404
            assert (await c.post(url, params={"key": "k"}, content=b"{}")).status_code == 405
            assert (await c.delete(url, params={"key": "mooncake/ram/x"})).status_code == 200
            assert (await c.delete(url, params={"key": "mooncake/ram/x"})).status_code == 404
        assert server.store.get("mooncake/rpc_meta/x") == b"{}"

    run_with_server(body)


def test_bounds_body_connections_store() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        async with httpx.AsyncClient() as c:
            big = b'"' + b"x" * 2000 + b'"'
            r = await c.put(url, params={"key": "k"}, content=big)
            assert r.status_code == 413 and b"exceeds 1024" in r.content
            # chunked (no Content-Length): cut off while reading
            chunk = b"1f4\r\n" + b"x" * 500 + b"\r\n"
            reply = await raw(
                url,
                b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunk * 10
                + b"0\r\n\r\n",
            )
            assert reply.startswith(b"HTTP/1.1 413")
            assert server.store.get("k") is None
            for i in range(4):
                r = await c.put(url, params={"key": f"k{i}"}, content=b'"' + b"v" * 900 + b'"')
                assert r.status_code == (200 if i < 2 else 507), (i, r.status_code)
            assert server.store.total_bytes <= 2048
        # at the bound, the longest-idle connection gives way to a new one; never more are live
        held = [await anyio.connect_tcp("127.0.0.1", httpx.URL(url).port or 0) for _ in range(3)]
        with anyio.fail_after(10):
            while server.active < 3:  # noqa: ASYNC110 (polls another process)
                await anyio.sleep(0.01)
        reply = await raw(url, b"GET /metadata?key=k0 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200")
        assert server.evicted >= 1 and server.active <= 3
        for s in held:
            await s.aclose()
        with anyio.fail_after(10):
            while server.active:  # noqa: ASYNC110 (polls another process)
                await anyio.sleep(0.01)
        reply = await raw(url, b"GET /metadata?key=k0 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200")

    run_with_server(body, max_body=1024, max_connections=3, max_total_bytes=2048)


def test_bad_and_slow_clients_do_not_stop_others() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        port = httpx.URL(url).port or 0
        slow = await anyio.connect_tcp("127.0.0.1", port)
        await slow.send(b"PUT /metadata?key=s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        garbage = await raw(url, b"\x00\x01 not http at all\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400")
        huge_head = await raw(url, b"GET /metadata?key=" + b"a" * 40000 + b" HTTP/1.1\r\n\r\n")
        assert huge_head == b"" or huge_head.startswith(b"HTTP/1.1 4")  # RST may beat it
        async with httpx.AsyncClient() as c:
            assert (await c.put(url, params={"key": "ok"}, content=b"1")).status_code == 200
            assert (await c.get(url, params={"key": "ok"})).content == b"1"
        assert server.store.get("s") is None  # the slow PUT never completed
        await slow.aclose()

    run_with_server(body)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_any_bytes_get_an_answer_or_a_close(data: bytes) -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        reply = await raw(url, data + b"\r\n\r\n")
        assert reply == b"" or reply.startswith(b"HTTP/1.1 "), reply[:80]
        async with httpx.AsyncClient() as c:  # and it still serves
            assert (await c.get(url, params={"key": "none"})).status_code == 404

    run_with_server(body)


def test_keep_alive_reuses_one_connection() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        req = b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        req += b"GET /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n"
        port = httpx.URL(url).port or 0
        async with await anyio.connect_tcp("127.0.0.1", port) as s:
            await s.send(req)
            out = b""
            with anyio.fail_after(10):
                while out.count(b"HTTP/1.1 200") < 2 or not out.endswith(b"{}"):
                    out += await s.receive()
        assert server.requests == 2

    run_with_server(body)


# -- client side: bad input -------------------------------------------------------------------


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown metadata scheme 'zk'"):
        parse_metadata("zk://127.0.0.1:2181")

    async def main() -> None:
        with pytest.raises(InvalidArgumentError, match="'zk'"):
            async with mooncake.open_engine("127.0.0.1", "zk://127.0.0.1:2181"):
                pass

    trio.run(main)


def test_unreachable_http_server_is_a_clear_error() -> None:
    port = services.free_port()
    url = f"http://127.0.0.1:{port}/metadata"

    async def main() -> None:
        with pytest.raises(MetadataError, match=rf"metadata server {url} unreachable"):
            async with mooncake.open_engine("127.0.0.1", url, segment_name="u"):
                pass

    trio.run(main)


def test_bad_reply_not_cached_then_good_one_used() -> None:
    """A corrupt descriptor (put into the store behind the server's back) fails the lookup with
    the key named; once it is fixed the same engine finds the segment."""

    async def body(url: str, server: HttpMetadataServer) -> None:
        keys = KeyLayout()
        async with (
            mooncake.open_engine("127.0.0.1", url, segment_name="good") as good,
            mooncake.open_engine("127.0.0.1", url, segment_name="me") as me,
        ):
            buf = await good.allocate(4096)
            buf.view[:5] = b"hello"
            right = server.store.get(keys.ram("good"))
            assert right is not None
            server.store.put(keys.ram("good"), b"\xff\xfe{garbage")
            with pytest.raises(
                MetadataError, match=r"key mooncake/ram/good: value is not valid JSON"
            ):
                await me.peer("good")
            assert "good" not in me._peers
            server.store.put(keys.ram("good"), right)
            local = await me.allocate(4096)
            await me.read("good", local.addr, buf.addr, 5)
            assert bytes(local.view[:5]) == b"hello"
            with pytest.raises(SegmentNotFoundError, match="nobody"):
                await me.peer("nobody")

    run_with_server(body)


def test_segment_name_clash_live_and_stale() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        keys = KeyLayout()
        async with mooncake.open_engine("127.0.0.1", url, segment_name="dup") as first:
            with pytest.raises(
                SegmentExistsError, match=rf"live engine at 127.0.0.1:{first.rpc_port}"
            ):
                async with mooncake.open_engine("127.0.0.1", url, segment_name="dup"):
                    pass
            # the failed start removed nothing of the live engine's
            assert server.store.get(keys.ram("dup")) is not None
        # a stale entry (its engine is gone without unpublishing) is replaced
        dead = services.free_port()
        server.store.put(
            keys.rpc_meta("stale"),
            json.dumps({"ip_or_host_name": "127.0.0.1", "rpc_port": dead}).encode(),
        )
        async with mooncake.open_engine("127.0.0.1", url, segment_name="stale") as e:
            rpc = json.loads(server.store.get(keys.rpc_meta("stale")) or b"{}")
            assert rpc["rpc_port"] == e.rpc_port

    run_with_server(body)


def test_p2p_refuses_segment_name() -> None:
    async def main() -> None:
        with pytest.raises(InvalidArgumentError, match="segment_name"):
            async with mooncake.open_engine("127.0.0.1", "P2PHANDSHAKE", segment_name="x"):
                pass

    trio.run(main)


def test_server_binds_loopback_by_default() -> None:
    async def body(url: str, server: HttpMetadataServer) -> None:
        assert httpx.URL(url).host == "127.0.0.1"
        probe = socket.socket()
        probe.settimeout(1)
        try:
            # no interface but loopback has it: connecting to a non-loopback local address fails
            addrs = [
                a
                for a in socket.gethostbyname_ex(socket.gethostname())[2]
                if not a.startswith("127.")
            ]
            if addrs:
                assert probe.connect_ex((addrs[0], httpx.URL(url).port or 0)) != 0
        finally:
            probe.close()

    run_with_server(body)


def test_key_layout() -> None:
    k = KeyLayout("")
    assert k.ram("10.0.0.1:1234") == "mooncake/ram/10.0.0.1:1234"
    assert k.rpc_meta("node") == "mooncake/rpc_meta/node"
    assert k.ram("nvmeof/disk0") == "mooncake/nvmeof/disk0"  # names with '/' map as in Mooncake
    assert k.segment_of_ram("mooncake/ram/node") == "node"
    assert k.segment_of_ram("mooncake/rpc_meta/node") is None
    c = KeyLayout("/c1/")
    assert c.ram("n") == "mooncake/c1/ram/n" and c.rpc_meta("n") == "mooncake/c1/rpc_meta/n"
