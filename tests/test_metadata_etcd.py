"""etcd backend against real etcd processes: failover across members, leases, watches."""

from __future__ import annotations

import gc
import inspect
import json
import re
import signal
import sys
from collections.abc import Iterator

import anyio
import pytest
import trio

import mooncake
from mooncake._engine.metadata import open_kv
from mooncake._engine.metadata.etcd import EtcdKV, parse_endpoints, prefix_end
from mooncake._engine.metadata.kv import KeyLayout, KVMetadata
from mooncake.errors import InvalidArgumentError, MetadataError
from tests import services

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as cluster:
        yield cluster


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1;b:2, http://c:3") == ["http://a:1", "http://b:2", "http://c:3"]
    with pytest.raises(InvalidArgumentError, match="host:port"):
        parse_endpoints("nohostport")
    with pytest.raises(InvalidArgumentError, match="names no endpoint"):
        parse_endpoints(" ; ")
    for bad in ("h:0", "h:70000", "h:12/x", "h:12?q=1", "ftp://h:1"):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"{bad!r} is not host:port")):
            parse_endpoints(bad)
    assert prefix_end(b"mooncake/ram/") == b"mooncake/ram0"
    assert prefix_end(b"a\xff") == b"b"


def test_cluster_id_prefix(etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "tenant7")

    async def main() -> None:
        async with mooncake.open_engine("127.0.0.1", etcd1.conn, segment_name="cid-a") as a:
            assert isinstance(a.metadata, KVMetadata)
            async with open_kv(etcd1.conn) as kv:
                assert isinstance(kv, EtcdKV)
                keys = await kv.list("mooncake/")
                assert "mooncake/tenant7/ram/cid-a" in keys
                assert "mooncake/tenant7/rpc_meta/cid-a" in keys
                assert "mooncake/ram/cid-a" not in keys

    trio.run(main)


def test_watch_updates_and_drops_cached_peer(etcd1: services.EtcdCluster) -> None:
    """A's cached copy of B follows B's unregister (no transfer needed) and B's exit."""

    async def main() -> None:
        async with mooncake.open_engine("127.0.0.1", etcd1.conn, segment_name="w-a") as a:
            assert isinstance(a.metadata, KVMetadata)
            async with mooncake.open_engine("127.0.0.1", etcd1.conn, segment_name="w-b") as b:
                b1 = await b.allocate(4096)
                b2 = await b.allocate(4096)
                peer = await a.peer("w-b")
                assert peer.descriptor.find_buffer(b2.addr, 4096) is not None
                await b.unregister(b2)
                with anyio.fail_after(10):
                    while a._peers["w-b"].descriptor.find_buffer(b2.addr, 4096) is not None:  # noqa: ASYNC110 (polls another process)
                        await anyio.sleep(0.02)
                assert a._peers["w-b"].descriptor.find_buffer(b1.addr, 4096) is not None
            with anyio.fail_after(10):
                while "w-b" in a._peers:  # noqa: ASYNC110 (polls another process)
                    await anyio.sleep(0.02)
            assert a.metadata.watch_events >= 2

    trio.run(main)


def test_lost_lease_is_replaced_and_keys_rewritten(etcd1: services.EtcdCluster) -> None:
    """Revoking an engine's lease from outside deletes its keys; the engine notices at its
    next keep-alive, takes a new lease and publishes again."""

    async def main() -> None:
        layout = KeyLayout()
        async with (
            mooncake.open_engine("127.0.0.1", etcd1.conn, segment_name="lease-a") as a,
            open_kv(etcd1.conn) as kv,
        ):
            assert isinstance(a.metadata, KVMetadata) and isinstance(a.metadata.kv, EtcdKV)
            ekv = a.metadata.kv
            ekv.lease_ttl = 1  # renew often (the lease itself keeps its granted TTL)
            old = ekv.lease_id
            assert isinstance(kv, EtcdKV)
            await kv.call("/v3/lease/revoke", {"ID": old})
            assert await kv.get(layout.ram("lease-a")) is None
            with anyio.fail_after(20):
                while await kv.get(layout.ram("lease-a")) is None:  # noqa: ASYNC110 (polls another process)
                    await anyio.sleep(0.1)
            assert ekv.lease_id != old and ekv.leases_granted == 2
            assert await kv.get(layout.rpc_meta("lease-a")) is not None

    trio.run(main)


def test_unreachable_etcd_is_a_clear_error() -> None:
    port = services.free_port()

    async def main() -> None:
        with pytest.raises(MetadataError, match=rf"no member answered.*127\.0\.0\.1:{port}"):
            async with mooncake.open_engine("127.0.0.1", f"etcd://127.0.0.1:{port}"):
                pass

    trio.run(main)


