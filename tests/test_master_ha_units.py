"""HA flags, snapshot stores (a directory; etcd with chunking and damage), fast."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from mooncake._cli.master import parse_gflags
from mooncake._engine.metadata.etcd import EtcdKV, _b64, parse_endpoints
from mooncake._store.snapshots import CHUNK, DirSnapshots, EtcdSnapshots, Snapshot
from mooncake.errors import InvalidArgumentError
from tests import services


def test_gflags_spellings_fill_the_ha_config() -> None:
    p = parse_gflags(
        [
            "--enable_ha",
            "--ha_backend_type=etcd",
            "--etcd_endpoints=127.0.0.1:2379;127.0.0.2:2379",
            "--cluster_id=prod",
            "--snapshot_interval_seconds=30",
            "--snapshot_retention_count=3",
        ],
        warn=lambda m: pytest.fail(m),
    )
    ha = p.server.ha
    assert ha is not None
    assert ha.endpoints == ["http://127.0.0.1:2379", "http://127.0.0.2:2379"]
    assert (ha.cluster_id, ha.snapshot_interval, ha.snapshot_retention) == ("prod", 30.0, 3)
    assert ha.lease_ttl == 5
    # the connstring wins over the legacy spelling; etcd:// prefix accepted
    p = parse_gflags(["--enable_ha", "--ha_backend_connstring=etcd://h:1", "--etcd_endpoints=x:2"])
    assert p.server.ha is not None and p.server.ha.endpoints == ["http://h:1"]
    assert parse_gflags(["--cluster_id=x"]).server.ha is None  # HA off by default


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--enable_ha", "--ha_backend_type=redis", "--etcd_endpoints=h:1"], "redis"),
        (["--enable_ha", "--ha_backend_type=k8s", "--etcd_endpoints=h:1"], "only etcd"),
        (["--enable_ha"], "--ha_backend_connstring"),
        (["--enable_ha", "--etcd_endpoints=nohostport"], "host:port"),
        (["--enable_ha", "--etcd_endpoints=h:1", "--cluster_id=a/b"], "cluster id"),
        (["--enable_snapshot"], "--snapshot_backup_dir"),
        (["--snapshot_retention_count=0"], "retention"),
    ],
)
def test_bad_ha_flags_are_named(argv: list[str], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        parse_gflags(argv)


def test_local_snapshots_without_ha_flags(tmp_path: Path) -> None:
    p = parse_gflags(
        ["--enable_snapshot", f"--snapshot_backup_dir={tmp_path}", "--enable_snapshot_restore"]
    )
    snap = p.server.snapshot
    assert snap is not None and snap.restore and snap.directory == str(tmp_path)
    p = parse_gflags(["--enable_snapshot_restore", f"--snapshot_backup_dir={tmp_path}"])
    assert p.server.snapshot is not None and p.server.snapshot.interval == float("inf")


def test_dir_snapshots_round_trip_retention_and_damage(tmp_path: Path) -> None:
    store = DirSnapshots(tmp_path, "c", retention=2)
    assert store.newest_sync() is None
    for seq in (1, 2, 3):
        store.write_sync(Snapshot(seq, os.urandom(1000) + bytes([seq]), float(seq)))
    assert store.seqs() == [3, 2]
    newest = store.newest_sync()
    assert newest is not None and newest.seq == 3 and newest.data[-1] == 3
    # damage the newest: the older one is used
    path = tmp_path / f"c-{3:020d}.snap"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    older = store.newest_sync()
    assert older is not None and older.seq == 2 and older.last_now == 2.0
    (tmp_path / f"c-{2:020d}.snap").write_bytes(b"junk")
    assert store.newest_sync() is None
    with pytest.raises(InvalidArgumentError):
        DirSnapshots(tmp_path, "c", retention=0)


@pytest.fixture
def etcd_endpoint() -> Iterator[str]:
    with services.etcd_cluster(1) as c:
        yield c.members[0].endpoint


@pytest.mark.etcd
def test_etcd_snapshots_chunked_verified_pruned(etcd_endpoint: str) -> None:
    async def main() -> None:
        kv = EtcdKV(parse_endpoints(etcd_endpoint))
        try:
            store = EtcdSnapshots(kv, "mooncake-store/u/snapshot/", retention=2)
            big = os.urandom(2 * CHUNK + 12345)  # three chunks
            assert await store.write(Snapshot(5, big, 1.5), fence=[])
            assert await store.write(Snapshot(9, b"small", 2.5), fence=[])
            got = await store.newest()
            assert got == Snapshot(9, b"small", 2.5)
            assert await store.load(5) == Snapshot(5, big, 1.5)
            # a fence that fails writes nothing usable
            bad_fence = [
                {"key": _b64("nope"), "target": "CREATE", "result": "EQUAL", "create_revision": "1"}
            ]
            assert not await store.write(Snapshot(11, b"x", 3.0), fence=bad_fence)
            assert await store.seqs() == [9, 5]
            # damage a chunk of 9: newest() falls back to 5
            await kv.put("mooncake-store/u/snapshot/00000000000000000009/chunk/000000", b"evil")
            assert (await store.newest()) == Snapshot(5, big, 1.5)
            assert await store.write(Snapshot(12, b"new", 4.0), fence=[])
            assert await store.prune() == 12
            assert await store.seqs() == [12, 9]
            left = await kv.list("mooncake-store/u/snapshot/00000000000000000005/")
            assert not left, "pruned snapshot left chunks behind"
        finally:
            await kv.aclose()

    trio.run(main)
