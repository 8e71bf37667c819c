"""The pinning rule: a registered region stays pinned for as long as anything may touch it.

In-process, deterministic checks of each path: local (own-segment) copies on a worker thread,
lookups that went stale across an ``await`` (a region replaced at the same address, a shm entry
revoked during a refresh), and ``unregister`` cancelled while it waits. The random, crashing
version of the same properties is ``tests/test_memory_safety.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Engine, open_engine
from mooncake._engine.transports.shm import available
from mooncake.errors import NotRegisteredError, RegistrationError, RemoteAccessError

pytestmark = pytest.mark.anyio

R = TransferRequest
BIG = 128 << 20


def addr(a: np.ndarray[Any, Any]) -> int:
    return int(a.ctypes.data)


@pytest.mark.parametrize("which", ["dst", "src"])
async def test_local_transfer_pins_both_regions(which: str) -> None:
    """unregister() of either side of an own-segment copy waits for the worker-thread memcpy."""
    async with open_engine("127.0.0.1", transports=["tcp"]) as engine:
        src = np.full(BIG, 7, dtype=np.uint8)
        dst = np.zeros(BIG, dtype=np.uint8)
        rsrc = await engine.register(src)
        rdst = await engine.register(dst)
        order: list[str] = []

        async def copy() -> None:
            (res,) = await engine.transfer(engine.segment_name, [R.read(addr(dst), addr(src), BIG)])
            order.append("copied" if res.ok else f"failed: {res.error}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(copy)
            # every task blocked: the copy sits in its worker thread
            await anyio.wait_all_tasks_blocked()
            assert not order
            assert rsrc.users == 1 and rdst.users == 1
            await engine.unregister(dst if which == "dst" else src)
            # returned only after the copy: every byte landed before unregister returned
            order.append("unregistered")
            assert dst[-1] == 7 and dst[0] == 7
        assert order == ["copied", "unregistered"]
        assert rsrc.users == 0 and rdst.users == 0


async def test_local_transfer_to_a_region_being_unregistered_is_refused() -> None:
    async with open_engine("127.0.0.1", transports=["tcp"]) as engine:
        a = np.zeros(1 << 16, dtype=np.uint8)
        b = np.zeros(1 << 16, dtype=np.uint8)
        ra = await engine.register(a)
        await engine.register(b)
        ra.closing = True  # as unregister() does first
        with pytest.raises(NotRegisteredError):
            await engine.transfer(engine.segment_name, [R.write(addr(a), addr(b), 16)])
        ra.closing = False
        (res,) = await engine.transfer(engine.segment_name, [R.write(addr(b), addr(a), 16)])
        assert res.ok
        assert ra.users == 0


def _gate_peer_lookup(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """Make ``engine.peer`` wait for the returned event (the await a stale lookup spans)."""
    gate = anyio.Event()
    real = engine.peer

    async def slow_peer(segment: str, *, refresh: bool = False) -> Any:
        await gate.wait()
        return await real(segment, refresh=refresh)

    monkeypatch.setattr(engine, "peer", slow_peer)
    return gate


async def test_region_replaced_during_peer_lookup_pins_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        open_engine("127.0.0.1", transports=["tcp"]) as target,
        open_engine("127.0.0.1", transports=["tcp"]) as engine,
    ):
        tbuf = await target.allocate(1 << 20)
        local = np.zeros(1 << 20, dtype=np.uint8)
        old = await engine.register(local)
        await engine.peer(target.segment_name)  # cached: the gate is the only await left
        gate = _gate_peer_lookup(engine, monkeypatch)
        seen: list[int] = []
        real_execute = engine.batches._execute

        async def spy(*args: Any) -> None:
            seen.append(engine.registry.get(addr(local)).users)
            await real_execute(*args)

        monkeypatch.setattr(engine.batches, "_execute", spy)
        out: list[Any] = []

        async def run() -> None:
            out.extend(
                await engine.transfer(target.segment_name, [R.read(addr(local), tbuf.addr, 4096)])
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.wait_all_tasks_blocked()
            await engine.unregister(local)  # not pinned yet: returns at once
            new = await engine.register(local)  # same address, a new region
            assert new is not old
            gate.set()
        assert out[0].ok
        assert seen == [1]  # the region registered now was pinned, not the stale one
        assert old.users == 0 and new.users == 0


async def test_cancelled_unregister_leaves_the_region_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        open_engine("127.0.0.1", transports=["tcp"]) as target,
        open_engine("127.0.0.1", transports=["tcp"]) as engine,
    ):
        tbuf = await target.allocate(1 << 20)
        local = np.zeros(1 << 20, dtype=np.uint8)
        region = await engine.register(local)
        hold = anyio.Event()
        real_execute = engine.batches._execute

        async def held(*args: Any) -> None:
            await hold.wait()  # a transfer in flight, pinning the region
            await real_execute(*args)

        monkeypatch.setattr(engine.batches, "_execute", held)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                engine.transfer, target.segment_name, [R.read(addr(local), tbuf.addr, 4096)]
            )
            await anyio.wait_all_tasks_blocked()
            assert region.users == 1
            with anyio.move_on_after(0.05) as scope:
                await engine.unregister(local)
            assert scope.cancelled_caught
            # still registered, usable, and unregister can be called again
            assert not region.closing
            assert engine.registry.find(addr(local), 1) is region
            hold.set()
        monkeypatch.undo()
        (res,) = await engine.transfer(target.segment_name, [R.read(addr(local), tbuf.addr, 16)])
        assert res.ok
        await engine.unregister(local)
        with pytest.raises(NotRegisteredError):
            engine.registry.get(addr(local))
        with pytest.raises((NotRegisteredError, RegistrationError)):
            await engine.unregister(local)


@pytest.mark.skipif(not available(), reason="shm needs Linux (AF_UNIX, memfd_create, /proc)")
async def test_shm_entry_revoked_during_a_refresh_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch looks its entries up, awaits a refresh (one range was missing), and meanwhile the
    server unregisters a buffer the batch had found: the stale entry must not be used (it used
    to fall through to process_vm at the old address)."""
    async with (
        open_engine("127.0.0.1", transports=["shm", "tcp"]) as server,
        open_engine("127.0.0.1", transports=["shm", "tcp"]) as client,
    ):
        arr = np.full(1 << 20, 0x5A, dtype=np.uint8)  # not engine memory: process_vm
        await server.register(arr)
        src = await client.allocate(1 << 20)
        src.numpy()[:] = 0xC3
        await client.read(server.segment_name, src.addr + 4096, addr(arr), 16)  # lists it
        src.numpy()[:] = 0xC3
        shm = next(t for t in client.transports if t.name == "shm")
        session = (await client.peer(server.segment_name)).state["shm"]
        real_refresh = session.refresh

        async def refresh_after_unregister() -> None:
            await server.unregister(arr)  # revoke + ack happen during our await
            await real_refresh()

        monkeypatch.setattr(session, "refresh", refresh_after_unregister)
        late = await server.allocate(4096)  # not yet listed: forces the refresh
        out = await shm.execute(
            await client.peer(server.segment_name),
            [R.write(src.addr, addr(arr), 1 << 20), R.write(src.addr, late.addr, 4096)],
        )
        assert isinstance(out[0].error, RemoteAccessError), out[0]
        assert out[1].ok
        assert (arr == 0x5A).all()  # not one byte written after its unregister returned


