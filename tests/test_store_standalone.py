"""Real processes: the standalone ``mooncake_client`` with dummy clients, and interpreter exit.

* A ``mooncake_client`` process (the published flags) owns a segment; dummy clients attach with
  ``setup_dummy`` -- one in this process, one in a child -- and use the bytes, zero-copy and
  multi-buffer calls through shared memory; the bytes land in the standalone client's segment.
* A process that sets up a store (or an engine) and exits without ``close()`` exits promptly,
  and its segment is unmounted: the next ``replica_num=2`` put does not land on a dead segment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig
from tests.helpers.store_procs import Master, _env, _readline
from tests.services import free_port

MIB = 1 << 20
INVALID = int(ErrorCode.INVALID_PARAMS)


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def standalone(master: Master) -> Iterator[tuple[str, str]]:
    """A running ``mooncake_client``: (its server address, its segment name)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake._cli.real_client",
            f"--port={port}",
            f"--master_server_address={master.address}",
            "--metadata_server=P2PHANDSHAKE",
            "--global_segment_size=64 MB",
            "--local_buffer_size",
            "0",
            "--threads=2",
            "--noenable_offload",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        line = _readline(proc, 60)
        assert line.startswith("mooncake_client: segment "), line
        yield f"127.0.0.1:{port}", line.split()[2]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0  # SIGTERM: unmount and exit 0
        if proc.stdout:
            proc.stdout.close()


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )


def test_dummy_clients_use_the_standalone_clients_segment(
    master: Master, standalone: tuple[str, str]
) -> None:
    address, segment = standalone
    d = MooncakeDistributedStore()
    assert d.setup_dummy(16 * MIB, 4 * MIB, address) == 0
    try:
        assert d.get_hostname() == "" and d.health_check() == 0  # no segment of its own
        assert d.put("bytes", b"hello") == 0 and d.get("bytes") == b"hello"
        assert d.get_size("bytes") == 5 and d.is_exist("bytes") == 1
        assert d.put("big", b"x" * (5 * MIB)) == INVALID  # larger than the local buffer
        p = d.alloc_from_mem_pool(1 * MIB)
        assert p != 0 and d.register_buffer(p, 1 * MIB) == 0
        payload = os.urandom(4096)
        ctypes.memmove(p, payload, len(payload))
        cfg = ReplicateConfig()
        cfg.preferred_segments = [segment]
        assert d.put_from("zc", p, 4096, cfg) == 0
        assert d.batch_put_from_multi_buffers(["mb"], [[p, p + 1000]], [[10, 20]]) == [0]
        q = p + 8192
        assert d.get_into("zc", q, 8192) == 4096 and ctypes.string_at(q, 4096) == payload
        assert d.batch_get_into_multi_buffers(["mb"], [[q]], [[30]]) == [30]
        assert ctypes.string_at(q, 30) == payload[:10] + payload[1000:1020]
        reps = d.get_replica_desc("zc")
        assert [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in reps] == [
            segment
        ]
        # memory of MooncakeHostMemAllocator is shared on register_buffer; other memory not
        host = MooncakeHostMemAllocator()
        h = host.alloc(8192)
        assert d.register_buffer(h, 8192) == 0 and d.get_into("zc", h, 8192) == 4096
        assert ctypes.string_at(h, 4096) == payload
        assert d.unregister_buffer(h) == 0 and host.free(h) == 0
        plain = np.zeros(64, np.uint8)
        assert d.register_buffer(int(plain.ctypes.data), 64) == -1  # as published
        assert d.put_from("plain", int(plain.ctypes.data), 64) == INVALID
        extra = d.alloc_from_mem_pool(32 * MIB)  # more than the pool: a fresh shared allocation
        assert extra != 0 and d.register_buffer(extra, 32 * MIB) == 0
        assert d.get_into("zc", extra, 4096) == 4096 and ctypes.string_at(extra, 4096) == payload
        # a second dummy, in another process, sees the same objects
        other = _run(
            f"""
            from mooncake.store import MooncakeDistributedStore
            e = MooncakeDistributedStore()
            assert e.setup_dummy(0, 1 << 20, {address!r}) == 0
            print(e.get("bytes").decode(), e.get_size("zc"), e.batch_is_exist(["mb", "no"]))
            """
        )
        assert other.returncode == 0, other.stderr[-2000:]
        assert other.stdout.split() == ["hello", "4096", "[1,", "0]"]
    finally:
        assert d.close() == 0
    assert d.get("bytes") == b"" and d.health_check() == 1  # detached
    assert MooncakeDistributedStore().setup_dummy(0, 0, "127.0.0.1:1") == int(ErrorCode.RPC_FAIL)


