"""RDMA-mode interoperability with the published Mooncake wheel, both directions, bytes verified.

The published engine (anchor venv) loads the project's software provider as its
``libibverbs.so.1`` (``LD_LIBRARY_PATH``) and our engine loads the same library through
``MOONCAKE_IBVERBS``; both share one fabric with the fake NIC ``soft0``. The published engine
is given its topology through ``MC_CUSTOM_TOPO_JSON`` (its sysfs discovery wants
``/dev/infiniband/uverbs*``). What crosses between the two is exactly what crosses on real
RNICs: the Metadata frame with the RDMA descriptor fields, the Connection handshake, QP numbers,
LIDs/GIDs and rkeys; the provider checks every WR against them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import mooncake
from mooncake._cli._peer import pattern
from mooncake._core.transfer import TransferRequest as R
from mooncake._core.transfer import TransferStatus
from tests.conftest import ROOT, anchor_python

verbs = pytest.importorskip("mooncake._fast.verbs")
ANCHOR = anchor_python()
pytestmark = [
    pytest.mark.anchor,
    pytest.mark.anyio,
    pytest.mark.skipif(
        ANCHOR is None, reason="published Mooncake wheel not installed (run shared/anchor/setup.sh)"
    ),
    pytest.mark.skipif(
        not verbs.AVAILABLE or not os.path.exists(verbs.soft_provider_path()),
        reason="verbs layer or libmcsoftverbs.so not built",
    ),
]
SIZE = 4 << 20


class PublishedRdma:
    def __init__(self, tmp: Path, fabric: str) -> None:
        libdir = tmp / "lib"
        libdir.mkdir()
        (libdir / "libibverbs.so.1").symlink_to(verbs.soft_provider_path())
        topo = tmp / "topo.json"
        topo.write_text(json.dumps({"cpu:0": [["soft0"], []], "*": [["soft0"], []]}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(
            LD_LIBRARY_PATH=str(libdir),
            MC_SOFTVERBS_FABRIC=fabric,
            MC_SOFTVERBS_DEVICES="soft0",
            MC_RDMA_PEER_DEVICE="soft0",
            MC_CUSTOM_TOPO_JSON=str(topo),
            MC_GID_INDEX="0",
            MC_LOG_LEVEL="ERROR",
        )
        assert ANCHOR is not None
        self.proc = subprocess.Popen(
            [ANCHOR, str(ROOT / "tests" / "helpers" / "published_rdma_peer.py"), str(SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd="/",
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"published engine exited ({self.proc.wait()})"
        info = json.loads(line)
        assert info.get("rc") == 0, info
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]

    async def cmd(self, **c: Any) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(c) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            assert line, "published engine died"
            out: dict[str, Any] = json.loads(line)
            return out

        return await anyio.to_thread.run_sync(run)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture(params=["infiniband", "ethernet"])
def published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[PublishedRdma]:
    """The published engine on one fake NIC, as an InfiniBand port (LID routing) and as a
    RoCE-like one (LID 0, GRH with the GID required)."""
    fabric = str(tmp_path / "fabric")
    monkeypatch.setenv("MOONCAKE_IBVERBS", "soft")
    monkeypatch.setenv("MC_SOFTVERBS_FABRIC", fabric)
    monkeypatch.setenv("MC_SOFTVERBS_DEVICES", "soft0")
    monkeypatch.setenv("MC_SOFTVERBS_LINK_LAYER", request.param)
    verbs.load(verbs.soft_provider_path())
    p = PublishedRdma(tmp_path, fabric)
    try:
        yield p
    finally:
        p.close()
    assert set(verbs.live_objects().values()) == {0}, verbs.live_objects()


async def test_we_write_and_read_the_published_engine_over_rdma(published: PublishedRdma) -> None:
    async with mooncake.open_engine(transports=["rdma"]) as engine:
        buf = await engine.allocate(SIZE)
        arr = buf.numpy()
        arr[:] = pattern(21, SIZE)
        n = (1 << 20) + 12345  # several slices, a merged tail
        await engine.write(published.segment, buf.addr, published.addr + 100, n)
        got = await published.cmd(op="dump", offset=100, length=n)
        assert bytes.fromhex(got["data_hex"]) == arr[:n].tobytes()
        data = pattern(22, 70000).tobytes()
        await published.cmd(op="fill", offset=5000, data_hex=data.hex())
        (res,) = await engine.transfer(
            published.segment, [R.read(buf.addr, published.addr + 5000, 70000)]
        )
        assert res.status is TransferStatus.COMPLETED
        assert arr[:70000].tobytes() == data
        t = engine.transports[0]
        assert t.stats["connects"] >= 1 and t.stats["posted"] >= 2  # type: ignore[attr-defined]


async def test_the_published_engine_writes_and_reads_us_over_rdma(
    published: PublishedRdma,
) -> None:
    async with mooncake.open_engine(transports=["rdma"]) as engine:
        buf = await engine.allocate(SIZE)
        arr = buf.numpy()
        data = pattern(31, 200000).tobytes()
        await published.cmd(op="fill", offset=0, data_hex=data.hex())
        r = await published.cmd(
            op="write",
            segment=engine.segment_name,
            local_off=0,
            remote=buf.addr + 64,
            length=200000,
        )
        assert r["rc"] == 0
        assert arr[64 : 64 + 200000].tobytes() == data
        arr[: 1 << 20] = pattern(32, 1 << 20)
        r = await published.cmd(
            op="read", segment=engine.segment_name, local_off=4096, remote=buf.addr, length=1 << 20
        )
        assert r["rc"] == 0
        got = await published.cmd(op="dump", offset=4096, length=1 << 20)
        assert bytes.fromhex(got["data_hex"]) == arr[: 1 << 20].tobytes()
        t = engine.transports[0]
        assert t.stats["accepts"] >= 1  # type: ignore[attr-defined]
