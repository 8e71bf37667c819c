"""The leader's commit queue without I/O (:mod:`mooncake._core.commitlog`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._core import commands
from mooncake._core.commitlog import MAX_ENTRY, CommitQueue, command_size
from mooncake.errors import InvalidArgumentError


def _put(n: int = 1) -> commands.Command:
    return commands.rpc_command("PutStart", b"x" * n, 1.0)


def _read() -> commands.Command:
    return commands.rpc_command("GetReplicaList", b"k", 1.0)


def test_tickets_barrier_and_durable() -> None:
    q = CommitQueue()
    assert q.append(_read()) == (1, False)  # not a mutation: no flush asked
    assert q.barrier == 0
    assert q.append(_put()) == (2, True)
    assert q.append(_read()) == (3, False)
    assert q.barrier == 2 and q.lag == 3
    epoch = q.epoch
    assert not q.may_answer(2, epoch)
    assert len(q.take_batch()) == 3 and q.take_batch() == []
    q.committed(3)
    assert q.may_answer(3, epoch) and q.lag == 0
    q.mark_mutated()
    assert q.barrier == 3


def test_a_deposed_epoch_never_answers() -> None:
    q = CommitQueue()
    t, _ = q.append(_put())
    epoch = q.epoch
    q.depose()
    assert q.pending == [] and not q.may_answer(t, epoch)
    q.committed(1)  # even once durable: the epoch it was queued in is over
    assert not q.may_answer(t, epoch)
    q.reset()
    assert (q.ticket, q.durable, q.barrier) == (0, 0, 0) and q.epoch == epoch + 2


def test_replica_acknowledgement_moves_durable_by_entry() -> None:
    q = CommitQueue()
    for _ in range(5):
        q.append(_put())
    q.published(1, len(q.take_batch()))  # one entry: all five
    q.append(_put())
    q.published(2, len(q.take_batch()))
    assert not q.acknowledged(0) and q.durable == 0
    assert q.acknowledged(1) and q.durable == 5
    assert not q.acknowledged(1)
    assert q.acknowledged(7) and q.durable == 6


def test_a_command_over_one_entry_is_refused_before_it_is_queued() -> None:
    q = CommitQueue()
    with pytest.raises(InvalidArgumentError, match="split the request"):
        q.append(_put(MAX_ENTRY))
    assert q.ticket == 0 and q.pending == []
    keys = [f"{i:06d}".ljust(300, "x") for i in range(6000)]
    ticket, flush = q.append(commands.ScanApply("GetReplicaListByRegex", b"p", keys, 1.0))
    assert ticket == len(q.pending) > 1 and not flush  # a lease-only scan, in parts


@given(st.lists(st.integers(min_value=0, max_value=MAX_ENTRY // 3), min_size=1, max_size=30))
def test_batches_keep_order_and_fit_one_entry(sizes: list[int]) -> None:
    q = CommitQueue()
    cmds = [_put(n) for n in sizes]
    for c in cmds:
        q.append(c)
    taken: list[commands.Command] = []
    while q.pending:
        batch = q.take_batch()
        assert batch, "a batch takes at least one command"
        assert len(batch) == 1 or sum(command_size(c) for c in batch) <= MAX_ENTRY
        taken += batch
    assert taken == cmds and q.pending_bytes == 0
