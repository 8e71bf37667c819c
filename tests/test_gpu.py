"""GPU memory on a real GPU: the runtime backends, CUDA IPC between two processes on one GPU
(4 KiB .. 1 GiB, verified), and device<->host through the host transports (staging).

Skipped, with the reason, where cupy is missing or ``cupy.cuda.is_available()`` is False. The peer
is ``tests/helpers/gpu_peer.py`` in a child process. ``benchmarks/gpu_check.sh`` runs this module on
a GPU machine and then measures throughput (docs/gpu.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

with warnings.catch_warnings():  # cupy may warn at import (toolkit paths); not our concern
    warnings.simplefilter("ignore")
    cupy = pytest.importorskip(
        "cupy", reason="cupy is not installed (GPU tests need cupy-cuda12x/13x)"
    )

import numpy as np

from mooncake._core import gpu
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import open_engine
from mooncake._engine.transports import TRANSPORTS
from mooncake._fast import cuda
from tests.helpers.driver import LineDriver


def _gpu_usable() -> bool:
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # a broken driver install: no usable GPU either
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    # cupy's own warnings (toolkit discovery, kernel cache) are not what these tests check
    pytest.mark.filterwarnings("ignore::UserWarning:cupy"),
    pytest.mark.filterwarnings("ignore::FutureWarning:cupy"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:cupy"),
    pytest.mark.skipif(
        not _gpu_usable(), reason="no usable GPU (cupy.cuda.is_available() is False)"
    ),
]

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from gpu_peer import (  # type: ignore[import-not-found]  # noqa: E402
    device_view,
    gpu_pattern,
    host_pattern,
)

HELPER = Path(__file__).parent / "helpers" / "gpu_peer.py"
GiB = 1 << 30
IPC_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, GiB]
STAGED_SIZES = [4 << 10, 1 << 20, 64 << 20]
HOST_SIZE = 256 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def peer_transports() -> str:
    return "tcp,cuda" + (",shm" if "shm" in TRANSPORTS else "")


class GpuPeer(LineDriver):
    def __init__(self, transports: str = "", size: int = GiB) -> None:
        transports = transports or peer_transports()
        super().__init__(
            [
                sys.executable,
                str(HELPER),
                "--size",
                str(size),
                "--host-size",
                str(HOST_SIZE),
                "--transports",
                transports,
            ],
            what="gpu_peer",
            close_timeout=30,
        )


@pytest.fixture(scope="module")
def peer() -> Iterator[GpuPeer]:
    p = GpuPeer()
    yield p
    p.close()


# -- the runtime ------------------------------------------------------------------------------


def _backends() -> list[str]:
    return ["dlopen", "ctypes", "cupy"]


@pytest.mark.parametrize("backend", _backends())
def test_runtime_backend(backend: str) -> None:
    if backend == "cupy":
        rt: Any = cuda.CupyRuntime()
    else:
        path = next((c for c in cuda.library_candidates() if _loads(c)), None)
        if path is None:
            pytest.skip("no libcudart.so on the library path (cupy links it statically)")
        if backend == "dlopen":
            _cuda = pytest.importorskip("mooncake._fast._cuda", reason="_cuda extension not built")
            rt = _cuda.DlopenRuntime(path)
        else:
            rt = cuda.CtypesRuntime(path)
    assert rt.get_device_count() >= 1
    rt.set_device(0)
    n = 1 << 20
    d = rt.malloc(2 * n)
    h = rt.host_alloc(n)
    try:
        assert rt.pointer_get_attributes(d + 5) == (cuda.MEMORY_DEVICE, 0)
        assert rt.pointer_get_attributes(h)[0] == cuda.MEMORY_HOST
        base, size = rt.mem_get_address_range(d + n)
        assert base == d and size >= 2 * n
        handle = rt.ipc_get_mem_handle(d)
        assert len(handle) == gpu.IPC_HANDLE_SIZE
        hv = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(h))
        hv[:] = np.arange(n, dtype=np.uint32).astype(np.uint8)
        s = rt.stream_create()
        rt.memcpy_async(d + n, h, n, s)
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        rt.stream_notify_fd(s, fd)
        assert os.eventfd_read(fd) == 1  # status 0 + 1
        os.close(fd)
        ev = rt.event_create()
        hv[:] = 0
        rt.memcpy_async(h, d + n, n, s)
        rt.event_record(ev, s)
        rt.event_synchronize(ev)
        assert rt.event_query(ev)
        assert np.array_equal(hv, np.arange(n, dtype=np.uint32).astype(np.uint8))
        rt.event_destroy(ev)
        rt.stream_destroy(s)
    finally:
        rt.free(d)
        rt.free_host(h)


def _loads(path: str) -> bool:
    try:
        ctypes.CDLL(path)
        return True
    except OSError:
        return False


async def test_register_cupy_array_publishes_handle() -> None:
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        arr = cupy.zeros(1 << 20, dtype=cupy.uint8)
        region = await e.register(arr)
        assert region.location == "cuda:0" and region.length == 1 << 20
        sub = cupy.zeros(4 << 20, dtype=cupy.uint8)[1 << 20 :]
        r2 = await e.register(sub)
        bufs = {b["addr"]: b for b in e.descriptor().to_json()["buffers"]}
        assert len(bufs[region.addr]["shm_name"]) == 128
        assert bufs[r2.addr].get("ipc_offset", 0) >= 1 << 20  # interior of its allocation
        await e.unregister(arr)
        await e.unregister(sub)


# -- IPC between two processes on one GPU -----------------------------------------------------


@pytest.mark.parametrize("size", IPC_SIZES, ids=lambda n: f"{n >> 10}KiB")
async def test_ipc_write_read_two_processes(peer: GpuPeer, size: int) -> None:
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        local = await e.allocate(size, location="cuda:0")
        lv = device_view(cupy, local.addr, size, local)
        lv[:] = gpu_pattern(cupy, size, 11)
        cupy.cuda.Device(0).synchronize()
        (res,) = await e.transfer(
            peer.segment,
            [TransferRequest.write(local.addr, peer.info["dev"], size)],
            transport="cuda",
        )
        assert res.ok, res.error
        assert peer.cmd(op="check", which="dev", offset=0, length=size, seed=11)["equal"]
        peer.cmd(op="fill", which="dev", offset=0, length=size, seed=12)
        lv[:] = 0
        cupy.cuda.Device(0).synchronize()
        await e.read(peer.segment, local.addr, peer.info["dev"], size)
        assert bool(cupy.array_equal(lv, gpu_pattern(cupy, size, 12)))
        state = (await e.peer(peer.segment)).state["cuda"]
        assert state.cache.opens == 1  # one mapping, reused by the read


async def test_ipc_into_interior_region(peer: GpuPeer) -> None:
    """The peer writes into a region that starts inside our allocation (ipc_offset)."""
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        whole = cupy.zeros(8 << 20, dtype=cupy.uint8)
        part = whole[3 << 20 :]
        region = await e.register(part)
        # the peer calls back into this engine: never block our loop on its answer
        out = await anyio.to_thread.run_sync(
            functools.partial(
                peer.cmd,
                op="push",
                segment=e.segment_name,
                remote=region.addr + 4096,
                length=1 << 20,
                seed=21,
                transport="cuda",
            )
        )
        assert out["transfer_ok"], out
        got = part[4096 : 4096 + (1 << 20)]
        assert bool(cupy.array_equal(got, gpu_pattern(cupy, 1 << 20, 21)))
        assert int(whole[: 3 << 20].sum()) == 0  # nothing before the region was touched
        await e.unregister(part)


# -- device <-> host through the host transports ----------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", STAGED_SIZES, ids=lambda n: f"{n >> 10}KiB")
async def test_staged_device_host(peer: GpuPeer, transport: str, size: int) -> None:
    if transport not in TRANSPORTS:
        pytest.skip(f"the {transport} transport is not in this tree")
    async with open_engine("127.0.0.1", transports=[transport]) as e:
        ldev = await e.allocate(size, location="cuda:0")
        lhost = await e.allocate(size)
        lv = device_view(cupy, ldev.addr, size, ldev)
        lv[:] = gpu_pattern(cupy, size, 31)
        cupy.cuda.Device(0).synchronize()
        # our device -> their host (we stage)
        await e.write(peer.segment, ldev.addr, peer.info["host"], size)
        assert peer.cmd(op="check", which="host", offset=0, length=size, seed=31)["equal"]
        # our host -> their device (over tcp, their server stages)
        if transport == "tcp":
            lhost.numpy()[:size] = host_pattern(size, 32)
            await e.write(peer.segment, lhost.addr, peer.info["dev"], size)
            assert peer.cmd(op="check", which="dev", offset=0, length=size, seed=32)["equal"]
        # their host -> our device (we stage a read)
        peer.cmd(op="fill", which="host", offset=0, length=size, seed=33)
        lv[:] = 0
        cupy.cuda.Device(0).synchronize()
        await e.read(peer.segment, ldev.addr, peer.info["host"], size)
        assert bool(cupy.array_equal(lv, gpu_pattern(cupy, size, 33)))
        assert e.staging.staged_bytes == 2 * size


async def test_thread_completion_mode(peer: GpuPeer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other completion bridge (cudaEventSynchronize in a worker thread) moves bytes too."""
    monkeypatch.setenv("MC_CUDA_COMPLETION", "thread")
    size = 16 << 20
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        assert e.cuda_completions.mode == "thread"
        local = await e.allocate(size, location="cuda:0")
        lv = device_view(cupy, local.addr, size, local)
        lv[:] = gpu_pattern(cupy, size, 41)
        cupy.cuda.Device(0).synchronize()
        await e.write(peer.segment, local.addr, peer.info["dev"], size)
        assert peer.cmd(op="check", which="dev", offset=0, length=size, seed=41)["equal"]


