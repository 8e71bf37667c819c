"""The WR slab under random traffic (a hypothesis state machine over the soft provider).

Model: which cookies are posted and not yet reaped, per QP. Invariants after every step: the
MR's and each QP's in-flight counts, the CQ's free slots, every reaped cookie was posted once
and reaped once, error completions flush the rest of their QP, nothing stray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

v = pytest.importorskip("mooncake._fast.verbs")
if not v.AVAILABLE or not os.path.exists(v.soft_provider_path()):
    pytest.skip("verbs layer or libmcsoftverbs.so not built", allow_module_level=True)
if os.environ.get("MC_RDMA_TEST_DEVICES"):
    pytest.skip("runs on the software provider only", allow_module_level=True)

CQE = 32
MAX_WR = 8


class SlabMachine(RuleBasedStateMachine):
    fabric: Path

    @initialize()
    def setup(self) -> None:
        self.ctx = v.Context("soft0")
        self.pd = v.PD(self.ctx)
        self.cq = v.CQ(self.ctx, CQE)
        self.buf = bytearray(1 << 16)
        self.mr = v.MR(self.pd, self.buf)
        self.wc = v.WcBatch(5)
        self.qps: list[object] = []
        self.live: dict[int, set[int]] = {}  # qp index -> posted, unreaped cookies
        self.errored: set[int] = set()
        self.reaped: set[int] = set()
        self.posted: set[int] = set()
        self.next_cookie = 1
        for _ in range(2):
            self._new_qp()

    def _new_qp(self) -> None:
        qp = v.QP(self.pd, self.cq, max_send_wr=MAX_WR)
        qp.to_init()
        qp.to_rtr(qp.qp_num, self.ctx.query_port()["lid"], None)
        qp.to_rts()
        self.qps.append(qp)
        self.live[len(self.qps) - 1] = set()

    def _open(self) -> list[int]:
        return [i for i, q in enumerate(self.qps) if not q.closed]  # type: ignore[attr-defined]

    @rule(data=st.data(), n=st.integers(1, MAX_WR), bad=st.booleans())
    def post(self, data: st.DataObject, n: int, bad: bool) -> None:
        opens = self._open()
        if not opens:
            return
        i = data.draw(st.sampled_from(opens))
        qp = self.qps[i]
        n = min(n, qp.slots_free)  # type: ignore[attr-defined]
        if n == 0:
            return
        cookies = list(range(self.next_cookie, self.next_cookie + n))
        self.next_cookie += n
        rkey = self.mr.rkey ^ (0x100 if bad else 0)
        op = data.draw(st.sampled_from([v.OP_WRITE, v.OP_READ]))
        assert (
            qp.post(
                op,
                [self.mr] * n,
                [self.mr.addr] * n,
                [64] * n,  # type: ignore[attr-defined]
                [self.mr.addr + 4096] * n,
                [rkey] * n,
                cookies,
            )
            == n
        )
        self.live[i].update(cookies)
        self.posted.update(cookies)
        if bad:
            self.errored.add(i)

    @rule()
    def poll(self) -> None:
        n = self.cq.poll(self.wc)
        for k in range(n):
            c = self.wc.cookies[k]
            assert c in self.posted and c not in self.reaped
            self.reaped.add(c)
            owner = next(i for i, s in self.live.items() if c in s)
            self.live[owner].discard(c)
            if self.wc.status[k] != v.WC_SUCCESS:
                assert owner in self.errored

    @precondition(lambda self: len(self._open()) > 0)
    @rule(data=st.data())
    def close_qp(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self._open()))
        self.qps[i].close()  # type: ignore[attr-defined]
        self.live[i].clear()  # destroyed: its unreaped WRs are released, never reported
        self._new_qp()

    @invariant()
    def counts_balance(self) -> None:
        total = sum(len(s) for s in self.live.values())
        assert self.mr.inflight == total
        assert self.cq.inflight == total
        assert self.cq.slots_free == CQE - total
        for i, q in enumerate(self.qps):
            if not q.closed:  # type: ignore[attr-defined]
                assert q.inflight == len(self.live[i])  # type: ignore[attr-defined]
        assert self.cq.stray == 0

    def teardown(self) -> None:
        self.ctx.close()
        assert set(v.live_objects().values()) == {0}


@pytest.fixture
def soft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_IBVERBS", "soft")
    monkeypatch.setenv("MC_SOFTVERBS_FABRIC", str(tmp_path / "fabric"))
    monkeypatch.setenv("MC_SOFTVERBS_DEVICES", "soft0")
    v.load(v.soft_provider_path())


def test_slab_state_machine(soft: None) -> None:
    run_state_machine_as_test(
        SlabMachine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        ),
    )
