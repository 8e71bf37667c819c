"""Per-transfer telemetry: records by handle (async API) and by batch id (sync facade), stage
times that add up, groups per transport, verdicts and retries, the bounded ring, JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

import mooncake
from mooncake._core.transfer import TransferRequest
from mooncake._engine import telemetry as tel
from mooncake.engine import TransferEngine, TransferOpcode

R = TransferRequest


@pytest.mark.anyio
async def test_async_records_by_handle_and_in_task() -> None:
    async with mooncake.open_engine() as a, mooncake.open_engine() as b:
        src = await a.allocate(1 << 20)
        dst = await b.allocate(1 << 20)
        reqs = [R.write(src.addr + i * 4096, dst.addr + i * 4096, 4096) for i in range(8)]
        h = a.submit(b.segment_name, reqs)
        await h.wait()
        rec = h.telemetry
        assert rec is not None and rec.verdict == "completed"
        assert rec.total_bytes == 8 * 4096 and rec.desc_count == 8 and rec.opcode == "write"
        assert rec.segment == b.segment_name and rec.path == "loop"
        assert sum(g.bytes for g in rec.groups) == rec.total_bytes
        assert {g.transport for g in rec.groups} <= {"tcp", "shm"} and rec.groups[0].nic
        # the stages partition the batch's time
        assert rec.queued_s >= 0 and rec.posted_s >= 0 and rec.wire_s > 0
        assert rec.queued_s + rec.posted_s + rec.wire_s <= rec.completed_s + 1e-6
        assert a.telemetry is not None and a.telemetry.get(rec.batch_id) is rec
        d = rec.as_dict()
        for k in ("start_time", "post_duration", "xfer_duration", "total_bytes", "desc_count"):
            assert k in d  # NIXL's getXferTelemetry names
        assert d["xfer_duration"] == rec.completed_s
        # awaited directly: the record is the task's current one afterwards
        await a.transfer(b.segment_name, [R.read(src.addr, dst.addr, 4096)])
        cur = tel.CURRENT.get()
        assert cur is not None and cur.opcode == "read" and cur.queued_s == 0.0
        # a range outside the peer's buffers: a descriptor refetch (a retry), then failed
        out = await a.transfer(b.segment_name, [R.write(src.addr, dst.addr + (2 << 20), 4096)])
        assert not out[0].ok
        cur = tel.CURRENT.get()
        assert cur is not None and cur.verdict == "failed" and cur.retries == 1 and cur.error
        slow = a.telemetry.slowest(2)
        assert len(slow) == 2 and slow[0].completed_s >= slow[1].completed_s


@pytest.mark.anyio
async def test_canceled_batch_is_recorded() -> None:
    async with mooncake.open_engine() as a:
        buf = await a.allocate(1 << 16)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await a.transfer("127.0.0.1:1", [R.write(buf.addr, 0, 16)])
        assert a.telemetry is not None
        rec = a.telemetry.recent(1)[0]
        assert rec.verdict == "canceled" and rec.segment == "127.0.0.1:1"


def test_ring_is_bounded_and_forgets_by_id() -> None:
    ring = tel.TelemetryRing(capacity=3)
    recs = []
    for i in range(5):
        r = ring.begin("s", "write", 1, i)
        ring.finish(r, "completed")
        recs.append(r)
    assert [r.total_bytes for r in ring.recent()] == [2, 3, 4]
    assert ring.get(recs[0].batch_id) is None and ring.get(recs[4].batch_id) is recs[4]
    for i in range(5):
        ring.add_sync("s", "read", 1, 10 + i, "tcp", "h", 0.0, 0.001, 0)
    assert [r.total_bytes for r in ring.recent()] == [12, 13, 14]
    last = ring.last_sync()
    assert last is not None and last.total_bytes == 14 and last.path == "sync"
    with pytest.raises(ValueError, match="capacity"):
        tel.TelemetryRing(capacity=0)


def test_facade_by_batch_id_sync_and_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "transfers.jsonl"
    monkeypatch.setenv("MOONCAKE_TRANSFER_TELEMETRY_LOG", str(log))
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        ab = a.allocate_managed_buffer(4 << 20)
        bb = b.allocate_managed_buffer(4 << 20)
        n = 32
        bid = a.batch_transfer_async(
            seg_b, [ab] * n, [bb + i * 65536 for i in range(n)], [65536] * n, TransferOpcode.Write
        )
        assert bid > 0 and a.get_batch_transfer_status([bid]) == 0
        d = a.get_transfer_telemetry(bid)  # still there after the batch was freed
        assert d is not None and d["verdict"] == "completed" and d["total_bytes"] == n * 65536
        assert (
            d["desc_count"] == n and d["groups"] and d["groups"][0]["transport"] in ("tcp", "shm")
        )
        assert a.get_transfer_telemetry(999) is None
        # a sync transfer (the first goes through the loop: first contact) then a small one
        assert a.transfer_sync_write(seg_b, ab, bb, 4096) == 0
        assert a.transfer_sync_write(seg_b, ab, bb, 4096) == 0
        d = a.get_transfer_telemetry(0)
        assert d is not None and d["total_bytes"] == 4096 and d["verdict"] == "completed"
        slow = a.get_slowest_transfers(1)
        assert len(slow) == 1 and slow[0]["completed_s"] >= d["completed_s"]
        assert a.transfer_sync_write(seg_b, ab, bb + (8 << 20), 4096) == -1
        d = a.get_transfer_telemetry(0)
        assert d is not None and d["verdict"] == "failed" and d["error"]
    finally:
        a.close()
        b.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert any(x["total_bytes"] == n * 65536 and x["verdict"] == "completed" for x in lines)
    assert all({"batch_id", "groups", "verdict", "posted_s"} <= x.keys() for x in lines)


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_TRANSFER_TELEMETRY_RING", "0")
    assert tel.from_env() is None
    monkeypatch.setenv("MOONCAKE_TRANSFER_TELEMETRY_RING", "lots")
    with pytest.raises(ValueError, match="MOONCAKE_TRANSFER_TELEMETRY_RING"):
        tel.from_env()


def test_top_renders_the_slowest_transfers() -> None:
    from rich.console import Console

    from mooncake._cli import top

    status = {
        "objects": 0, "clients": 0, "segments": 0, "capacity_bytes": 0, "used_bytes": 0,
        "tiers": {}, "counters": {"gets": 0, "get_misses": 0, "evicted_objects": 0},
        "segment_list": [], "client_list": [],
    }  # fmt: skip
    row = {
        "read_bytes": 0.0, "write_bytes": 0.0, "reads": 0.0, "writes": 0.0,
        "failed_reads": 0.0, "engine_bytes": 0.0,
        "slowest": [
            {"batch_id": "7", "segment": "h:1", "op": "write", "transport": "tcp",
             "nic": "h", "verdict": "completed", "bytes": "4096", "seconds": 0.25,
             "exporter": "c:1"},
        ],
    }  # fmt: skip
    a = {"t": 0.0, "status": status, "clients": {"c:1": row}}
    b = {"t": 1.0, "status": status, "clients": {"c:1": row}}
    console = Console(width=200, record=True)
    console.print(top.render(top.view(a, b)))
    text = console.export_text()
    assert "slowest transfers" in text and "250.00" in text and "tcp" in text
