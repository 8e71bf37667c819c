"""The replicated master in sans-I/O: commands, determinism, failover from the durable prefix.

A leader applies random RPC and internal commands and appends them to a log; a prefix of the
log is durable. Followers apply the durable prefix through :func:`commands.apply`. A "leader
kill" drops the non-durable tail; a follower (tailing, or restored from a snapshot plus the
log after it) takes over by appending ``Promote``. After every step every replica's state
digest equals the leader's once it has applied as much, and every acknowledged object is in
the new leader.
"""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mooncake._core import commands, rpc
from mooncake._core.commands import Command, Durability
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import InvalidArgumentError, MooncakeError, NotSupportedError

MiB = 1 << 20
KEYS = [f"k{i}" for i in range(8)]
CLIENTS = ["c0", "c1", "c2"]


def _cfg() -> MasterConfig:
    # seed None: each process would seed differently; Promote fixes the rng from the log
    return MasterConfig(
        client_ttl=1e6, put_start_discard_timeout=5.0, put_start_release_timeout=5.0
    )


def call(method: str, params: msgspec.Struct, now: float) -> Command:
    return commands.rpc_command(method, msgspec.msgpack.encode(params), now)


def run(state: MasterState, cmd: Command) -> object:
    try:
        return commands.apply(state, cmd)
    except MooncakeError as e:
        return e


def test_classification_covers_every_method() -> None:
    assert set(rpc.METHODS) - rpc.AUTH_METHODS == set(commands.HANDLERS)
    assert commands.durability("PutEnd") is Durability.MUTATING
    assert commands.durability("RemoveByRegex") is Durability.MUTATING
    assert commands.durability("GetReplicaList") is Durability.LEASE_ONLY
    assert commands.durability("QueryKey") is Durability.PURE_READ
    assert not commands.LEASE_ONLY & commands.PURE_READS


def test_pure_reads_change_nothing() -> None:
    s = MasterState(MasterConfig(seed=3))
    run(
        s,
        call(
            "MountSegment",
            rpc.MountSegmentParams("c0", Segment(id="s", name="n", base=0, size=MiB)),
            1.0,
        ),
    )
    run(s, call("PutStart", rpc.PutStartParams("c0", "a", 100), 1.0))
    run(s, call("PutEnd", rpc.KeyClientParams("c0", "a"), 1.0))
    before = commands.digest(s)
    for method, params in [
        ("QueryKey", rpc.KeyParams("a")),
        ("QueryKey", rpc.KeyParams("missing")),
        ("GetAllKeys", rpc.Empty()),
        ("GetAllSegments", rpc.Empty()),
        ("ExplainMiss", rpc.KeyParams("missing")),
        ("GetTierStats", rpc.Empty()),
        ("GetSegmentTiers", rpc.Empty()),
        ("ServiceReady", rpc.Empty()),
        ("QueryTask", rpc.TaskIdParams("nope")),
    ]:
        assert commands.durability(method) is Durability.PURE_READ
        run(s, call(method, params, 2.0))
    assert commands.digest(s) == before


def test_same_commands_same_state_whatever_the_seed() -> None:
    """Two states seeded differently agree once a Promote fixed the rng: placement, task ids
    and view id come from the log, not the process."""
    a, b = MasterState(MasterConfig(seed=1)), MasterState(MasterConfig(seed=2))
    log = [commands.Promote(0.0, 99, genesis=True)]
    for i in range(4):
        seg = Segment(id=f"s{i}", name=f"h:{i}", base=0, size=MiB)
        log.append(call("MountSegment", rpc.MountSegmentParams("c0", seg), 0.1))
    for i in range(20):
        log.append(
            call(
                "PutStart",
                rpc.PutStartParams("c0", f"k{i}", 1000, ReplicateConfig(replica_num=2)),
                1.0 + i,
            )
        )
    log.append(call("CreateCopyTask", rpc.CopyTaskParams("k1", ["h:3"]), 30.0))
    ra = [run(a, c) for c in log]
    rb = [run(b, c) for c in log]
    assert repr(ra) == repr(rb)
    assert commands.digest(a) == commands.digest(b)


def test_log_entry_codec_round_trips_and_rejects_garbage() -> None:
    batch = [
        call("Ping", rpc.ClientParams("c0"), 1.5),
        commands.Sweep(2.0),
        commands.CreditStall(0.5, 2.0),
        commands.ScanApply(
            "RemoveByRegex", msgspec.msgpack.encode(rpc.RegexParams("k.*")), ["k1"], 3.0
        ),
        commands.Promote(4.0, 7),
    ]
    assert commands.decode_commands(commands.encode_commands(batch)) == batch
    with pytest.raises(InvalidArgumentError):
        commands.decode_commands(b"\x93garbage")
    with pytest.raises(NotSupportedError):
        commands.apply(MasterState(), commands.rpc_command("Nope", b"\x80", 1.0))
    with pytest.raises(InvalidArgumentError):
        commands.apply(MasterState(), Command("bogus", 1.0))


