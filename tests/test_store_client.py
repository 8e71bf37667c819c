"""The async store client against an in-process master: flows, routes, fences, cancellation."""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import mooncake
from mooncake._core.master import MasterConfig
from mooncake._store import moves as moves_mod
from mooncake._store import writes as writes_mod
from mooncake._store.master import MasterServerConfig, serve_master
from mooncake.errors import (
    ErrorCode,
    InvalidArgumentError,
    LeaseExpiredError,
    NoAvailableHandleError,
    NotRegisteredError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
)
from mooncake.store import ReplicateConfig

MIB = 1 << 20


@asynccontextmanager
async def master(**state: Any) -> AsyncIterator[str]:
    cfg = MasterServerConfig(rpc_port=0, enable_metric_reporting=False, state=MasterConfig(**state))
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield f"127.0.0.1:{server.rpc_port}"
        tg.cancel_scope.cancel()


def run(fn: Callable[[], Awaitable[None]], clock: Any = None) -> None:
    trio.run(fn, clock=clock)


def pattern(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-memcpy", "network"])
def test_put_get_between_two_clients(memcpy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)

    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=8 * MIB, local_buffer_size=8 * MIB) as a,
            mooncake.open_store(addr, segment_size=8 * MIB, local_buffer_size=8 * MIB) as b,
        ):
            on_b = ReplicateConfig()
            on_b.preferred_segment = b.segment_name
            on_a = ReplicateConfig()
            on_a.preferred_segment = a.segment_name
            for i, n in enumerate((1, 4096, 100_003, 2 * MIB)):
                v = pattern(n, i)
                await a.put(f"k{i}", v, on_b)  # a writes into b's segment
                await a.put(f"own{i}", v, on_a)
                assert await b.get(f"k{i}") == v  # b reads its own segment
                assert await a.get(f"k{i}") == v  # a reads b's segment
                assert await b.get(f"own{i}") == v
                assert (await a.replica_descriptors(f"k{i}"))[0].segment_name == b.segment_name
            assert a._shm.enabled is (memcpy == "1")
            assert (a._shm.cached(b.segment_name) is not None) is (memcpy == "1")
            # batch forms, zero-copy
            src = await a.engine.allocate(4 * MIB)
            dst = await a.engine.allocate(4 * MIB)
            src.numpy()[:] = np.frombuffer(pattern(4 * MIB, 9), dtype=np.uint8)
            keys = [f"z{i}" for i in range(32)]
            res = await a.batch_put_from(
                keys, [src.addr + i * 4096 for i in range(32)], [4096] * 32, on_b
            )
            assert res == [None] * 32
            got = await a.batch_get_into(
                keys, [dst.addr + i * 4096 for i in range(32)], [4096] * 32
            )
            assert got == [4096] * 32
            assert bytes(dst.view[: 32 * 4096]) == bytes(src.view[: 32 * 4096])
            vals = await b.get_batch([*keys, "missing"])
            assert vals[:32] == [bytes(src.view[i * 4096 : (i + 1) * 4096]) for i in range(32)]
            assert isinstance(vals[32], ObjectNotFoundError)
            assert await b.batch_exists([*keys[:2], "missing"]) == [1, 1, 0]

    run(main)


def test_semantics_of_the_published_store() -> None:
    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=1 * MIB) as s,
        ):
            await s.put("k", b"A" * 100)
            await s.put("k", b"B" * 50)  # existing key: a silent no-op
            assert await s.get("k") == b"A" * 100
            await s.upsert("k", b"C" * 70)
            assert await s.get("k") == b"C" * 70
            with pytest.raises(ObjectHasLeaseError):
                await s.remove("k")  # the get above leased it
            await s.remove("k", force=True)
            with pytest.raises(ObjectNotFoundError):
                await s.get("k")
            with pytest.raises(InvalidArgumentError):
                await s.put("e", b"")
            with pytest.raises(InvalidArgumentError, match="local buffer"):
                await s.put("big", bytes(2 * MIB))  # larger than the staging buffer
            with pytest.raises(NoAvailableHandleError):
                buf = await s.engine.allocate(5 * MIB)
                await s.put_from("huge", buf.addr, 5 * MIB)  # larger than any segment
            unreg = np.zeros(4096, dtype=np.uint8)
            with pytest.raises(NotRegisteredError):
                await s.put_from("u", int(unreg.ctypes.data), 4096)
            await s.put("small", b"x" * 8192)
            buf2 = await s.engine.allocate(4096)
            with pytest.raises(InvalidArgumentError, match="smaller"):
                await s.get_into("small", buf2.addr, 4096)
            assert await s.get_size("small") == 8192
            res = await s.batch_put_from(["a", "b"], [buf2.addr], [1, 2])
            assert all(isinstance(r, InvalidArgumentError) for r in res) and len(res) == 2
            assert await s.batch_put_from([], [], []) == []
            assert await s.remove_all(force=True) == 1

    run(main)


