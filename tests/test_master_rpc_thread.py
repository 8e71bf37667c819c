"""The master's RPC connections served from their own thread (``mooncake._store.rpc_thread``):
real sockets, trio's real clock (the thread is used only there), the loop path beside it."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
import trio

from mooncake._core import auth, rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake._store.master import MasterServer, MasterServerConfig, serve_master
from mooncake.errors import ObjectNotFoundError

BOTH = pytest.mark.parametrize("threaded", [True, False], ids=["thread", "loop"])


@asynccontextmanager
async def master(threaded: bool, **kw: Any) -> AsyncIterator[MasterServer]:
    cfg = MasterServerConfig(
        rpc_port=0,
        metrics_port=-1,
        rpc_threads=2 if threaded else 0,
        cluster_secret=kw.pop("cluster_secret", ""),
        state=MasterConfig(seed=0),
        **kw,
    )
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        assert (server.rpc_thread is not None) is threaded
        yield server
        tg.cancel_scope.cancel()


def seg() -> Segment:
    return Segment(id="s0", name="127.0.0.1:2000", base=1 << 32, size=1 << 24)


async def read_replies(stream: anyio.abc.ByteStream, n: int) -> list[rpc.Response]:
    dec = rpc.MessageDecoder()
    got: list[rpc.Response] = []
    with anyio.fail_after(30):
        while len(got) < n:
            dec.feed(await stream.receive())
            got.extend(m for m in dec if isinstance(m, rpc.Response))
    return got


async def call(stream: anyio.abc.ByteStream, i: int, method: str, params: msgspec.Struct) -> Any:
    await stream.send(rpc.encode_request(i, method, params))
    (reply,) = await read_replies(stream, 1)
    assert reply.id == i
    return rpc.decode_result(method, reply)


@BOTH
def test_pipelined_mix_with_a_regex_call_answered_in_order(threaded: bool) -> None:
    """Requests sent in one burst, a regex call (matched on the loop) among them: every
    answer in request order, the calls after the regex one still served."""

    async def main() -> None:
        async with master(threaded) as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                mount = rpc.MountSegmentParams(client_id="a", segment=seg())
                await call(stream, 1, "MountSegment", mount)
                for i, k in enumerate(["ka", "kb"]):
                    put = rpc.PutStartParams(client_id="a", key=k, size=64)
                    await call(stream, 10 + i, "PutStart", put)
                    await call(stream, 20 + i, "PutEnd", rpc.KeyClientParams(client_id="a", key=k))
                frames = [
                    rpc.encode_request(100 + i, "ExistKey", rpc.KeyParams(key="ka"))
                    for i in range(40)
                ]
                frames.append(
                    rpc.encode_request(200, "GetReplicaListByRegex", rpc.RegexParams(regex="^k"))
                )
                frames += [
                    rpc.encode_request(300 + i, "ExistKey", rpc.KeyParams(key="kz"))
                    for i in range(40)
                ]
                await stream.send(b"".join(frames))
                got = await read_replies(stream, 81)
                assert [m.id for m in got] == [*range(100, 140), 200, *range(300, 340)]
                assert rpc.decode_result("ExistKey", got[0]) is True
                assert sorted(rpc.decode_result("GetReplicaListByRegex", got[40])) == ["ka", "kb"]
                assert rpc.decode_result("ExistKey", got[-1]) is False
                # the connection keeps working after the hand-back to the loop
                with pytest.raises(ObjectNotFoundError):
                    await call(stream, 400, "GetReplicaList", rpc.KeyParams(key="kz"))
            if threaded:
                assert server.rpc_thread is not None and server.rpc_thread.rounds > 0

    trio.run(main)


@BOTH
def test_a_flood_that_never_reads_does_not_starve_another_connection(threaded: bool) -> None:
    """One peer sends requests without reading any answer: its answers fill the socket
    buffers, the master stops reading it (nothing grows without bound) and answers another
    connection meanwhile; once the flood reads, every answer arrives, in order."""

    async def main() -> None:
        async with master(threaded) as server:
            setup = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            keys = [f"key-{i:04d}-" + "x" * 200 for i in range(500)]  # ~100 KB per answer
            async with setup:
                mount = rpc.MountSegmentParams(client_id="a", segment=seg())
                await call(setup, 1, "MountSegment", mount)
                put = rpc.BatchPutStartParams(client_id="a", keys=keys, sizes=[64] * len(keys))
                await call(setup, 2, "BatchPutStart", put)
                end = rpc.BatchKeyClientParams(client_id="a", keys=keys)
                await call(setup, 3, "BatchPutEnd", end)
            with socket.create_connection(("127.0.0.1", server.rpc_port)) as flood:
                n = 200  # ~20 MB of answers, far more than the socket buffers hold
                flood.sendall(
                    b"".join(rpc.encode_request(i, "GetAllKeys", rpc.Empty()) for i in range(n))
                )
                await anyio.sleep(0.3)  # the master fills the buffers and waits for the reader
                other = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
                async with other:
                    assert await call(other, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                flood.setblocking(True)
                dec = rpc.MessageDecoder()
                ids: list[int] = []
                with anyio.fail_after(60):
                    while len(ids) < n:
                        data = await anyio.to_thread.run_sync(flood.recv, 1 << 20)
                        assert data, "the master closed the flooding connection"
                        dec.feed(data)
                        for m in dec:
                            assert isinstance(m, rpc.Response)
                            assert len(rpc.decode_result("GetAllKeys", m)) == len(keys)
                            ids.append(m.id)
                assert ids == list(range(n))

    trio.run(main)


@BOTH
def test_idle_connection_closed_busy_one_kept(threaded: bool) -> None:
    """``idle_timeout``: a connection quiet between frames is closed, one calling is not."""

    async def check_closed() -> None:
        async with master(threaded, idle_timeout=0.5) as server:
            idle = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            busy = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with idle, busy:
                assert await call(idle, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                closed = False
                with anyio.fail_after(30):
                    i = 2
                    while not closed:
                        assert await call(busy, i, "ServiceReady", rpc.Empty()) == rpc.VERSION
                        i += 1
                        with anyio.move_on_after(0.05):
                            try:
                                await idle.receive()
                            except (anyio.EndOfStream, anyio.BrokenResourceError):
                                closed = True
                assert server.connections_dropped >= 1

    trio.run(check_closed)


@BOTH
def test_authentication_on_the_connection(threaded: bool) -> None:
    async def main() -> None:
        secret = "s3cret"
        async with master(threaded, cluster_secret=secret) as server:
            bad = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with bad:
                await bad.send(rpc.encode_request(1, "ServiceReady", rpc.Empty()))
                (reply,) = await read_replies(bad, 1)
                assert reply.code != 0 and "authentication required" in reply.message
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    with anyio.fail_after(10):
                        while True:
                            await bad.receive()
            good = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with good:
                cn = auth.new_nonce()
                ch = await call(good, 1, "AuthHello", rpc.AuthHelloParams(nonce=cn))
                key = auth.load_secret(secret)
                assert key is not None
                assert auth.verify(auth.server_proof(key, "rpc", cn, ch.nonce), ch.proof)
                proof = auth.client_proof(key, "rpc", cn, ch.nonce)
                await call(good, 2, "AuthProve", rpc.AuthProveParams(proof=proof))
                assert await call(good, 3, "ServiceReady", rpc.Empty()) == rpc.VERSION
            assert server.auth_failures == 1

    trio.run(main)


def test_cancelling_the_master_closes_threaded_connections_and_stops_the_thread() -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cfg = MasterServerConfig(rpc_port=0, metrics_port=-1, cluster_secret="")
            server: MasterServer = await tg.start(serve_master, cfg)
            rt = server.rpc_thread
            assert rt is not None
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                assert await call(stream, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                tg.cancel_scope.cancel()
                await anyio.lowlevel.checkpoint()
            # the loop still runs; the state is usable and the thread gone
        assert server.rpc_thread is None and not any(w.thread.is_alive() for w in rt._workers)
        assert server.state.object_count == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.rpc_port), timeout=2).close()

    trio.run(main)


def test_mock_clock_masters_stay_on_the_loop() -> None:
    """Under trio's ``MockClock`` time moves with the loop: the thread is not used."""
    import trio.testing

    async def main() -> None:
        cfg = MasterServerConfig(rpc_port=0, metrics_port=-1, cluster_secret="")
        async with anyio.create_task_group() as tg:
            server = await tg.start(serve_master, cfg)
            assert server.rpc_thread is None
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                assert await call(stream, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
            tg.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@BOTH
def test_a_slow_but_steady_reader_is_not_dropped(threaded: bool) -> None:
    """Answers far larger than the socket buffers, read slowly for several times
    ``progress_timeout``: every byte sent restarts that deadline, so the connection stays."""

    async def main() -> None:
        # 2.5 s: a loaded host (load 11 on 2 cores) left a reader unscheduled for over 0.6 s
        async with master(threaded, progress_timeout=2.5) as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            keys = [f"key-{i:04d}-" + "x" * 200 for i in range(500)]  # ~100 KB per answer
            async with stream:
                mount = rpc.MountSegmentParams(client_id="a", segment=seg())
                await call(stream, 1, "MountSegment", mount)
                put = rpc.BatchPutStartParams(client_id="a", keys=keys, sizes=[64] * len(keys))
                await call(stream, 2, "BatchPutStart", put)
                await call(
                    stream, 3, "BatchPutEnd", rpc.BatchKeyClientParams(client_id="a", keys=keys)
                )
                n = 100  # ~10 MB, read 64 KiB per 50 ms: >= 7.6 s, three progress timeouts
                await stream.send(
                    b"".join(
                        rpc.encode_request(10 + i, "GetAllKeys", rpc.Empty()) for i in range(n)
                    )
                )
                dec = rpc.MessageDecoder()
                ids: list[int] = []
                with anyio.fail_after(120):
                    while len(ids) < n:
                        await anyio.sleep(0.05)  # seconds in all: several progress timeouts
                        dec.feed(await stream.receive(64 << 10))
                        ids.extend(m.id for m in dec)
                assert ids == [10 + i for i in range(n)]
            assert server.connections_dropped == 0

    trio.run(main)


def test_forked_snapshots_while_threads_serve_puts(tmp_path: Any) -> None:
    """Local snapshots fork the process while the serving threads answer puts: each snapshot
    restores to a state whose objects are all readable and complete (one forked while a put
    was half applied would not restore or would miss a key of a finished pair)."""
    from mooncake._store.snapshots import DirSnapshots, SnapshotConfig

    async def main() -> None:
        snap = SnapshotConfig(directory=str(tmp_path), interval=0.1)
        async with master(True, snapshot=snap) as server:
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with stream:
                mount = rpc.MountSegmentParams(client_id="a", segment=seg())
                await call(stream, 1, "MountSegment", mount)
                i = 0
                with anyio.fail_after(60):
                    while server.last_snapshot_seq < 4:
                        keys = [f"k{i}-{j}" for j in range(32)]
                        put = rpc.BatchPutStartParams(
                            client_id="a", keys=keys, sizes=[64] * len(keys)
                        )
                        await call(stream, 10 + 2 * i, "BatchPutStart", put)
                        end = rpc.BatchKeyClientParams(client_id="a", keys=keys)
                        assert await call(stream, 11 + 2 * i, "BatchPutEnd", end) == [0] * 32
                        i += 1
        store = DirSnapshots(tmp_path, "mooncake_cluster", 2)
        newest = store.newest_sync()
        assert newest is not None
        from mooncake._core.master import MasterState

        restored = MasterState.restore(newest.data, MasterConfig(seed=0))
        keys = restored.readable_keys()
        assert keys and len(keys) % 32 == 0  # whole batches only: no snapshot mid-batch

    trio.run(main)


@BOTH
def test_at_the_connection_cap_an_idle_connection_gives_way(threaded: bool) -> None:
    """``max_connections``: the connection that reaches the cap closes the longest-idle one (its
    loop task is cancelled; with the threads, the thread lets go of it first)."""

    async def main() -> None:
        async with master(threaded, max_connections=3) as server:
            a = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            b = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with a, b:
                assert await call(a, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                await anyio.sleep(0.05)
                assert await call(b, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                c = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
                async with c:
                    assert await call(c, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                        with anyio.fail_after(10):
                            await a.receive()  # the longest idle: closed
                    assert await call(b, 2, "ServiceReady", rpc.Empty()) == rpc.VERSION
            assert server.slots.evicted == 1

    trio.run(main)


def test_a_connection_is_stamped_idle_before_its_reply_can_be_seen(monkeypatch: Any) -> None:
    """A thread's connection is idle from its last reply on, stamped before the reply is sent:
    stamped after it, a thread descheduled in between (here: made slow after its sends) left
    the accept loop seeing the older connection as the more recently active one, and at the
    cap it evicted that one, not the longest idle."""
    import time

    from mooncake._store import rpc_thread

    rearm = rpc_thread._Worker._rearm

    def late(self: Any, c: Any) -> None:
        time.sleep(0.2)
        rearm(self, c)

    monkeypatch.setattr(rpc_thread._Worker, "_rearm", late)

    async def main() -> None:
        async with master(True) as server:
            a = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            b = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            async with a, b:
                assert await call(a, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                await anyio.sleep(0.5)
                assert await call(b, 1, "ServiceReady", rpc.Empty()) == rpc.VERSION
                by_port = {s.sock.getpeername()[1]: s for s in server.slots.live}
                port = anyio.abc.SocketAttribute.local_port
                assert by_port[a.extra(port)].since < by_port[b.extra(port)].since

    trio.run(main)


def test_a_restored_master_sweeps_on_its_restored_clock(tmp_path: Any) -> None:
    """A master restored from a snapshot goes on from the snapshot's clock: its sweeper expires
    clients by that clock, not by the loop's raw one (trio's starts at a random 10^4-2*10^5 s,
    so a client restored with 600 s left was dropped at the first sweep whenever that raw time
    lay past its deadline, taking every key with it)."""
    from mooncake._store.snapshots import DirSnapshots, Snapshot, SnapshotConfig

    cfg = MasterConfig(seed=0, client_ttl=600.0)
    state = MasterState(cfg)
    state.mount_segment("a", seg(), 1.0)
    state.put_start("a", "k", 64, ReplicateConfig(), 1.0)
    state.put_end("a", "k", 1.0)
    state.settle()
    DirSnapshots(tmp_path, "mooncake_cluster", 2).write_sync(Snapshot(1, state.snapshot(), 1.0))

    async def main() -> None:
        assert anyio.current_time() > 1.0 + 600.0  # the raw clock is past the client's deadline
        snap = SnapshotConfig(directory=str(tmp_path), restore=True, interval=3600.0)
        async with master(False, snapshot=snap) as server:
            assert server.state.readable_keys() == ["k"]
            sweeps: list[float] = []
            five = anyio.Event()
            real_sweep = server.state.sweep

            def counted(now: float) -> Any:
                sweeps.append(now)
                if len(sweeps) >= 5:
                    five.set()
                return real_sweep(now)

            server.state.sweep = counted  # type: ignore[method-assign]
            with anyio.fail_after(60):
                await five.wait()  # five real sweeps, however slowly the host runs them
            assert min(sweeps) < 1.0 + 600.0  # they ran on the restored clock
            assert server.state.readable_keys() == ["k"]
            assert "a" in server.state._clients

    trio.run(main)
