"""The rdma transport between two processes over the software verbs provider.

Engine A runs here (trio), engine B in a child process (``tests/helpers/rdma_peer.py``); both
see two fake NICs, ``soft0`` and ``soft1``, on a private fabric. Every transfer is verified byte
for byte through digests taken on the other side. See docs/rdma.md for what this does and does
not prove about real RNICs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import mooncake
from mooncake._cli._peer import digest, pattern
from mooncake._core.rdma import split_lengths
from mooncake._core.transfer import TransferRequest, TransferStatus
from mooncake.errors import (
    PeerDiedError,
    PeerUnreachableError,
    RemoteAccessError,
    TransferError,
    TransferTimeoutError,
)
from tests.conftest import ROOT, clean_env

verbs = pytest.importorskip("mooncake._fast.verbs")
# MC_RDMA_TEST_DEVICES=mlx5_0,mlx5_1 runs these tests on real RNICs through libibverbs (see
# docs/rdma.md); the fault-injection tests need the software provider and skip there.
HW_DEVICES = [d for d in os.environ.get("MC_RDMA_TEST_DEVICES", "").split(",") if d]
DEVICES = HW_DEVICES or ["soft0", "soft1"]
soft_only = pytest.mark.skipif(bool(HW_DEVICES), reason="needs the software provider's hooks")
if not verbs.AVAILABLE or not (HW_DEVICES or os.path.exists(verbs.soft_provider_path())):
    pytest.skip("verbs layer or libmcsoftverbs.so not built", allow_module_level=True)

pytestmark = pytest.mark.anyio
R = TransferRequest
PEER_SIZE = 8 << 20


@pytest.fixture
def fabric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    if HW_DEVICES:
        env = {"MC_TE_FILTERS": ",".join(HW_DEVICES)}
    else:
        env = {
            "MOONCAKE_IBVERBS": "soft",
            "MC_SOFTVERBS_FABRIC": str(tmp_path / "fabric"),
            "MC_SOFTVERBS_DEVICES": "soft0,soft1",
        }
        monkeypatch.delenv("MC_SOFTVERBS_LINK_LAYER", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    verbs.load(None if HW_DEVICES else verbs.soft_provider_path())
    yield env
    assert set(verbs.live_objects().values()) == {0}, verbs.live_objects()
    if not HW_DEVICES:
        assert set(verbs.provider_live_objects().values()) == {0}, verbs.provider_live_objects()


class RdmaPeer:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.rdma_peer", str(PEER_SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=clean_env(**env),
            cwd=str(ROOT),
        )
        info = self._read()
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"rdma peer exited ({self.proc.wait()})"
        out: dict[str, Any] = json.loads(line)
        return out

    async def cmd(self, **c: Any) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(c) + "\n")
            self.proc.stdin.flush()
            return self._read()

        return await anyio.to_thread.run_sync(run)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> dict[str, Any] | None:
        res = None
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            res = self._read()
            self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        return res


@pytest.fixture
def rpeer(fabric: dict[str, str]) -> Iterator[RdmaPeer]:
    p = RdmaPeer(fabric)
    try:
        yield p
    finally:
        res = p.close()
        if res is not None:  # the peer's verbs objects balance too
            assert set(res["live"].values()) == {0}, res
            assert HW_DEVICES or set(res["provider"].values()) == {0}, res


@pytest.fixture
async def engine(fabric: dict[str, str]) -> AsyncIterator[mooncake.Engine]:
    async with mooncake.open_engine(transports=["rdma"]) as e:
        yield e


def _t(engine: mooncake.Engine) -> Any:
    (t,) = engine.transports
    assert t.name == "rdma"
    return t


@pytest.mark.parametrize("size", [1, 4095, 65536 + 16384, 65536 + 16385, (3 << 20) + 5])
async def test_write_then_read_verified(
    engine: mooncake.Engine, rpeer: RdmaPeer, size: int
) -> None:
    buf = await engine.allocate(PEER_SIZE)
    arr = buf.numpy()
    arr[:size] = pattern(size, size)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr + 7, size)
    assert (await rpeer.cmd(op="digest", offset=7, length=size))["digest"] == digest(arr[:size])
    await rpeer.cmd(op="fill", offset=3, length=size, seed=size + 1)
    await engine.read(rpeer.segment, buf.addr + 1, rpeer.addr + 3, size)
    assert digest(arr[1 : 1 + size]) == digest(pattern(size + 1, size))
    # one WR per slice, Mooncake's slicing (64 KiB, tail merge)
    assert _t(engine).stats["posted"] == 2 * len(split_lengths(size))


async def test_mixed_batch_on_several_rails(engine: mooncake.Engine, rpeer: RdmaPeer) -> None:
    buf = await engine.allocate(PEER_SIZE)
    arr = buf.numpy()
    arr[:] = pattern(5, PEER_SIZE)
    await rpeer.cmd(op="fill", offset=4 << 20, length=4 << 20, seed=6)
    reqs = [R.write(buf.addr + (i << 20), rpeer.addr + (i << 20), 1 << 20) for i in range(4)]
    reqs += [R.read(buf.addr + (i << 20), rpeer.addr + (i << 20), 1 << 20) for i in range(4, 8)]
    res = await engine.transfer(rpeer.segment, reqs)
    assert [r.status for r in res] == [TransferStatus.COMPLETED] * 8
    assert (await rpeer.cmd(op="digest", offset=0, length=4 << 20))["digest"] == digest(
        pattern(5, PEER_SIZE)[: 4 << 20]
    )
    assert digest(arr[4 << 20 :]) == digest(pattern(6, 4 << 20))
    t = _t(engine)
    if len(DEVICES) > 1:
        assert t.stats["connects"] >= 2  # slices spread over NIC pairs (random among preferred)
    if not HW_DEVICES:
        assert verbs.soft_wr_count("soft0") > 0 and verbs.soft_wr_count("soft1") > 0


async def test_stale_rkey_refreshes_descriptor_and_succeeds(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(1 << 20)
    buf.numpy()[:] = pattern(1, 1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
    connects = _t(engine).stats["connects"]
    await rpeer.cmd(op="rekey")  # same memory, new MRs: our cached rkeys are stale
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
    assert _t(engine).stats["wc_IBV_WC_REM_ACCESS_ERR"] >= 1
    assert _t(engine).stats["connects"] > connects  # the errored endpoint was re-established
    assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
        pattern(1, 1 << 20)
    )


async def test_unregistered_remote_buffer_is_remote_access_error(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4096)
    await rpeer.cmd(op="unregister")  # our cached descriptor still lists it
    (res,) = await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])
    assert res.status is TransferStatus.FAILED
    assert isinstance(res.error, RemoteAccessError)
    assert _t(engine).stats["wc_IBV_WC_REM_ACCESS_ERR"] >= 1


async def test_peer_death_fails_the_transfer_without_hanging(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
    rpeer.kill()
    with anyio.fail_after(60):  # a safety net against hangs, not a speed assertion
        (res,) = await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])
    assert res.status is TransferStatus.FAILED
    assert isinstance(res.error, (PeerDiedError, PeerUnreachableError))
    t = _t(engine)
    assert t.stats["wc_IBV_WC_RETRY_EXC_ERR"] >= 1  # the NIC's verdict on the dead responder
    assert not t._inflight


@soft_only
async def test_failed_slices_retry_on_the_other_nic(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(2 << 20)
    buf.numpy()[:] = pattern(9, 2 << 20)
    verbs.soft_inject_fault("soft0", verbs.WC_RETRY_EXC_ERR, 3)
    before = verbs.soft_wr_count("soft1")
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 2 << 20)
    assert (await rpeer.cmd(op="digest", offset=0, length=2 << 20))["digest"] == digest(
        pattern(9, 2 << 20)
    )
    t = _t(engine)
    assert t.stats["wc_IBV_WC_RETRY_EXC_ERR"] == 3
    assert t.stats["retries"] >= 3
    assert verbs.soft_wr_count("soft1") > before


@soft_only
async def test_nic_down_pauses_its_rails_and_traffic_moves(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(4 << 20)
    buf.numpy()[:] = pattern(11, 4 << 20)
    verbs.soft_set_port_state("soft0", up=False)
    try:
        for _ in range(3):
            await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4 << 20)
        t = _t(engine)
        paused = t.rails.health.paused_rails(anyio.current_time())
        assert paused and all(li == 0 or path.endswith("@soft0") for li, path in paused), paused
        before = verbs.soft_wr_count("soft0")
        await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4 << 20)
        # paused rails are skipped: nothing more is even tried through soft0's rails
        assert verbs.soft_wr_count("soft0") == before
    finally:
        verbs.soft_set_port_state("soft0", up=True)
    assert (await rpeer.cmd(op="digest", offset=0, length=4 << 20))["digest"] == digest(
        pattern(11, 4 << 20)
    )


@soft_only
async def test_every_rail_down_fails_clearly(engine: mooncake.Engine, rpeer: RdmaPeer) -> None:
    buf = await engine.allocate(1 << 20)
    for d in ("soft0", "soft1"):
        verbs.soft_set_port_state(d, up=False)
    try:
        with anyio.fail_after(60):
            (res,) = await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])
    finally:
        for d in ("soft0", "soft1"):
            verbs.soft_set_port_state(d, up=True)
    assert res.status is TransferStatus.FAILED
    assert isinstance(res.error, TransferError)
    assert "RETRY_EXC_ERR" in str(res.error) or "no usable RDMA rail" in str(res.error)


async def test_cancelled_transfer_leaves_nothing_in_flight(
    engine: mooncake.Engine, rpeer: RdmaPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled right after its first WRs are posted, a transfer returns only once every
    posted WR has been reaped; its buffer stays pinned until then."""
    buf = await engine.allocate(4 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4096)  # endpoints up
    t = _t(engine)
    (region,) = engine.registry.regions()
    real_post = t.rails.post
    seen: dict[str, int] = {}
    scope = anyio.CancelScope()

    def post_then_cancel(*args: Any) -> None:
        real_post(*args)
        if not seen and t._inflight:
            seen["posted"] = len(t._inflight)
            seen["mr_inflight"] = sum(mr.inflight for mr in region.meta["rdma_mrs"])
            seen["users"] = region.users
            scope.cancel()

    monkeypatch.setattr(t.rails, "post", post_then_cancel)
    # a small budget per pump run: the first post leaves WRs in flight (and more to post)
    monkeypatch.setattr(t.rails, "pump_budget", 4)
    posted0, reaped0 = t.stats["posted"], t.stats["completions"]
    with scope:
        await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 4 << 20)])
    assert scope.cancelled_caught
    assert seen["posted"] > 0 and seen["mr_inflight"] == seen["posted"]  # cancelled mid-flight
    assert seen["users"] > 0  # the buffer was pinned while its WRs were out
    # on return: every WR that was posted has been retired (reaped, or covered by a later
    # signaled completion on its QP), nothing is left in flight
    assert t.stats["posted"] - posted0 >= seen["posted"]
    assert t.stats["completions"] - reaped0 > 0
    assert not t._inflight
    assert all(mr.inflight == 0 for mr in region.meta["rdma_mrs"])
    assert region.users == 0
    monkeypatch.setattr(t.rails, "post", real_post)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4 << 20)  # still usable


