"""Small synchronous facade calls on the calling thread (``mooncake._engine.syncpath``).

Real peer processes and real sockets: the caller-thread path must move the same bytes, give the
same codes and keep the async path's guarantees (pinning, timeouts, fallbacks, many threads).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake._cli._peer import digest, pattern
from mooncake._engine import syncpath
from mooncake.engine import TransferEngine
from tests.conftest import PeerProc

KIB = 1024


def _facade(monkeypatch: pytest.MonkeyPatch, transports: str | None) -> TransferEngine:
    if transports is None:
        monkeypatch.delenv("MOONCAKE_TRANSPORTS", raising=False)
    else:
        monkeypatch.setenv("MOONCAKE_TRANSPORTS", transports)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


def _fast(te: TransferEngine) -> syncpath.SyncPath:
    fp = te._fast
    assert fp is not None, "the caller-thread path is off (MOONCAKE_SYNC_FASTPATH?)"
    return fp


@pytest.fixture
def te(monkeypatch: pytest.MonkeyPatch) -> Iterator[TransferEngine]:
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    engine = _facade(monkeypatch, None)
    try:
        yield engine
    finally:
        engine.close()


def _registered(te: TransferEngine, n: int) -> tuple[np.ndarray, int]:  # type: ignore[type-arg]
    buf = np.zeros(n, dtype=np.uint8)
    base = int(buf.ctypes.data)
    assert te.register_memory(base, n) == 0
    return buf, base


@pytest.mark.parametrize("transports", [None, "shm,tcp"], ids=["tcp", "shm"])
def test_small_calls_run_on_the_caller_thread(
    monkeypatch: pytest.MonkeyPatch, peer: PeerProc, transports: str | None
) -> None:
    """After first contact (through the loop), small writes, reads and batches are done here,
    with the right bytes; a 1 MiB call still goes through the loop."""
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    te = _facade(monkeypatch, transports)
    try:
        fp = _fast(te)
        buf, base = _registered(te, 4 << 20)
        buf[:] = pattern(3, buf.size)
        assert te.transfer_sync_write(peer.segment, base, peer.addr, 4 * KIB) == 0
        assert fp.hits == 0  # first contact: the loop fetched the descriptor
        for i in range(1, 33):
            off = i * 4 * KIB
            assert te.transfer_sync_write(peer.segment, base + off, peer.addr + off, 4 * KIB) == 0
        assert fp.hits == 32
        assert peer.cmd(op="digest", offset=0, length=132 * KIB)["digest"] == digest(
            buf[: 132 * KIB]
        )
        peer.cmd(op="fill", offset=0, length=1 << 20, seed=4)
        offs = [k * 4 * KIB for k in range(32)]
        assert (
            te.batch_transfer_sync_read(
                peer.segment, [base + o for o in offs], [peer.addr + o for o in offs], [4096] * 32
            )
            == 0
        )
        assert fp.hits == 33
        assert digest(buf[: 128 * KIB]) == digest(pattern(4, 1 << 20)[: 128 * KIB])
        assert te.transfer_sync_read(peer.segment, base, peer.addr, 1 << 20) == 0
        assert fp.hits == 33  # too big: the loop path
        assert digest(buf[: 1 << 20]) == digest(pattern(4, 1 << 20))
        if transports is None:
            assert sum(p.opened for p in fp._pools.values()) == 1  # one lane, reused
        else:
            assert fp._pools == {}  # shm: no TCP connection at all
    finally:
        te.close()


def test_notify_after_a_caller_thread_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transfer_sync with a notification: the bytes on the caller thread, then the notify (on
    the loop), in that order, as on the loop path."""
    from mooncake.engine import TransferNotify, TransferOpcode

    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    a = _facade(monkeypatch, None)
    b = _facade(monkeypatch, None)
    try:
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        ab = a.allocate_managed_buffer(1 << 16)
        bb = b.allocate_managed_buffer(1 << 16)
        assert a.transfer_sync_write(seg_b, ab, bb, 16) == 0  # first contact
        assert a.write_bytes_to_buffer(ab, b"kv block ready!!", 16) == 0
        note = TransferNotify("req-1", "layer 0")
        assert a.transfer_sync(seg_b, ab, bb, 16, TransferOpcode.Write, note) == 0
        assert _fast(a).hits == 1
        assert b.read_bytes_from_buffer(bb, 16) == b"kv block ready!!"
        assert [(n.name, n.msg) for n in b.get_notifies()] == [("req-1", "layer 0")]
        # a failed transfer sends no notification
        assert a.transfer_sync(seg_b, ab, bb + (1 << 16), 16, TransferOpcode.Write, note) == -1
        assert b.get_notifies() == []
    finally:
        a.close()
        b.close()