def test_a_process_that_never_closes_exits_and_unmounts(master: Master) -> None:
    writer = MooncakeDistributedStore()
    assert (
        writer.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address)
        == 0
    )
    try:
        child = _run(
            f"""
            from mooncake.engine import TransferEngine
            from mooncake.store import MooncakeDistributedStore
            te = TransferEngine()
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", {master.address!r}) == 0
            t = MooncakeDistributedStore()  # a second one sharing the engine
            assert t.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", {master.address!r}, te) == 0
            cycle = [s]
            cycle.append(cycle)  # collected only at shutdown
            print(s.get_hostname(), flush=True)
            """,
            timeout=60,  # the old facade hung here forever
        )
        assert child.returncode == 0, child.stderr[-2000:]
        dead = child.stdout.strip()
        assert dead.startswith("127.0.0.1:")
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        cfg.preferred_segments = [dead, writer.get_hostname()]
        assert writer.put("after-exit", b"v" * 1000, cfg) == 0  # not on the dead segment
        reps = writer.get_replica_desc("after-exit")
        assert [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in reps] == [
            writer.get_hostname()
        ]
        assert writer.get("after-exit") == b"v" * 1000
    finally:
        writer.close()


def test_mooncake_client_flags_parse_as_the_published_binary() -> None:
    from mooncake._cli.real_client import main, parse_flags

    f = parse_flags(
        [
            "--host=10.0.0.1",
            "--port",
            "50100",
            "--global_segment_size=4 GB",
            "--enable_offload",
            "--nostart_offload_rpc_server",
            "--threads=4",
        ]
    )
    assert (f["host"], f["port"], f["global_segment_size"], f["threads"]) == (
        "10.0.0.1",
        50100,
        "4 GB",
        4,
    )
    assert f["enable_offload"] is True and f["start_offload_rpc_server"] is False
    assert f["master_server_address"] == "127.0.0.1:50051" and f["local_buffer_size"] == "0"
    for bad in (["--no_such_flag=1"], ["--port"], ["--enable_offload=maybe"], ["stray"]):
        with pytest.raises(ValueError):
            parse_flags(bad)
    assert main(["--bogus"]) == 2


def test_hostile_dummies_cannot_crash_the_standalone_client(
    master: Master, standalone: tuple[str, str]
) -> None:
    import socket
    import struct

    from mooncake.store import _standalone as wire

    address, _ = standalone

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(wire.socket_name(address))
        s.settimeout(30)
        return s

    s = connect()
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, 1 << 20)
    wire.send_frame(s, ["map", 1 << 40, 1 << 20], [unsealed])
    assert wire.recv_frame(s)[0] == ["ok", INVALID]  # could be shrunk under the reader
    short = wire.shared_fd(4096, "short")
    wire.send_frame(s, ["map", 1 << 40, 1 << 30], [short])  # claims more than the file holds
    assert wire.recv_frame(s)[0] == ["ok", INVALID]
    wire.send_frame(s, ["call", "no_such_method", [], {}])
    assert wire.recv_frame(s)[0][0] == "raise"
    wire.send_frame(s, ["call", "put_from", ["k", 12345, 10, {"__rc__": {"replica_num": -3}}], {}])
    assert wire.recv_frame(s)[0][0] == "raise"  # TypeError for the bad config, answered
    os.close(unsealed)
    os.close(short)
    s.sendall(b"\x00\x00\x00\x05garba")  # not msgpack: this connection is dropped
    assert s.recv(16) == b""
    s.close()
    s = connect()
    s.sendall(struct.pack(">I", (1 << 31)))  # a frame over the bound: dropped too
    assert s.recv(16) == b""
    s.close()
    d = MooncakeDistributedStore()  # the standalone client still serves
    assert d.setup_dummy(0, 1 * MIB, address) == 0
    assert d.put("after", b"ok") == 0 and d.get("after") == b"ok"
    d.close()


