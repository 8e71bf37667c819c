"""The store client against HA-style master addresses, with real etcd and real master processes:
``etcd://`` resolution, following a changed ``master_view``, retries with request ids across a
connection that loses the reply, and clear errors for malformed addresses."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import msgspec
import pytest
import trio

import mooncake
from mooncake._core import rpc
from mooncake._core.store_types import Segment
from mooncake._engine.metadata.etcd import EtcdKV
from mooncake._store.leader import master_view_key, parse_ha_address
from mooncake._store.master_conn import MasterConnection
from mooncake.errors import (
    InvalidArgumentError,
    MasterUnreachableError,
    NotSupportedError,
    ObjectNotFoundError,
)
from tests import services
from tests.helpers.store_procs import Client, Master

pytestmark = pytest.mark.etcd

CLUSTER = "ha_client_test"
KEY = master_view_key(CLUSTER)


@pytest.fixture(scope="module")
def etcd1() -> Iterator[services.EtcdCluster]:
    with services.etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture
def masters() -> Iterator[list[Master]]:
    ms = [Master(), Master()]
    try:
        yield ms
    finally:
        for m in ms:
            m.stop()


def _kv(cluster: services.EtcdCluster) -> EtcdKV:
    return EtcdKV(parse_ha_address(cluster.conn))


async def _set_leader(cluster: services.EtcdCluster, addr: str | None) -> None:
    kv = _kv(cluster)
    try:
        if addr is None:
            await kv.delete(KEY)
        else:
            await kv.put(KEY, addr.encode())
    finally:
        await kv.aclose()


# -- addresses --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "error", "match"),
    [
        ("etcd://", InvalidArgumentError, "names no etcd endpoint"),
        ("etcd:// ; ", InvalidArgumentError, "names no etcd endpoint"),
        ("etcd://host", InvalidArgumentError, "'host' is not host:port"),
        ("etcd://h:1;nope", InvalidArgumentError, "'nope' is not host:port"),
        ("etcd://h:0", InvalidArgumentError, "'h:0' is not host:port"),
        ("etcd://h:70000", InvalidArgumentError, "'h:70000' is not host:port"),
        ("etcd://h:12/x", InvalidArgumentError, "'h:12/x' is not host:port"),
        ("redis://h:6379", NotSupportedError, "only etcd://"),
        ("k8s://ns/name", NotSupportedError, "only etcd://"),
        ("no-port", InvalidArgumentError, "host:port"),
    ],
)
def test_malformed_master_addresses_are_refused_by_name(
    address: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        MasterConnection(address)


def test_etcd_address_forms() -> None:
    assert parse_ha_address("etcd://a:1;b:2,[::1]:3") == [
        "http://a:1",
        "http://b:2",
        "http://[::1]:3",
    ]
    c = MasterConnection("etcd://a:1", cluster_id="c9/")
    assert c.resolver is not None and c.resolver.key == "mooncake-store/c9/master_view"


def test_cluster_id_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_STORE_CLUSTER_ID", raising=False)
    c = MasterConnection("etcd://a:1")
    assert (
        c.resolver is not None and c.resolver.key == "mooncake-store/mooncake_cluster/master_view"
    )
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", "tenant-a")
    c = MasterConnection("etcd://a:1")
    assert c.resolver is not None and c.resolver.key == "mooncake-store/tenant-a/master_view"


def test_sync_facade_setup_refuses_a_malformed_etcd_address() -> None:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "etcd://nohost")
    assert rc != 0


# -- resolution and following -----------------------------------------------------------------


def test_resolves_the_leader_through_etcd(
    etcd1: services.EtcdCluster, masters: list[Master], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    a = masters[0]

    async def main() -> None:
        await _set_leader(etcd1, a.address)
        async with mooncake.open_store(etcd1.conn, segment_size=4 << 20) as store:
            assert store.master.leader == a.address
            await store.put("k", b"v" * 1000)
            assert await store.get("k") == b"v" * 1000
            # the object went to master A: ask A directly
            direct = MasterConnection(a.address)
            try:
                assert await direct.call("GetAllKeys", rpc.Empty()) == ["k"]
            finally:
                direct.close()

    trio.run(main)


def test_no_leader_within_the_timeout_is_a_clear_error(
    etcd1: services.EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER + "-empty")

    async def main() -> None:
        conn = MasterConnection(etcd1.conn, failover_timeout=0.5)
        try:
            with pytest.raises(MasterUnreachableError, match="no leader of cluster"):
                await conn.call("Ping", rpc.ClientParams(client_id="x"))
        finally:
            await conn.aclose()

    trio.run(main)


def test_follows_a_changed_master_view_and_remounts(
    etcd1: services.EtcdCluster, masters: list[Master], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two plain masters, the key switched from A to B: the client drops A, retries at B,
    re-mounts its segment there (B did not know it), and a call made while no master is
    named waits for one instead of failing."""
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    a, b = masters

    async def segments_at(addr: str) -> list[str]:
        direct = MasterConnection(addr)
        try:
            segs = await direct.call("GetAllSegments", rpc.Empty())
        finally:
            direct.close()
        return [s.client_id for s in segs]

    async def main() -> None:
        await _set_leader(etcd1, a.address)
        async with mooncake.open_store(etcd1.conn, segment_size=4 << 20) as store:
            await store.put("at-a", b"a" * 100)
            assert store.client_id in await segments_at(a.address)
            await _set_leader(etcd1, b.address)
            with trio.fail_after(20):
                while store.client_id not in await segments_at(b.address):  # noqa: ASYNC110 (polls another process)
                    await trio.sleep(0.1)  # the heartbeat remounts at B
            assert store.master.leader == b.address
            await store.put("at-b", b"b" * 100)
            assert await store.get("at-b") == b"b" * 100
            with pytest.raises(ObjectNotFoundError):
                await store.get("at-a")  # B never had it: the state is B's
            # no leader for a while: the call in flight waits, then lands at the new one
            await _set_leader(etcd1, None)
            done: list[bytes] = []

            async def late_get() -> None:
                await store.put("during", b"d" * 10)
                done.append(await store.get("during"))

            async with trio.open_nursery() as n:
                await _set_leader(etcd1, "127.0.0.1:1")  # named but dead: retried, not failed
                n.start_soon(late_get)
                await trio.sleep(0.5)
                assert not done
                await _set_leader(etcd1, a.address)
            assert done == [b"d" * 10]
            assert store.master.leader == a.address
            assert store.master.retries > 0

    trio.run(main)


