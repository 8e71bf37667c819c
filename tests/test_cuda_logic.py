"""GPU paths without a GPU: descriptor encoding, the runtime loader, the completion bridge, the IPC
handle cache, staging through pinned buffers, transport routing, and the cuda transport between
two real processes.

Everything above the CUDA runtime runs here against ``FakeCudaRuntime`` (mooncake.testing), a test
double backed by host memory whose IPC handles really open in another process. What only a GPU
can show (real IPC, real DMA, speed) is in ``tests/test_gpu.py``, skipped here.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core import gpu
from mooncake._core.descriptor import decode_descriptor
from mooncake._core.transfer import TransferRequest, TransferStatus
from mooncake._engine.cudaio import Completions, Stager
from mooncake._engine.engine import Engine, open_engine
from mooncake._engine.transports import TRANSPORTS, default_transports
from mooncake._engine.transports.cuda import CudaTransport, HandleCache, host_id
from mooncake._fast import cuda
from mooncake.errors import (
    CudaError,
    InvalidArgumentError,
    NoGpuError,
    NotSupportedError,
    ProtocolError,
)
from mooncake.testing.fake_cuda import FakeCudaRuntime, view
from tests.helpers.driver import LineDriver

HELPER = Path(__file__).parent / "helpers" / "fake_cuda_peer.py"


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@pytest.fixture
def fake() -> Iterator[FakeCudaRuntime]:
    rt = FakeCudaRuntime()
    yield rt
    rt.close()


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- descriptor encoding ----------------------------------------------------------------------


@given(st.binary(min_size=64, max_size=64))
def test_ipc_handle_roundtrip(handle: bytes) -> None:
    text = gpu.encode_ipc_handle(handle)
    assert len(text) == 128 and text == text.upper()
    assert gpu.decode_ipc_handle(text) == handle


@pytest.mark.parametrize("bad", ["", "AB" * 63, "AB" * 65, "ZZ" * 64, 12, None, ["AB" * 64]])
def test_ipc_handle_malformed(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="shm_name"):
        gpu.decode_ipc_handle(bad)


def test_ipc_handle_wrong_size() -> None:
    with pytest.raises(InvalidArgumentError, match="64 bytes"):
        gpu.encode_ipc_handle(b"x" * 63)


def test_locations() -> None:
    assert gpu.parse_location("cuda:3") == ("cuda", 3)
    assert gpu.parse_location("cpu:0") == ("cpu", 0)
    for bad in ("cuda", "cuda:-1", "gpu:0", "cuda:x", "*", "cuda:0 "):
        with pytest.raises(InvalidArgumentError, match="location"):
            gpu.parse_location(bad)
    assert gpu.device_of("cuda:2") == 2
    assert gpu.device_of("cpu:0") is None
    assert gpu.device_of("cuda:") is None


def test_device_buffer_fields_roundtrip_through_descriptor() -> None:
    handle = bytes(range(64))
    raw = {
        "name": "127.0.0.1:1",
        "protocol": "tcp",
        "buffers": [
            {"name": "cuda:1", "addr": 0x10000, "length": 4096, **gpu.buffer_fields(handle, 256)},
            {"name": "cuda:0", "addr": 0x20000, "length": 4096, **gpu.buffer_fields(handle, 0)},
            {"name": "cpu:0", "addr": 0x30000, "length": 4096},
        ],
    }
    desc = decode_descriptor(json.loads(json.dumps(raw)))
    b1, b0, host = desc.buffers
    assert (
        "ipc_offset" not in b0.extra
    )  # omitted when 0, as the published encoder has no such field
    d1 = gpu.device_buffer(b1.name, b1.addr, b1.length, b1.extra)
    assert d1 is not None and (d1.device, d1.offset, d1.handle) == (1, 256, handle)
    assert d1.key == (0x10000 - 256, handle)
    assert gpu.device_buffer(host.name, host.addr, host.length, host.extra) is None
    assert desc.to_json()["buffers"][0]["shm_name"] == handle.hex().upper()


def test_published_nvlink_buffer_decodes() -> None:
    # the published nvlink_intra encoder: name, addr, length, shm_name; nothing else
    raw = {"name": "cuda:0", "addr": 4096, "length": 8192, "shm_name": "0A" * 64}
    (b,) = decode_descriptor({"name": "x", "protocol": "nvlink_intra", "buffers": [raw]}).buffers
    d = gpu.device_buffer(b.name, b.addr, b.length, b.extra)
    assert d is not None and d.offset == 0 and d.handle == b"\x0a" * 64


@pytest.mark.parametrize("off", [-1, 1 << 40, "3", True])
def test_device_buffer_bad_offset(off: Any) -> None:
    with pytest.raises(ProtocolError, match="ipc_offset"):
        gpu.device_buffer("cuda:0", 4096, 10, {"shm_name": "00" * 64, "ipc_offset": off})


# -- runtime loader ---------------------------------------------------------------------------


def test_status_mapping() -> None:
    with pytest.raises(NoGpuError, match=r"no usable GPU.*cudaErrorInsufficientDriver"):
        cuda.check(35, "cudaGetDeviceCount")
    with pytest.raises(NoGpuError, match="cudaErrorNoDevice"):
        cuda.check(100, "cudaGetDeviceCount")
    with pytest.raises(CudaError) as ei:
        cuda.check(700, "cudaMemcpyAsync", "cudaErrorIllegalAddress")
    assert ei.value.status == 700 and not isinstance(ei.value, NoGpuError)
    cuda.check(0, "fine")


def _libcudart() -> str | None:
    import ctypes

    for cand in cuda.library_candidates():
        try:
            ctypes.CDLL(cand)
            return cand
        except OSError:
            continue
    return None


@pytest.mark.parametrize("backend", ["ctypes", "dlopen"])
def test_real_libcudart_without_driver_is_no_gpu(backend: str) -> None:
    """A CUDA toolkit without a driver (this CI): the runtime loads, then says "no usable GPU"."""
    if cuda.is_available():
        pytest.skip("a usable GPU is present: the no-driver path cannot be observed")
    path = _libcudart()
    if path is None:
        pytest.skip("no libcudart on this machine")
    if backend == "dlopen":
        _cuda = pytest.importorskip("mooncake._fast._cuda", reason="_cuda extension not built")
        rt: Any = _cuda.DlopenRuntime(path)
    else:
        rt = cuda.CtypesRuntime(path)
    assert isinstance(rt, cuda.CudaRuntime)
    with pytest.raises(NoGpuError, match="no usable GPU"):
        rt.get_device_count()


def test_dlopen_missing_library() -> None:
    _cuda = pytest.importorskip("mooncake._fast._cuda", reason="_cuda extension not built")
    with pytest.raises(OSError):
        _cuda.DlopenRuntime("/nonexistent/libcudart.so")


def test_runtime_without_gpu_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if cuda.is_available():
        pytest.skip("a usable GPU is present")
    monkeypatch.setattr(cuda, "_runtime", None)
    monkeypatch.setattr(cuda, "_failure", None)
    with pytest.raises(NoGpuError, match=r"^no usable GPU") as ei:
        cuda.runtime()
    assert "ctypes" in str(ei.value) and "cupy" in str(ei.value)  # every backend was tried
    assert cuda.loaded_runtime() is None
    assert "cuda" not in default_transports()


def test_runtime_bad_backend_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "_runtime", None)
    monkeypatch.setattr(cuda, "_failure", None)
    monkeypatch.setenv("MOONCAKE_CUDA_BACKEND", "opencl")
    with pytest.raises(NoGpuError, match="MOONCAKE_CUDA_BACKEND='opencl'"):
        cuda.runtime()


def test_fake_implements_interface(fake: FakeCudaRuntime) -> None:
    assert isinstance(fake, cuda.CudaRuntime)
    assert TRANSPORTS["cuda"].endswith(":CudaTransport")


# -- completion bridge ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["eventfd", "thread"])
async def test_completion_reports_done_and_failure(fake: FakeCudaRuntime, mode: str) -> None:
    comp = Completions(fake, mode)
    s = fake.stream_create()
    src, dst = fake.host_alloc(4096), fake.malloc(4096)
    view(src, 4096)[:] = 9
    fake.memcpy_async(dst, src, 4096, s)
    await comp.wait(s)
    assert bytes(view(dst, 4096)) == b"\x09" * 4096
    fake.fail_next_copy(700)
    fake.memcpy_async(dst, src, 16, s)
    with pytest.raises(CudaError) as ei:
        await comp.wait(s)
    assert ei.value.status == 700
    fake.memcpy_async(dst, src, 16, s)  # the stream works again after the report
    await comp.wait(s)
    comp.close()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["eventfd", "thread"])
async def test_completion_wait_survives_cancellation(fake: FakeCudaRuntime, mode: str) -> None:
    """A cancelled wait still returns only after the copy it covers has finished."""
    comp = Completions(fake, mode)
    s = fake.stream_create()
    src, dst = fake.host_alloc(4096), fake.malloc(4096)
    view(src, 4096)[:] = 5
    fake.gate.clear()
    fake.memcpy_async(dst, src, 4096, s)
    finished = []

    async def waiter() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await comp.wait(s)
        finished.append(bytes(view(dst, 4)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert finished == []  # still held by the gate despite the cancel
        fake.gate.set()
    assert finished == [b"\x05" * 4]
    comp.close()


@pytest.mark.anyio
async def test_eventfd_pool_is_reused_and_bounded(fake: FakeCudaRuntime) -> None:
    comp = Completions(fake, "eventfd")
    streams = [fake.stream_create() for _ in range(8)]
    for _ in range(3):
        fake.gate.clear()  # all 8 waits in flight at once
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(comp.wait, s)
            await anyio.wait_all_tasks_blocked()
            fake.gate.set()
        assert comp.live_fds == 8  # one per concurrent wait, reused across rounds
    comp.close()
    assert comp.live_fds == 0


@pytest.mark.anyio
async def test_completion_does_not_block_the_loop(fake: FakeCudaRuntime) -> None:
    comp = Completions(fake, "eventfd")
    s = fake.stream_create()
    fake.gate.clear()
    done = anyio.Event()
    ticks = 0

    async def wait() -> None:
        await comp.wait(s)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        while ticks < 50:  # other tasks run while the stream is held
            await anyio.lowlevel.checkpoint()
            ticks += 1
        assert not done.is_set()
        fake.gate.set()
    assert done.is_set()
    comp.close()


def test_completion_mode_checked(fake: FakeCudaRuntime) -> None:
    with pytest.raises(InvalidArgumentError, match="MC_CUDA_COMPLETION"):
        Completions(fake, "poll")


# -- staging logic ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("length", [1, 4095, 4096, 4097, 3 * 4096 + 17])
async def test_stager_chunks_and_pipelines(fake: FakeCudaRuntime, length: int) -> None:
    """A host-only executor sees only pinned chunks; the bytes land where the device asked."""
    stager = Stager(fake, Completions(fake), chunk=4096, depth=2)
    dev = fake.malloc(length)
    remote = np.frombuffer(bytearray(pattern(length, 1)), np.uint8)
    raddr = int(remote.ctypes.data)
    seen: list[tuple[int, int]] = []
    inflight = peak = 0

    async def execute(reqs: Any) -> Any:
        nonlocal inflight, peak
        from mooncake._core.transfer import Opcode, completed
        from mooncake._fast import memcpy_at

        inflight += 1
        peak = max(peak, inflight)
        out = []
        for r in reqs:
            kind, _ = fake.pointer_get_attributes(r.local_addr)
            assert kind == cuda.MEMORY_HOST  # pinned, never the device pointer
            assert r.length <= 4096
            seen.append((r.remote_addr - raddr, r.length))
            await anyio.lowlevel.checkpoint()
            if r.opcode is Opcode.READ:
                memcpy_at(r.local_addr, r.remote_addr, r.length)
            else:
                memcpy_at(r.remote_addr, r.local_addr, r.length)
            out.append(completed(r.length))
        inflight -= 1
        return out

    (res,) = await stager.run(execute, [TransferRequest.read(dev, raddr, length)], [0])
    assert res.ok and res.transferred == length
    assert bytes(view(dev, length)) == remote.tobytes()
    assert sorted(seen) == [(o, min(4096, length - o)) for o in range(0, length, 4096)]
    assert peak <= 2  # bounded by the pinned pool
    view(dev, length)[:] = 0xAB
    (res,) = await stager.run(execute, [TransferRequest.write(dev, raddr, length)], [0])
    assert res.ok and remote.tobytes() == b"\xab" * length
    stager.close()
    assert fake.live()["host"] == 0  # pinned chunks freed


@pytest.mark.anyio
async def test_stager_failure_is_per_request(fake: FakeCudaRuntime) -> None:
    from mooncake._core.transfer import completed, failed
    from mooncake.errors import RemoteAccessError

    stager = Stager(fake, Completions(fake), chunk=1024, depth=3)
    a, b = fake.malloc(4096), fake.malloc(4096)
    host = bytearray(4096)
    haddr = int(np.frombuffer(host, np.uint8).ctypes.data)

    async def execute(reqs: Any) -> Any:
        return [
            failed(RemoteAccessError("no"))
            if r.remote_addr == haddr + 2048
            else completed(r.length)
            for r in reqs
        ]

    reqs = [TransferRequest.read(a, haddr, 4096), TransferRequest.read(b, haddr + 4096, 0 + 1)]
    r1, r2 = await stager.run(execute, reqs, [0, 0])
    assert r1.status is TransferStatus.FAILED and isinstance(r1.error, RemoteAccessError)
    assert r2.ok
    fake.fail_next_copy(700)
    (r3,) = await stager.run(execute, [TransferRequest.write(a, haddr, 512)], [0])
    assert isinstance(r3.error, CudaError) and r3.error.status == 700
    stager.close()


# -- handle cache (handles exported by a real second process) ---------------------------------


class Peer(LineDriver):
    """``tests/helpers/fake_cuda_peer.py`` in a child process."""

    def __init__(self, *extra: str) -> None:
        super().__init__([sys.executable, str(HELPER), *extra], what="fake_cuda_peer")


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer("--size", str(1 << 20), "--interior", "8192")
    yield p
    p.close()


@pytest.mark.anyio
async def test_handle_cache_opens_once_evicts_lru_and_prunes(
    fake: FakeCudaRuntime, peer: Peer
) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as engine:
        info = await engine.peer(peer.segment)
    bufs = [gpu.device_buffer(b.name, b.addr, b.length, b.extra) for b in info.descriptor.buffers]
    main, interior = [b for b in bufs if b is not None]
    assert {main.offset, interior.offset} == {0, 8192}
    cache = HandleCache(fake, capacity=1)
    p1 = cache.acquire(main)
    assert cache.acquire(main) == p1 and cache.opens == 1  # cached
    p2 = cache.acquire(interior)  # over capacity, but main is in use: nothing closed
    assert cache.closes == 0 and len(cache) == 2
    cache.release(main)
    cache.release(main)
    cache.release(interior)
    cache.acquire(main)  # opening nothing new; LRU eviction only when opening
    assert cache.opens == 2
    cache.prune({main.key})
    assert cache.closes == 1 and len(cache) == 1  # interior no longer published
    assert p2 != p1
    cache.release(main)
    cache.close()
    assert fake.live()["opened"] == 0


# -- the engine: registration, routing, staging, the cuda transport ---------------------------


@pytest.fixture
async def pair(fake: FakeCudaRuntime) -> AsyncIterator[tuple[Engine, Engine]]:
    async with (
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as b,
    ):
        yield a, b


@pytest.mark.anyio
async def test_register_device_memory_publishes_handle(fake: FakeCudaRuntime) -> None:
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as e:
        base = fake.malloc(1 << 16)
        r0 = await e.register((base, 4096), location="cuda:0")
        r1 = await e.register((base + 8192, 4096))  # "*": the loaded runtime says cuda:0
        assert r1.location == "cuda:0"
        desc = e.descriptor().to_json()
        assert desc["cuda_host"] == host_id()
        b0, b1 = desc["buffers"]
        assert b0["name"] == "cuda:0" and len(b0["shm_name"]) == 128
        assert "ipc_offset" not in b0 and b1["ipc_offset"] == 8192
        assert b0["shm_name"] == b1["shm_name"]  # one allocation, one handle
        await e.unregister(r0)
        await e.unregister(base + 8192)


@pytest.mark.anyio
async def test_register_device_checks(fake: FakeCudaRuntime) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as e:
        dev = fake.malloc(4096)
        with pytest.raises(InvalidArgumentError, match="sees 1 GPU"):
            await e.register((dev, 4096), location="cuda:1")
        with pytest.raises(InvalidArgumentError, match="not device memory"):
            await e.register((dev, 8192), location="cuda:0")  # runs past the allocation
        with pytest.raises(InvalidArgumentError, match="cannot have location"):
            await e.register(bytearray(64), location="cuda:0")
        with pytest.raises(InvalidArgumentError, match="bad memory location"):
            await e.register((dev, 4096), location="cuda0")
        assert len(e.registry) == 0


class FakeCudaArray:
    """Just ``__cuda_array_interface__`` (what cupy arrays expose)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: Any = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f4",
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


