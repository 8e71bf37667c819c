"""The master and the TCP data port survive hostile clients: peers that never read their
answers, and peers that trickle a frame a byte at a time to hold connection slots.

Real sockets, trio's real clock (the master's RPC threads run only there), both serving
paths of the master. Timeouts are hang guards, never speed assertions.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import trio

import mooncake
from mooncake._core import rpc
from mooncake._core.master import MasterConfig
from mooncake._core.store_types import Segment
from mooncake._core.transfer import TransferRequest
from mooncake._engine.metadata.p2p import split_segment
from mooncake._engine.transports.tcp import TcpTransport
from mooncake._store.master import MasterServer, MasterServerConfig, serve_master

BOTH = pytest.mark.parametrize("threaded", [True, False], ids=["thread", "loop"])
V2_WRITE = 0x81


@asynccontextmanager
async def master(threaded: bool, **kw: Any) -> AsyncIterator[MasterServer]:
    cfg = MasterServerConfig(
        rpc_port=0,
        metrics_port=-1,
        rpc_threads=2 if threaded else 0,
        cluster_secret="",
        state=MasterConfig(seed=0, client_ttl=3600.0),  # the test's client sends no pings
        **kw,
    )
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        assert (server.rpc_thread is not None) is threaded
        yield server
        tg.cancel_scope.cancel()


async def wait_until(cond: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    with anyio.fail_after(limit):
        while not cond():  # noqa: ASYNC110 (polls server state)
            await anyio.sleep(0.02)


def blocking_call(port: int, method: str, params: Any, timeout: float = 30.0) -> Any:
    """One call on a fresh connection (run in a thread); raises on no answer in time."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(rpc.encode_request(1, method, params))
        dec = rpc.MessageDecoder()
        while True:
            data = s.recv(1 << 20)
            assert data, "the master closed the connection"
            dec.feed(data)
            for m in dec:
                assert isinstance(m, rpc.Response)
                return rpc.decode_result(method, m)
    finally:
        s.close()


async def store_keys(port: int, n: int, klen: int) -> list[str]:
    keys = [f"{i:06d}".ljust(klen, "k") for i in range(n)]
    seg = Segment(id="s0", name="127.0.0.1:2000", base=1 << 32, size=1 << 30)
    calls: list[tuple[str, Any]] = [
        ("MountSegment", rpc.MountSegmentParams(client_id="a", segment=seg))
    ]
    for j in range(0, n, 2000):
        ks = keys[j : j + 2000]
        calls.append(
            ("BatchPutStart", rpc.BatchPutStartParams(client_id="a", keys=ks, sizes=[64] * len(ks)))
        )
        calls.append(("BatchPutEnd", rpc.BatchKeyClientParams(client_id="a", keys=ks)))
    for method, params in calls:
        await anyio.to_thread.run_sync(blocking_call, port, method, params)
    return keys


# -- answers a peer never reads ----------------------------------------------------------------


@BOTH
def test_a_burst_of_big_answers_for_a_peer_that_never_reads_is_not_all_built(
    threaded: bool,
) -> None:
    """One small burst of GetAllKeys (about 20 bytes each, ~200 KB answers): the master
    answers a batch, then waits for the peer to read it before answering (or reading) more;
    once the peer reads, every answer arrives, complete and in order."""

    async def main() -> None:
        async with master(threaded) as server:
            keys = await store_keys(server.rpc_port, 1000, 200)
            n = 300  # ~60 MB of answers for ~6 KB of requests
            flood = socket.socket()
            flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            flood.connect(("127.0.0.1", server.rpc_port))
            flood.sendall(
                b"".join(rpc.encode_request(i, "GetAllKeys", rpc.Empty()) for i in range(n))
            )

            def answered() -> int:
                return server.requests["GetAllKeys"]

            await wait_until(lambda: answered() > 0, "the master answers")
            # it stops once the socket buffers are full and a batch waits: the count holds
            # still for a second (not a speed claim: a master that went on would reach n)
            last = -1
            with anyio.fail_after(60):
                while answered() != last:
                    last = answered()
                    await anyio.sleep(1.0)
            assert last < n // 2, f"{last} of {n} answers built for a peer that reads nothing"
            assert server.replies.held <= server.config.reply_batch + server.config.max_frame
            flood.setblocking(True)
            dec = rpc.MessageDecoder()
            ids: list[int] = []
            with anyio.fail_after(120):
                while len(ids) < n:
                    data = await anyio.to_thread.run_sync(flood.recv, 1 << 20)
                    assert data, "the master closed the connection"
                    dec.feed(data)
                    for m in dec:
                        assert isinstance(m, rpc.Response)
                        assert len(rpc.decode_result("GetAllKeys", m)) == len(keys)
                        ids.append(m.id)
            assert ids == list(range(n))
            flood.close()
            await wait_until(lambda: server.replies.held == 0, "held bytes given back")

    trio.run(main)


