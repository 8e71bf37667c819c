"""The Cython verbs layer against the software verbs provider, across two real processes.

What this proves (see docs/rdma.md): the layer drives the libibverbs ABI correctly (device
list, context, PD, MR, CQ + completion channel, RC QP INIT->RTR->RTS, posted WRITE/READ
batches, batched polling), error completions surface with the right status (remote access,
flush, retry exceeded), and ownership holds (buffers stay exported, WRs pin their MR until
reaped, nothing leaks). Wire timing, DMA ordering and real NIC error timing are not covered.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import random
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake.errors import (
    ClosedError,
    InvalidArgumentError,
    NotRegisteredError,
    RegionBusyError,
    VerbsError,
)

v = pytest.importorskip("mooncake._fast.verbs")
if not v.AVAILABLE:
    pytest.skip(f"verbs layer not built: {v.UNAVAILABLE_REASON}", allow_module_level=True)
# MC_RDMA_TEST_DEVICES=mlx5_0,mlx5_1 runs the same tests on real RNICs through libibverbs
# (see docs/rdma.md); the fault-injection tests need the software provider and skip there.
HW_DEVICES = [d for d in os.environ.get("MC_RDMA_TEST_DEVICES", "").split(",") if d]
DEV0, DEV1 = (HW_DEVICES * 2)[:2] if HW_DEVICES else ("soft0", "soft1")
GID_INDEX = int(os.environ.get("MC_GID_INDEX", "0") or 0)
soft_only = pytest.mark.skipif(bool(HW_DEVICES), reason="needs the software provider's hooks")
if not HW_DEVICES and not os.path.exists(v.soft_provider_path()):
    pytest.skip("libmcsoftverbs.so not built (setup.py build_ext)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "_verbs_peer.py"


@pytest.fixture(autouse=True)
def soft_fabric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private fabric per test; every verbs object closed at the end (counters balance)."""
    fabric = tmp_path / "fabric"
    if HW_DEVICES:
        v.load()
    else:
        monkeypatch.setenv("MOONCAKE_IBVERBS", "soft")
        monkeypatch.setenv("MC_SOFTVERBS_FABRIC", str(fabric))
        monkeypatch.setenv("MC_SOFTVERBS_DEVICES", "soft0,soft1")
        monkeypatch.delenv("MC_SOFTVERBS_LINK_LAYER", raising=False)
        v.load(v.soft_provider_path())
    yield fabric
    assert set(v.live_objects().values()) == {0}, v.live_objects()
    if not HW_DEVICES:
        assert set(v.provider_live_objects().values()) == {0}, v.provider_live_objects()


class Peer:
    """The passive side in a child process."""

    def __init__(self, fabric: Path, length: int = 1 << 20, device: str = DEV0) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            MC_SOFTVERBS_FABRIC=str(fabric),
            MC_VERBS_TEST_DEVICE=device,
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(length)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.info = self.recv()

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait()}"
        return json.loads(line)

    def call(self, obj: Any) -> Any:
        self.send(obj)
        return self.recv()

    def close(self) -> dict[str, Any]:
        if self.proc.poll() is not None:
            return {}
        res = self.call({"cmd": "exit"})
        self._reap()
        return res  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class Side:
    """The active side in this process: context, PD, channel, CQ, one registered buffer, QP."""

    def __init__(self, device: str = DEV0, length: int = 1 << 20, cqe: int = 256) -> None:
        self.ctx = v.Context(device)
        self.pd = v.PD(self.ctx)
        self.ch = v.CompChannel(self.ctx)
        self.cq = v.CQ(self.ctx, cqe, self.ch)
        self.buf = bytearray(length)
        self.mr = v.MR(self.pd, self.buf)
        self.qp = v.QP(self.pd, self.cq, max_send_wr=64)
        self.wc = v.WcBatch(32)

    def endpoint(self) -> dict[str, Any]:
        return {
            "qpn": self.qp.qp_num,
            "lid": self.ctx.query_port()["lid"],
            "gid": self.ctx.query_gid(1, GID_INDEX).hex(),
        }

    def connect(self, peer: dict[str, Any]) -> None:
        self.qp.to_init()
        self.qp.to_rtr(peer["qpn"], peer["lid"], bytes.fromhex(peer["gid"]), sgid_index=GID_INDEX)
        self.qp.to_rts()

    def reap(self, want: int) -> list[tuple[int, int, int]]:
        """Wait on the completion channel fd until ``want`` completions are reaped."""
        got: list[tuple[int, int, int]] = []
        while len(got) < want:
            self.cq.req_notify()
            n = self.cq.poll(self.wc)  # drain after arming: nothing can slip between
            if n == 0:
                r, _, _ = select.select([self.ch.fd], [], [], 10)
                assert r, "no completion event within 10 s"
                assert self.ch.get_events() >= 1
                continue
            got += [(self.wc.cookies[i], self.wc.status[i], self.wc.byte_len[i]) for i in range(n)]
        return got

    def post(
        self,
        op: int,
        offs: list[int],
        lens: list[int],
        raddrs: list[int],
        rkey: int,
        cookies: list[int] | None = None,
    ) -> int:
        n = len(offs)
        return self.qp.post(  # type: ignore[no-any-return]
            op,
            [self.mr] * n,
            [self.mr.addr + o for o in offs],
            lens,
            raddrs,
            [rkey] * n,
            cookies if cookies is not None else list(range(n)),
        )

    def close(self) -> None:
        self.ctx.close()