def test_snapshot_restore_is_equal() -> None:
    s = MasterState(MasterConfig(seed=5))
    run(
        s,
        call(
            "MountSegment",
            rpc.MountSegmentParams("c0", Segment(id="s", name="n", base=0, size=MiB)),
            1.0,
        ),
    )
    for i in range(10):
        run(s, call("PutStart", rpc.PutStartParams("c0", f"k{i}", 100), 1.0))
        run(s, call("PutEnd", rpc.KeyClientParams("c0", f"k{i}"), 1.0))
    r = MasterState.restore(s.snapshot(), _cfg())
    assert r.config.client_ttl == 1e6
    r.config = s.config
    assert commands.digest(r) == commands.digest(s)
    r.check_invariants()


class Replicated(RuleBasedStateMachine):
    """A leader, its log (a durable prefix), followers; random commands and leader kills."""

    @initialize(seed=st.integers(0, 2**32))
    def start(self, seed: int) -> None:
        self.now = 1.0
        self.leader = MasterState(_cfg())
        self.log: list[Command] = []
        self.durable = 0
        self.followers: list[tuple[MasterState, int]] = []  # (state, applied count)
        self.snapshot: tuple[bytes, int] | None = None
        self.leader_cmd(commands.Promote(self.now, seed, genesis=True))
        self.flush()
        for _ in range(2):
            self.followers.append((MasterState(_cfg()), 0))

    def leader_cmd(self, cmd: Command) -> object:
        self.log.append(cmd)
        return run(self.leader, cmd)

    def tick(self, dt: float) -> float:
        self.now += dt
        return self.now

    # -- commands -------------------------------------------------------------------------

    @rule(c=st.sampled_from(CLIENTS), i=st.integers(0, 5), mib=st.integers(1, 4))
    def mount(self, c: str, i: int, mib: int) -> None:
        seg = Segment(id=f"{c}-s{i}", name=f"{c}:{i}", base=(i + 1) << 32, size=mib * MiB)
        self.leader_cmd(call("MountSegment", rpc.MountSegmentParams(c, seg), self.tick(0.01)))

    @rule(c=st.sampled_from(CLIENTS), i=st.integers(0, 5))
    def unmount(self, c: str, i: int) -> None:
        self.leader_cmd(
            call("UnmountSegment", rpc.UnmountSegmentParams(c, f"{c}-s{i}"), self.tick(0.01))
        )

    @rule(
        c=st.sampled_from(CLIENTS),
        k=st.sampled_from(KEYS),
        size=st.integers(1, 300_000),
        n=st.integers(1, 3),
        end=st.booleans(),
        upsert=st.booleans(),
    )
    def put(self, c: str, k: str, size: int, n: int, end: bool, upsert: bool) -> None:
        start, fin = ("UpsertStart", "UpsertEnd") if upsert else ("PutStart", "PutEnd")
        r = self.leader_cmd(
            call(
                start,
                rpc.PutStartParams(c, k, size, ReplicateConfig(replica_num=n)),
                self.tick(0.01),
            )
        )
        if end and not isinstance(r, MooncakeError):
            self.leader_cmd(call(fin, rpc.KeyClientParams(c, k), self.tick(0.01)))

    @rule(
        c=st.sampled_from(CLIENTS),
        ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    )
    def batch_put(self, c: str, ks: list[str]) -> None:
        self.leader_cmd(
            call("BatchPutStart", rpc.BatchPutStartParams(c, ks, [4096] * len(ks)), self.tick(0.01))
        )
        self.leader_cmd(call("BatchPutEnd", rpc.BatchKeyClientParams(c, ks), self.tick(0.01)))

    @rule(c=st.sampled_from(CLIENTS), k=st.sampled_from(KEYS))
    def revoke(self, c: str, k: str) -> None:
        self.leader_cmd(call("PutRevoke", rpc.KeyClientParams(c, k), self.tick(0.01)))

    @rule(k=st.sampled_from(KEYS), force=st.booleans())
    def remove(self, k: str, force: bool) -> None:
        self.leader_cmd(call("Remove", rpc.RemoveParams(k, force), self.tick(0.01)))

    @rule(k=st.sampled_from(KEYS))
    def read(self, k: str) -> None:
        self.leader_cmd(call("GetReplicaList", rpc.KeyParams(k), self.tick(0.01)))

    @rule(c=st.sampled_from(CLIENTS))
    def ping(self, c: str) -> None:
        self.leader_cmd(call("Ping", rpc.ClientParams(c), self.tick(0.01)))

    @rule(pattern=st.sampled_from(["k[0-3]", "k.*", "nothing"]))
    def remove_regex(self, pattern: str) -> None:
        keys = [k for k in self.leader.readable_keys() if re.fullmatch(pattern, k)]
        params = msgspec.msgpack.encode(rpc.RegexParams(pattern, force=True))
        self.leader_cmd(commands.ScanApply("RemoveByRegex", params, keys, self.tick(0.01)))

    @rule(k=st.sampled_from(KEYS), c=st.sampled_from(CLIENTS), i=st.integers(0, 5))
    def copy_task(self, k: str, c: str, i: int) -> None:
        self.leader_cmd(
            call("CreateCopyTask", rpc.CopyTaskParams(k, [f"{c}:{i}"]), self.tick(0.01))
        )
        self.leader_cmd(call("FetchTasks", rpc.ClientParams(c), self.tick(0.01)))

    @rule(
        c=st.sampled_from(CLIENTS),
        i=st.integers(0, 5),
        onto=st.lists(st.sampled_from([f"{c}:{i}" for c in CLIENTS for i in range(2)])),
        limit=st.integers(0, 3),
        undrain=st.booleans(),
    )
    def drain_job(self, c: str, i: int, onto: list[str], limit: int, undrain: bool) -> None:
        """A master-run drain job's step (or its cancel), then its progress read on the leader
        only: the read must change nothing the followers would not have."""
        name = f"{c}:{i}"
        if undrain:
            self.leader_cmd(commands.Undrain(name, self.tick(0.01)))
        else:
            self.leader_cmd(commands.DrainStep(name, onto, limit, self.tick(0.01)))
        for key, _, _ in self.leader.drain_units(name) or []:
            self.leader.key_busy(key)
        self.leader.segment_draining(name)
        self.leader_cmd(call("FetchTasks", rpc.ClientParams(c), self.tick(0.01)))

    @rule(dt=st.floats(0.0, 8.0), stall=st.floats(0.0, 2.0))
    def sweep(self, dt: float, stall: float) -> None:
        now = self.tick(dt)
        if stall:
            self.leader_cmd(commands.CreditStall(stall, now))
        self.leader_cmd(commands.Sweep(now))

    # -- replication ----------------------------------------------------------------------

    @rule()
    def flush(self) -> None:
        """Everything logged so far becomes durable (a group commit): what the clients were
        told up to here is what any successor must have."""
        self.durable = len(self.log)
        self.at_flush = (commands.digest(self.leader), sorted(self.leader.readable_keys()))

    @rule(which=st.integers(0, 1))
    def follow(self, which: int) -> None:
        state, n = self.followers[which]
        for cmd in self.log[n : self.durable]:
            run(state, cmd)
        self.followers[which] = (state, self.durable)

    @rule()
    def take_snapshot(self) -> None:
        state, n = self.followers[0]
        self.snapshot = (state.snapshot(), n)

    @rule(which=st.integers(0, 2), gap=st.floats(0.0, 3.0))
    def kill_leader(self, which: int, gap: float) -> None:
        """The leader dies: its non-durable tail is gone; a replica (tailing, or restored
        from a snapshot) finishes the durable log, takes over, appends Promote."""
        if which == 2 and self.snapshot is None:
            return
        del self.log[self.durable :]
        if which == 2:
            assert self.snapshot is not None
            data, n = self.snapshot
            state = MasterState.restore(data, _cfg())
        else:
            state, n = self.followers[which]
        for cmd in self.log[n:]:
            run(state, cmd)
        # exactly the state the clients were last acknowledged against
        assert (commands.digest(state), sorted(state.readable_keys())) == self.at_flush
        self.leader = state
        last_now = max((c.now for c in self.log), default=0.0)
        self.now = max(self.now, last_now) + gap
        self.leader_cmd(commands.Promote(self.now, int(gap * 1000)))
        self.followers = [(f, k) for f, k in self.followers if f is not state]
        while len(self.followers) < 2:
            self.followers.append((MasterState(_cfg()), 0))

    # -- checks ---------------------------------------------------------------------------

    @invariant()
    def replicas_agree(self) -> None:
        self.leader.check_invariants()
        for state, n in self.followers:
            state.check_invariants()
            if n == len(self.log):
                assert commands.digest(state) == commands.digest(self.leader)


TestReplicated = Replicated.TestCase
TestReplicated.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "prefix-lru"])
def test_replicas_in_other_processes_agree(policy: str) -> None:
    """Masters are separate processes with their own string-hash salt, and a standby may start
    from a snapshot: the same commands must give the same state anyway (a set iterated in
    hash order once decided policy and ledger order)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    helper = ROOT / "tests" / "helpers" / "replay_digest.py"

    def digest(hashseed: str, *extra: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, str(helper), "11", "2500", "--policy", policy, *extra],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=300,
        )
        return out.stdout.split()[0]

    first = digest("1")
    assert digest("2") == first
    assert digest("3", "--snapshot-at", "1200") == first
