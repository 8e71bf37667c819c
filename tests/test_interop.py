"""Interoperability with the published Mooncake wheel, in both directions, bytes verified.

The published engine runs in its own venv (scripts/setup-anchor.sh); both packages are called
``mooncake``, so it lives in a subprocess without our PYTHONPATH. Skipped when that venv is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import mooncake
from mooncake._cli._peer import pattern
from mooncake._core.transfer import TransferRequest as R
from mooncake._core.transfer import TransferStatus
from mooncake.errors import RemoteAccessError
from tests.conftest import ROOT, anchor_python, clean_env

ANCHOR = anchor_python()
pytestmark = [
    pytest.mark.anchor,
    pytest.mark.skipif(
        ANCHOR is None,
        reason="published Mooncake wheel not installed (run scripts/setup-anchor.sh)",
    ),
]


class Published:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["MC_LOG_LEVEL"] = "ERROR"
        assert ANCHOR is not None
        self.proc = subprocess.Popen(
            [
                ANCHOR,
                str(ROOT / "tests" / "helpers" / "published_peer.py"),
                "--size",
                str(16 << 20),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd="/",
        )
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        assert info["rc"] == 0
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]

    def cmd_sync(self, c: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(c) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return out

    async def cmd(self, **c: Any) -> dict[str, Any]:
        # the published process may call back into our engine: never block our loop on it
        return await anyio.to_thread.run_sync(self.cmd_sync, c)

    def close(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def published() -> Iterator[Published]:
    p = Published()
    try:
        yield p
    finally:
        p.close()


pytestmark.append(pytest.mark.anyio)


async def test_we_read_and_write_published_memory(published: Published) -> None:
    async with mooncake.open_engine() as engine:
        buf = await engine.allocate(8 << 20)
        arr = buf.numpy()
        data = pattern(11, (5 << 20) + 123)
        arr[: data.size] = data
        await engine.write(published.segment, buf.addr, published.addr + 1, data.size)
        got = await published.cmd(op="dump", offset=1, length=4096)
        assert bytes.fromhex(got["data_hex"]) == data[:4096].tobytes()
        got = await published.cmd(op="dump", offset=1 + data.size - 4096, length=4096)
        assert bytes.fromhex(got["data_hex"]) == data[-4096:].tobytes()

        blob = pattern(12, 3000).tobytes()
        await published.cmd(op="fill", offset=5000, data_hex=blob.hex())
        await engine.read(published.segment, buf.addr, published.addr + 5000, 3000)
        assert arr[:3000].tobytes() == blob

        # a batch with one refused request: the published server closes after refusing; the
        # requests behind it are re-sent and complete
        reqs = [R.read(buf.addr + i * 4096, published.addr + i * 4096, 4096) for i in range(4)]
        info = await engine.peer(published.segment)
        from mooncake._core.descriptor import BufferDesc

        info.descriptor = info.descriptor.replace(buffers=(BufferDesc("all", 0, 2**63),))
        reqs.insert(2, R.read(buf.addr, 4096, 4096))
        results = await engine.transfer(published.segment, reqs)
        assert [r.status for r in results] == [TransferStatus.COMPLETED] * 2 + [
            TransferStatus.FAILED
        ] + [TransferStatus.COMPLETED] * 2
        assert isinstance(results[2].error, RemoteAccessError)


async def test_published_reads_and_writes_our_memory(published: Published) -> None:
    async with mooncake.open_engine() as engine:
        buf = await engine.allocate(4 << 20)
        arr = buf.numpy()
        arr[:] = pattern(21, arr.size)
        r = await published.cmd(
            op="read", segment=engine.segment_name, local_off=0, remote=buf.addr, length=1 << 20
        )
        assert r["rc"] == 0
        got = await published.cmd(op="dump", offset=0, length=1 << 20)
        assert bytes.fromhex(got["data_hex"]) == arr[: 1 << 20].tobytes()

        blob = pattern(22, 70000).tobytes()
        await published.cmd(op="fill", offset=0, data_hex=blob.hex())
        r = await published.cmd(
            op="write", segment=engine.segment_name, local_off=0, remote=buf.addr + 99, length=70000
        )
        assert r["rc"] == 0
        assert arr[99 : 99 + 70000].tobytes() == blob

        offs = [i * 8192 for i in range(32)]
        r = await published.cmd(
            op="batch_read",
            segment=engine.segment_name,
            local_offs=offs,
            remotes=[buf.addr + o for o in offs],
            lengths=[8192] * 32,
        )
        assert r["rc"] == 0
        # outside our registered memory: refused, and we keep serving it
        r = await published.cmd(
            op="read", segment=engine.segment_name, local_off=0, remote=4096, length=100
        )
        assert r["rc"] != 0
        r = await published.cmd(
            op="read", segment=engine.segment_name, local_off=0, remote=buf.addr, length=100
        )
        assert r["rc"] == 0


@pytest.mark.slow
def test_anchor_te_bench_runs_unchanged_against_our_facade(tmp_path: Any) -> None:
    bench = None
    for d in (ROOT / "benchmarks" / "anchor", ROOT.parent / "shared" / "anchor"):
        if (d / "mooncake_te_bench.py").exists():
            bench = d / "mooncake_te_bench.py"
    if bench is None:
        pytest.skip("benchmarks/anchor/mooncake_te_bench.py missing")
    out = tmp_path / "te.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--buffer",
            "64M",
            "--sizes",
            "4K,1M",
            "--batches",
            "1,32",
            "--case-seconds",
            "0.05",
            "--async-depth",
            "2",
            "--json",
            str(out),
            "--logdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=str(tmp_path),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verify read=True verify write=True" in proc.stdout
    api = json.loads(out.read_text())["python_api"]
    assert api["verify_read"] and api["verify_write"]
    assert api["unregistered_remote_read_rc"] != 0


def test_facade_sync_calls_against_the_published_server(published: Published) -> None:
    """Our sync facade's caller-thread path (pooled lanes, ClientPipe.run_blocking) against the
    published TCP server: bytes both ways; a refused request (the published server closes the
    connection after it) gives -1 and the next calls work on a fresh connection."""
    from mooncake._core.descriptor import BufferDesc
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        addr = te.allocate_managed_buffer(1 << 20)
        data = pattern(31, 64 * 1024).tobytes()
        assert te.write_bytes_to_buffer(addr, data, len(data)) == 0
        assert te.transfer_sync_write(published.segment, addr, published.addr, 4096) == 0
        fp = te._fast
        assert fp is not None
        for k in range(16):
            off = k * 4096
            rc = te.transfer_sync_write(published.segment, addr + off, published.addr + off, 4096)
            assert rc == 0
        assert fp.hits == 16
        got = published.cmd_sync({"op": "dump", "offset": 0, "length": 64 * 1024})
        assert bytes.fromhex(got["data_hex"]) == data
        blob = pattern(32, 3000).tobytes()
        published.cmd_sync({"op": "fill", "offset": 8000, "data_hex": blob.hex()})
        assert te.transfer_sync_read(published.segment, addr, published.addr + 8000, 3000) == 0
        assert te.read_bytes_from_buffer(addr, 3000) == blob
        assert fp.hits == 17
        # make our cached descriptor claim everything, so the refusal comes from their server
        info = te._engine._peers[published.segment]  # type: ignore[union-attr]
        info.descriptor = info.descriptor.replace(buffers=(BufferDesc("all", 0, 2**63),))
        assert te.transfer_sync_read(published.segment, addr, 4096, 100) == -1
        assert te.transfer_sync_read(published.segment, addr, published.addr + 8000, 3000) == 0
        assert te.read_bytes_from_buffer(addr, 3000) == blob
    finally:
        te.close()