async def test_own_segment_device_copy_pins_both_regions() -> None:
    """The store's own-segment GPU path: a device copy held on its stream keeps both regions
    pinned; unregister of the host side returns only after the copy ran (fake CUDA runtime)."""
    from mooncake.testing.fake_cuda import FakeCudaRuntime

    rt = FakeCudaRuntime()
    try:
        async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=rt) as engine:
            dev = await engine.allocate(1 << 20, location="cuda:0")
            host = np.full(1 << 20, 3, dtype=np.uint8)
            rhost = await engine.register(host)
            order: list[str] = []
            rt.gate.clear()  # every stream worker waits: the copy stays enqueued

            async def copy() -> None:
                (res,) = await engine.transfer(
                    engine.segment_name, [R.read(dev.addr, addr(host), 1 << 20)]
                )
                order.append("copied" if res.ok else f"failed: {res.error}")

            async def unregister() -> None:
                await engine.unregister(host)
                order.append("unregistered")

            async with anyio.create_task_group() as tg:
                try:
                    tg.start_soon(copy)
                    await anyio.wait_all_tasks_blocked()
                    assert rhost.users == 1 and dev.region.users == 1
                    tg.start_soon(unregister)
                    await anyio.wait_all_tasks_blocked()
                    assert order == []  # unregister waits for the held copy
                finally:
                    rt.gate.set()
            assert order == ["copied", "unregistered"]
            out = np.zeros(1 << 20, dtype=np.uint8)
            await engine.register(out)
            (res,) = await engine.transfer(
                engine.segment_name, [R.read(addr(out), dev.addr, 1 << 20)]
            )
            assert res.ok and (out == 3).all()
    finally:
        rt.close()
