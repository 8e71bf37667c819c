"""The published Python modules around the store: ``mooncake_config``, ``buffer_pool``,
``async_store``, ``allocator`` and the ``mooncake_http_metadata_server`` /
``transfer_engine_bench`` console scripts (real master, real processes, real sockets)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mooncake
from mooncake.allocator import MemoryBackend, NVLinkAllocator
from mooncake.async_store import MooncakeDistributedStoreAsync
from mooncake.buffer_pool import BufferPool, RegisteredBufferPool
from mooncake.mooncake_config import MooncakeConfig, _parse_bool, _parse_segment_size
from tests.conftest import ROOT, anchor_python, clean_env
from tests.helpers.store_procs import Master, _readline

MIB = 1 << 20
ANCHOR = anchor_python()


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    m = Master()
    yield m
    m.stop()


def test_config_sizes_and_booleans() -> None:
    assert _parse_segment_size("4gb") == 4 << 30
    assert _parse_segment_size(" 512M ") == 512 << 20
    assert _parse_segment_size("1.5k") == 1536
    assert _parse_segment_size("100") == 100
    assert _parse_segment_size(7) == 7
    for bad in ("", "gb", "x"):
        with pytest.raises(ValueError):
            _parse_segment_size(bad)
    assert _parse_bool("On") and not _parse_bool("disable") and not _parse_bool(None)
    with pytest.raises(ValueError, match="boolean"):
        _parse_bool("maybe")


def test_config_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps(
            {
                "local_hostname": "h",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "m:1",
                "protocol": "RDMA",
                "global_segment_size": "1gb",
                "enable_ssd_offload": "yes",
            }
        )
    )
    c = MooncakeConfig.from_file(str(f))
    assert (c.protocol, c.global_segment_size, c.enable_ssd_offload) == ("rdma", 1 << 30, True)
    for k in list(os.environ):
        if k.startswith("MOONCAKE_"):
            monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "64mb")
    monkeypatch.setenv("MOONCAKE_CLIENT_HTTP_PORT", "9400")
    c = MooncakeConfig.load_from_env()
    assert (c.master_server_address, c.local_buffer_size, c.client_http_port) == (
        "10.0.0.1:50051",
        64 << 20,
        9400,
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(f))
    assert MooncakeConfig.load_from_env().local_hostname == "h"
    with pytest.raises(ValueError, match="non-empty"):
        MooncakeConfig("", "P2PHANDSHAKE", 0, 0, "tcp", "", "m:1")


ENVS = [
    {"MOONCAKE_MASTER": "m:1"},
    {
        "MOONCAKE_MASTER": "m:1",
        "MOONCAKE_PROTOCOL": "RDMA",
        "MOONCAKE_DEVICE": "mlx5_0",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2.5g",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "512MB",
        "MOONCAKE_LOCAL_HOSTNAME": "node1",
        "MOONCAKE_TE_META_DATA_SERVER": "http://x:8080/metadata",
        "MOONCAKE_OFFLOAD_ENABLED": "on",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/nvme",
        "MOONCAKE_TENANT_ID": "t1",
        "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": "1",
        "MOONCAKE_CLIENT_HTTP_PORT": "9999",
    },
    {"MOONCAKE_MASTER": "m:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "100", "MOONCAKE_PROTOCOL": "tcp"},
]


@pytest.mark.anchor
@pytest.mark.skipif(
    ANCHOR is None, reason="published wheel not installed (scripts/setup-anchor.sh)"
)
@pytest.mark.parametrize("env", ENVS)
def test_load_from_env_matches_the_published_module(env: dict[str, str]) -> None:
    base = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MOONCAKE_")
    }
    code = (
        "import dataclasses, json; from mooncake.mooncake_config import MooncakeConfig; "
        "print(json.dumps(dataclasses.asdict(MooncakeConfig.load_from_env())))"
    )
    res = subprocess.run(
        [str(ANCHOR), "-c", code],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd="/",
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-1000:]
    published = json.loads(res.stdout.strip().splitlines()[-1])
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MOONCAKE_")}
    try:
        os.environ.update(env)
        ours = dataclasses.asdict(MooncakeConfig.load_from_env())
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(old)
    assert ours == published


def test_buffer_pool_leases_registered_memory(master: Master) -> None:
    from mooncake.store import MooncakeDistributedStore

    assert mooncake.BufferPool is BufferPool and RegisteredBufferPool is BufferPool
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address) == 0
    try:
        pool = BufferPool(s, max_bytes=2 * MIB, min_size_class=MIB, alignment=4096)
        with pool.acquire(1000) as lease:
            assert lease.size == 1000 and lease.ptr % 4096 == 0
            lease.buffer[:5] = b"hello"
            assert s.put_from("bp", lease.ptr, 5) == 0  # registered: the zero-copy put works
            first = lease.ptr
        again = pool.acquire(MIB)
        assert again.ptr == first  # released buffers are reused
        other = pool.acquire(10)
        with pytest.raises(RuntimeError, match="exhausted"):
            pool.acquire(10, block=False)
        with pytest.raises(RuntimeError, match="timed out"):
            pool.acquire(10, timeout=0.05)
        with pytest.raises(RuntimeError, match="exceeds pool capacity"):
            pool.acquire(4 * MIB)
        with pytest.raises(RuntimeError, match="active leases"):
            pool.close()
        assert s.get_into("bp", other.ptr, other.size) == 5
        assert bytes(other.buffer[:5]) == b"hello"
        again.release()
        other.release()
        other.release()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            _ = other.ptr
        pool.close()
        with pytest.raises(RuntimeError, match="closing"):
            pool.acquire(1)
    finally:
        s.close()


def test_async_store_awaits_the_store_loop(master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address) == 0

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def no_executor(*a: Any) -> Any:
            raise AssertionError("a byte call went through a worker thread")

        monkeypatch.setattr(loop, "run_in_executor", no_executor)
        assert await s.async_put("a1", b"x" * 100) == 0
        assert await s.async_get("a1") == b"x" * 100
        assert await s.async_get("missing") == b""
        assert await s.async_is_exist("a1") == 1
        assert await s.async_get_size("a1") == 100
        assert await s.async_get_size("missing") == -704
        r = await asyncio.gather(*(s.async_put(f"c{i}", bytes([i]) * 10) for i in range(8)))
        assert r == [0] * 8
        assert await s.async_batch_is_exist(["c0", "nope"]) == [1, 0]
        assert await s.async_remove("a1") == -706  # the get's read lease
        assert await s.async_remove("a1", True) == 0  # published positional force
        assert await s.async_remove("a1", force=True) == -704
        monkeypatch.undo()
        assert await s.async_get_hostname() == s.get_hostname()  # no async twin: executor

    try:
        asyncio.run(main())
        with pytest.raises(AttributeError):
            _ = s.async_no_such_method
        with pytest.raises(AttributeError):
            _ = s.no_such_method
    finally:
        s.close()


def test_allocator_reports_no_fabric_backend() -> None:
    assert NVLinkAllocator.detect_mem_backend() is MemoryBackend.UNSUPPORTED
    with pytest.raises(ImportError, match="nvlink_allocator"):
        NVLinkAllocator.get_allocator("cuda:0")


def _script(name: str) -> list[str]:
    fn = {
        "mooncake_http_metadata_server": "http_metadata_server_main",
        "transfer_engine_bench": "transfer_engine_bench_main",
    }[name]
    return [
        sys.executable,
        "-c",
        f"import sys; from mooncake._cli.published import {fn} as m; sys.exit(m())",
    ]


def test_http_metadata_server_script(tmp_path: Path) -> None:
    p = subprocess.Popen(
        [*_script("mooncake_http_metadata_server"), "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
    )
    try:
        line = _readline(p, 30)
        url = re.search(r"(http://\S+)", line)
        assert url, line
        req = urllib.request.Request(url.group(1) + "?key=k", data=b'{"v": 1}', method="PUT")
        urllib.request.urlopen(req, timeout=10).read()
        assert urllib.request.urlopen(url.group(1) + "?key=k", timeout=10).read() == b'{"v": 1}'
    finally:
        p.terminate()
        p.wait(20)
        assert p.stdout
        p.stdout.close()


def test_transfer_engine_bench_script_target_and_initiator() -> None:
    flags = [
        "--metadata_server=P2PHANDSHAKE",
        "--protocol=tcp",
        "--local_server_name=127.0.0.1",
        "--buffer_size=8388608",
    ]
    target = subprocess.Popen(
        [*_script("transfer_engine_bench"), "--mode=target", *flags],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
    )
    try:
        line = _readline(target, 60)
        m = re.match(r"listening on (\S+)", line)
        assert m, line
        res = subprocess.run(
            [
                *_script("transfer_engine_bench"),
                *flags,
                f"--segment_id={m.group(1)}",
                "--operation=write",
                "--block_size=4096",
                "--batch_size=8",
                "--threads=2",
                "--duration=1",
            ],
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=str(ROOT),
            timeout=120,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        done = re.search(
            r"Test completed: duration ([\d.]+), batch count (\d+), "
            r"throughput ([\d.]+) GB/s",
            res.stdout,
        )
        assert done and int(done.group(2)) > 0, res.stdout
        bad = subprocess.run(
            [*_script("transfer_engine_bench"), "--no_such_flag=1"],
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=str(ROOT),
        )
        assert bad.returncode != 0 and "unknown flag" in bad.stderr
    finally:
        target.terminate()
        target.wait(20)
        assert target.stdout
        target.stdout.close()
