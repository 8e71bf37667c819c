"""The caller-thread transfer path runs only under the GIL (its pins are unlocked counters)."""

from __future__ import annotations

import sys

import pytest

from mooncake._engine import syncpath
from mooncake.engine import TransferEngine, TransferOpcode


def test_without_the_gil_the_caller_thread_path_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    assert syncpath.gil_enabled() and syncpath.enabled()
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert not syncpath.gil_enabled() and not syncpath.enabled()
    monkeypatch.delattr(sys, "_is_gil_enabled", raising=False)  # before 3.13: always a GIL
    assert syncpath.gil_enabled() and syncpath.enabled()
    monkeypatch.setenv("MOONCAKE_SYNC_FASTPATH", "0")
    assert not syncpath.enabled()


def test_a_facade_without_the_gil_transfers_through_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert a._fast is None  # no caller-thread pins at all
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        ab, bb = a.allocate_managed_buffer(1 << 16), b.allocate_managed_buffer(1 << 16)
        assert a.write_bytes_to_buffer(ab, b"through the loop", 16) == 0
        assert a.transfer_sync(seg_b, ab, bb, 16, TransferOpcode.Write) == 0
        assert b.read_bytes_from_buffer(bb, 16) == b"through the loop"
    finally:
        a.close()
        b.close()