@BOTH
def test_unread_answers_past_the_master_reply_budget_close_their_connection(
    threaded: bool,
) -> None:
    """With the budget smaller than what one unread answer leaves unsent (one larger than
    the socket buffers hold), that connection is closed (counted), the bytes it held are
    given back, and others are served."""

    async def main() -> None:
        async with master(threaded, reply_budget=64 << 10) as server:
            await store_keys(server.rpc_port, 20000, 400)  # ~8 MB answers: past the buffers
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.rpc_port))
            n = 4  # ~32 MB of answers
            s.sendall(rpc.encode_request(1, "GetAllKeys", rpc.Empty()) * n)
            await wait_until(lambda: server.replies.refused > 0, "the budget refuses")
            await wait_until(lambda: server.connections_dropped > 0, "the connection dropped")
            await wait_until(lambda: server.replies.held == 0, "held bytes given back")
            s.setblocking(True)
            s.settimeout(60)
            got = 0
            with contextlib.suppress(OSError):
                while data := s.recv(1 << 20):
                    got += len(data)
            assert got < n * 20000 * 400, "every answer arrived"
            s.close()
            ready = await anyio.to_thread.run_sync(
                blocking_call, server.rpc_port, "ServiceReady", rpc.Empty()
            )
            assert ready == rpc.VERSION

    trio.run(main)


# -- trickling peers ---------------------------------------------------------------------------


def inside_requests(slots: Any, n: int) -> bool:
    """``n`` connections hold the cap and the server has seen each one's first bytes: until it
    has (a loaded host may take a while), a trickle still looks idle to it and is evicted as
    idle at the cap, not closed as the one longest inside a request."""
    live = list(slots.live)
    return len(live) == n and not any(s.is_idle() for s in live)


class Trickler:
    """``n`` connections that each begin a frame, then send one byte every ``every`` s."""

    def __init__(
        self, port: int, n: int, header: bytes, every: float, host: str = "127.0.0.1"
    ) -> None:
        self.socks = [socket.create_connection((host, port)) for _ in range(n)]
        for s in self.socks:
            s.sendall(header)
        self.stop = threading.Event()
        self.every = every
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for s in self.socks:
                try:
                    s.send(b"\x00")
                except OSError:
                    pass

    def closed(self) -> int:
        """How many the server has closed (EOF or reset)."""
        n = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                n += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()


@BOTH
def test_trickled_frames_are_closed_by_their_whole_frame_bound(threaded: bool) -> None:
    """A byte every half ``progress_timeout`` restarts the no-byte deadline forever; the
    frame's own bound (progress_timeout + size / min_rate from its first byte) closes it,
    and a new client is served although the trickles held every slot."""

    async def main() -> None:
        async with master(threaded, max_connections=4, progress_timeout=1.0) as server:
            t = Trickler(server.rpc_port, 4, struct.pack(">I", 1000) + b"\x95", 0.4)
            try:
                await wait_until(lambda: t.closed() == 4, "every trickle closed")
                ready = await anyio.to_thread.run_sync(
                    blocking_call, server.rpc_port, "ServiceReady", rpc.Empty()
                )
                assert ready == rpc.VERSION
            finally:
                t.close()

    trio.run(main)