def test_sync_facade_in_a_process_uses_an_etcd_address(
    etcd1: services.EtcdCluster, masters: list[Master], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    a = masters[0]
    trio.run(_set_leader, etcd1, a.address)
    c = Client(etcd1.conn, 4)
    try:
        assert c.cmd("put", key="p", seed=3, size=5000)["rc"] == 0
        assert c.cmd("digest", key="p")["len"] == 5000
    finally:
        c.stop()


class Standby:
    """A master that is not the leader: answers every request -1010 "not the leader" (real
    frames over a real socket, as a standby of an HA cluster does)."""

    def __init__(self) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.refused: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with c:
            self._refuse(c)

    def _refuse(self, c: socket.socket) -> None:
        dec = rpc.MessageDecoder()
        while True:
            try:
                data = c.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            dec.feed(data)
            for msg in dec:
                assert isinstance(msg, rpc.Request)
                self.refused.append(msg.method)
                c.sendall(rpc.encode_error(msg.id, -1010, "not the leader: this is a standby"))


def test_a_standby_answer_makes_the_client_re_resolve(
    etcd1: services.EtcdCluster, masters: list[Master], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", CLUSTER)
    standby = Standby()

    async def main() -> None:
        await _set_leader(etcd1, standby.address)
        conn = MasterConnection(etcd1.conn)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(conn.follow)
                got: list[bool] = []

                async def exists() -> None:
                    got.append(await conn.call("ExistKey", rpc.KeyParams(key="nothing")))

                n.start_soon(exists)
                with trio.fail_after(10):
                    while not standby.refused:  # noqa: ASYNC110 (polls another thread)
                        await trio.sleep(0.05)
                assert not got  # refused, not failed: still retrying
                await _set_leader(etcd1, masters[0].address)
                with trio.fail_after(20):
                    while not got:  # noqa: ASYNC110 (polls the retrying call)
                        await trio.sleep(0.05)
                n.cancel_scope.cancel()
            assert got == [False] and conn.leader == masters[0].address
        finally:
            await conn.aclose()
            standby.lsock.close()

    trio.run(main)


def test_with_one_master_a_standby_answer_is_returned_as_is() -> None:
    standby = Standby()

    async def main() -> None:
        conn = MasterConnection(standby.address)
        try:
            with pytest.raises(mooncake.errors.UnavailableError, match="not the leader"):
                await conn.call("ExistKey", rpc.KeyParams(key="k"))
            assert conn.retries == 0
        finally:
            conn.close()
            standby.lsock.close()

    trio.run(main)


# -- a reply lost after the master applied the call -------------------------------------------


class ReplyDropper:
    """A TCP proxy in front of a master that, once armed for ``method``, forwards that request
    but swallows its reply and cuts the connection: the master applied the call, the client
    never heard."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.arm: str | None = None
        self.dropped = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.lsock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            watched: set[int] = set()
            threading.Thread(target=self._up, args=(c, u, watched), daemon=True).start()
            threading.Thread(target=self._down, args=(u, c, watched), daemon=True).start()

    @staticmethod
    def _frames(sock: socket.socket) -> Iterator[bytes]:
        buf = b""
        while True:
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                n = 4 + struct.unpack(">I", buf[:4])[0]
                yield buf[:n]
                buf = buf[n:]
            try:
                data = sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buf += data

    def _up(self, c: socket.socket, u: socket.socket, watched: set[int]) -> None:
        for f in self._frames(c):
            body = msgspec.msgpack.decode(f[4:])
            if self.arm is not None and body[0] == 0 and body[2] == self.arm:
                watched.add(body[1])
            try:
                u.sendall(f)
            except OSError:
                return
        u.close()

    def _down(self, u: socket.socket, c: socket.socket, watched: set[int]) -> None:
        for f in self._frames(u):
            body = msgspec.msgpack.decode(f[4:])
            if body[0] == 1 and body[1] in watched:
                self.arm = None
                self.dropped += 1
                for s in (c, u):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    s.close()
                return
            try:
                c.sendall(f)
            except OSError:
                return
        c.close()


def test_a_put_start_whose_reply_is_lost_is_retried_and_applied_once(
    masters: list[Master],
) -> None:
    m = masters[0]
    proxy = ReplyDropper(m.address)

    async def main() -> None:
        direct = MasterConnection(m.address)
        seg = Segment(id="seg-1", name="holder", base=1 << 30, size=1 << 20, te_endpoint="holder")
        await direct.call("MountSegment", rpc.MountSegmentParams(client_id="h", segment=seg))
        conn = MasterConnection(proxy.address)
        try:
            proxy.arm = "PutStart"
            put = rpc.PutStartParams(client_id="w", key="once", size=4096)
            reps = await conn.call("PutStart", put)  # reply lost, retried on a new connection
            assert proxy.dropped == 1 and conn.retries == 1
            assert len(reps) == 1
            segs = await direct.call("GetAllSegments", rpc.Empty())
            assert [s.used for s in segs] == [4096]  # allocated once, not twice
            # a fresh PutStart of the same key (another rid) is applied: refused, pending
            with pytest.raises(mooncake.errors.StoreError):
                await conn.call("PutStart", put)
            proxy.arm = "PutEnd"
            await conn.call("PutEnd", rpc.KeyClientParams(client_id="w", key="once"))
            assert proxy.dropped == 2
            assert await direct.call("GetAllKeys", rpc.Empty()) == ["once"]
            # a read whose answer is lost is simply asked again; its fence starts at the resend
            proxy.arm = "GetReplicaList"
            t_before = trio.current_time()
            resp, sent = await conn.call_stamped("GetReplicaList", rpc.KeyParams(key="once"))
            assert proxy.dropped == 3 and conn.retries == 3
            assert sent > t_before and len(resp.replicas) == 1
            proxy.arm = "Remove"
            await conn.call("Remove", rpc.RemoveParams(key="once", force=True))
            assert proxy.dropped == 4  # answered "removed" again, not "not found"
            assert await direct.call("GetAllKeys", rpc.Empty()) == []
        finally:
            conn.close()
            direct.close()
            proxy.close()

    trio.run(main)


def test_a_store_put_survives_a_lost_put_end_reply(masters: list[Master]) -> None:
    m = masters[0]
    proxy = ReplyDropper(m.address)

    async def main() -> None:
        async with mooncake.open_store(proxy.address, segment_size=4 << 20) as store:
            proxy.arm = "PutEnd"
            await store.put("p", b"x" * 3000)  # without a rid the retry would fail (not pending)
            assert proxy.dropped == 1
            # the cut connection may have been this client's heartbeat connection: the master
            # then quarantines its segment (ConnectionLost) until its next heartbeat (1 s)
            with trio.fail_after(60):
                while True:
                    try:
                        got = await store.get("p")
                        break
                    except mooncake.errors.ReplicaNotFoundError:
                        await trio.sleep(0.1)
            assert got == b"x" * 3000

    try:
        trio.run(main)
    finally:
        proxy.close()
