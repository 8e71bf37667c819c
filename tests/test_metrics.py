"""Metrics: scrape the engine's and the store client's exporters after known traffic.

Real processes and sockets: the remote engine is ``tests/helpers/engine_peer.py``, the master
is ``python -m mooncake master`` and a second store client is
``tests/helpers/store_client_driver.py``; every count is checked exactly.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mooncake._core.transfer import Opcode, TransferRequest
from mooncake._engine.engine import open_engine
from mooncake._engine.metrics import BUCKETS
from tests.helpers.driver import LineDriver
from tests.helpers.store_procs import Client, _env, _readline

pytestmark = pytest.mark.anyio

HELPER = Path(__file__).parent / "helpers" / "engine_peer.py"
ROOT = Path(__file__).parent.parent
SIZE = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


class Peer(LineDriver):
    def __init__(self) -> None:
        super().__init__(
            [sys.executable, str(HELPER), "--alloc", str(SIZE), "--array", str(SIZE)],
            what="engine_peer",
        )


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.close()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_buckets_resolve_10us_to_1s() -> None:
    assert BUCKETS[0] == 1e-5 and BUCKETS[-1] == 1.0
    assert all(b / a <= 2.5 for a, b in itertools.pairwise(BUCKETS))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_engine_counts_after_known_traffic(peer: Peer, transport: str) -> None:
    remote = peer.info["alloc"]
    async with open_engine(transports=[transport], metrics_port=0) as eng:
        assert eng.metrics_server is not None
        buf = await eng.allocate(SIZE)
        w = [
            TransferRequest(Opcode.WRITE, buf.addr + i * 4096, remote + i * 4096, 4096)
            for i in (0, 1)
        ]
        for _ in range(3):
            assert all(r.ok for r in await eng.transfer(peer.segment, w))
        rd = [TransferRequest(Opcode.READ, buf.addr, remote, 65536)]
        assert (await eng.transfer(peer.segment, rd))[0].ok
        # a range outside the peer's buffers fails before any transport sees it
        bad = [TransferRequest(Opcode.READ, buf.addr, remote + (64 << 20), 4096)]
        (res,) = await eng.transfer(peer.segment, bad)
        assert not res.ok
        m = scrape(eng.metrics_server.port)
    seg = peer.segment
    lab = {"transport": transport, "peer": seg}
    assert val(m, "mooncake_engine_batches_total", op="write", **lab) == 3
    assert val(m, "mooncake_engine_transfer_requests_total", op="write", **lab) == 6
    assert val(m, "mooncake_engine_transfer_bytes_total", op="write", **lab) == 6 * 4096
    assert val(m, "mooncake_engine_transfer_requests_total", op="read", **lab) == 1
    assert val(m, "mooncake_engine_transfer_bytes_total", op="read", **lab) == 65536
    assert val(m, "mooncake_engine_transfer_failed_requests_total", op="read", **lab) == 0
    assert (
        val(m, "mooncake_engine_transfer_failed_requests_total", transport="", peer=seg, op="read")
        == 1
    )
    assert total(m, "mooncake_engine_errors_total", transport="", kind="RemoteAccessError") == 1
    # the histogram: one observation per batch, cumulative buckets ending in +Inf == count
    h = {"transport": transport, "op": "write"}
    assert val(m, "mooncake_engine_batch_latency_seconds_count", **h) == 3
    assert val(m, "mooncake_engine_batch_latency_seconds_bucket", le="+Inf", **h) == 3
    cum = [val(m, "mooncake_engine_batch_latency_seconds_bucket", le=str(b), **h) for b in BUCKETS]
    assert cum == sorted(cum) and cum[-1] <= 3
    assert val(m, "mooncake_engine_batch_latency_seconds_sum", **h) > 0
    assert val(m, "mooncake_engine_registered_bytes") == SIZE
    assert val(m, "mooncake_engine_pinned_bytes") == 0
    assert val(m, "mooncake_engine_connections", transport=transport) == 1


async def test_local_segment_and_batch_failure_counted(peer: Peer) -> None:
    async with open_engine(transports=["tcp"]) as eng:
        a = await eng.allocate(SIZE)
        b = await eng.allocate(SIZE)
        r = [TransferRequest(Opcode.WRITE, a.addr, b.addr, 8192)]
        assert (await eng.transfer(eng.segment_name, r))[0].ok
        res = await eng.transfer("127.0.0.1:1", r)  # nobody listens there
        assert not res[0].ok
        m = parse(generate_latest(eng.metrics_registry).decode())
    assert val(
        m, "mooncake_engine_transfer_bytes_total",
        transport="local", peer=eng.segment_name, op="write",
    ) == 8192  # fmt: skip
    assert val(
        m, "mooncake_engine_transfer_failed_requests_total",
        transport="", peer="127.0.0.1:1", op="write",
    ) == 1  # fmt: skip
    kind = type(res[0].error).__name__
    assert total(m, "mooncake_engine_errors_total", transport="", kind=kind) == 1


def test_sync_facade_path_counts_once(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller-thread path counts its batches; a batch is never counted twice."""
    from mooncake.engine import TransferEngine

    monkeypatch.setenv("MC_FORCE_TCP", "1")
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        addr = te.allocate_managed_buffer(SIZE)
        remote = peer.info["alloc"]
        for _ in range(5):
            assert te.transfer_sync_write(peer.segment, addr, remote, 4096) == 0
        assert te._fast is not None and te._fast.hits >= 1  # some went the caller-thread way
        port = te.serve_metrics(0)
        m = scrape(port)
    finally:
        te.close()
    lab = {"transport": "tcp", "peer": peer.segment, "op": "write"}
    assert val(m, "mooncake_engine_batches_total", **lab) == 5
    assert val(m, "mooncake_engine_transfer_bytes_total", **lab) == 5 * 4096
    assert val(m, "mooncake_engine_batch_latency_seconds_count", transport="tcp", op="write") == 5