def test_read_finishing_after_its_window_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that outlives its read window raises LeaseExpiredError instead of returning bytes."""
    clock = trio.testing.MockClock()
    real = moves_mod._memcpy_many
    slow = {"on": False}

    async def copy_then_stall(copies: Any) -> None:
        if slow["on"]:
            clock.jump(30)  # the copy "takes" 30 s: past any read window and the lease
        await real(copies)

    real_crc = moves_mod._memcpy_many_crc

    async def crc_then_stall(copies: Any, sums: Any) -> list[int]:
        if slow["on"]:
            clock.jump(30)
        return await real_crc(copies, sums)

    for mod in (moves_mod, writes_mod):  # the read and the write paths
        monkeypatch.setattr(mod, "_memcpy_many", copy_then_stall)
    monkeypatch.setattr(moves_mod, "_memcpy_many_crc", crc_then_stall)  # verified copies

    async def main() -> None:
        async with (
            master(client_ttl=1000.0) as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=MIB) as s,
        ):
            v = pattern(65536)
            await s.put("k", v)
            dst = await s.engine.allocate(65536)
            assert await s.get_into("k", dst.addr, 65536) == 65536
            slow["on"] = True
            with pytest.raises(LeaseExpiredError):
                await s.get_into("k", dst.addr, 65536)
            res = await s.batch_get_into(["k"], [dst.addr], [65536])
            assert isinstance(res[0], LeaseExpiredError)
            slow["on"] = False
            assert s.lease_fences == 2, s.lease_fences
            assert await s.get("k") == v  # a timely read works again

    run(main, clock=clock)


def test_cancelled_put_is_revoked(monkeypatch: pytest.MonkeyPatch) -> None:
    real = moves_mod._memcpy_many
    stall = {"on": True}

    async def maybe_stall(copies: Any) -> None:
        if stall["on"]:
            await anyio.sleep_forever()
        await real(copies)

    real_crc = moves_mod._memcpy_many_crc

    async def maybe_stall_crc(copies: Any, sums: Any) -> list[int]:
        if stall["on"]:
            await anyio.sleep_forever()
        return await real_crc(copies, sums)

    for mod in (moves_mod, writes_mod):  # the read and the write paths
        monkeypatch.setattr(mod, "_memcpy_many", maybe_stall)
    monkeypatch.setattr(moves_mod, "_memcpy_many_crc", maybe_stall_crc)  # verified copies

    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=MIB) as s,
        ):
            with anyio.move_on_after(0.2) as scope:
                await s.put("k", b"v" * 1000)
            assert scope.cancelled_caught
            assert not await s.exists("k")  # revoked, not left half-written
            stall["on"] = False
            await s.put("k", b"w" * 1000)  # no zombie blocks the key
            assert await s.get("k") == b"w" * 1000

    run(main)


def test_asyncio_backend_smoke() -> None:
    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=MIB) as s,
        ):
            await s.put("k", b"hello")
            assert await s.get("k") == b"hello"
            assert await s.health() == 0

    anyio.run(main, backend="asyncio")


def test_ranged_read_fenced_by_its_window_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranged read that outlives its read window is read once more with a fresh
    GetReplicaList (as ``get``): the caller gets the bytes, the fence is counted; a read
    fenced twice gives LEASE_EXPIRED."""
    clock = trio.testing.MockClock()
    real = moves_mod._memcpy_many
    stalls = {"left": 0}

    async def copy_then_stall(copies: Any) -> None:
        if stalls["left"] > 0:
            stalls["left"] -= 1
            clock.jump(30)  # the copy "takes" 30 s: past any read window and the lease
        await real(copies)

    monkeypatch.setattr(moves_mod, "_memcpy_many", copy_then_stall)
    monkeypatch.setenv("MOONCAKE_STORE_CHECKSUM", "0")  # the plain copy path is the one stalled

    async def main() -> None:
        async with (
            master(client_ttl=1000.0) as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=MIB) as s,
        ):
            v = pattern(65536)
            await s.put("k", v)
            dst = await s.engine.allocate(8192)
            args = ([dst.addr], [["k"]], [[[0, 4096]]], [[[100, 60000]]], [[[4096, 4096]]])
            stalls["left"] = 1
            assert await s.get_into_ranges(*args) == [[[4096, 4096]]]
            got = bytes((ctypes.c_char * 8192).from_address(dst.addr))
            assert got == v[100:4196] + v[60000:64096]
            assert s.lease_fences == 1, s.lease_fences
            stalls["left"] = 2  # fenced again on the second try: the error, no stale bytes
            code = int(ErrorCode.LEASE_EXPIRED)
            assert await s.get_into_ranges(*args) == [[[code, code]]]
            assert s.lease_fences == 3, s.lease_fences

    run(main, clock=clock)