def test_tensor_calls_through_a_dummy_client(standalone: tuple[str, str]) -> None:
    """The tensor methods work through a dummy (their staging memory is shared with the
    standalone client): plain, batch, upsert, ``_from``/``_into``, TP and parallelism forms."""
    torch = pytest.importorskip("torch")
    from mooncake._store.facade_tensors import ParallelAxis, ReadTarget, TensorParallelism

    address, _ = standalone
    d = MooncakeDistributedStore()
    assert d.setup_dummy(16 * MIB, 4 * MIB, address) == 0
    try:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert d.put_tensor("t", t) == 0
        got = d.get_tensor("t")
        assert got is not None and torch.equal(got, t)
        n = d.get_size("t")
        p = d.alloc_from_mem_pool(n)
        assert n > 0 and p != 0 and d.register_buffer(p, n) == 0
        into = d.get_tensor_into("t", p, n)
        assert into is not None and torch.equal(into, t)
        assert d.put_tensor_from("t_from", p, n) == 0
        assert torch.equal(d.get_tensor("t_from"), t)
        assert list(d.batch_put_tensor(["b0", "b1"], [t, t + 1])) == [0, 0]
        b = d.batch_get_tensor(["b0", "b1"])
        assert torch.equal(b[0], t) and torch.equal(b[1], t + 1)
        assert d.upsert_tensor("t", t * 2) == 0 and torch.equal(d.get_tensor("t"), t * 2)
        assert d.put_tensor_with_tp("tp", t, tp_rank=0, tp_size=2, split_dim=1) == 0
        assert torch.equal(d.get_tensor_with_tp("tp", tp_rank=1, tp_size=2), t[:, 2:])
        big = torch.arange(3 * MIB // 4, dtype=torch.float32)  # grows the staging buffer
        assert d.put_tensor("big", big) == 0 and torch.equal(d.get_tensor("big"), big)
        a = ParallelAxis()
        a.kind, a.rank, a.size, a.split_dim = "tp", 0, 1, 0
        par = TensorParallelism()
        par.axes = [a]
        assert d.put_tensor_with_parallelism("par", t, par) == 0
        rt = ReadTarget()
        rt.mode, rt.parallelism = "shard", par
        assert torch.equal(d.get_tensor_with_parallelism("par", rt), t)
    finally:
        assert d.close() == 0


def test_dummy_get_into_ranges_stays_inside_the_registered_buffer(
    standalone: tuple[str, str],
) -> None:
    """A range that does not fit in the dummy's registered buffer is refused (never written,
    even though the pool around it is shared with the standalone client); the others land."""
    address, _ = standalone
    d = MooncakeDistributedStore()
    assert d.setup_dummy(16 * MIB, 4 * MIB, address) == 0
    try:
        data = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        assert d.put("r1", data) == 0
        size = 32
        p = d.alloc_from_mem_pool(size)
        guard = d.alloc_from_mem_pool(size)  # the pool memory right after it
        assert p and guard and d.register_buffer(p, size) == 0
        ctypes.memset(p, ord("_"), size)
        ctypes.memset(guard, ord("#"), size)
        assert guard >= p + size
        ok = d.get_into_ranges(
            [p], [["r1", "r1"]], [[[0, 20], [8]]], [[[2, 30], [10]]], [[[4, 3], [6]]]
        )
        assert ok == [[[4, 3], [6]]]
        assert ctypes.string_at(p, 4) == data[2:6] and ctypes.string_at(p + 20, 3) == data[30:33]
        # destination past the buffer's end: refused, nothing written past it or into it
        before = ctypes.string_at(p, size)
        over = d.get_into_ranges([p], [["r1"]], [[[size - 2, 0]]], [[[0, 0]]], [[[4, 2]]])
        assert over == [[[INVALID, 2]]]
        assert ctypes.string_at(p + size - 2, 2) == before[size - 2 :]
        assert ctypes.string_at(guard, size) == b"#" * size
        # a range reaching the pool's guard through a large size, a negative offset, source
        # past the object's end, a pointer never registered nor shared
        assert d.get_into_ranges([p], [["r1"]], [[[0]]], [[[0]]], [[[size + 8]]]) == [[[INVALID]]]
        assert d.get_into_ranges([p], [["r1"]], [[[-4]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
        assert d.get_into_ranges([p], [["r1"]], [[[0]]], [[[len(data) - 1]]], [[[4]]]) == [
            [[INVALID]]
        ]
        stray = ctypes.create_string_buffer(64)
        got = d.get_into_ranges([ctypes.addressof(stray)], [["r1"]], [[[0]]], [[[0]]], [[[4]]])
        assert got[0][0][0] < 0 and stray.raw == b"\0" * 64
        assert ctypes.string_at(guard, size) == b"#" * size
        # mismatched lists and missing keys keep the published shapes
        mism = d.get_into_ranges([p], [["r1", "r1"]], [[[0], []]], [[[0, 1], []]], [[[4, 4], []]])
        assert len(mism[0]) == 2 and mism[0][0][0] < 0 and mism[0][1] == []
        miss = d.get_into_ranges([p], [["nope", "r1"]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]])
        assert miss[0][0][0] < 0 and miss[0][1] == [4]
        # after unregister, the bound is the pool's again (the published dummy's mem pool is
        # registered with the standalone client as a whole)
        assert d.unregister_buffer(p) == 0
        assert d.get_into_ranges([p], [["r1"]], [[[size]]], [[[0]]], [[[4]]]) == [[[4]]]
    finally:
        assert d.close() == 0


def test_replica_descriptors_of_both_kinds_cross_the_wire() -> None:
    """A LOCAL_DISK replica and a memory replica come back from the standalone wire encoding
    as the same kinds, with their fields."""
    from mooncake._core import store_types as st
    from mooncake._store.config import ReplicaDescriptor
    from mooncake.store._standalone import decode_result, encode_result

    mem = ReplicaDescriptor(st.ReplicaDescriptor(segment_name="h:1", addr=4096, length=7))
    disk = ReplicaDescriptor.local_disk("client-a", 7)
    got = decode_result(encode_result({"k": [mem, disk]}))
    back_mem, back_disk = got["k"]
    assert back_mem.is_memory_replica() and not back_mem.is_local_disk_replica()
    d = back_mem.get_memory_descriptor().buffer_descriptor
    assert (d.buffer_address, d.size, d.transport_endpoint) == (4096, 7, "h:1")
    assert back_disk.is_local_disk_replica() and not back_disk.is_memory_replica()
    assert (back_disk.local_disk_client, back_disk.local_disk_size) == ("client-a", 7)