def test_errors_keep_their_codes(te: TransferEngine, peer: PeerProc) -> None:
    """Misses, bad arguments and a dead peer: -1 as on the loop path, no hang."""
    fp = _fast(te)
    _buf, base = _registered(te, 1 << 20)  # (kept alive while registered)
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    hits = fp.hits
    assert hits == 1
    # remote range outside every buffer of the peer (the loop refreshes, then refuses)
    assert te.transfer_sync_read(peer.segment, base, peer.addr + peer.size, 100) == -1
    # straddling the end of the peer's buffer
    assert te.transfer_sync_read(peer.segment, base, peer.addr + peer.size - 10, 100) == -1
    # local range not registered, zero and negative lengths, mismatched lists, bad opcode
    assert te.transfer_sync_read(peer.segment, base + (2 << 20), peer.addr, 100) == -1
    assert te.transfer_sync_read(peer.segment, base, peer.addr, 0) == -1
    assert te.transfer_sync_read(peer.segment, base, peer.addr, -5) == -1
    assert te.batch_transfer_sync_read(peer.segment, [base], [peer.addr, peer.addr], [1]) == -1
    assert te.transfer_sync(peer.segment, base, peer.addr, 10, 7) == -1
    assert fp.hits == hits  # none of these moved a byte here
    assert te.transfer_sync_read(peer.segment, base, peer.addr, 100) == 0
    peer.kill()
    # the pooled connection is dead: the loop path retries and reports the dead peer
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == -1
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == -1


def test_stale_pooled_connection_falls_back(te: TransferEngine, peer: PeerProc) -> None:
    """A pooled connection that died while idle costs nothing: the call goes through the loop."""
    fp = _fast(te)
    buf, base = _registered(te, 1 << 20)
    buf[:4096] = pattern(5, 4096)
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    (pool,) = fp._pools.values()
    for lane in pool._idle:
        lane.sock.shutdown(socket.SHUT_RDWR)
    hits = fp.hits
    buf[:4096] = pattern(6, 4096)
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    assert fp.hits == hits  # this one went through the loop
    assert peer.cmd(op="digest", offset=0, length=4096)["digest"] == digest(pattern(6, 4096))
    assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
    assert fp.hits == hits + 1  # and the next is back on a fresh pooled lane


