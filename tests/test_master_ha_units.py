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
    assert ha.ack_mode == "etcd"  # acknowledged once in etcd unless asked otherwise
    p = parse_gflags(["--enable_ha", "--etcd_endpoints=h:1", "--ha_ack_mode=replica"])
    assert p.server.ha is not None and p.server.ha.ack_mode == "replica"
    assert p.server.ha.etcd_linger == 0.02  # replica mode's etcd appends gather 20 ms
    p = parse_gflags(["--enable_ha", "--etcd_endpoints=h:1", "--ha_etcd_linger_ms=0"])
    assert p.server.ha is not None and p.server.ha.etcd_linger == 0


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
        (["--enable_ha", "--etcd_endpoints=h:1", "--ha_ack_mode=quorum"], "ha_ack_mode"),
        (["--enable_ha", "--etcd_endpoints=h:1", "--ha_etcd_linger_ms=-1"], "ha_etcd_linger"),
        (["--enable_ha", "--etcd_endpoints=h:1", "--ha_etcd_linger_ms=5000"], "ha_etcd_linger"),
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


def test_forked_snapshot_sees_the_state_at_fork_time() -> None:
    from mooncake._store.snapshots import ForkedSnapshot

    box = {"v": b"before" * 100_000}

    async def main() -> None:
        child = ForkedSnapshot(lambda: box["v"])
        box["v"] = b"after"  # the parent moves on at once
        assert await child.result() == b"before" * 100_000

        def boom() -> bytes:
            raise RuntimeError("serializer failed")

        with pytest.raises(OSError, match="status 1"):
            await ForkedSnapshot(boom).result()

    trio.run(main)


