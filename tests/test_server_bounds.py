"""Every server is bounded: connection caps, deadlines from accept, per-request progress
deadlines, and ``unregister()`` ending what a silent peer holds.

Real engines over real sockets; the hostile peers are raw sockets sending partial frames.
Timeouts here are hang guards (a failure is a hang on the old code), never speed assertions.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import mooncake
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Engine
from mooncake._engine.metadata.p2p import split_segment
from mooncake._engine.transports.tcp import TcpTransport

pytestmark = pytest.mark.anyio

R = TransferRequest
V2_WRITE = 0x81
V2_READ = 0x80
MODES = ["thread", "loop", "staged"]


def tcp_of(engine: Engine) -> TcpTransport:
    (t,) = [t for t in engine.transports if isinstance(t, TcpTransport)]
    return t


def set_mode(t: TcpTransport, mode: str) -> None:
    """Pick which server serves the next connections: the compiled one on a thread, the same
    state machine stepped on the loop, or the Python loop used while device memory is
    registered (forced here for host memory, which it serves the same way)."""
    t.serve_threads = mode == "thread"
    if mode == "staged":
        t._device_regions += 1


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
            if mode == "staged":
                await wait_for(lambda: t._staged_holds, "server inside the write")
            else:
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
            if mode == "staged":
                await wait_for(lambda: t._staged_holds, "server inside the read")
            else:
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
        flood = [socket.create_connection((host, port)) for _ in range(40)]
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
            for f in flood:
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
        flood = [socket.create_connection((host, port)) for _ in range(8)]
        try:
            for f in flood:
                f.sendall(struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE) + b"z" * 100)
            with anyio.fail_after(30):
                (res,) = await initiator.transfer(
                    target.segment_name, [R.write(ibuf.addr, buf.addr, 4096)]
                )
            assert res.ok, res
        finally:
            for f in flood:
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