@pytest.mark.parametrize("transports", [None, "shm,tcp"], ids=["tcp", "shm"])
def test_ten_threads_at_once(
    monkeypatch: pytest.MonkeyPatch, peer: PeerProc, transports: str | None
) -> None:
    """vLLM calls batch_transfer_sync_write from many worker threads at once: every byte lands
    where it belongs, every call returns 0, connections are pooled, not one per call."""
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    te = _facade(monkeypatch, transports)
    threads_n, rounds, per_batch, block = 10, 40, 4, 4 * KIB
    span = rounds * per_batch * block  # bytes per thread
    try:
        fp = _fast(te)
        buf, base = _registered(te, threads_n * span)
        buf[:] = pattern(7, buf.size)
        assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0  # first contact
        codes: list[int] = []
        start = threading.Barrier(threads_n)

        def worker(t: int) -> None:
            start.wait()
            for r in range(rounds):
                offs = [t * span + (r * per_batch + k) * block for k in range(per_batch)]
                codes.append(
                    te.batch_transfer_sync_write(
                        peer.segment,
                        [base + o for o in offs],
                        [peer.addr + o for o in offs],
                        [block] * per_batch,
                    )
                )

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts)
        assert codes == [0] * (threads_n * rounds)
        assert fp.hits == threads_n * rounds
        assert peer.cmd(op="digest", offset=0, length=buf.size)["digest"] == digest(buf)
        # and read back in parallel into a cleared buffer
        buf[:] = 0
        codes.clear()

        def reader(t: int) -> None:
            for r in range(rounds):
                off = t * span + r * per_batch * block
                codes.append(
                    te.transfer_sync_read(
                        peer.segment, base + off, peer.addr + off, per_batch * block
                    )
                )

        ts = [threading.Thread(target=reader, args=(t,)) for t in range(threads_n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert codes == [0] * (threads_n * rounds)
        assert digest(buf) == digest(pattern(7, buf.size))
        if transports is None:
            (pool,) = fp._pools.values()
            assert pool.opened <= threads_n  # at most one lane per thread at a time
            assert len(pool._idle) <= syncpath.IDLE_LANES
    finally:
        te.close()


def test_unregister_waits_for_a_caller_thread_transfer(
    monkeypatch: pytest.MonkeyPatch, peer: PeerProc, caplog: pytest.LogCaptureFixture
) -> None:
    """A transfer on the caller thread pins its local region: unregister_memory returns only
    after it ended (here at MC_TRANSFER_TIMEOUT, against a data port that never answers)."""
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # the published minimum
    te = _facade(monkeypatch, None)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        fp = _fast(te)
        _buf, base = _registered(te, 1 << 20)
        assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
        info = te._engine._peers[peer.segment]  # type: ignore[union-attr]
        info.descriptor = info.descriptor.replace(tcp_data_port=silent.getsockname()[1])
        rc: list[int] = []

        def call() -> None:
            rc.append(te.transfer_sync_write(peer.segment, base, peer.addr, 4096))

        t = threading.Thread(target=call)
        t.start()
        conn, _ = silent.accept()  # the caller thread connected to the silent port ...
        got = b""
        while len(got) < 24:  # ... and sent its request header
            chunk = conn.recv(4096)
            assert chunk, "the caller thread closed before its deadline"
            got += chunk
        assert te.unregister_memory(base) == 0
        # The caller thread closes its connection before it unpins: if unregister had returned
        # while the transfer could still touch the buffer, the connection would still be open.
        conn.settimeout(2)
        try:
            while conn.recv(65536):  # what the caller had sent, then its close
                pass
        except TimeoutError:
            raise AssertionError("unregister returned while the caller thread still ran")
        t.join(60)
        assert rc == [-1]  # timed out
        assert fp.hits == 0
        # the caller thread's own deadline, not the loop's
        assert any("did not finish within the deadline" in r.getMessage() for r in caplog.records)
        conn.close()
    finally:
        te.close()
        silent.close()


def test_close_waits_for_a_caller_thread_transfer(
    monkeypatch: pytest.MonkeyPatch, peer: PeerProc
) -> None:
    """close() returns only after running caller-thread calls ended (the engine unmaps its
    buffers next); later calls fail cleanly."""
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    te = _facade(monkeypatch, None)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        addr = te.allocate_managed_buffer(1 << 16)  # engine memory: unmapped by close()
        assert te.transfer_sync_write(peer.segment, addr, peer.addr, 4096) == 0
        info = te._engine._peers[peer.segment]  # type: ignore[union-attr]
        info.descriptor = info.descriptor.replace(tcp_data_port=silent.getsockname()[1])
        fp = _fast(te)
        rc: list[int] = []
        t = threading.Thread(
            target=lambda: rc.append(te.transfer_sync_write(peer.segment, addr, peer.addr, 4096))
        )
        t.start()
        conn, _ = silent.accept()
        assert conn.recv(4096), "the caller thread closed before its deadline"
        assert fp._inflight == 1
        te.close()
        assert fp._inflight == 0  # the call had ended (at its deadline) before close went on
        t.join(60)
        assert rc == [-1]
        with pytest.raises(Exception, match="not initialized"):
            te.transfer_sync_write(peer.segment, addr, peer.addr, 4096)
        conn.close()
    finally:
        te.close()
        silent.close()


def test_fast_path_off_uses_the_loop(monkeypatch: pytest.MonkeyPatch, peer: PeerProc) -> None:
    monkeypatch.setenv("MOONCAKE_SYNC_FASTPATH", "0")
    te = _facade(monkeypatch, None)
    try:
        assert te._fast is None
        buf, base = _registered(te, 1 << 20)
        buf[:4096] = pattern(8, 4096)
        assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
        assert te.transfer_sync_write(peer.segment, base, peer.addr, 4096) == 0
        assert peer.cmd(op="digest", offset=0, length=4096)["digest"] == digest(pattern(8, 4096))
    finally:
        te.close()


def test_run_blocking_times_out_against_a_silent_server() -> None:
    """``ClientPipe.run_blocking`` returns -ETIMEDOUT at its deadline (both twins)."""
    import errno

    from mooncake import _fast

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    c = socket.create_connection(silent.getsockname())
    c.setblocking(False)
    src = np.zeros(4096, dtype=np.uint8)
    try:
        pipe = _fast.ClientPipe(c.fileno(), True, True, [int(src.ctypes.data)], [0x1000], [4096])
        t0 = time.monotonic()
        assert pipe.run_blocking(200, 50) == -errno.ETIMEDOUT
        assert time.monotonic() - t0 < 30  # hang guard, not a timing assertion
        assert pipe.done == 0
    finally:
        c.close()
        silent.close()


def test_shm_revoke_while_threads_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing a buffer that caller-thread shm copies are using: the free completes (the
    revoke waits for the pins, then is acknowledged), every call returns 0 or -1, and after
    the free nothing reaches the old mapping: calls to it fail with -1."""
    monkeypatch.delenv("MOONCAKE_SYNC_FASTPATH", raising=False)
    monkeypatch.setenv("MOONCAKE_TRANSPORTS", "shm,tcp")
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        seg_b = f"127.0.0.1:{b.get_rpc_port()}"
        fp = _fast(a)
        src = a.allocate_managed_buffer(1 << 20)
        dst = b.allocate_managed_buffer(1 << 20)
        keep = b.allocate_managed_buffer(1 << 16)  # b stays reachable after the free
        assert a.write_bytes_to_buffer(src, bytes(range(256)) * 16, 4096) == 0
        assert a.transfer_sync_write(seg_b, src, dst, 4096) == 0  # first contact
        assert a.transfer_sync_write(seg_b, src, dst, 4096) == 0
        assert fp.hits == 1 and fp._pools == {}
        assert b.read_bytes_from_buffer(dst, 4096) == bytes(range(256)) * 16
        stop = threading.Event()
        codes: list[int] = []

        def hammer(t: int) -> None:
            k = 0
            while not stop.is_set() and k < 2000:
                off = ((t * 97 + k) % 255) * 4096
                codes.append(a.transfer_sync_write(seg_b, src + off, dst + off, 4096))
                k += 1

        ts = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        while len(codes) < 50 and any(t.is_alive() for t in ts):
            time.sleep(0.001)
        assert b.free_managed_buffer(dst, 1 << 20) == 0
        stop.set()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts)
        assert set(codes) <= {0, -1} and 0 in codes
        assert a.transfer_sync_write(seg_b, src, dst, 4096) == -1  # revoked
        assert a.transfer_sync_write(seg_b, src, keep, 4096) == 0  # the rest still works
    finally:
        a.close()
        b.close()