def test_a_hung_snapshot_child_is_killed_and_reaped_at_its_timeout() -> None:
    import os
    import time

    from mooncake._store.snapshots import ForkedSnapshot

    def hang() -> bytes:
        time.sleep(120)
        return b"never"

    async def main() -> None:
        child = ForkedSnapshot(hang, timeout=0.5)
        with pytest.raises(OSError, match=r"timed out after 0\.5 s"):
            await child.result()
        with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
            os.waitpid(child._pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG

    trio.run(main)


@pytest.mark.etcd
def test_standby_loads_snapshot_plus_log_and_detects_a_gap(etcd_endpoint: str) -> None:
    import msgspec

    from mooncake._core import commands, rpc
    from mooncake._core.store_types import Segment
    from mooncake._store.ha import HaConfig, HaNode, _Gap
    from mooncake._store.master import MasterServer, MasterServerConfig

    def entry(*cmds: commands.Command) -> bytes:
        return commands.encode_commands(list(cmds))

    def call(method: str, params: msgspec.Struct, now: float) -> commands.Command:
        return commands.rpc_command(method, msgspec.msgpack.encode(params), now)

    def node() -> HaNode:
        return HaNode(
            MasterServer(MasterServerConfig(rpc_port=0)),
            HaConfig(endpoints=parse_endpoints(etcd_endpoint), cluster_id="gap"),
        )

    seg = Segment(id="s", name="h:1", base=0, size=1 << 20)
    log = [
        entry(commands.Promote(1.0, 5, genesis=True)),
        entry(call("MountSegment", rpc.MountSegmentParams("c", seg), 1.0)),
        entry(call("PutStart", rpc.PutStartParams("c", "k1", 100), 1.5)),
        entry(call("PutEnd", rpc.KeyClientParams("c", "k1"), 1.6), commands.Sweep(1.7)),
    ]

    async def main() -> None:
        a, b, c = node(), node(), node()
        try:
            for i, data in enumerate(log, 1):
                await a.etcd.put(f"{a.log_prefix}{i:020d}", data)
            await a._load()
            assert a.applied_seq == 4 and a.server.state.all_keys() == ["k1"]
            assert a.last_now == 1.7
            # snapshot at 4, log compacted below it, one more entry
            snap = Snapshot(4, a.server.state.snapshot(), a.last_now)
            assert await a.snapshots.write(snap, fence=[])
            for i in range(1, 5):
                await a.etcd.delete(f"{a.log_prefix}{i:020d}")
            more = entry(
                call("PutStart", rpc.PutStartParams("c", "k2", 100), 2.0),
                call("PutEnd", rpc.KeyClientParams("c", "k2"), 2.1),
            )
            await a.etcd.put(f"{a.log_prefix}{5:020d}", more)
            await b._load()  # a fresh standby: snapshot 4 + entry 5
            assert (b.snapshot_seq, b.applied_seq) == (4, 5)
            await a._catch_up()  # a tailing standby: entry 5 follows its 4
            assert a.applied_seq == 5
            assert commands.digest(a.server.state) == commands.digest(b.server.state)
            assert sorted(b.server.state.all_keys()) == ["k1", "k2"]
            c.applied_seq = 2  # a standby that stopped at 2: entries 3, 4 are gone
            with pytest.raises(_Gap, match="entry 3 is gone"):
                await c._catch_up()
            await c._load()  # what the HA loop does on a gap: reload from the snapshot
            assert (c.snapshot_seq, c.applied_seq) == (4, 5)
        finally:
            for n in (a, b, c):
                await n.etcd.aclose()

    trio.run(main)


@pytest.mark.etcd
def test_standby_flags_a_leader_with_other_settings(etcd_endpoint: str) -> None:
    from mooncake._core import commands
    from mooncake._core.master import MasterConfig
    from mooncake._store.ha import HaConfig, HaNode
    from mooncake._store.master import MasterServer, MasterServerConfig

    def node(cluster: str, **state: float) -> HaNode:
        cfg = MasterServerConfig(rpc_port=0, state=MasterConfig(**state))  # type: ignore[arg-type]
        return HaNode(
            MasterServer(cfg),
            HaConfig(endpoints=parse_endpoints(etcd_endpoint), cluster_id=cluster),
        )

    same = commands.config_fingerprint(MasterConfig(seed=7))
    assert same == commands.config_fingerprint(MasterConfig())  # the seed is not a setting
    assert same != commands.config_fingerprint(MasterConfig(client_ttl=3.0))

    async def main() -> None:
        ok, bad = node("cfg-ok"), node("cfg-bad", client_ttl=3.0)
        try:
            for n in (ok, bad):
                promote = commands.Promote(1.0, 1, genesis=True, config=same)
                await n.etcd.put(f"{n.log_prefix}{1:020d}", commands.encode_commands([promote]))
                await n._load()
            assert not ok.config_mismatch and ok.status()["config_mismatch"] is False
            assert bad.config_mismatch and bad.status()["config_mismatch"] is True
        finally:
            for n in (ok, bad):
                await n.etcd.aclose()

    trio.run(main)


def test_command_sizes_and_split_scans() -> None:
    """A scan over more key bytes than one entry holds splits into parts under the budget that
    keep every key once and in order; a lone key over the budget cannot be split."""
    from mooncake._core import commands
    from mooncake._store.ha import MAX_ENTRY, command_size, split_scan

    keys = [f"{i:06d}".ljust(300, "x") for i in range(6000)]
    cmd = commands.ScanApply("GetReplicaListByRegex", b"p" * 20, keys, 1.5)
    assert command_size(cmd) >= len(commands.encode_commands([cmd])) > MAX_ENTRY
    parts = split_scan(cmd)
    assert parts is not None and len(parts) > 1
    assert [k for p in parts for k in p.keys or []] == keys
    for p in parts:
        assert (p.kind, p.method, p.params, p.now) == (cmd.kind, cmd.method, cmd.params, cmd.now)
        assert len(commands.encode_commands([p])) <= command_size(p) <= MAX_ENTRY // 2
    assert split_scan(commands.rpc_command("PutStart", b"x", 1.0)) is None
    huge = commands.ScanApply("GetReplicaListByRegex", b"", ["k" * MAX_ENTRY], 1.0)
    assert split_scan(huge) is None


@pytest.mark.etcd
def test_a_lost_answer_to_the_election_txn_releases_the_lease(etcd_endpoint: str) -> None:
    """The election txn commits but its answer is lost: the HA loop's release revokes the
    lease, so the key naming this master goes at once (it would follow itself otherwise)."""
    from mooncake._store.ha import HaConfig, HaNode
    from mooncake._store.master import MasterServer, MasterServerConfig
    from mooncake.errors import MetadataError

    n = HaNode(
        MasterServer(MasterServerConfig(rpc_port=0)),
        HaConfig(endpoints=parse_endpoints(etcd_endpoint), cluster_id="lost-answer"),
    )
    real = n.etcd.call

    async def lossy(path: str, body: dict[str, object]) -> dict[str, object]:
        out: dict[str, object] = await real(path, body)
        if path == "/v3/kv/txn":
            raise MetadataError("etcd: the answer was lost")
        return out

    async def main() -> None:
        try:
            n.etcd.call = lossy  # type: ignore[method-assign]
            with pytest.raises(MetadataError):
                await n._campaign()
            n.etcd.call = real  # type: ignore[method-assign]
            assert await n.etcd.get(n.view_key) is not None  # it did win
            await n._release_lease()  # what the HA loop does after the error
            assert await n.etcd.get(n.view_key) is None
        finally:
            await n.etcd.aclose()

    trio.run(main)


@pytest.mark.etcd
def test_an_undecodable_entry_makes_a_standby_reload_and_a_snapshot_past_it_heals(
    etcd_endpoint: str,
) -> None:
    from mooncake._core import commands
    from mooncake._store.ha import HaConfig, HaNode, _Gap
    from mooncake._store.master import MasterServer, MasterServerConfig

    def node() -> HaNode:
        return HaNode(
            MasterServer(MasterServerConfig(rpc_port=0)),
            HaConfig(endpoints=parse_endpoints(etcd_endpoint), cluster_id="baddata"),
        )

    async def main() -> None:
        a = node()
        try:
            good = commands.encode_commands([commands.Promote(1.0, 5, genesis=True)])
            await a.etcd.put(f"{a.log_prefix}{1:020d}", good)
            await a.etcd.put(f"{a.log_prefix}{2:020d}", b"\xc1 not msgpack")
            with pytest.raises(_Gap, match="entry 2 does not decode"):
                await a._load()
            assert a.applied_seq == 1 and a.apply_errors > 0
            # the leader's next snapshot past it; the log below compacted
            snap = Snapshot(2, a.server.state.snapshot(), 1.0)
            assert await a.snapshots.write(snap, fence=[])
            for i in (1, 2):
                await a.etcd.delete(f"{a.log_prefix}{i:020d}")
            await a._load()
            assert (a.snapshot_seq, a.applied_seq) == (2, 2)
        finally:
            await a.etcd.aclose()

    trio.run(main)