@pytest.mark.anyio
async def test_register_cuda_array_interface(fake: FakeCudaRuntime) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as e:
        ptr = fake.malloc(4096)
        arr = FakeCudaArray(ptr, (16, 64))
        region = await e.register(arr)
        assert (region.addr, region.length, region.location) == (ptr, 4096, "cuda:0")
        assert region.owner is arr
        await e.unregister(arr)
        with pytest.raises(InvalidArgumentError, match="C-contiguous"):
            await e.register(FakeCudaArray(ptr, (16, 32), strides=(256, 4)))


@pytest.mark.anyio
async def test_allocate_device_memory_and_free(fake: FakeCudaRuntime) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as e:
        dm = await e.allocate(1 << 20, location="cuda:0")
        assert fake.live()["device"] == 1 and dm.region.location == "cuda:0"
        await e.unregister(dm)
        assert fake.live()["device"] == 0
        await e.allocate(4096, location="cuda:0")
    assert fake.live()["device"] == 0  # freed at close


@pytest.mark.anyio
async def test_cuda_transport_same_process(
    pair: tuple[Engine, Engine], fake: FakeCudaRuntime
) -> None:
    """Two engines in one process: device<->device by copies on the peer stream, no IPC."""
    a, b = pair
    src = await a.allocate(1 << 16, location="cuda:0")
    dst = await b.allocate(1 << 16, location="cuda:0")
    data = pattern(1 << 16, 2)
    view(src.addr, 1 << 16)[:] = np.frombuffer(data, np.uint8)
    copies = fake.copies
    await a.write(b.segment_name, src.addr, dst.addr, 1 << 16)
    assert bytes(view(dst.addr, 1 << 16)) == data
    view(src.addr, 1 << 16)[:] = 0
    await a.read(b.segment_name, src.addr, dst.addr + 100, 1000)
    assert bytes(view(src.addr, 1000)) == data[100:1100]
    assert fake.copies == copies + 2 and fake.ipc_opens == 0
    # host local memory to a remote device buffer also goes over cuda
    host = await a.allocate(4096)
    host.numpy()[:] = 7
    await a.write(b.segment_name, host.addr, dst.addr, 4096)
    assert bytes(view(dst.addr, 4096)) == b"\x07" * 4096
    assert fake.copies == copies + 3