@BOTH
def test_at_the_cap_the_longest_partial_frame_gives_way(threaded: bool) -> None:
    """Slots all held by trickles inside a frame whose bound is far off: a new client is
    still served, because at the cap the connection longest inside a request is closed."""

    async def main() -> None:
        async with master(threaded, max_connections=4, progress_timeout=600.0) as server:
            t = Trickler(server.rpc_port, 4, struct.pack(">I", 1000) + b"\x95", 0.2)
            try:
                await wait_until(
                    lambda: inside_requests(server.slots, 4), "the trickles hold the cap"
                )
                ready = await anyio.to_thread.run_sync(
                    blocking_call, server.rpc_port, "ServiceReady", rpc.Empty()
                )
                assert ready == rpc.VERSION
                assert server.slots.killed >= 1
            finally:
                t.close()

    trio.run(main)


# -- the TCP data port -------------------------------------------------------------------------


def tcp_of(engine: Any) -> TcpTransport:
    (t,) = [t for t in engine.transports if isinstance(t, TcpTransport)]
    return t


@pytest.mark.parametrize("mode", ["thread", "loop"])
def test_tcp_data_port_trickles_at_the_cap_give_way(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every slot of the data port held by WRITEs trickled a byte at a time (each byte
    restarts the progress deadline): a real transfer still gets a slot."""
    monkeypatch.setenv("MC_TCP_MAX_CONNECTIONS", "4")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT", "600")

    async def main() -> None:
        async with (
            mooncake.open_engine(transports=["tcp"]) as target,
            mooncake.open_engine(transports=["tcp"]) as initiator,
        ):
            t = tcp_of(target)
            t.serve_threads = mode == "thread"
            buf = await target.allocate(1 << 20)
            ibuf = await initiator.allocate(4096)
            ibuf.numpy()[:] = 9
            host, _ = split_segment(target.segment_name)
            port = target.descriptor().tcp_data_port
            header = struct.pack("<QQB7x", 4096, buf.addr, V2_WRITE) + b"z"
            tr = Trickler(port, 4, header, 0.2, host=host)
            try:
                await wait_until(lambda: inside_requests(t._slots, 4), "the trickles hold the cap")
                with anyio.fail_after(60):
                    (res,) = await initiator.transfer(
                        target.segment_name, [TransferRequest.write(ibuf.addr, buf.addr, 4096)]
                    )
                assert res.ok, res
                assert (buf.numpy()[:4096] == 9).all()
                assert t._slots.killed >= 1
            finally:
                tr.close()

    trio.run(main)


# -- descriptor ownership between the loop and the RPC threads -------------------------------


def test_a_thread_late_to_let_go_still_holds_its_own_descriptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop gives up waiting for a serving thread (5 s) and closes the connection's socket
    while the thread has not yet let go: the descriptor the thread uses is its own and still
    names that connection (not a closed or reused number); the thread closes it when it lets
    go."""
    from mooncake._store import rpc_thread

    gate = threading.Event()
    stalled = threading.Event()
    original = rpc_thread._Worker._take_queue

    def late_take_queue(self: Any) -> None:
        if any(not attach for attach, _ in self.queue):  # a request to let go: be late
            stalled.set()
            gate.wait(60)
        original(self)

    monkeypatch.setattr(rpc_thread._Worker, "_take_queue", late_take_queue)

    async def main() -> None:
        async with master(True) as server:
            client = socket.create_connection(("127.0.0.1", server.rpc_port))
            try:
                client.sendall(rpc.encode_request(1, "ServiceReady", rpc.Empty()))
                assert await anyio.to_thread.run_sync(client.recv, 4096)  # never on the loop
                assert server.rpc_thread is not None
                workers = server.rpc_thread._workers
                await wait_until(lambda: any(w.conns for w in workers), "the thread holds it")
                (conn,) = [c for w in workers for c in w.conns.values()]
                (slot,) = server.slots.live
                loop_sock = slot.sock
                assert conn.fd != loop_sock.fileno()
                ino = os.fstat(conn.fd).st_ino
                slot.kill()  # as eviction at the cap does
                await wait_until(lambda: loop_sock.fileno() < 0, "the loop closed its socket")
                assert stalled.is_set()
                # while the thread is late, the number it uses is the same connection still
                assert os.fstat(conn.fd).st_ino == ino
                blocker = socket.socket()  # would take a freed number
                try:
                    assert blocker.fileno() != conn.fd
                finally:
                    blocker.close()
                gate.set()
                await wait_until(lambda: conn.sock.fileno() < 0, "the thread closed its own")
            finally:
                gate.set()
                client.close()

    trio.run(main)
