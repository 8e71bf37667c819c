"""MasterState.snapshot / restore: a restored master is indistinguishable from the original.

Hypothesis draws a command sequence (puts, upserts, pins, reads, removes, revokes, tier moves,
replica tasks, mounts, client deaths, time passing), applies it to a master, takes a snapshot
at a random point, restores it, and applies the rest to both: every answer and the final
states (objects, allocators, policy order, queues, clients, tasks, counters, rng) are equal.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.policies import make_policy
from mooncake._core.store_types import ReplicateConfig, Segment, SoftPinAction
from mooncake.errors import (
    InvalidArgumentError,
    MooncakeError,
    NoAvailableHandleError,
    ObjectNotFoundError,
    ReplicaNotFoundError,
    ReplicaNotReadyError,
)

KiB = 1 << 10
CLIENTS = ["a", "b"]
KEYS = [f"k{i}" for i in range(6)]


def seg(client: str, size: int = 16 * KiB) -> Segment:
    i = CLIENTS.index(client)
    return Segment(id=f"seg-{client}", name=f"127.0.0.1:{1000 + i}", base=1 << 30, size=size)


def new_master(policy: str) -> MasterState:
    m = MasterState(
        MasterConfig(
            seed=7,
            eviction_policy=policy,
            eviction_round_objects=3,
            client_ttl=5.0,
            put_start_discard_timeout=3.0,
            put_start_release_timeout=6.0,
            demote_timeout=4.0,
            read_fence_ttl=1.0,
            put_revoke_hold=2.0,
        )
    )
    for c in CLIENTS:
        m.mount_segment(c, seg(c), 0.0)
    m.mount_local_disk("a", 1 << 20, 0.0)
    return m


client = st.sampled_from(CLIENTS)
key = st.sampled_from(KEYS)
size = st.sampled_from([1, 100, 4 * KiB, 8 * KiB, 12 * KiB])
pin = st.sampled_from(["none", "soft", "hard"])
_put = st.tuples(st.just("put"), client, key, size, pin, st.integers(1, 2))
command = st.one_of(
    _put,
    _put,
    _put,
    st.tuples(st.just("start"), client, key, size, st.booleans()),
    st.tuples(st.just("end"), key),
    st.tuples(st.just("revoke"), key),
    st.tuples(st.just("get"), key),
    st.tuples(st.just("exist"), key),
    st.tuples(st.just("remove"), key, st.booleans()),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.5, 4.0, 7.0]), st.booleans()),
    st.tuples(st.just("demote_end"), key),
    st.tuples(st.just("copy"), key, client),
    st.tuples(st.just("run_tasks")),
    st.tuples(st.just("remount"), client),
    st.tuples(st.just("clear"), client, key),
)


def apply(m: MasterState, cmd: tuple[Any, ...], now: list[float]) -> object:
    """Apply one command; its answer (or error code) is what both masters must agree on."""
    t = now[0]
    op = cmd[0]
    try:
        if op == "put":
            _, c, k, n, p, r = cmd
            cfg = ReplicateConfig(
                replica_num=r,
                with_hard_pin=p == "hard",
                soft_pin_action=SoftPinAction.ENABLE if p == "soft" else SoftPinAction.PRESERVE,
                soft_pin_ttl_ms=3000 if p == "soft" else None,
            )
            reps = m.put_start(c, k, n, cfg, t)
            m.put_end(c, k, t)
            return reps
        if op == "start":
            _, c, k, n, upsert = cmd
            return (m.upsert_start if upsert else m.put_start)(c, k, n, ReplicateConfig(), t)
        if op in ("end", "revoke"):  # by the key's writer, if it has one
            obj = m._objects.get(cmd[1])
            writer = obj.pending.client_id if obj is not None and obj.pending else "a"
            return (m.put_end if op == "end" else m.put_revoke)(writer, cmd[1], t)
        if op == "get":
            return m.get_replica_list(cmd[1], t)
        if op == "exist":
            return m.exist_key(cmd[1], t)
        if op == "remove":
            m.remove(cmd[1], cmd[2], t)
            return None
        if op == "advance":
            _, dt, b_alive = cmd
            now[0] = t = t + dt
            m.ping("a", t)
            if b_alive:
                m.ping("b", t)
            m.sweep(t)
            return m.all_keys()
        if op == "demote_end":
            tasks = m.fetch_tier_tasks("a", t)
            for d in tasks.demote:
                m.demote_end("a", d.key, d.vid, t)
            return tasks
        if op == "copy":
            target = seg(cmd[2]).name
            return m.create_copy_task(cmd[1], [target], t)
        if op == "run_tasks":
            out: list[object] = []
            for c in CLIENTS:
                for task in m.fetch_tasks(c, t):
                    out.append(m.task_start(c, task.id, t))
                    m.task_end(c, task.id, t)
            return out
        if op == "remount":
            m.ping(cmd[1], t)
            m.remount_segments(cmd[1], [seg(cmd[1])], t)
            return None
        if op == "clear":
            return m.batch_replica_clear(cmd[1], [cmd[2]], "", t)
    except MooncakeError as e:
        return int(e.code)
    raise AssertionError(f"unknown command {cmd!r}")


def _any(key: object) -> bool:
    return True


def observe(m: MasterState) -> dict[str, Any]:
    """Everything that decides the master's future answers, in comparable form."""
    pol = m.policy
    return {
        "objects": [(k, m.query_key(k)) for k in m._objects],
        "vids": [
            (
                o.readable.vid if o.readable else None,
                o.read_deadline,
                o.group,
                tuple(o.readable.disk) if o.readable else (),
            )
            for o in m._objects.values()
        ],
        "segments": m.all_segments(),
        "allocators": [s.alloc.state() for s in m._seg_list],
        "seg_keys": [m._objects.keys_on(s) for s in m._seg_list],
        # the order it would evict everything in (asked of both masters alike)
        "policy": (type(pol).__name__, len(pol), pol.total_bytes, pol.victims(1 << 62, _any)),
        "pins": sorted(getattr(pol, "_pins", {}).items()),
        "stats": m.stats,
        "tiers": m.tiers,
        "deferred": sorted(
            (t, [(r.seg.segment.id, r.addr, r.length) for r in reps]) for t, _, reps in m._deferred
        ),
        "queues": (list(m._writing), list(m._demotions), list(m._promotions)),
        "soft": (sorted(m._soft_pinned), sorted(m._pin_heap)),
        "clients": {
            cid: (
                c.deadline,
                sorted(c.segments),
                c.ssd_capacity,
                sorted(c.ssd_keys),
                c.demote_tasks,
                c.disk_drops,
            )
            for cid, c in m._clients.items()
        },
        "tasks": {tid: t.info() for tid, t in m._tasks.items()},
        "active": list(m._active_tasks),
        "misses": (m.misses.counts(), len(m.misses)),
        "counters": (
            m._next_vid,
            m.view_version_id,
            m._evict_goal,
            m._used,
            m._capacity,
            m._demoting_bytes,
        ),
        "rng": m.rng.getstate(),
    }