@pytest.mark.slow
def test_engine_survives_killing_members_of_a_3_member_cluster() -> None:
    """Two engines on a 3-member cluster; the member they talk to is killed (SIGKILL), quorum
    (2 of 3) remains. Publishing, lookups, leases and transfers carry on through the others."""
    with services.etcd_cluster(3) as cluster:
        # a dead address first in the list: the engines start through failover already
        conn = f"etcd://127.0.0.1:{services.free_port()};" + cluster.conn.removeprefix("etcd://")

        async def main() -> None:
            layout = KeyLayout()
            async with (
                mooncake.open_engine("127.0.0.1", conn, segment_name="ha-a") as a,
                mooncake.open_engine("127.0.0.1", conn, segment_name="ha-b") as b,
            ):
                assert isinstance(a.metadata, KVMetadata) and isinstance(a.metadata.kv, EtcdKV)
                assert isinstance(b.metadata, KVMetadata) and isinstance(b.metadata.kv, EtcdKV)
                a.metadata.kv.lease_ttl = b.metadata.kv.lease_ttl = 3
                cur = a.metadata.kv.current_endpoint
                victim = next(m for m in cluster.members if cur.endswith(m.endpoint))
                src = await b.allocate(1 << 20)
                src.numpy()[:] = 0x5A
                dst = await a.allocate(1 << 20)
                await a.read("ha-b", dst.addr, src.addr, 1 << 20)
                victim.stop(signal.SIGKILL)
                # everything below needs etcd: register (publish), lookup of a new peer,
                # watch-driven refresh, lease renewal over several TTLs
                fresh = await b.allocate(1 << 16)
                fresh.numpy()[:] = 0xC3
                a.forget("ha-b")
                out = await a.allocate(1 << 16)
                await a.read("ha-b", out.addr, fresh.addr, 1 << 16)
                assert (out.numpy() == 0xC3).all()
                assert not a.metadata.kv.current_endpoint.endswith(victim.endpoint)
                assert a.metadata.kv.failovers >= 2  # the dead first address, then the victim
                await anyio.sleep(4)  # > one TTL: keep-alives went to the survivors
                async with open_kv(conn) as kv:
                    for seg in ("ha-a", "ha-b"):
                        raw = await kv.get(layout.ram(seg))
                        assert raw is not None and json.loads(raw)["name"] == seg
                    bufs = json.loads(await kv.get(layout.ram("ha-b")) or b"{}")["buffers"]
                    assert fresh.addr in {x["addr"] for x in bufs}

        trio.run(main)


def test_a_watch_cancelled_inside_its_callback_leaves_nothing_to_finalize(
    etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling a watch while its callback awaits (a store or an engine closing) ends every
    async generator of the HTTP stream there and then: none is left for the garbage collector,
    which trio reports as a ``ResourceWarning`` ("garbage collected before it had been
    exhausted")."""
    unraisable: list[str] = []
    monkeypatch.setattr(
        sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
    )

    async def one_round(prefix: str) -> None:
        kv = EtcdKV(parse_endpoints(etcd1.conn.removeprefix("etcd://")))
        in_callback = trio.Event()

        async def callback(key: str, value: bytes | None) -> None:
            in_callback.set()
            await trio.sleep_forever()

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(kv.watch, prefix, callback)
                await kv.put(prefix + "k", b"v")
                with trio.fail_after(30):
                    await in_callback.wait()
                nursery.cancel_scope.cancel()
        finally:
            await kv.aclose()
        gc.collect()

    async def main() -> None:
        for round_ in range(3):
            await one_round(f"gc-watch/{round_}/")

    trio.run(main)
    gc.collect()
    assert unraisable == []


def test_request_bodies_are_plain_iterators_with_the_json_bytes() -> None:
    """The body of every etcd request iterates without an async generator (a cancelled send
    would leave one for the garbage collector) and carries the JSON of the call, resendable."""
    kv = EtcdKV(["http://127.0.0.1:1"])

    async def main() -> None:
        try:
            req = kv._request("http://127.0.0.1:1/v3/kv/range", {"key": "YQ=="})
            assert req.headers["content-type"] == "application/json"
            assert req.headers["content-length"] == str(len(b'{"key":"YQ=="}'))
            for _ in range(2):
                it = aiter(req.stream)  # type: ignore[arg-type]
                assert not inspect.isasyncgen(it)
                assert [c async for c in it] == [b'{"key":"YQ=="}']
        finally:
            await kv.aclose()

    trio.run(main)