@pytest.fixture
def pair(soft_fabric: Path) -> Iterator[tuple[Side, Peer]]:
    peer = Peer(soft_fabric)
    side = Side()
    try:
        side.connect(peer.info)
        assert peer.call(side.endpoint()) == {"ready": True}
        yield side, peer
    finally:
        side.close()
        if peer.proc.poll() is None:
            res = peer.close()
            assert set(res["live"].values()) == {0}
            assert HW_DEVICES or set(res["provider"].values()) == {0}
        else:
            peer.kill()


@soft_only
def test_device_list_and_port_attributes() -> None:
    assert v.get_device_list() == ["soft0", "soft1"]
    with v.Context("soft1") as ctx:
        port = ctx.query_port()
        assert port["state"] == "ACTIVE" and port["link_layer"] == "INFINIBAND"
        assert port["lid"] > 0 and v.MTU_BYTES[port["active_mtu"]] == 4096
        assert len(ctx.query_gid()) == 16
        assert ctx.query_device()["max_qp_wr"] >= 256
    with pytest.raises(InvalidArgumentError, match="no RDMA device named 'mlx5_9'"):
        v.Context("mlx5_9")


def test_two_processes_write_then_read_byte_for_byte(pair: tuple[Side, Peer]) -> None:
    side, peer = pair
    rng = random.Random(7)
    side.buf[:] = rng.randbytes(len(side.buf))
    base, rkey = peer.info["addr"], peer.info["rkey"]
    # 16 WRITEs of 64 KiB in one posted batch, remote offsets shuffled
    offs = [i << 16 for i in range(16)]
    remote = offs[:]
    rng.shuffle(remote)
    assert (
        side.post(
            v.OP_WRITE,
            offs,
            [1 << 16] * 16,
            [base + r for r in remote],
            rkey,
            cookies=[1000 + i for i in range(16)],
        )
        == 16
    )
    done = side.reap(16)
    assert sorted(c for c, _, _ in done) == [1000 + i for i in range(16)]
    assert {s for _, s, _ in done} == {v.WC_SUCCESS}
    for lo, ro in zip(offs, remote, strict=True):
        want = hashlib.sha256(side.buf[lo : lo + (1 << 16)]).hexdigest()
        assert peer.call({"cmd": "sha", "off": ro, "len": 1 << 16})["sha"] == want
    # READ back a peer-filled buffer, odd sizes and offsets
    assert peer.call({"cmd": "fill", "seed": 99}) == {"ok": True}
    expect = random.Random(99).randbytes(len(side.buf))
    side.buf[:] = bytes(len(side.buf))
    cuts = [0, 1, 4096, 4096 + 65539, 300_000, 700_000, 1 << 20]
    spans = [(a, b - a) for a, b in itertools.pairwise(cuts)]
    assert side.post(
        v.OP_READ, [o for o, _ in spans], [n for _, n in spans], [base + o for o, _ in spans], rkey
    ) == len(spans)
    done = side.reap(len(spans))
    assert [s for _, s, _ in done] == [v.WC_SUCCESS] * len(spans)
    assert sorted(b for _, _, b in done) == sorted(n for _, n in spans)
    assert side.buf == expect
    assert side.mr.inflight == 0 and side.qp.inflight == 0 and side.cq.inflight == 0


def test_wrong_rkey_is_remote_access_error_then_flush(pair: tuple[Side, Peer]) -> None:
    side, peer = pair
    base, rkey = peer.info["addr"], peer.info["rkey"]
    side.post(v.OP_WRITE, [0, 0], [64, 64], [base, base], rkey ^ 0x100, cookies=[1, 2])
    assert side.reap(2) == [(1, v.WC_REM_ACCESS_ERR, 0), (2, v.WC_WR_FLUSH_ERR, 0)]
    # the QP is in ERR now: everything later is flushed, nothing reaches the peer
    side.post(v.OP_WRITE, [0], [64], [base], rkey, cookies=[3])
    assert side.reap(1) == [(3, v.WC_WR_FLUSH_ERR, 0)]
    assert v.wc_status_name(v.WC_REM_ACCESS_ERR) == "IBV_WC_REM_ACCESS_ERR"