async def test_metrics_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_METRICS", "0")
    async with open_engine(transports=["tcp"], metrics_port=0) as eng:
        assert eng.metrics is None and eng.metrics_server is None
        assert generate_latest(eng.metrics_registry) == b""


async def test_bad_metrics_port_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake.errors import InvalidArgumentError

    monkeypatch.setenv("MC_METRICS_PORT", "nine")
    with pytest.raises(InvalidArgumentError, match="MC_METRICS_PORT"):
        async with open_engine(transports=["tcp"]):
            pass


# -- store ------------------------------------------------------------------------------------


class MasterProc:
    """``python -m mooncake master`` with RPC and metrics on free loopback ports."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--metrics-port", "0"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
        )
        line = _readline(self.proc, 30)
        self.address = line.split("rpc=", 1)[1].split()[0]
        self.http = line.split("metrics=", 1)[1].split()[0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def master() -> Iterator[MasterProc]:
    m = MasterProc()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def other_client(master: MasterProc) -> Iterator[Client]:
    c = Client(master.address, 16)
    try:
        yield c
    finally:
        c.stop()


async def test_store_counts_and_top(master: MasterProc, other_client: Client) -> None:
    from mooncake._store.client import open_store

    async with open_store(master.address, segment_size=16 << 20, metrics_port=0) as store:
        port = store.engine.metrics_server.port  # type: ignore[union-attr]
        for i in range(3):
            await store.put(f"k{i}", bytes([i]) * 4096)
        await store.put_batch(["b0", "b1"], [b"x" * 100, b"y" * 200])
        for i in range(3):
            assert await store.get(f"k{i}") == bytes([i]) * 4096
        for k in ("absent0", "absent1"):
            with pytest.raises(Exception, match=r"(?i)not.found|OBJECT_NOT_FOUND"):
                await store.get(k)
        got = await store.get_batch(["b0", "absent2"])
        assert got[0] == b"x" * 100 and isinstance(got[1], Exception)
        m = scrape(port)
        top = await anyio.run_process(
            [
                sys.executable, "-m", "mooncake", "top", master.http,
                "--client", f"127.0.0.1:{port}", "--once", "--json", "--interval", "0.2",
            ],
            env=_env(),
        )  # fmt: skip
        table = await anyio.run_process(
            [
                sys.executable, "-m", "mooncake", "top", master.http, "--client", "127.0.0.1:1",
                "--once", "--interval", "0",
            ],
            env={**_env(), "COLUMNS": "200"},
        )  # fmt: skip
    text = table.stdout.decode()
    assert "mooncake master" in text and "segments" in text and "unreachable" in text
    loop = {"path": "loop"}
    assert val(m, "mooncake_store_calls_total", family="put", **loop) == 3
    assert val(m, "mooncake_store_bytes_total", family="put", **loop) == 3 * 4096
    assert val(m, "mooncake_store_items_total", family="put_batch", **loop) == 2
    assert val(m, "mooncake_store_bytes_total", family="put_batch", **loop) == 300
    assert val(m, "mooncake_store_calls_total", family="get", **loop) == 5
    assert val(m, "mooncake_store_bytes_total", family="get", **loop) == 3 * 4096
    assert val(m, "mooncake_store_failed_items_total", family="get", **loop) == 2
    assert val(m, "mooncake_store_items_total", family="get_batch", **loop) == 2
    assert val(m, "mooncake_store_failed_items_total", family="get_batch", **loop) == 1
    assert val(m, "mooncake_store_call_latency_seconds_count", family="get", **loop) == 5
    assert total(m, "mooncake_store_errors_total", family="get", kind="ObjectNotFoundError") == 2
    assert total(m, "mooncake_store_misses_total") == 3  # miss_stats: two gets, one batch key
    assert ("mooncake_store_lease_fences_total", ()) in m
    # the engine's series share the registry
    assert ("mooncake_engine_registered_bytes", ()) in m

    v: dict[str, Any] = json.loads(top.stdout)
    assert v["master"]["objects"] == 5
    assert v["master"]["clients"] == 2 and v["master"]["segments"] == 2
    assert v["master"]["capacity_bytes"] == 2 * (16 << 20)
    assert v["master"]["tiers"]["dram"]["segments"] == 2
    assert v["master"]["counters"]["get_misses"] >= 2
    assert len(v["segments"]) == 2 and len(v["master_clients"]) == 2
    (c,) = v["clients"]
    assert c["read_bytes"] == 3 * 4096 + 100 and c["write_bytes"] == 3 * 4096 + 300
    assert c["failed_reads"] == 3 and c["read_bytes_per_s"] == 0


def test_facade_fast_path_counts(master: MasterProc) -> None:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address)
    assert rc == 0
    try:
        assert s.put("f0", b"a" * 1000) == 0
        assert s.put("f1", b"b" * 2000) == 0
        assert s.get("f0") == b"a" * 1000
        assert s.get("f1") == b"b" * 2000
        assert s.get("nope") == b""
        m = parse(generate_latest(s.metrics_registry).decode())
    finally:
        s.close()
    assert total(m, "mooncake_store_calls_total", family="put") == 2
    assert total(m, "mooncake_store_bytes_total", family="put") == 3000
    assert total(m, "mooncake_store_calls_total", family="get") == 3
    assert total(m, "mooncake_store_bytes_total", family="get") == 3000
    assert val(m, "mooncake_store_calls_total", family="get", path="fast") >= 2


def test_top_without_master_says_so() -> None:
    from tests.services import free_port

    r = subprocess.run(
        [sys.executable, "-m", "mooncake", "top", f"127.0.0.1:{free_port()}", "--once", "--json"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "cannot read" in r.stderr and "/status" in r.stderr


async def test_env_port_taken_by_first_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """MC_METRICS_PORT: the first engine serves it, a second one opens without an exporter;
    an explicit port that cannot be bound is an error."""
    from mooncake.errors import InvalidArgumentError
    from tests.services import free_port

    port = free_port()
    monkeypatch.setenv("MC_METRICS_PORT", str(port))
    async with open_engine(transports=["tcp"]) as a, open_engine(transports=["tcp"]) as b:
        assert a.metrics_server is not None and a.metrics_server.port == port
        assert b.metrics_server is None
        assert ("mooncake_engine_registered_bytes", ()) in scrape(port)
        with pytest.raises(InvalidArgumentError, match="cannot serve metrics"):
            async with open_engine(transports=["tcp"], metrics_port=port):
                pass
