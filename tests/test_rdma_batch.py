"""The compiled batch engine (``_rdma_batch``): slicing, rail choice, the held/retry state
machine, and over the software provider: WR chains with selective signaling.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core.rdma import split_lengths

v = pytest.importorskip("mooncake._fast.verbs")
if not v.AVAILABLE:
    pytest.skip("verbs extensions not built", allow_module_level=True)

from mooncake.errors import InvalidArgumentError  # noqa: E402


def _batch(
    lengths: list[int],
    slice_size: int,
    frag: int,
    nnic: int = 1,
    npeer: int = 1,
    rkeys: list[int] | None = None,
    engine: Any = None,
) -> Any:
    n = len(lengths)
    return v.SliceBatch(
        engine or v.BatchEngine(),
        [0x1000 * (i + 1) for i in range(n)],
        [0x9000 * (i + 1) for i in range(n)],
        lengths,
        [v.OP_WRITE] * n,
        [0] * n,
        [7] * (n * nnic),
        rkeys if rkeys is not None else [5] * (n * npeer),
        [[object()] * nnic for _ in range(n)],
        nnic,
        npeer,
        slice_size,
        frag,
        12345,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 1 << 20), min_size=1, max_size=5),
    st.integers(256, 1 << 17),
    st.integers(0, 4),
)
def test_slicing_is_mooncakes(lengths: list[int], slice_size: int, ratio: int) -> None:
    frag = slice_size // ratio if ratio else 0
    b = _batch(lengths, slice_size, frag)
    got = [b.slice_info(i)[:3] for i in range(b.nslices)]
    want = [
        (r, off, n) for r, L in enumerate(lengths) for off, n in split_lengths(L, slice_size, frag)
    ]
    assert got == want
    assert [b.remaining(r) for r in range(len(lengths))] == [
        len(split_lengths(L, slice_size, frag)) for L in lengths
    ]
    b.cancel()
    b.release()


def test_first_tries_spread_retries_rotate_and_missing_rails_are_errors() -> None:
    b = _batch([64 * 4096], 4096, 0, nnic=2, npeer=2, rkeys=[5, -1])
    assert b.needed_tables() == {(0, 0)}
    b.set_table(0, 0, [(0, [0]), (1, [0])])  # two local NICs, peer device 0 only
    rails = b.choose()
    assert sorted(rails) == [0, 2]  # li * npeer + pi: both local NICs drawn at random
    assert b.queued == 64 and not b.has_new()
    # take them back as if the endpoints failed: held, then retried on the rotation's rail
    assert b.unqueue(0) + b.unqueue(2) == 64
    errs = b.take_errors()
    assert len(errs) == 64 and all(e[1] == v.ERR_UNQUEUED for e in errs)
    for i, *_ in errs:
        assert b.retry(i, True, 9)
    assert b.needed_tables() == {(0, 1)}
    b.set_table(0, 1, [(1, [1]), (0, [0])])  # retries take the first option: device 1
    assert b.choose() == []  # device 1 has no rkey for this buffer: every slice is an error
    errs = b.take_errors()
    assert {e[1] for e in errs} == {v.ERR_BAD_RKEY} and {e[2] for e in errs} == {1}
    for i, *_ in errs:
        b.fail(i)
    assert b.failed(0) and b.remaining(0) == 0 and b.finished()
    b.release()


def test_retry_limit_and_no_rail() -> None:
    b = _batch([4096], 4096, 0)
    b.set_table(0, 0, [])
    assert b.choose() == []
    ((i, kind, _, _),) = b.take_errors()
    assert kind == v.ERR_NO_RAIL and b.held() == [i]
    assert b.retry(i, True, 1)  # first retry allowed ...
    b.set_table(0, 1, [])
    b.choose()
    b.take_errors()
    assert not b.retry(i, True, 1)  # ... the second is over MC_RETRY_CNT=1
    assert b.retry(i, False, 1)  # a flush resend does not count
    with pytest.raises(InvalidArgumentError):
        b.fail(i)  # not held any more
    b.cancel()
    assert b.finished()
    b.release()


def test_a_batch_with_slices_queued_cannot_leave_the_table() -> None:
    eng = v.BatchEngine()
    b = _batch([8192], 4096, 0, engine=eng)
    b.set_table(0, 0, [(0, [0])])
    b.choose()
    with pytest.raises(InvalidArgumentError, match="queued"):
        b.release()
    assert eng.live == 1
    b.cancel()
    b.release()
    assert eng.live == 0


# -- over the software provider: chains and selective signaling --------------------------------

if os.path.exists(v.soft_provider_path()) and not os.environ.get("MC_RDMA_TEST_DEVICES"):
    import tests.test_rdma_transport as _rt
    from mooncake._cli._peer import digest, pattern

    fabric = _rt.fabric
    rpeer = _rt.rpeer
    engine = _rt.engine
    R = _rt.R
    _t = _rt._t

    @pytest.mark.anyio
    async def test_chains_ring_one_doorbell_and_signal_one_wr_in_sixteen(
        engine: Any, rpeer: Any
    ) -> None:
        buf = await engine.allocate(1 << 20)
        buf.numpy()[:] = pattern(77, 1 << 20)
        t = _t(engine)
        t.cfg.slice_size = 4096  # 256 WRs
        (res,) = await engine.transfer(rpeer.segment, [R.write(buf.addr, rpeer.addr, 1 << 20)])
        assert res.ok
        assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
            pattern(77, 1 << 20)
        )
        posted = t.stats["posted"]
        assert posted == 256
        # every chain ends signaled and one WR in 16 is: far fewer CQEs than WRs
        assert t.stats["completions"] < posted // 4
        doorbells = sum(n.pump.doorbells for n in t.nics)
        assert doorbells < posted // 4  # WRs go in chains, not one post per WR
        assert not t._inflight
        for region in engine.registry.regions():
            assert all(mr.inflight == 0 for mr in region.meta.get("rdma_mrs", []))

    @pytest.mark.anyio
    async def test_a_pump_out_of_budget_yields_and_finishes_later(engine: Any, rpeer: Any) -> None:
        buf = await engine.allocate(1 << 20)
        buf.numpy()[:] = pattern(78, 1 << 20)
        t = _t(engine)
        t.cfg.slice_size = 4096
        t.rails.pump_budget = 8  # every run stops after 8 WRs: the rest is posted from later runs
        reqs = [R.write(buf.addr + (i << 18), rpeer.addr + (i << 18), 1 << 18) for i in range(4)]
        res = await engine.transfer(rpeer.segment, reqs)
        assert all(r.ok for r in res)
        assert t.stats["posted"] == 256
        assert (await rpeer.cmd(op="digest", offset=0, length=1 << 20))["digest"] == digest(
            pattern(78, 1 << 20)
        )
