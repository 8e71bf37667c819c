"""The whole store and engine surface with ``MOONCAKE_CLUSTER_SECRET`` set on every process.

A real master and a holder client run as processes sharing the secret; this process is one more
client (the sync facade with its caller-thread fast path, the async facade, and the async
``Store``), then two engines (the sync facade and ``open_engine``) over each transport that
works on this machine. Every call must succeed: a connection that skips the challenge-response
(the caller-thread path once did) is refused by the master and turns a call into -900.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator

import anyio
import anyio.to_thread
import numpy as np
import pytest

import mooncake
from mooncake.engine import TransferEngine, TransferOpcode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_client_driver import value
from tests.helpers.store_procs import Client, Master

SECRET = "surface-cluster-secret"
MIB = 1 << 20


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", SECRET)


@pytest.fixture
def cluster(secret_env: None) -> Iterator[tuple[Master, Client]]:
    m = Master()
    try:
        holder = Client(m.address, 32)
        try:
            yield m, holder
        finally:
            holder.stop()
    finally:
        m.stop()


def _facade(address: str) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MIB, 32 * MIB, "tcp", "", address)
    assert rc == 0
    return s


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-mapped", "network-only"])
def test_sync_facade_surface_with_a_cluster_secret(
    cluster: tuple[Master, Client], memcpy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)
    master, holder = cluster
    me = _facade(master.address)
    buf = np.zeros(4 * MIB, dtype=np.uint8)
    base = int(buf.ctypes.data)
    try:
        assert me._fast is not None  # the caller-thread path is on (the default)
        assert me.register_buffer(base, buf.nbytes) == 0
        on_holder, on_me = ReplicateConfig(), ReplicateConfig()
        on_holder.preferred_segment = holder.hostname
        on_me.preferred_segment = me.get_hostname()
        for where, cfg in (("h", on_holder), ("m", on_me)):
            for i, n in enumerate((11, 4096, MIB + 1)):  # MIB + 1: the loop path
                key, v = f"{where}{i}", value(i, n)
                assert me.put(key, v, cfg) == 0, key
                assert me.get(key) == v
                assert me.is_exist(key) == 1 and me.get_size(key) == n
                assert me.get_into(key, base, buf.nbytes) == n and buf[:n].tobytes() == v
                buf[:n] = np.frombuffer(value(i + 50, n), dtype=np.uint8)
                assert me.put_from(key + "f", base, n, cfg) == 0
                assert me.get(key + "f") == value(i + 50, n)
            keys = [f"{where}b{j}" for j in range(3)]
            vals = [value(100 + j, 1000 + j) for j in range(3)]
            assert me.put_batch(keys, vals, cfg) == 0
            assert me.get_batch(keys) == vals
            assert me.batch_is_exist([*keys, "absent"]) == [1, 1, 1, 0]
            offs = [0, 8192, 16384]
            for j, v in enumerate(vals):
                buf[offs[j] : offs[j] + len(v)] = np.frombuffer(v, dtype=np.uint8)
            bkeys = [k + "p" for k in keys]
            ptrs, sizes = [base + o for o in offs], [len(v) for v in vals]
            assert me.batch_put_from(bkeys, ptrs, sizes, cfg) == [0, 0, 0]
            buf[:32768] = 0
            assert me.batch_get_into(bkeys, ptrs, sizes) == sizes
            assert [buf[o : o + len(v)].tobytes() for o, v in zip(offs, vals, strict=True)] == vals
            mkeys = [k + "m" for k in keys]
            halves = [[p, p + s // 2] for p, s in zip(ptrs, sizes, strict=True)]
            hsizes = [[s // 2, s - s // 2] for s in sizes]
            assert me.batch_put_from_multi_buffers(mkeys, halves, hsizes, cfg) == [0, 0, 0]
            assert me.get_batch(mkeys) == vals
            buf[:32768] = 0
            assert me.batch_get_into_multi_buffers(mkeys, halves, hsizes) == sizes
            assert [buf[o : o + len(v)].tobytes() for o, v in zip(offs, vals, strict=True)] == vals
            assert me.upsert(keys[0], b"replaced", cfg) == 0 and me.get(keys[0]) == b"replaced"
            h = me.get_buffer(keys[1])
            assert h is not None and ctypes.string_at(h.ptr(), h.size()) == vals[1]
            assert me.remove(keys[2], force=True) == 0 and me.is_exist(keys[2]) == 0
        # the holder process reads what this process wrote, through its own fast path
        assert holder.cmd("digest", key="m1")["len"] == 4096
        assert holder.cmd("exist", key="h2") == {"rc": 1}
        assert me._fast.hits > 0
    finally:
        me.unregister_buffer(base)
        me.close()


def test_a_client_without_the_secret_is_refused(
    cluster: tuple[Master, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, _ = cluster
    monkeypatch.delenv("MOONCAKE_CLUSTER_SECRET")
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address) != 0
    s.close()


def test_async_facade_and_store_with_a_cluster_secret(cluster: tuple[Master, Client]) -> None:
    from mooncake.async_store import MooncakeDistributedStoreAsync

    master, holder = cluster
    on_holder = ReplicateConfig()
    on_holder.preferred_segment = holder.hostname

    async def facade() -> None:
        s = MooncakeDistributedStoreAsync()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address)
        assert rc == 0
        try:
            assert await s.async_put("af", b"async facade", on_holder) == 0
            assert await s.async_get("af") == b"async facade"
            assert await s.async_is_exist("af") == 1
            assert await s.async_remove("af", True) == 0
        finally:
            s.close()

    asyncio.run(facade())

    async def native() -> None:
        async with mooncake.open_store(master.address, segment_size=16 * MIB) as st:
            await st.put("as", b"async store")
            assert await st.get("as") == b"async store"
            assert await st.get_batch(["as"]) == [b"async store"]
            # the holder reads it from this process's segment (served by this loop meanwhile)
            got = await anyio.to_thread.run_sync(lambda: holder.cmd("digest", key="as"))
            assert got["len"] == len(b"async store")

    anyio.run(native, backend="trio")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_engine_surface_with_a_cluster_secret(secret_env: None, transport: str) -> None:
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", transport, "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", transport, "") == 0
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        ab = a.allocate_managed_buffer(1 << 20)
        bb = b.allocate_managed_buffer(1 << 20)
        assert a.write_bytes_to_buffer(ab, b"secret bytes", 12) == 0
        assert a.transfer_sync_write(seg_b, ab, bb, 12) == 0
        assert b.read_bytes_from_buffer(bb, 12) == b"secret bytes"
        assert a.transfer_sync(seg_b, ab + 100, bb, 12, TransferOpcode.Read) == 0
        assert a.read_bytes_from_buffer(ab + 100, 12) == b"secret bytes"
        assert a.send_probe(seg_b) == 0
    finally:
        a.close()
        b.close()

    async def native() -> None:
        async with (
            mooncake.open_engine(transports=[transport]) as target,
            mooncake.open_engine(transports=[transport]) as initiator,
        ):
            tbuf = await target.allocate(1 << 20)
            ibuf = await initiator.allocate(1 << 20)
            ibuf.numpy()[:] = 7
            (res,) = await initiator.transfer(
                target.segment_name, [mooncake.TransferRequest.write(ibuf.addr, tbuf.addr, 65536)]
            )
            assert res.ok, res
            assert (tbuf.numpy()[:65536] == 7).all()

    anyio.run(native, backend="trio")


def test_the_shm_transport_runs_the_exchange_and_refuses_without_it(secret_env: None) -> None:
    import json
    import socket

    from mooncake._engine.transports.shm import ShmTransport, _Session

    def shm_of(engine: mooncake.Engine) -> ShmTransport:
        (t,) = [t for t in engine.transports if isinstance(t, ShmTransport)]
        return t

    async def native() -> None:
        async with (
            mooncake.open_engine(transports=["shm", "tcp"]) as target,
            mooncake.open_engine(transports=["shm", "tcp"]) as initiator,
        ):
            tbuf = await target.allocate(1 << 20)
            ibuf = await initiator.allocate(1 << 20)
            ibuf.numpy()[:] = 5
            (res,) = await initiator.transfer(
                target.segment_name, [mooncake.TransferRequest.write(ibuf.addr, tbuf.addr, 4096)]
            )
            assert res.ok, res
            assert (tbuf.numpy()[:4096] == 5).all()
            peer = await initiator.peer(target.segment_name)
            assert isinstance(peer.state.get("shm"), _Session)  # memory mapped, not TCP
            assert shm_of(target).auth_failures == 0
            # a same-uid process without the secret gets no buffer list, not even one fd
            name = str(peer.descriptor.extra["shm_socket"])
            assert peer.descriptor.extra.get("shm_auth") == 1
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                raw.connect("\0" + name.removeprefix("@"))
                raw.send(json.dumps({"op": "list"}).encode())
                raw.settimeout(30)  # the server runs on this loop: wait in a thread
                data, fds, _, _ = await anyio.to_thread.run_sync(
                    lambda: socket.recv_fds(raw, 1 << 16, 8)
                )
                assert data == b"" and fds == []  # closed on us
            finally:
                raw.close()
            assert shm_of(target).auth_failures == 1  # counted before it closed the socket

    anyio.run(native, backend="trio")
