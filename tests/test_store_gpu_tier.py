"""The store's GPU tier: a client whose segment is device memory (``segment_location="cuda:N"``).

No GPU here: device memory is :class:`~mooncake.testing.fake_cuda.FakeCudaRuntime`'s (memfd-backed,
copies on worker-thread "streams", counted), so what these tests check is the routing and the
bytes: replicas on a device segment never take the host memfd/memcpy paths, they go through the
engine (own segment: the engine's CUDA stream; another client: the ``cuda`` transport or TCP
staging through pinned host memory), and the master reports the segment in its ``gpu`` tier.
``benchmarks/gpu_tier_check.py`` does the same on a real GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import mooncake
from mooncake._core.master import MasterConfig
from mooncake._engine.engine import open_engine
from mooncake._store import client as client_mod
from mooncake._store.client import Store
from mooncake._store.master import MasterServerConfig, serve_master
from mooncake.errors import InvalidArgumentError
from mooncake.store import ReplicateConfig
from mooncake.testing.fake_cuda import FakeCudaRuntime, view

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "tests" / "helpers" / "gpu_store_peer.py"


@asynccontextmanager
async def master_server(**state: Any) -> AsyncIterator[Any]:
    # A read window long enough for a loaded host: the default 0.5 s (+10 ms per MiB) was
    # exceeded by a 1 MiB read on the pure-Python path with three engines on one loop.
    state.setdefault("read_fence_ttl", 5.0)
    cfg = MasterServerConfig(rpc_port=0, enable_metric_reporting=False, state=MasterConfig(**state))
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield server
        tg.cancel_scope.cancel()


def url(server: Any) -> str:
    return f"127.0.0.1:{server.rpc_port}"


@asynccontextmanager
async def master(**state: Any) -> AsyncIterator[str]:
    async with master_server(**state) as server:
        yield f"127.0.0.1:{server.rpc_port}"


@pytest.fixture
def fake() -> Iterator[FakeCudaRuntime]:
    rt = FakeCudaRuntime()
    yield rt
    rt.close()


def pattern(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def on(store: Store) -> ReplicateConfig:
    cfg = ReplicateConfig()
    cfg.preferred_segment = store.segment_name
    return cfg


class CopySpy:
    """Records every address range the same-host memcpy path (``Store._copy``) touched, and
    every segment a get/put judged memcpy-able (``Store._is_copyable``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.copyable: set[str] = set()
        real = Store._copy
        real_copyable = Store._is_copyable

        def copyable(store: Store, segment: str) -> bool:
            ok = real_copyable(store, segment)
            if ok:
                self.copyable.add(segment)
            return ok

        monkeypatch.setattr(Store, "_is_copyable", copyable)

        async def spy(store: Store, copies: list[tuple[int, int, int]], ops: Any) -> None:
            for dst, src, n in copies:
                self.ranges += [(dst, n), (src, n)]
            await real(store, copies, ops)

        monkeypatch.setattr(Store, "_copy", spy)

    def touched(self, addr: int, length: int) -> bool:
        return any(a < addr + length and addr < a + n for a, n in self.ranges)


@pytest.fixture(autouse=True)
def _no_real_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the FAKE runtime: on a GPU machine an engine opened with default
    transports would add the real ``cuda`` transport and try the fake IPC handles with it."""
    monkeypatch.setenv("MC_DISABLE_CUDA", "1")


@pytest.mark.parametrize("peer_transports", [["tcp"], ["tcp", "cuda"]], ids=["tcp", "cuda"])
def test_put_get_through_a_device_segment(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch, peer_transports: Sequence[str]
) -> None:
    """Client ``a`` mounts fake-device memory; ``a`` itself, a host-segment client ``b`` and a
    pure client ``c`` put into it and get from it. Bytes land in (and come from) the device
    memory, and no copy took the memfd/memcpy path for it."""
    monkeypatch.setenv("MC_STORE_MEMCPY", "1")  # the same-host path is on: it must be skipped
    spy = CopySpy(monkeypatch)

    async def main() -> None:
        async with (
            master_server() as server,
            open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as ea,
            open_engine("127.0.0.1", transports=peer_transports, cuda_runtime=fake) as eb,
            open_engine("127.0.0.1", transports=peer_transports, cuda_runtime=fake) as ec,
            mooncake.open_store(
                url(server), engine=ea, segment_size=4 * MIB, segment_location="cuda:0"
            ) as a,
            mooncake.open_store(url(server), engine=eb, segment_size=4 * MIB) as b,
            mooncake.open_store(url(server), engine=ec, segment_size=0) as c,
        ):
            dev = a.device_segment
            assert dev is not None and a.segment is None
            assert a.mounted is not None and a.mounted.location == "cuda:0"
            assert ea.registry.find(dev.addr, dev.length).location == "cuda:0"  # type: ignore[union-attr]
            copies = fake.copies
            for i, n in enumerate((1, 4096, 100_003, MIB)):
                for writer in (a, b, c):
                    key = f"k{i}-{writer is a}{writer is b}"
                    v = pattern(n, i * 3 + (writer is b))
                    await writer.put(key, v, on(a))
                    (rep,) = await a.replica_descriptors(key)
                    assert rep.segment_name == a.segment_name
                    assert dev.addr <= rep.addr and rep.addr + n <= dev.addr + dev.length
                    assert bytes(view(rep.addr, n)) == v  # in the device memory
                    for reader in (a, b, c):
                        assert await reader.get(key) == v
            # batches too
            vals = [pattern(5000 + i, 50 + i) for i in range(4)]
            keys = [f"batch{i}" for i in range(4)]
            assert await b.put_batch(keys, vals, on(a)) == [None] * 4
            assert await c.get_batch(keys) == vals
            assert await a.get_batch(keys) == vals
            # every byte in or out of the device segment was a device copy, none a memcpy
            assert fake.copies > copies
            assert not spy.touched(dev.addr, dev.length)
            assert a.segment_name not in spy.copyable
            assert b._shm.cached(a.segment_name) is None  # nothing mapped: no memfd served
            assert await b._shm.lookup(a.segment_name) is None
            # b's host segment still takes the memcpy path from a same-host client
            before = len(spy.ranges)
            v = pattern(8192, 99)
            await c.put("host", v, on(b))
            assert await c.get("host") == v
            assert len(spy.ranges) > before and b.segment_name in spy.copyable
            assert c._shm.cached(b.segment_name) is not None
            # the master knows the tiers apart
            tiers = await c.segment_tiers()
            assert tiers["gpu"]["segments"] == 1 and tiers["gpu"]["capacity"] == dev.length
            assert tiers["gpu"]["used"] > 0
            assert tiers["dram"]["segments"] == 1 and tiers["dram"]["capacity"] == 4 * MIB
            metrics = {
                (m.name, smp.labels.get("tier")): smp.value
                for m in text_string_to_metric_families(generate_latest(server.registry).decode())
                for smp in m.samples
            }
            assert metrics["master_tier_segments", "gpu"] == 1
            assert metrics["master_tier_capacity_bytes", "gpu"] == dev.length
            assert metrics["master_tier_used_bytes", "gpu"] == tiers["gpu"]["used"]
            assert metrics["master_tier_segments", "dram"] == 1
        # the store gave its device memory back (engines closed too: nothing left)
        assert fake.live()["device"] == 0

    trio.run(main)


def test_zero_copy_into_and_out_of_a_device_segment(fake: FakeCudaRuntime) -> None:
    """``put_from``/``get_into`` with host and device caller buffers, replica on the own device
    segment: engine copies both ways, bytes exact."""

    async def main() -> None:
        async with (
            master() as addr,
            open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as ea,
            mooncake.open_store(
                addr, engine=ea, segment_size=2 * MIB, segment_location="cuda:0"
            ) as a,
        ):
            host = await ea.allocate(MIB)
            devbuf = await ea.allocate(MIB, location="cuda:0")
            v = pattern(300_001, 5)
            host.numpy()[: len(v)] = np.frombuffer(v, np.uint8)
            await a.put_from("h", host.addr, len(v))
            view(devbuf.addr, len(v))[:] = np.frombuffer(v[::-1], np.uint8)
            await a.put_from("d", devbuf.addr, len(v))
            host.numpy()[:] = 0
            assert await a.get_into("d", host.addr, len(v)) == len(v)
            assert bytes(host.numpy()[: len(v)]) == v[::-1]
            view(devbuf.addr, len(v))[:] = 0
            assert await a.get_into("h", devbuf.addr, len(v)) == len(v)
            assert bytes(view(devbuf.addr, len(v))) == v

    trio.run(main)


def test_cuda_runtime_threads_through_open_store(fake: FakeCudaRuntime) -> None:
    """Without ``engine=``, ``cuda_runtime`` reaches the engine ``open_store`` opens."""

    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(
                addr, segment_size=MIB, segment_location="cuda:0", cuda_runtime=fake
            ) as a,
        ):
            assert a.device_segment is not None and fake.live()["device"] == 1
            await a.put("k", b"abc" * 1000)
            assert await a.get("k") == b"abc" * 1000

    trio.run(main)


@pytest.mark.parametrize("loc", ["gpu:0", "cuda", "cuda:-1", ""])
def test_bad_segment_location_is_refused(loc: str) -> None:
    async def main() -> None:
        with pytest.raises(InvalidArgumentError, match="location"):
            async with mooncake.open_store("127.0.0.1:1", segment_location=loc):
                pass  # pragma: no cover

    trio.run(main)


def test_host_segment_is_unchanged() -> None:
    """The default location mounts the memfd segment, omitted from the wire as before."""
    import msgspec

    from mooncake._core import store_types as st

    seg = st.Segment(id="x", name="n", base=1, size=2)
    assert seg.location == "cpu:0" and b"location" not in msgspec.msgpack.encode(seg)
    assert client_mod.Store("m:1", segment_size=1, local_buffer_size=0).segment_location == "cpu:0"


class GpuStorePeer:
    """``tests/helpers/gpu_store_peer.py``: a store client with a fake-device segment, in a child
    process."""

    def __init__(self, master: str, transports: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), master, "--transports", transports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._line()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("gpu_store_peer exited")
        out: dict[str, Any] = json.loads(line)
        return out

    async def cmd(self, **kw: Any) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(kw) + "\n")
            self.proc.stdin.flush()
            return self._line()

        out = await trio.to_thread.run_sync(call)
        assert out.get("ok"), out
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.mark.parametrize("transports", ["tcp", "tcp,cuda"])
def test_device_segment_in_another_process(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch, transports: str
) -> None:
    """The device segment's owner is another process on this host: a host-segment client and a
    pure client put into it and read back (``cuda``: IPC handles opened across processes; ``tcp``:
    the owner's server stages), the owner reads what they wrote and they read what it wrote.
    No memfd is served for it, so nothing here maps it."""
    monkeypatch.setenv("MC_STORE_MEMCPY", "1")
    spy = CopySpy(monkeypatch)

    async def main() -> None:
        async with master() as addr:
            peer = await trio.to_thread.run_sync(GpuStorePeer, addr, transports)
            try:
                seg = peer.info["segment"]
                base, size = peer.info["base"], peer.info["size"]
                cfg = ReplicateConfig()
                cfg.preferred_segment = seg
                async with (
                    open_engine(
                        "127.0.0.1", transports=transports.split(","), cuda_runtime=fake
                    ) as eb,
                    mooncake.open_store(addr, engine=eb, segment_size=2 * MIB) as b,
                    mooncake.open_store(addr, segment_size=0) as c,
                ):
                    for i, n in enumerate((1, 4097, 300_000)):
                        for w in (b, c):
                            key = f"x{i}-{w is b}"
                            v = pattern(n, 10 * i + (w is b))
                            await w.put(key, v, cfg)
                            (r,) = await b.replica_descriptors(key)
                            assert r.segment_name == seg
                            assert base <= r.addr and r.addr + n <= base + size
                            assert await b.get(key) == v and await c.get(key) == v
                            got = await peer.cmd(op="get", key=key)
                            assert bytes.fromhex(got["data_hex"]) == v
                        v = pattern(n, 100 + i)
                        await peer.cmd(op="put", key=f"own{i}", data_hex=v.hex())
                        assert await b.get(f"own{i}") == v and await c.get(f"own{i}") == v
                    assert await b._shm.lookup(seg) is None and seg not in spy.copyable
                    assert not spy.ranges  # no memcpy at all: b's segment was never used
                    if transports == "tcp,cuda":
                        assert fake.ipc_opens >= 1  # b really opened the peer's IPC handle
                    stats = await peer.cmd(op="stats")
                    assert stats["copies"] > 0
                    assert (await c.segment_tiers())["gpu"]["segments"] == 1
            finally:
                await trio.to_thread.run_sync(peer.close)

    trio.run(main)


def test_sync_fast_path_hands_device_replicas_to_the_loop(fake: FakeCudaRuntime) -> None:
    """The sync facade's caller-thread path (``FastPath``) never memcpys a device-segment
    replica: puts and gets on it go to the loop (``hits`` stays 0), bytes exact; a host-segment
    replica still takes the fast path."""
    from mooncake._store.fastpath import FastPath
    from mooncake._sync import LoopThread

    loop = LoopThread(name="gpu-tier-test")
    ready: Any = {}

    async def life(stop: Any) -> None:
        async with (
            master() as addr,
            mooncake.open_store(
                addr, segment_size=2 * MIB, segment_location="cuda:0", cuda_runtime=fake
            ) as a,
            mooncake.open_store(addr, segment_size=2 * MIB) as b,
        ):
            ready.update(a=a, b=b, stop=anyio.Event())
            stop.set()
            await ready["stop"].wait()

    started = threading.Event()
    fut = loop.submit(life, started)
    try:
        assert started.wait(30), fut.exception(0) if fut.done() else "store did not start"
        a, b = ready["a"], ready["b"]
        fp = FastPath(a, loop)
        try:
            dev = a.device_segment
            v = pattern(70_000, 7)
            src = np.frombuffer(v, np.uint8).copy()
            fp.put("k", src.ctypes.data, len(v), on(a), upsert=False)
            (r,) = loop.call(a.replica_descriptors, "k")
            assert dev.addr <= r.addr < dev.addr + dev.length
            assert bytes(view(r.addr, len(v))) == v
            assert fp.get("k") == v
            out = np.zeros(len(v), np.uint8)
            loop.call(a.register_buffer, out.ctypes.data, len(v))
            assert fp.get_into("k", out.ctypes.data, len(v)) == len(v)
            assert out.tobytes() == v
            assert fp.hits == 0  # all three went through the loop
            # control: a replica on b's host segment is memcpy'd from this thread once mapped
            # (the first put, on the loop, maps it)
            fp.put("h", src.ctypes.data, len(v), on(b), upsert=False)
            assert fp.get("h") == v and fp.hits == 1
        finally:
            fp.close()

        async def stop() -> None:
            ready["stop"].set()

        loop.call(stop)
        fut.result(30)
    finally:
        loop.close()
