"""Admission at the tier boundaries: the frequency sketch, TinyLFU and frequency-threshold rules,
the SSD tier's demotion hook on a real disk, and the two-tier trace replay's SSD writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake._cli import main
from mooncake._core.policies import make_policy
from mooncake._core.tiers import (
    AlwaysAdmit,
    FrequencyAdmission,
    FrequencySketch,
    TinyLFUAdmission,
    make_admission,
)
from mooncake._store.ssd import open_ssd_tier
from mooncake.errors import InvalidArgumentError, NoAvailableHandleError
from mooncake.replay.model import KVModel, PrefillModel
from mooncake.replay.run import ReplayConfig, replay
from mooncake.replay.sim import HitRateSim
from mooncake.replay.tiers import ADMISSIONS, TierSim
from mooncake.replay.trace import TraceRequest, load_trace

TRACES = Path(__file__).parent / "data" / "traces"


def test_sketch_counts_and_ages() -> None:
    sk = FrequencySketch(width=1 << 12, window=1000)
    assert sk.estimate("a") == 0
    sk.add("a")
    assert sk.estimate("a") == 1  # the doorkeeper took the first access
    for _ in range(9):
        sk.add("a")
    sk.add(7)
    assert sk.estimate("a") == 10
    assert sk.estimate(7) == 1
    for i in range(1000 - 11):
        sk.add(("filler", i))
    # The 1000th access halved every counter and cleared the doorkeeper.
    assert sk.estimate("a") == 0
    sk.add("a")
    assert sk.estimate("a") == 1 + 9 // 2


def test_sketch_refuses_bad_shapes() -> None:
    for kwargs in ({"width": 1000}, {"width": 1 << 17}, {"depth": 5}, {"window": 0}):
        with pytest.raises(InvalidArgumentError):
            FrequencySketch(**kwargs)


def test_tinylfu_admits_the_more_popular() -> None:
    rule = TinyLFUAdmission()
    rule.record("cold")
    assert not rule.admit_ssd("cold", None)  # seen once: not written
    for _ in range(3):
        rule.record("hot")
    rule.record("cold")
    assert rule.admit_ssd("cold", None)
    assert not rule.admit_ssd("cold", "hot")  # would displace a hotter block
    assert rule.admit_ssd("hot", "cold")
    assert not rule.admit_ssd("cold", "cold")  # ties keep the resident
    assert rule.admit_dram("new", "hot")  # DRAM admits everything by default
    dram = make_admission("tinylfu-dram")
    assert isinstance(dram, TinyLFUAdmission) and dram.name == "tinylfu-dram"
    for _ in range(3):
        dram.record("hot")
    dram.record("new")
    assert not dram.admit_dram("new", "hot")
    assert dram.admit_dram("hot", "new") and dram.admit_dram("new", None)


def test_frequency_threshold_and_names() -> None:
    rule = make_admission("freq:3")
    assert isinstance(rule, FrequencyAdmission) and rule.threshold == 3
    for n in range(1, 4):
        rule.record("k")
        assert rule.admit_ssd("k", "other") is (n >= 3)
    assert rule.admit_dram("k", "other")
    assert isinstance(make_admission("freq"), FrequencyAdmission)
    assert AlwaysAdmit().admit_ssd("x", "y") and AlwaysAdmit().admit_dram("x", "y")
    for bad in ("freq:x", "freq:0", "tinylfu:2", "lfu"):
        with pytest.raises(InvalidArgumentError):
            make_admission(bad)


@pytest.mark.anyio
async def test_ssd_tier_demotion_admission(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20, admission="freq:2") as tier:
        with pytest.raises(NoAvailableHandleError, match="refused 'a'"):
            await tier.put("a", b"x" * 100)
        assert "a" not in tier and tier.counters.extra["refused"] == 1
        await tier.put("a", b"y" * 100)  # the second demotion of "a" is written
        assert await tier.get("a") == b"y" * 100
        assert tier.counters.bytes_written == 100
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        assert tier.admission is None  # no rule: every put is written
        await tier.put("b", b"z")
        assert await tier.get("a") == b"y" * 100


@pytest.mark.anyio
async def test_ssd_tier_tinylfu_keeps_the_hot_object(tmp_path: Path) -> None:
    # Room for two 8 KiB files (a 4 KiB header + 4 KiB of payload each).
    async with open_ssd_tier(tmp_path, 4 * 4096, admission="tinylfu") as tier:
        for key in ("hot", "warm"):
            tier.admission.record(key)  # type: ignore[union-attr]
            await tier.put(key, b"h" * 4000)
        for _ in range(5):
            assert await tier.get("hot") == b"h" * 4000
        await tier.get("warm")
        tier.admission.record("cold")  # type: ignore[union-attr]
        # "cold" (seen twice) would evict the SSD's LRU head, "hot", read five times: refused.
        with pytest.raises(NoAvailableHandleError):
            await tier.put("cold", b"c" * 4000)
        assert "hot" in tier and "warm" in tier


def _trace() -> list[TraceRequest]:
    return load_trace(str(TRACES / "synthetic_trace.jsonl.gz"))


def test_tier_sim_without_ssd_is_the_lru_pool() -> None:
    reqs = _trace()[:1500]
    kv, model = KVModel(), PrefillModel()
    lru = HitRateSim("lru", lambda: make_policy("lru"), 800, kv=kv, model=model)
    for adm in ("write-through", "always", "freq:2"):
        tiers = TierSim(adm, 800, 0, kv=kv, model=model)
        for r in reqs:
            tiers.feed(r)
        if adm == "write-through":
            for r in reqs:
                lru.feed(r)
        assert tiers.hits == lru.hits
        assert tiers.ssd_writes == 0 and tiers.ssd_hit_blocks == 0


def test_tier_sim_counts_ssd_writes() -> None:
    reqs = _trace()[:1500]
    kv, model = KVModel(), PrefillModel()
    unique = len({b for r in reqs for b in r.hash_ids})
    sims = {a: TierSim(a, 500, 10**7, kv=kv, model=model) for a in ADMISSIONS}
    for sim in sims.values():
        for r in reqs:
            sim.feed(r)
    # An SSD that never fills: write-through writes every block once, and every block is
    # then found on one tier or the other as an infinite cache would.
    assert sims["write-through"].ssd_writes == unique
    assert sims["always"].ssd_writes < unique  # only what DRAM evicted
    inf = TierSim("write-through", 10**7, 0, kv=kv, model=model)
    for r in reqs:
        inf.feed(r)
    assert sims["write-through"].hits == inf.hits
    # The filters write fewer blocks than demote-on-evict.
    for a in ("tinylfu", "freq:2", "freq:3"):
        assert sims[a].ssd_writes < sims["always"].ssd_writes, a
        assert sims[a].ssd_refused > 0
    d = sims["freq:2"].summary()
    assert d["ssd_write_bytes"] == d["ssd_writes"] * kv.block_bytes
    assert d["block_hit_rate"] == pytest.approx(d["dram_hit_rate"] + d["ssd_hit_rate"])


def test_replay_reports_tiers_and_cli_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ReplayConfig(
        capacities=(500,),
        local_policies=(),
        strategies=(),
        belady=False,
        admissions=("write-through", "tinylfu"),
        ssd_ratio=2,
    )
    report = replay(_trace()[:300], cfg)
    doc = report.to_dict()
    assert [t["admission"] for t in doc["tiers"]] == ["write-through", "tinylfu"]
    assert doc["tiers"][0]["ssd_capacity_blocks"] == 1000
    with pytest.raises(InvalidArgumentError):
        replay(_trace()[:3], ReplayConfig(admissions=("bogus",), strategies=()))
    path = str(TRACES / "synthetic_trace.jsonl.gz")
    args = ["replay", path, "--no-progress", "--strategies", "none", "--policies", "lru"]
    assert (
        main(
            [
                *args,
                "--capacities",
                "2000",
                "--local-policies",
                "none",
                "--no-belady",
                "--admissions",
                "all",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Tier admission" in out and "writes vs write-through" in out
    for a in ADMISSIONS:
        assert a in out