async def test_descriptor_carries_mooncake_rdma_fields(engine: mooncake.Engine) -> None:
    buf = await engine.allocate(1 << 20)
    d = engine.descriptor().to_json()
    assert d["protocol"] == "rdma"
    assert [x["name"] for x in d["devices"]] == DEVICES
    assert all(len(x["gid"].split(":")) == 16 for x in d["devices"])
    (b,) = d["buffers"]
    assert b["addr"] == buf.addr and len(b["rkey"]) == len(b["lkey"]) == len(DEVICES)
    assert set(d["priority_matrix"]) >= {"cpu:0", "*"}


@soft_only
async def test_cancel_during_a_stalled_transfer_flushes_and_returns(
    engine: mooncake.Engine, rpeer: RdmaPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = await engine.allocate(1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4096)  # endpoints up
    t = _t(engine)
    posted = anyio.Event()
    real_post = t.rails.post

    def spy(*args: Any) -> None:
        real_post(*args)
        posted.set()

    monkeypatch.setattr(t.rails, "post", spy)
    for d in DEVICES:
        verbs.soft_set_stall(d, True)
    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])

            tg.start_soon(run)
            await posted.wait()  # WRs are posted (and swallowed by the stalled NICs)
            assert t._inflight
            (region,) = engine.registry.regions()
            assert sum(mr.inflight for mr in region.meta["rdma_mrs"]) == len(t._inflight)
            tg.cancel_scope.cancel()
        # returned only after every posted WR was flushed and reaped
        assert not t._inflight
        assert all(mr.inflight == 0 for mr in region.meta["rdma_mrs"])
        assert t.stats["wc_IBV_WC_WR_FLUSH_ERR"] >= 1
    finally:
        for d in DEVICES:
            verbs.soft_set_stall(d, False)
    buf.numpy()[:] = pattern(3, 1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)  # fresh endpoints work
    assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
        pattern(3, 1 << 20)
    )