@pytest.mark.anyio
async def test_routing_per_buffer(pair: tuple[Engine, Engine], fake: FakeCudaRuntime) -> None:
    """One batch, remote host and device buffers: each request goes to the transport that reaches
    its buffer (tcp for host memory, cuda for device memory)."""
    a, b = pair
    local = await a.allocate(8192)
    rhost = await b.allocate(4096)
    rdev = await b.allocate(4096, location="cuda:0")
    local.numpy()[:4096] = 1
    local.numpy()[4096:] = 2
    tcp_b = next(t for t in b.transports if t.name == "tcp")
    copies = fake.copies
    res = await a.transfer(
        b.segment_name,
        [
            TransferRequest.write(local.addr, rhost.addr, 4096),
            TransferRequest.write(local.addr + 4096, rdev.addr, 4096),
        ],
    )
    assert all(r.ok for r in res)
    assert bytes(rhost.numpy()) == b"\x01" * 4096
    assert bytes(view(rdev.addr, 4096)) == b"\x02" * 4096
    assert fake.copies == copies + 1  # only the device request was a CUDA copy
    assert tcp_b.served_connections >= 1  # type: ignore[attr-defined]
    # forcing cuda for a host buffer: a per-request failure naming the buffer, not a crash
    (r,) = await a.transfer(
        b.segment_name, [TransferRequest.write(local.addr, rhost.addr, 64)], transport="cuda"
    )
    assert isinstance(r.error, NotSupportedError) and "cpu:0" in str(r.error)