@settings(max_examples=120, deadline=None)
@given(
    cmds=st.lists(command, min_size=10, max_size=80),
    cut=st.integers(0, 80),
    policy=st.sampled_from(["lru", "fifo", "lfu", "sieve"]),
)
def test_restored_master_is_indistinguishable(
    cmds: list[tuple[Any, ...]], cut: int, policy: str
) -> None:
    m = new_master(policy)
    now = [0.0]
    cut = min(cut, len(cmds))
    for cmd in cmds[:cut]:
        apply(m, cmd, now)
    r = MasterState.restore(m.snapshot())
    r.check_invariants()
    assert observe(r) == observe(m)
    now_r = list(now)
    for cmd in cmds[cut:]:
        assert apply(r, cmd, now_r) == apply(m, cmd, now)
    r.check_invariants()
    m.check_invariants()
    assert observe(r) == observe(m)


def test_restore_takes_a_new_config_and_refuses_foreign_bytes() -> None:
    m = new_master("lru")
    m.put_start("a", "k", 100, ReplicateConfig(), 0.0)
    m.put_end("a", "k", 0.0)
    cfg = MasterConfig(seed=7, default_kv_lease_ttl=99.0)
    r = MasterState.restore(m.snapshot(), cfg)
    assert r.config is cfg and r.get_replica_list("k", 1.0).lease_ttl_ms == 99_000
    with pytest.raises(InvalidArgumentError, match="not a master snapshot"):
        MasterState.restore(b"garbage")
    with pytest.raises(InvalidArgumentError, match="older format \\(MCKSNAP1\\)"):
        MasterState.restore(b"MCKSNAP1" + m.snapshot()[8:])


def test_a_custom_policy_is_carried_whole() -> None:
    m = MasterState(MasterConfig(seed=1), policy=make_policy("s3fifo"))
    m.mount_segment("a", seg("a"), 0.0)
    for i in range(5):
        m.put_start("a", f"k{i}", 100, ReplicateConfig(), 0.0)
        m.put_end("a", f"k{i}", 0.0)
    r = MasterState.restore(m.snapshot())
    assert type(r.policy) is type(m.policy) and len(r.policy) == 5
    r.check_invariants()


# -- rules the command machine above found broken ---------------------------------------------


def test_no_replica_task_on_an_object_moving_to_ssd_or_held_only_there() -> None:
    m = new_master("lru")
    m.put_start("a", "k", 8 * KiB, ReplicateConfig(preferred_segments=[seg("a").name]), 0.0)
    m.put_end("a", "k", 0.0)
    m.evict(0.0, need=1 << 30)  # demotion to a's SSD starts
    with pytest.raises(ReplicaNotReadyError):
        m.create_copy_task("k", [seg("b").name], 0.0)
    (d,) = m.fetch_tier_tasks("a", 0.0).demote
    m.demote_end("a", "k", d.vid, 0.0)  # now on SSD only
    with pytest.raises(ReplicaNotFoundError):
        m.create_copy_task("k", [seg("b").name], 0.0)
    m.check_invariants()


def test_a_failed_put_that_preempted_a_zombie_leaves_no_empty_record() -> None:
    m = new_master("lru")
    m.put_start("a", "k", 100, ReplicateConfig(), 0.0)  # its writer never ends it
    with pytest.raises(NoAvailableHandleError):
        m.put_start("a", "k", 64 * KiB, ReplicateConfig(), 5.0)  # pre-empts it, then no space
    m.check_invariants()
    with pytest.raises(ObjectNotFoundError):
        m.query_key("k")