async def test_refused_posts_move_to_a_fresh_endpoint(
    engine: mooncake.Engine, rpeer: RdmaPeer
) -> None:
    buf = await engine.allocate(1 << 20)
    buf.numpy()[:] = pattern(41, 1 << 20)
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4096)
    t = _t(engine)
    for ep in list(t.rails.active.values()):
        for qp in ep.qps:
            qp.reset()  # behind the transport's back: the device refuses posts on these QPs
    connects = t.stats["connects"]
    await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
    assert t.stats["connects"] > connects
    assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
        pattern(41, 1 << 20)
    )


async def test_tiny_queues_throttle_posting_without_losing_slices(
    fabric: dict[str, str], rpeer: RdmaPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, val in {
        "MC_MAX_WR": "2",
        "MC_MAX_CQE_PER_CTX": "3",
        "MC_NUM_QP_PER_EP": "1",
        "MC_SLICE_SIZE": "4096",
    }.items():
        monkeypatch.setenv(k, val)
    async with mooncake.open_engine(transports=["rdma"]) as engine:
        buf = await engine.allocate(1 << 20)
        buf.numpy()[:] = pattern(42, 1 << 20)
        reqs = [R.write(buf.addr + (i << 18), rpeer.addr + (i << 18), 1 << 18) for i in range(4)]
        res = await engine.transfer(rpeer.segment, reqs)
        assert all(r.ok for r in res)
        assert _t(engine).stats["posted"] == 256  # 1 MiB in 4 KiB slices, <= 3 in flight per NIC
    assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
        pattern(42, 1 << 20)
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_smoke(fabric: dict[str, str], rpeer: RdmaPeer) -> None:
    async with mooncake.open_engine(transports=["rdma"]) as engine:
        buf = await engine.allocate(1 << 20)
        buf.numpy()[:] = pattern(51, 1 << 20)
        await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
        await rpeer.cmd(op="fill", offset=0, length=1 << 20, seed=52)
        await engine.read(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)
        assert digest(buf.numpy()) == digest(pattern(52, 1 << 20))


async def test_concurrent_batches_share_endpoints(engine: mooncake.Engine, rpeer: RdmaPeer) -> None:
    buf = await engine.allocate(PEER_SIZE)
    arr = buf.numpy()
    arr[:] = pattern(61, PEER_SIZE)
    part = PEER_SIZE // 8
    results: list[Any] = [None] * 8

    async def one(i: int) -> None:
        off = i * part
        results[i] = await engine.transfer(
            rpeer.segment, [R.write(buf.addr + off, rpeer.addr + off, part)]
        )

    async with anyio.create_task_group() as tg:  # all connect at once: one handshake per rail
        for i in range(8):
            tg.start_soon(one, i)
    assert all(r[0].ok for r in results)
    t = _t(engine)
    assert t.stats["connects"] <= len(DEVICES) ** 2
    assert (await rpeer.cmd(op="digest", offset=0, length=PEER_SIZE))["digest"] == digest(arr)


@soft_only
async def test_slice_timeout_fails_a_hung_transfer_with_timeout(
    fabric: dict[str, str], rpeer: RdmaPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_SLICE_TIMEOUT", "0.2")
    async with mooncake.open_engine(transports=["rdma"]) as engine:
        buf = await engine.allocate(1 << 20)
        await engine.write(rpeer.segment, buf.addr, rpeer.addr, 4096)
        for d in DEVICES:
            verbs.soft_set_stall(d, True)
        try:
            (res,) = await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])
        finally:
            for d in DEVICES:
                verbs.soft_set_stall(d, False)
        assert res.status is TransferStatus.TIMEOUT
        assert isinstance(res.error, TransferTimeoutError)
        t = _t(engine)
        assert not t._inflight and t.stats["timeouts"] >= 1
        await engine.write(rpeer.segment, buf.addr, rpeer.addr, 1 << 20)  # and it recovers