@pytest.mark.parametrize(("delta", "length"), [(-1, 64), ((1 << 20) - 63, 64), (1 << 20, 1)])
def test_out_of_range_remote_address_is_remote_access_error(
    pair: tuple[Side, Peer], delta: int, length: int
) -> None:
    side, peer = pair
    side.post(v.OP_READ, [0], [length], [peer.info["addr"] + delta], peer.info["rkey"])
    assert side.reap(1) == [(0, v.WC_REM_ACCESS_ERR, 0)]


def test_peer_death_gives_retry_exceeded_then_flush(pair: tuple[Side, Peer]) -> None:
    side, peer = pair
    base, rkey = peer.info["addr"], peer.info["rkey"]
    side.post(v.OP_WRITE, [0], [4096], [base], rkey, cookies=[1])
    assert side.reap(1) == [(1, v.WC_SUCCESS, 4096)]
    peer.kill()
    side.post(v.OP_WRITE, [0, 4096, 8192], [4096] * 3, [base] * 3, rkey, cookies=[2, 3, 4])
    assert side.reap(3) == [
        (2, v.WC_RETRY_EXC_ERR, 0),
        (3, v.WC_WR_FLUSH_ERR, 0),
        (4, v.WC_WR_FLUSH_ERR, 0),
    ]


def _pair(dev: str) -> tuple[Side, Side]:
    a, b = Side(dev), Side(dev)
    a.connect(b.endpoint())
    b.connect(a.endpoint())
    return a, b


def _reconnect(a: Side, b: Side) -> None:
    for s in (a, b):
        s.qp.reset()
    a.connect(b.endpoint())
    b.connect(a.endpoint())


@soft_only
def test_injected_fault_and_port_down_fail_only_that_nic(soft_fabric: Path) -> None:
    a0, b0 = _pair("soft0")
    a1, b1 = _pair("soft1")
    try:
        v.soft_inject_fault("soft1", v.WC_RETRY_EXC_ERR, 1)
        before = v.soft_wr_count("soft0")
        a1.post(v.OP_WRITE, [0], [8], [b1.mr.addr], b1.mr.rkey, cookies=[5])
        a0.post(v.OP_WRITE, [0], [8], [b0.mr.addr], b0.mr.rkey, cookies=[6])
        assert a1.reap(1) == [(5, v.WC_RETRY_EXC_ERR, 0)]
        assert a0.reap(1) == [(6, v.WC_SUCCESS, 8)]
        assert v.soft_wr_count("soft0") == before + 1
        # the responder of an errored QP does not answer until both sides reconnect
        b1.post(v.OP_WRITE, [0], [8], [a1.mr.addr], a1.mr.rkey, cookies=[7])
        assert b1.reap(1) == [(7, v.WC_RETRY_EXC_ERR, 0)]
        _reconnect(a1, b1)
        a1.post(v.OP_WRITE, [0], [8], [b1.mr.addr], b1.mr.rkey, cookies=[8])
        assert a1.reap(1) == [(8, v.WC_SUCCESS, 8)]
        v.soft_set_port_state("soft1", up=False)
        assert b1.ctx.query_port()["state"] == "DOWN"
        a1.post(v.OP_WRITE, [0], [8], [b1.mr.addr], b1.mr.rkey, cookies=[9])
        a0.post(v.OP_WRITE, [0], [8], [b0.mr.addr], b0.mr.rkey, cookies=[10])
        assert a1.reap(1) == [(9, v.WC_RETRY_EXC_ERR, 0)]
        assert a0.reap(1) == [(10, v.WC_SUCCESS, 8)]
    finally:
        v.soft_set_port_state("soft1", up=True)
        for s in (a0, b0, a1, b1):
            s.close()


def test_post_errors_release_their_slots(soft_fabric: Path) -> None:
    s = Side()
    try:
        free = s.qp.slots_free
        # RESET state: the device refuses the post itself
        with pytest.raises(VerbsError) as ei:
            s.post(v.OP_WRITE, [0, 8], [8, 8], [s.mr.addr] * 2, s.mr.rkey)
        assert ei.value.errno == errno.EINVAL and ei.value.posted == 0
        assert s.qp.slots_free == free and s.mr.inflight == 0
        with pytest.raises(NotRegisteredError, match="not inside MR"):
            s.post(v.OP_WRITE, [len(s.buf) - 4], [8], [s.mr.addr], s.mr.rkey)
        with pytest.raises(InvalidArgumentError, match="free send-queue slots"):
            s.post(v.OP_WRITE, [0] * 65, [8] * 65, [s.mr.addr] * 65, s.mr.rkey)
        with pytest.raises(VerbsError, match="ibv_modify_qp"):
            s.qp.to_rts()  # RESET -> RTS skips INIT and RTR
    finally:
        s.close()


