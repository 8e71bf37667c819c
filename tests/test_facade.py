"""The published sync API (``mooncake.engine.TransferEngine``): names, arguments, int codes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake._cli._peer import digest, pattern
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
from tests.conftest import PeerProc


@pytest.fixture
def te() -> Iterator[TransferEngine]:
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        yield engine
    finally:
        engine.close()


def test_sync_transfers_and_codes(te: TransferEngine, peer: PeerProc) -> None:
    buf = np.zeros(4 << 20, dtype=np.uint8)
    base = int(buf.ctypes.data)
    assert te.register_memory(base, buf.nbytes) == 0
    assert te.register_memory(base + 10, 10) < 0  # overlap
    buf[:] = pattern(1, buf.size)
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 1 << 20) == 0
    assert peer.cmd(op="digest", offset=0, length=1 << 20)["digest"] == digest(buf[: 1 << 20])
    peer.cmd(op="fill", offset=0, length=4 << 20, seed=2)
    assert te.transfer_sync_read(peer.segment, base, peer.addr, 4 << 20) == 0
    assert digest(buf) == digest(pattern(2, 4 << 20))
    # batch forms and their argument checks
    offs = [i * 4096 for i in range(32)]
    assert (
        te.batch_transfer_sync_write(
            peer.segment, [base + o for o in offs], [peer.addr + o for o in offs], [4096] * 32
        )
        == 0
    )
    assert te.batch_transfer_sync_read(peer.segment, [base], [peer.addr, peer.addr], [1]) == -1
    # unregistered remote / local memory: -1, and the engine keeps working
    assert te.transfer_sync_read(peer.segment, base, 4096, 100) == -1
    assert te.transfer_sync_read(peer.segment, base + (8 << 20), peer.addr, 100) == -1
    assert te.transfer_sync(peer.segment, base, peer.addr, 100, TransferOpcode.Read) == 0
    assert te.get_first_buffer_address(peer.segment) == peer.addr
    assert te.unregister_memory(base) == 0
    assert te.unregister_memory(base) == -1


def test_async_batches_and_status(te: TransferEngine, peer: PeerProc) -> None:
    addr = te.allocate_managed_buffer(2 << 20)
    assert addr != 0
    ids = [
        te.batch_transfer_async_write(
            peer.segment, [addr + i * 65536], [peer.addr + i * 65536], [65536]
        )
        for i in range(8)
    ]
    assert all(i > 0 for i in ids) and len(set(ids)) == 8
    assert te.get_batch_transfer_status(ids) == 0
    bid = te.transfer_submit_write(peer.segment, addr, peer.addr, 1 << 20)
    deadline = time.monotonic() + 30
    while (st := te.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert st == 1
    assert te.transfer_check_status(bid) == -1  # freed after it reported
    bad = te.batch_transfer_async_read(peer.segment, [addr], [12345], [10])
    assert bad > 0 and te.get_batch_transfer_status([bad]) == -1
    assert te.batch_transfer_async_read(peer.segment, [addr + (4 << 20)], [peer.addr], [10]) == 0
    assert te.get_batch_transfer_status([987654]) == -1
    assert te.free_managed_buffer(addr, 2 << 20) == 0
    assert te.free_managed_buffer(addr, 2 << 20) == -1


def test_two_facades_notify_probe_and_bytes_helpers() -> None:
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        ab = a.allocate_managed_buffer(1 << 16)
        bb = b.allocate_managed_buffer(1 << 16)
        assert a.write_bytes_to_buffer(ab, b"hello world", 11) == 0
        note = TransferNotify("kv", "done")
        assert a.transfer_sync(seg_b, ab, bb, 11, TransferOpcode.Write, note) == 0
        assert b.read_bytes_from_buffer(bb, 11) == b"hello world"
        got = b.get_notifies()
        assert [(n.name, n.msg) for n in got] == [("kv", "done")]
        assert a.send_probe(seg_b) == 0
        assert a.read_bytes_from_buffer(12345, 4) == b""
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice
    finally:
        a.close()
        b.close()
    assert TransferEngine().initialize("127.0.0.1", "bogus://x", "tcp", "") == -1
    assert TransferEngine().initialize("127.0.0.1", "etcd://127.0.0.1:1", "tcp", "") == -1


def test_published_names_exist() -> None:
    import mooncake.engine as e

    for name in (
        "TransferEngine",
        "TransferOpcode",
        "TransferNotify",
        "Read",
        "Write",
        "SUPPORT_CUDA",
        "SUPPORT_EFA",
    ):
        assert hasattr(e, name)
    for method in (
        "initialize",
        "initialize_ext",
        "get_rpc_port",
        "allocate_managed_buffer",
        "free_managed_buffer",
        "transfer_sync_write",
        "transfer_sync_read",
        "transfer_sync",
        "batch_transfer_sync_write",
        "batch_transfer_sync_read",
        "batch_transfer_sync",
        "batch_transfer_async_write",
        "batch_transfer_async_read",
        "batch_transfer_async",
        "get_batch_transfer_status",
        "transfer_submit_write",
        "transfer_check_status",
        "write_bytes_to_buffer",
        "read_bytes_from_buffer",
        "register_memory",
        "unregister_memory",
        "batch_register_memory",
        "batch_unregister_memory",
        "get_local_topology",
        "get_first_buffer_address",
        "warmup_efa_segment",
        "get_notifies",
        "send_probe",
        "get_engine",
        "get_engine_ptr",
    ):
        assert callable(getattr(TransferEngine, method)), method
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1


def test_silent_peer_times_out_with_minus_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that accepts and never answers: the batch ends at MC_TRANSFER_TIMEOUT (-2), and
    the sync forms fail (-1) instead of hanging."""
    import socket

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # the published minimum
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    seg = f"127.0.0.1:{silent.getsockname()[1]}"
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        addr = te.allocate_managed_buffer(1 << 16)
        bid = te.transfer_submit_write(seg, addr, 0x10000, 4096)
        assert bid > 0
        deadline = time.monotonic() + 60  # hang guard, not a timing assertion
        while (st := te.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st == -2
        assert te.transfer_sync_write(seg, addr, 0x10000, 4096) == -1
    finally:
        te.close()
        silent.close()


def test_check_status_never_answers_before_the_batch_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the caller-side deadline, a batch still running on the loop is "in progress" (0):
    answering -2 then (and cancelling its future) let callers free buffers under a running
    batch, and its late result raised InvalidStateError on the loop."""
    import socket

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    seg = f"127.0.0.1:{silent.getsockname()[1]}"
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        addr = te.allocate_managed_buffer(1 << 16)
        bid = te.transfer_submit_write(seg, addr, 0x10000, 4096)
        batch = te._batches[bid]
        batch.deadline = 0.0  # the caller's clock says the deadline has passed ...
        assert not batch.future.done()  # ... while the loop still runs the batch
        assert te.transfer_check_status(bid) == 0
        deadline = time.monotonic() + 60  # hang guard, not a timing assertion
        while (st := te.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st == -2  # the loop's own deadline ended it
        assert batch.future.done() and not batch.future.cancelled()
        assert isinstance(batch.future.exception(), TimeoutError)
    finally:
        te.close()
        silent.close()
