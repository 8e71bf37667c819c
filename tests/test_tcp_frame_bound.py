"""The TCP data port bounds a request's whole time, not just the gap between two bytes.

A peer that trickles a request a byte at a time, each byte well inside ``progress_timeout``,
restarted the old per-byte deadline forever and held its connection (and, with enough of them,
every slot). Now a request must be done within ``progress_timeout`` + its size / ``min_rate``
of its start (``ServeConn.frame_wait``, the compiled machine and its pure twin alike), and at
the connection cap the connection longest inside its request gives way to a new one.

Real engines over real sockets; timeouts are hang guards, never speed assertions.
"""

from __future__ import annotations

import socket
import struct
import time

import anyio
import pytest

import mooncake
from mooncake._core.transfer import TransferRequest
from mooncake._fast import RegionTable as FastTable
from mooncake._fast import ServeConn as FastConn
from mooncake._fast import _tcp_pure
from tests.test_server_bounds import MODES, data_addr, set_mode, tcp_of

pytestmark = pytest.mark.anyio

R = TransferRequest
V2_WRITE = 0x81


async def trickle_until_closed(
    host: str, port: int, at_once: bytes, slow: bytes, gap: float
) -> int:
    """Send ``at_once``, then ``slow`` a byte per ``gap`` seconds; how many bytes of ``slow``
    were sent when the server closed the connection (``len(slow)`` if it never did)."""
    s = socket.create_connection((host, port))
    try:
        s.sendall(at_once)
        s.setblocking(False)
        for i in range(len(slow)):
            try:
                if s.recv(1) == b"":
                    return i
            except BlockingIOError:
                pass
            except OSError:
                return i
            try:
                s.send(slow[i : i + 1])
            except OSError:
                return i
            await anyio.sleep(gap)
        return len(slow)
    finally:
        s.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", ["header", "payload"])
async def test_a_trickled_request_is_dropped_within_its_bound(mode: str, cut: str) -> None:
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        t.progress_timeout = 1.0  # each byte comes 10-50x faster than this
        t.min_rate = float(1 << 20)
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        host, port = data_addr(target)
        header = struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE)
        with anyio.fail_after(600):
            if cut == "header":  # a header trickled: 2.4 s against its 1 s bound
                sent = await trickle_until_closed(host, port, b"", header, 0.1)
                assert sent < len(header)
            else:  # a quick header, then 4096 bytes at 50 B/s against a bound of ~1 s
                body = b"p" * 4096
                sent = await trickle_until_closed(host, port, header, body, 0.02)
                assert sent < len(body)
        (res,) = await initiator.transfer(target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)])
        assert res.ok, res


@pytest.mark.parametrize("mode", MODES)
async def test_at_the_cap_the_connection_longest_inside_a_request_gives_way(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_TCP_MAX_CONNECTIONS", "4")
    async with (
        mooncake.open_engine(transports=["tcp"]) as target,
        mooncake.open_engine(transports=["tcp"]) as initiator,
    ):
        t = tcp_of(target)
        t.progress_timeout = 3600.0  # only the cap can free a slot here
        t.min_rate = 0.0
        set_mode(t, mode)
        buf = await target.allocate(1 << 20)
        ibuf = await initiator.allocate(4096)
        ibuf.numpy()[:] = 5
        host, port = data_addr(target)
        header = struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE)
        socks = [socket.create_connection((host, port)) for _ in range(4)]
        try:
            for s in socks:
                s.sendall(header + b"q" * 100)  # every slot inside a request, never idle
            with anyio.fail_after(60):
                while len(t._slots) < 4:  # noqa: ASYNC110 (polls server state)
                    await anyio.sleep(0.01)
                (res,) = await initiator.transfer(
                    target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)]
                )
            assert res.ok, res
            assert (buf.numpy()[:4096] == 5).all()
            assert t._slots.killed >= 1
        finally:
            for s in socks:
                s.close()


@pytest.mark.parametrize(
    "impl", [(FastTable, FastConn), (_tcp_pure.RegionTable, _tcp_pure.ServeConn)]
)
def test_frame_wait_counts_from_the_request_start(impl: tuple[type, type]) -> None:
    table_cls, conn_cls = impl
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        b.setblocking(False)
        table = table_cls()
        conn = conn_cls(a.fileno(), table, 1 << 20)
        assert conn.frame_wait(1000, 5000, 1024.0) == 5000  # idle: the idle deadline
        b.send(b"\0" * 10)  # a partial header
        conn.step()
        first = conn.frame_wait(1000, 5000, 1024.0)
        assert 0 < first <= 1000
        time.sleep(0.3)
        b.send(b"\0")  # a byte more: the old per-byte deadline would start again
        conn.step()
        later = conn.frame_wait(1000, 5000, 1024.0)
        assert later < 1000 and later <= first  # the whole request's clock keeps running
        time.sleep(0.8)
        assert conn.frame_wait(1000, 5000, 1024.0) == 0  # past its bound: drop it
        conn.close()
    finally:
        a.close()
        b.close()