@soft_only
def test_loopback_qp_and_roce_addressing(
    soft_fabric: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_SOFTVERBS_LINK_LAYER", "ethernet")
    s = Side("soft0")
    try:
        port = s.ctx.query_port()
        assert port["link_layer"] == "ETHERNET" and port["lid"] == 0
        s.qp.to_init()
        with pytest.raises(VerbsError):  # RoCE needs a GRH: LID 0 alone addresses nothing
            s.qp.to_rtr(s.qp.qp_num, 0, None)
        s.qp.to_rtr(s.qp.qp_num, 0, s.ctx.query_gid())  # connected to itself, as Mooncake does
        s.qp.to_rts()
        s.buf[:4] = b"abcd"
        s.post(v.OP_WRITE, [0], [4], [s.mr.addr + 100], s.mr.rkey)
        assert s.reap(1) == [(0, v.WC_SUCCESS, 4)]
        assert s.buf[100:104] == b"abcd"
    finally:
        s.close()


def test_ownership_buffers_stay_exported_and_wrs_pin_their_mr(soft_fabric: Path) -> None:
    s = Side()
    try:
        with pytest.raises(BufferError):
            s.buf.extend(b"x")  # exported while the MR exists
        s.qp.to_init()
        s.qp.to_rtr(
            s.qp.qp_num,
            s.ctx.query_port()["lid"],
            s.ctx.query_gid(1, GID_INDEX),
            sgid_index=GID_INDEX,
        )
        s.qp.to_rts()
        s.post(v.OP_WRITE, [0], [8], [s.mr.addr + 8], s.mr.rkey)
        assert s.mr.inflight == 1 and s.qp.inflight == 1
        with pytest.raises(RegionBusyError, match="1 posted work requests"):
            s.mr.close()
        assert s.reap(1) == [(0, v.WC_SUCCESS, 8)]
        s.mr.close()
        s.mr.close()  # idempotent
        s.buf.extend(b"x")  # released
        with pytest.raises(ClosedError):
            s.post(v.OP_WRITE, [0], [8], [0], 0)
        # closing a parent closes its children first: the QP goes with its CQ
        s.cq.close()
        assert s.qp.closed and s.cq.closed and not s.pd.closed
    finally:
        s.close()
    assert s.pd.closed and s.ch.closed and s.ctx.closed


def test_destroying_a_qp_releases_its_unreaped_slots(soft_fabric: Path) -> None:
    s = Side()
    try:
        s.qp.to_init()
        s.qp.to_rtr(
            s.qp.qp_num,
            s.ctx.query_port()["lid"],
            s.ctx.query_gid(1, GID_INDEX),
            sgid_index=GID_INDEX,
        )
        s.qp.to_rts()
        s.post(v.OP_WRITE, [0, 8, 16], [8] * 3, [s.mr.addr + 64] * 3, s.mr.rkey)
        assert s.mr.inflight == 3 and s.cq.slots_free == 256 - 3
        s.qp.close()
        assert s.mr.inflight == 0 and s.cq.slots_free == 256
        assert s.cq.poll(s.wc) == 0  # the provider purged the QP's completions too
        assert s.cq.stray == 0
    finally:
        s.close()


def test_unclosed_objects_warn_when_collected(soft_fabric: Path) -> None:
    import gc

    ctx = v.Context(DEV0)
    pd = v.PD(ctx)
    with pytest.warns(ResourceWarning, match="unclosed verbs PD"):
        del pd
        gc.collect()
    with pytest.warns(ResourceWarning, match="unclosed verbs Context"):
        del ctx
        gc.collect()


@soft_only
def test_stalled_wrs_stay_in_flight_until_the_qp_errors(soft_fabric: Path) -> None:
    a, b = _pair("soft1")
    try:
        v.soft_set_stall("soft1", True)
        a.post(v.OP_WRITE, [0, 8], [8, 8], [b.mr.addr] * 2, b.mr.rkey, cookies=[1, 2])
        assert a.cq.poll(a.wc) == 0
        assert a.mr.inflight == 2 and a.qp.slots_free == 64 - 2
        with pytest.raises(RegionBusyError):
            a.mr.close()  # the NIC may still read it: the buffer stays pinned
        a.qp.to_error()
        assert a.reap(2) == [(1, v.WC_WR_FLUSH_ERR, 0), (2, v.WC_WR_FLUSH_ERR, 0)]
        assert a.mr.inflight == 0 and a.qp.slots_free == 64
    finally:
        v.soft_set_stall("soft1", False)
        a.close()
        b.close()