def test_gpu_found_by_default() -> None:
    from mooncake._engine.transports import default_transports

    assert cuda.is_available()
    assert "cuda" in default_transports()


async def test_many_small_blocks_ipc_and_staged(peer: GpuPeer) -> None:
    """A KV-cache-like batch: 512 blocks of 16 KiB, over IPC and staged over tcp (packed)."""
    block, count = 16 << 10, 512
    size = block * count
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        local = await e.allocate(size, location="cuda:0")
        lv = device_view(cupy, local.addr, size, local)
        for transport, seed in (("cuda", 51), ("tcp", 52)):
            lv[:] = gpu_pattern(cupy, size, seed)
            cupy.cuda.Device(0).synchronize()
            reqs = [
                TransferRequest.write(local.addr + k * block, peer.info["dev"] + k * block, block)
                for k in range(count)
            ]
            res = await e.transfer(peer.segment, reqs, transport=transport)
            assert all(r.ok for r in res), [r.error for r in res if not r.ok][:3]
            assert peer.cmd(op="check", which="dev", offset=0, length=size, seed=seed)["equal"]


@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned"])
async def test_host_to_peer_device_over_ipc(
    peer: GpuPeer, monkeypatch: pytest.MonkeyPatch, pin: bool
) -> None:
    """Local host memory <-> the peer's GPU over CUDA IPC, pageable or page-locked."""
    monkeypatch.setenv("MC_CUDA_PIN_HOST", "1" if pin else "0")
    size = 64 << 20
    async with open_engine("127.0.0.1", transports=["tcp", "cuda"]) as e:
        host = await e.allocate(size)
        assert bool(host.region.meta.get("cuda_pinned")) is pin
        if pin:
            assert e.cuda.pointer_get_attributes(host.addr)[0] == cuda.MEMORY_HOST
        host.numpy()[:] = host_pattern(size, 61)
        await e.write(peer.segment, host.addr, peer.info["dev"], size)
        assert peer.cmd(op="check", which="dev", offset=0, length=size, seed=61)["equal"]
        host.numpy()[:] = 0
        await e.read(peer.segment, host.addr, peer.info["dev"], size)
        assert np.array_equal(host.numpy()[:size], host_pattern(size, 61))
