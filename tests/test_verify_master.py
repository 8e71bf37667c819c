"""Verified reads, the master's half: CRCs recorded at PutEnd, handed out per version, corrupt
replicas dropped (through the commands, so the wire params are decoded as a master does)."""

from __future__ import annotations

import msgspec
import pytest

from mooncake._core import commands, rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import GetReplicaListResponse, ReplicateConfig, Segment
from mooncake.errors import ObjectNotFoundError

MiB = 1 << 20


def _call(m: MasterState, method: str, params: msgspec.Struct, now: float = 1.0) -> object:
    cmd = commands.rpc_command(method, msgspec.msgpack.encode(params), now)
    out = commands.apply(m, cmd)
    m.settle()
    return out


def _state(n_segs: int = 2) -> MasterState:
    m = MasterState(MasterConfig(seed=0))
    for i in range(n_segs):
        seg = Segment(id=f"s{i}", name=f"127.0.0.1:{1000 + i}", base=(i + 1) << 30, size=MiB)
        m.mount_segment(f"c{i}", seg, 0.0)
    return m


def _put(
    m: MasterState, key: str, crc: int | None, *, replicas: int = 1, upsert: bool = False
) -> None:
    pre = "Upsert" if upsert else "Put"
    cfg = ReplicateConfig(replica_num=replicas)
    _call(m, f"{pre}Start", rpc.PutStartParams(client_id="c0", key=key, size=4096, config=cfg))
    end = (
        rpc.PutEndParams(client_id="c0", key=key, crc=crc)
        if crc is not None
        else rpc.KeyClientParams(client_id="c0", key=key)  # an older writer: no crc field
    )
    _call(m, f"{pre}End", end)


def _get(m: MasterState, key: str) -> GetReplicaListResponse:
    r = _call(m, "GetReplicaList", rpc.KeyParams(key=key))
    assert isinstance(r, GetReplicaListResponse)
    return r


def test_crc_recorded_per_version_and_absent_without_one() -> None:
    m = _state()
    _put(m, "a", 0xDEADBEEF)
    _put(m, "old", None)
    a = _get(m, "a")
    assert a.crc == 0xDEADBEEF and a.vid > 0
    assert _get(m, "old").crc == -1
    # an upsert is a new generation with its own crc; one without a crc has none
    _put(m, "a", 7, upsert=True)
    a2 = _get(m, "a")
    assert a2.vid > a.vid and a2.crc == 7
    _put(m, "a", None, upsert=True)
    assert _get(m, "a").crc == -1
    m.check_invariants()


def test_batch_put_end_crcs_and_a_reused_handle_has_none() -> None:
    m = _state()
    cfg = ReplicateConfig()
    keys = ["k0", "k1", "k2"]
    _call(
        m,
        "BatchPutStart",
        rpc.BatchPutStartParams(client_id="c0", keys=keys, sizes=[4096] * 3, config=cfg),
    )
    _call(m, "BatchPutEnd", rpc.BatchPutEndParams(client_id="c0", keys=keys, crcs=[1, 2]))
    assert [_get(m, k).crc for k in keys] == [1, 2, -1]
    _call(m, "Remove", rpc.RemoveParams(key="k0", force=True))
    _put(m, "fresh", None)  # may reuse k0's handle: k0's crc must not answer for it
    assert _get(m, "fresh").crc == -1


def test_corrupt_replica_dropped_then_object_removed_with_its_last() -> None:
    m = _state()
    _put(m, "x", 5, replicas=2)
    r = _get(m, "x")
    assert len(r.replicas) == 2
    bad = r.replicas[0]
    params = rpc.CorruptReplicaParams(
        client_id="c1", key="x", vid=r.vid, segment_name=bad.segment_name, addr=bad.addr
    )
    assert _call(m, "ReportCorruptReplica", params) == 1
    left = _get(m, "x")
    assert [(x.segment_name, x.addr) for x in left.replicas] == [
        (r.replicas[1].segment_name, r.replicas[1].addr)
    ]
    assert left.crc == 5
    # a report of a stale generation changes nothing
    stale = rpc.CorruptReplicaParams(
        client_id="c1",
        key="x",
        vid=r.vid - 1,
        segment_name=left.replicas[0].segment_name,
        addr=left.replicas[0].addr,
    )
    assert _call(m, "ReportCorruptReplica", stale) == 0
    assert len(_get(m, "x").replicas) == 1
    last = rpc.CorruptReplicaParams(
        client_id="c1",
        key="x",
        vid=r.vid,
        segment_name=left.replicas[0].segment_name,
        addr=left.replicas[0].addr,
    )
    assert _call(m, "ReportCorruptReplica", last) == 0
    with pytest.raises(ObjectNotFoundError, match="removed"):
        _get(m, "x")
    assert "corrupt" in m.misses.classify("x").detail
    assert m.stats.corrupt_reports == 3
    assert m.stats.corrupt_replicas_dropped == 2
    assert m.stats.corrupt_objects_removed == 1
    m.check_invariants()


def test_crcs_survive_a_snapshot() -> None:
    m = _state()
    _put(m, "s", 99)
    back = MasterState.restore(m.snapshot())
    assert back.get_replica_list("s", 2.0).crc == 99


def test_a_reply_with_a_crc_decodes_in_a_reader_that_predates_it() -> None:
    class OldResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
        replicas: list[dict[str, object]]
        lease_ttl_ms: int
        size: int = 0
        vid: int = 0

    m = _state()
    _put(m, "o", 1234)
    wire = msgspec.msgpack.encode(_get(m, "o"))
    old = msgspec.msgpack.decode(wire, type=OldResponse)
    assert old.size == 4096 and old.replicas
    # and one without a crc carries no crc field at all
    _put(m, "n", None)
    assert b"crc" not in msgspec.msgpack.encode(_get(m, "n"))
