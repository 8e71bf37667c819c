"""Regex requests and master stalls: a pathological pattern or a stopped loop expires nobody.

Real time (no MockClock): the matching runs in a worker thread, and the stalls are real.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import anyio
import anyio.abc
import pytest
import trio

from mooncake._core import rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig
from mooncake._store.keyscan import KeyScanner
from mooncake._store.master import MasterServerConfig, serve_master
from mooncake.errors import InvalidArgumentError, InvalidKeyError
from tests.test_master_server import Client, seg

EVIL = "(a|aa)+$"  # exponential backtracking on a long run of a's that does not end the key
LONG_KEY = "a" * 5000 + "!"


async def _put(c: Client, cid: str, key: str, segment: int) -> None:
    cfg = ReplicateConfig(preferred_segments=[seg(segment).name])
    await c.call("PutStart", rpc.PutStartParams(client_id=cid, key=key, size=64, config=cfg))
    await c.call("PutEnd", rpc.KeyClientParams(client_id=cid, key=key))


async def _pinger(c: Client, cid: str, period: float) -> None:
    while True:
        await c.call("Ping", rpc.ClientParams(client_id=cid))
        await anyio.sleep(period)


@pytest.mark.timeout(120)
def test_catastrophic_regex_neither_stalls_the_master_nor_expires_a_live_client() -> None:
    async def main() -> None:
        cfg = MasterServerConfig(
            rpc_port=0,
            enable_metric_reporting=False,
            regex_budget=2.0,
            state=MasterConfig(seed=0, client_ttl=1.0),
        )
        streams: list[anyio.abc.SocketStream] = []
        try:
            async with anyio.create_task_group() as tg:
                server = await tg.start(serve_master, cfg)
                for _ in range(3):
                    streams.append(await anyio.connect_tcp("127.0.0.1", server.rpc_port))
                await _regex_scenario(tg, server, streams)
                tg.cancel_scope.cancel()
        finally:
            # closed once the pinger is cancelled: closing its stream under it (it may be in a
            # call at any moment) would fail it with ClosedResourceError
            for s in streams:
                await s.aclose()

    trio.run(main)


async def _regex_scenario(
    tg: anyio.abc.TaskGroup, server: Any, streams: list[anyio.abc.SocketStream]
) -> None:
    live, evil, other = (Client(s) for s in streams)
    await live.call("MountSegment", rpc.MountSegmentParams(client_id="L", segment=seg(0)))
    await _put(live, "L", "live-object", 0)
    await _put(live, "L", LONG_KEY, 0)
    tg.start_soon(_pinger, live, "L", 0.1)

    answered = 0
    scan_done = anyio.Event()
    outcome: list[BaseException] = []

    async def scan() -> None:
        try:
            await evil.call("RemoveByRegex", rpc.RegexParams(regex=EVIL, force=True))
        except InvalidArgumentError as e:
            outcome.append(e)
        scan_done.set()

    tg.start_soon(scan)
    while not scan_done.is_set():  # other RPCs are answered while the scan runs
        assert await other.call("ExistKey", rpc.KeyParams(key="live-object")) is True
        answered += 1
        await anyio.sleep(0.02)
    assert len(outcome) == 1 and "did not finish" in str(outcome[0])
    assert answered >= 3
    assert server.scanner.timeouts == 1
    assert server.state.has_client("L")
    assert server.state.stats.clients_expired == 0
    keys = await other.call("GetAllKeys", rpc.Empty())
    assert sorted(keys) == sorted(["live-object", LONG_KEY])  # the refused scan removed nothing
    # a benign pattern goes through the same path and works
    got = await other.call("GetReplicaListByRegex", rpc.RegexParams(regex="^live-"))
    assert list(got) == ["live-object"]
    assert await other.call("RemoveByRegex", rpc.RegexParams(regex="!$", force=True)) == 1
    with pytest.raises(InvalidKeyError):
        await other.call("RemoveByRegex", rpc.RegexParams(regex="(unclosed"))


@pytest.mark.timeout(120)
def test_a_stalled_master_loop_does_not_expire_a_client_that_kept_pinging() -> None:
    """The loop is blocked (a synchronous sleep in a task) longer than client_ttl, several times,
    while the client's pings queue up in its socket: no stall expires it."""

    async def main() -> None:
        cfg = MasterServerConfig(
            rpc_port=0, enable_metric_reporting=False, state=MasterConfig(seed=0, client_ttl=0.5)
        )
        async with anyio.create_task_group() as tg:
            server = await tg.start(serve_master, cfg)
            stream = await anyio.connect_tcp("127.0.0.1", server.rpc_port)
            c = Client(stream)
            await c.call("MountSegment", rpc.MountSegmentParams(client_id="L", segment=seg(0)))
            await _put(c, "L", "live-object", 0)

            # the pings are sent from a thread (a separate process would do as well) so that
            # they queue up in the master's socket while the master's loop cannot run
            stop = threading.Event()

            def ping() -> None:
                with socket.create_connection(("127.0.0.1", server.rpc_port)) as sock:
                    i = 0
                    while not stop.is_set():
                        i += 1
                        sock.sendall(rpc.encode_request(i, "Ping", rpc.ClientParams(client_id="L")))
                        time.sleep(0.05)

            pinger = threading.Thread(target=ping)
            pinger.start()
            for _ in range(4):
                await anyio.sleep(0.3)
                time.sleep(1.2)  # noqa: ASYNC251 -- the point: the master's loop stops for 2.4 TTLs
            await anyio.sleep(0.3)
            # while its heartbeat connection is open (closing it quarantines the client's
            # segments at once: ConnectionLost, by design)
            assert await c.call("ExistKey", rpc.KeyParams(key="live-object")) is True
            stop.set()
            pinger.join()
            assert server.state.has_client("L")
            assert server.state.stats.clients_expired == 0
            assert server.state.stats.stall_seconds >= 4.0
            await stream.aclose()
            tg.cancel_scope.cancel()

    trio.run(main)


def test_credit_stall_moves_every_client_deadline() -> None:
    m = MasterState(MasterConfig(client_ttl=1.0))
    m.ping("a", 0.0)
    m.credit_stall(5.0)
    assert m.expire_clients(5.5) == []
    assert m.expire_clients(6.5) == ["a"]


def test_scanner_refuses_bad_settings_and_long_patterns() -> None:
    with pytest.raises(InvalidArgumentError):
        KeyScanner(budget=0)

    async def main() -> None:
        s = KeyScanner(budget=1.0)
        assert await s.matching(["ab", "b", "ba"], "^b") == ["b", "ba"]
        with pytest.raises(InvalidKeyError, match="characters"):
            await s.matching(["x"], "a" * 10_000)

    trio.run(main)