@pytest.mark.anyio
@pytest.mark.parametrize("length", [4096, 5 * 4096 + 3])
async def test_tcp_staging_both_ends(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """Only tcp installed: local device memory is staged by the client, remote device memory by
    the TCP server, both through pinned chunks smaller than the request."""
    monkeypatch.setenv("MC_CUDA_STAGING_CHUNK", "4096")
    async with (
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as b,
    ):
        ldev = await a.allocate(length, location="cuda:0")
        rdev = await b.allocate(length, location="cuda:0")
        rhost = await b.allocate(length)
        lhost = await a.allocate(length)
        data = pattern(length, 3)
        view(ldev.addr, length)[:] = np.frombuffer(data, np.uint8)
        # device -> host (client stages)
        await a.write(b.segment_name, ldev.addr, rhost.addr, length)
        assert bytes(rhost.numpy()[:length]) == data
        # device -> device (client and server stage)
        await a.write(b.segment_name, ldev.addr, rdev.addr, length)
        assert bytes(view(rdev.addr, length)) == data
        # host <- device (server stages a READ)
        await a.read(b.segment_name, lhost.addr, rdev.addr, length)
        assert bytes(lhost.numpy()[:length]) == data
        # device <- host (client stages a READ)
        view(ldev.addr, length)[:] = 0
        await a.read(b.segment_name, ldev.addr, rhost.addr, length)
        assert bytes(view(ldev.addr, length)) == data
        # a staged its device side of 3 requests, b the device side of the 2 that reached rdev
        assert a.staging.staged_bytes == 3 * length and b.staging.staged_bytes == 2 * length
        assert a.staging.chunk == 4096
        assert a.staging.pool.in_use == 0 and b.staging.server_pool.in_use == 0
        # staging chunks are registered local-only memory: never published
        chunks = a.staging.pool.chunks
        assert chunks and all(not a.registry.find(c, 1).remote_accessible for c in chunks)  # type: ignore[union-attr]
        published = {buf["addr"] for buf in a.descriptor().to_json()["buffers"]}
        assert published.isdisjoint(chunks)
    # closing the engines released everything they took from the runtime
    assert a.cuda_completions.live_fds == 0 and b.cuda_completions.live_fds == 0
    assert fake.live() == {"device": 0, "host": 0, "opened": 0, "streams": 0}


@pytest.mark.anyio
async def test_tcp_server_device_copy_failure_drops_connection(fake: FakeCudaRuntime) -> None:
    async with (
        open_engine("127.0.0.1", transports=["tcp"]) as a,
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as b,
    ):
        lhost = await a.allocate(4096)
        rdev = await b.allocate(4096, location="cuda:0")
        fake.fail_next_copy(700)
        (r,) = await a.transfer(b.segment_name, [TransferRequest.read(lhost.addr, rdev.addr, 4096)])
        assert not r.ok
        # the server survives and serves the next request
        view(rdev.addr, 4096)[:] = 4
        await a.read(b.segment_name, lhost.addr, rdev.addr, 4096)
        assert bytes(lhost.numpy()[:4096]) == b"\x04" * 4096


@pytest.mark.anyio
async def test_cuda_copy_failure_is_a_result(
    pair: tuple[Engine, Engine], fake: FakeCudaRuntime
) -> None:
    a, b = pair
    src = await a.allocate(4096, location="cuda:0")
    dst = await b.allocate(4096, location="cuda:0")
    fake.fail_next_copy(700)
    (r,) = await a.transfer(b.segment_name, [TransferRequest.write(src.addr, dst.addr, 4096)])
    assert r.status is TransferStatus.FAILED and isinstance(r.error, CudaError)
    await a.write(b.segment_name, src.addr, dst.addr, 4096)  # the engine goes on


@pytest.mark.anyio
async def test_local_segment_device_copies(fake: FakeCudaRuntime) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as e:
        dev = await e.allocate(4096, location="cuda:0")
        host = await e.allocate(4096)
        host.numpy()[:] = 3
        await e.write(e.segment_name, host.addr, dev.addr, 4096)
        assert bytes(view(dev.addr, 4096)) == b"\x03" * 4096


@pytest.mark.anyio
async def test_cuda_transport_without_gpu_fails_at_open() -> None:
    if cuda.is_available():
        pytest.skip("a usable GPU is present")
    with pytest.raises(NoGpuError, match="no usable GPU"):
        async with open_engine("127.0.0.1", transports=["tcp", "cuda"]):
            pass


@pytest.mark.anyio
async def test_host_only_engine_never_loads_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> Any:
        raise AssertionError("CUDA loaded for host memory")

    monkeypatch.setattr(cuda, "runtime", boom)
    async with (
        open_engine("127.0.0.1", transports=["tcp"]) as a,
        open_engine("127.0.0.1", transports=["tcp"]) as b,
    ):
        x = await a.allocate(4096)
        y = await b.register(bytearray(4096), location="*")
        assert y.location == "cpu:0"
        await a.write(b.segment_name, x.addr, y.addr, 4096)


# -- two processes: IPC through the fake runtime ----------------------------------------------


@pytest.mark.anyio
async def test_cuda_transport_two_processes(fake: FakeCudaRuntime, peer: Peer) -> None:
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as e:
        local = await e.allocate(1 << 20, location="cuda:0")
        data = pattern(1 << 20, 4)
        view(local.addr, 1 << 20)[:] = np.frombuffer(data, np.uint8)
        seg, addr, interior = peer.segment, peer.info["addr"], peer.info["interior_addr"]
        for off, n in [(0, 4096), (4096, 1 << 19), (100, 12345)]:
            await e.write(seg, local.addr + off, addr + off, n)
        got = bytes.fromhex(peer.cmd(op="dump", which="main", offset=0, length=1 << 20)["data_hex"])
        assert got[0 : (1 << 19) + 4096] == data[0 : (1 << 19) + 4096]
        # an interior-pointer region: ipc_offset makes the same bytes land at the right place
        await e.write(seg, local.addr, interior + 10, 4096)
        got = bytes.fromhex(
            peer.cmd(op="dump", which="interior", offset=10, length=4096)["data_hex"]
        )
        assert got == data[:4096]
        peer.cmd(op="fill", which="main", offset=0, data_hex=b"\xee".hex() * 8192)
        await e.read(seg, local.addr, addr, 8192)
        assert bytes(view(local.addr, 8192)) == b"\xee" * 8192
        cudat = next(t for t in e.transports if isinstance(t, CudaTransport))
        state = (await e.peer(seg)).state["cuda"]
        assert fake.ipc_opens == 2 and state.cache.opens == 2  # main + interior, once each
        assert len(state.streams) == 1  # one stream per (peer, device)
        # the peer frees and re-allocates: a new handle is opened, the stale one closed
        new_addr = peer.cmd(op="realloc")["addr"]
        await e.write(seg, local.addr, new_addr, 4096)
        got = bytes.fromhex(peer.cmd(op="dump", which="main", offset=0, length=4096)["data_hex"])
        assert got == b"\xee" * 4096  # what `local` holds since the read above
        assert fake.ipc_opens == 3 and fake.ipc_closes == 1
        e.forget(seg)
        assert fake.live()["opened"] == 0  # forgetting the peer closes its mappings
        assert cudat._states == []
    assert fake.live() == {"device": 0, "host": 0, "opened": 0, "streams": 0}


@pytest.mark.anyio
async def test_two_importers_in_one_process_share_a_mapping(
    fake: FakeCudaRuntime, peer: Peer
) -> None:
    """CUDA maps a handle once per process: two engines importing the same buffer share it."""
    async with (
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as b,
    ):
        la = await a.allocate(4096, location="cuda:0")
        lb = await b.allocate(4096, location="cuda:0")
        view(la.addr, 4096)[:] = 1
        view(lb.addr, 4096)[:] = 2
        await a.write(peer.segment, la.addr, peer.info["addr"], 4096)
        await b.write(peer.segment, lb.addr, peer.info["addr"] + 4096, 4096)
        got = bytes.fromhex(peer.cmd(op="dump", which="main", offset=0, length=8192)["data_hex"])
        assert got == b"\x01" * 4096 + b"\x02" * 4096
        assert fake.ipc_opens == 1
        a.forget(peer.segment)
        assert fake.live()["opened"] == 1  # b still uses it
        b.forget(peer.segment)
        assert fake.live()["opened"] == 0


@pytest.mark.anyio
async def test_cuda_transport_large_pageable_host(
    pair: tuple[Engine, Engine], fake: FakeCudaRuntime
) -> None:
    """Large copies from/to pageable host memory are issued off the event loop; bytes still land."""
    a, b = pair
    n = 1 << 20
    host = await a.allocate(n)
    dev = await b.allocate(n, location="cuda:0")
    data = pattern(n, 9)
    host.numpy()[:] = np.frombuffer(data, np.uint8)
    await a.write(b.segment_name, host.addr, dev.addr, n)
    assert bytes(view(dev.addr, n)) == data
    host.numpy()[:] = 0
    await a.read(b.segment_name, host.addr, dev.addr, n)
    assert bytes(host.numpy()) == data


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_smoke(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """The eventfd bridge, the cuda transport and TCP staging under asyncio."""
    monkeypatch.setenv("MC_CUDA_STAGING_CHUNK", "4096")
    async with (
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as b,
    ):
        src = await a.allocate(10000, location="cuda:0")
        view(src.addr, 10000)[:] = 6
        rdev = await b.allocate(10000, location="cuda:0")
        rhost = await b.allocate(10000)
        await a.write(b.segment_name, src.addr, rhost.addr, 10000)  # staged over tcp
        await a.write(b.segment_name, src.addr, rdev.addr, 10000)  # b has no handle: tcp
        assert bytes(rhost.numpy()[:10000]) == b"\x06" * 10000
        assert bytes(view(rdev.addr, 10000)) == b"\x06" * 10000
        dst = await a.allocate(10000, location="cuda:0")
        await a.write(a.segment_name, src.addr, dst.addr, 10000)  # local copy on a stream
        assert bytes(view(dst.addr, 10000)) == b"\x06" * 10000


@given(
    st.lists(
        st.tuples(st.integers(1, 20000), st.sampled_from([None, 0, 1]), st.booleans()),
        max_size=30,
    ),
    st.integers(256, 9000),
)
@settings(deadline=None)
def test_stager_plan_covers_every_byte_once(
    reqs: list[tuple[int, int | None, bool]], chunk: int
) -> None:
    stager = Stager(FakeCudaRuntime(), Completions(FakeCudaRuntime()), chunk=chunk, depth=1)
    requests = [
        (TransferRequest.write if w else TransferRequest.read)(1 << 20, 1 << 30, n)
        for n, _, w in reqs
    ]
    devices = [d for _, d, _ in reqs]
    covered: dict[int, list[tuple[int, int]]] = {}
    for dev, op, pieces in stager.plan(requests, devices):
        used = []
        for i, off, n, b in pieces:
            assert devices[i] == dev and requests[i].opcode is op
            assert n > 0 and b + n <= chunk  # fits its chunk
            used.append((b, b + n))
            covered.setdefault(i, []).append((off, off + n))
        used.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(used))  # disjoint
    for i, (n, want, _) in enumerate(reqs):
        if want is None:
            assert i not in covered
        else:
            spans = sorted(covered[i])
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.anyio
async def test_stager_packs_small_requests(fake: FakeCudaRuntime) -> None:
    """100 blocks of 1000 bytes through 4 KiB chunks: one host-transport call per chunk."""
    from mooncake._core.transfer import completed
    from mooncake._fast import memcpy_at

    stager = Stager(fake, Completions(fake), chunk=4096, depth=2)
    dev = fake.malloc(100_000)
    data = pattern(100_000, 5)
    view(dev, 100_000)[:] = np.frombuffer(data, np.uint8)
    remote = bytearray(100_000)
    raddr = int(np.frombuffer(remote, np.uint8).ctypes.data)
    calls = 0

    async def execute(reqs: Any) -> Any:
        nonlocal calls
        calls += 1
        for r in reqs:
            memcpy_at(r.remote_addr, r.local_addr, r.length)
        return [completed(r.length) for r in reqs]

    reqs = [TransferRequest.write(dev + k * 1000, raddr + k * 1000, 1000) for k in range(100)]
    out = await stager.run(execute, reqs, [0] * 100)
    assert all(r.ok for r in out)
    assert bytes(remote) == data
    assert calls == 25  # 4 blocks of 1000 (at 1024-aligned offsets) per 4 KiB chunk
    stager.close()


@pytest.mark.anyio
async def test_tcp_server_device_write_failure_drops_connection(fake: FakeCudaRuntime) -> None:
    async with (
        open_engine("127.0.0.1", transports=["tcp"]) as a,
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as b,
    ):
        lhost = await a.allocate(4096)
        rdev = await b.allocate(4096, location="cuda:0")
        fake.fail_next_copy(700)  # the server's host->device copy
        (r,) = await a.transfer(
            b.segment_name, [TransferRequest.write(lhost.addr, rdev.addr, 4096)]
        )
        assert not r.ok
        lhost.numpy()[:] = 8
        await a.write(b.segment_name, lhost.addr, rdev.addr, 4096)
        assert bytes(view(rdev.addr, 4096)) == b"\x08" * 4096
        assert b.staging.server_pool.in_use == 0  # every chunk came back


@pytest.mark.anyio
async def test_staging_towards_each_other_does_not_deadlock(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines staging device writes at each other with one pinned chunk each: a client job
    holds its chunk until the peer's server answers, so servers draw from a pool of their own."""
    monkeypatch.setenv("MC_CUDA_STAGING_CHUNK", "4096")
    monkeypatch.setenv("MC_CUDA_STAGING_DEPTH", "1")
    n = 16 * 4096
    async with (
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as b,
    ):
        da, db = (
            await a.allocate(2 * n, location="cuda:0"),
            await b.allocate(2 * n, location="cuda:0"),
        )
        view(da.addr, n)[:] = 1
        view(db.addr, n)[:] = 2

        async def push(src: Engine, dst: Engine, s: int, d: int) -> None:
            reqs = [TransferRequest.write(s + k * 4096, d + n + k * 4096, 4096) for k in range(16)]
            assert all(r.ok for r in await src.transfer(dst.segment_name, reqs))

        with anyio.fail_after(60):  # a deadlock would hang here
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(push, a, b, da.addr, db.addr)
                    tg.start_soon(push, b, a, db.addr, da.addr)
        assert bytes(view(db.addr + n, n)) == b"\x01" * n
        assert bytes(view(da.addr + n, n)) == b"\x02" * n


@pytest.mark.anyio
async def test_pin_host_memory_opt_in(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MC_CUDA_PIN_HOST=1: host regions are page-locked while registered, unlocked after; a
    registration that fails on a later transport is rolled back on the cuda transport too."""
    from mooncake._engine.transports.base import Transport

    monkeypatch.setenv("MC_CUDA_PIN_HOST", "1")
    async with (
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as a,
        open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=fake) as b,
    ):
        n = 1 << 20
        host = await a.allocate(n)
        assert fake.host_registers == 1 and host.region.meta["cuda_pinned"]
        assert fake.pointer_get_attributes(host.addr)[0] == cuda.MEMORY_HOST
        dev = await b.allocate(n, location="cuda:0")
        host.numpy()[:] = 3
        await a.write(b.segment_name, host.addr, dev.addr, n)  # pinned: issued inline
        assert bytes(view(dev.addr, n)) == b"\x03" * n
        await a.unregister(host)
        assert fake.live()["host"] == 0

        class Refuses(Transport):
            name = "refuses"

            def can_reach(self, peer: Any) -> bool:
                return False

            async def execute(self, peer: Any, requests: Any) -> Any:
                raise AssertionError

            async def on_register(self, region: Any) -> None:
                raise InvalidArgumentError("refused")

        a.transports.append(Refuses(a))
        with pytest.raises(InvalidArgumentError, match="refused"):
            await a.register(bytearray(8192))
        assert fake.live()["host"] == 0 and len(a.registry) == 0
        a.transports.pop()
        await a.register(bytearray(4096))  # left registered: unpinned when the engine closes
        assert fake.live()["host"] == 1
    assert fake.live()["host"] == 0


# -- the store with GPU buffers (zero-copy APIs) ------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-memcpy", "network"])
async def test_store_put_from_get_into_device_buffers(
    fake: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch, memcpy: str
) -> None:
    """put_from / get_into with registered GPU buffers: same-host replicas are copied on a CUDA
    stream (never memcpy on a device pointer), remote ones staged by the engine."""
    import mooncake
    from mooncake._core.master import MasterConfig
    from mooncake._store.master import MasterServerConfig, serve_master
    from mooncake.store import ReplicateConfig

    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)
    cfg = MasterServerConfig(rpc_port=0, enable_metric_reporting=False, state=MasterConfig())
    n = 300_000
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        addr = f"127.0.0.1:{server.rpc_port}"
        async with (
            open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as ea,
            open_engine("127.0.0.1", transports=["tcp"], cuda_runtime=fake) as eb,
            mooncake.open_store(addr, segment_size=4 << 20, engine=ea) as a,
            mooncake.open_store(addr, segment_size=4 << 20, engine=eb) as b,
        ):
            src, dst = fake.malloc(n), fake.malloc(n)
            await a.register_buffer(src, n)
            await a.register_buffer(dst, n)
            assert ea.registry.find(src, n).location == "cuda:0"  # type: ignore[union-attr]
            data = pattern(n, 12)
            view(src, n)[:] = np.frombuffer(data, np.uint8)
            for target in (a, b):  # own segment, then the other client's
                cfg_r = ReplicateConfig()
                cfg_r.preferred_segment = target.segment_name
                key = f"k-{target.segment_name}"
                copies = fake.copies
                await a.put_from(key, src, n, cfg_r)
                assert await b.get(key) == data  # the bytes in the store are right
                view(dst, n)[:] = 0
                assert await a.get_into(key, dst, n) == n
                assert bytes(view(dst, n)) == data
                assert fake.copies > copies  # the device side went through the runtime
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("backend", ["ctypes", "dlopen"])
def test_every_binding_reaches_libcudart_without_a_driver(backend: str) -> None:
    """Each call of both real backends goes through to libcudart (argument marshalling, by-value
    IPC handle, attribute struct) and comes back as a clean "no usable GPU", never a crash or a
    ctypes argument error."""
    if cuda.is_available():
        pytest.skip("a usable GPU is present: tests/test_gpu.py covers the bindings")
    path = _libcudart()
    if path is None:
        pytest.skip("no libcudart on this machine")
    if backend == "dlopen":
        _cuda = pytest.importorskip("mooncake._fast._cuda", reason="_cuda extension not built")
        rt: Any = _cuda.DlopenRuntime(path)
    else:
        rt = cuda.CtypesRuntime(path)
    fd = os.eventfd(0, os.EFD_CLOEXEC)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("get_device_count", ()),
        ("set_device", (0,)),
        ("get_device", ()),
        ("malloc", (4096,)),
        ("free", (4096,)),
        ("host_alloc", (4096,)),
        ("free_host", (4096,)),
        ("host_register", (4096, 4096)),
        ("host_unregister", (4096,)),
        ("memset", (4096, 0, 16)),
        ("pointer_get_attributes", (4096,)),
        ("mem_get_address_range", (4096,)),
        ("ipc_get_mem_handle", (4096,)),
        ("ipc_open_mem_handle", (b"\x01" * 64,)),
        ("ipc_close_mem_handle", (4096,)),
        ("stream_create", ()),
        ("stream_destroy", (1,)),
        ("stream_synchronize", (0,)),
        ("memcpy", (4096, 8192, 16)),
        ("memcpy_async", (4096, 8192, 16, 0)),
        ("event_create", ()),
        ("event_destroy", (1,)),
        ("event_record", (1, 0)),
        ("event_query", (1,)),
        ("event_synchronize", (1,)),
        ("stream_notify_fd", (0, fd)),
    ]
    try:
        for name, args in calls:
            with pytest.raises((NoGpuError, CudaError)):
                getattr(rt, name)(*args)
    finally:
        os.close(fd)
