"""Every family of the published ``MooncakeDistributedStore`` against a real master process.

The master is ``python -m mooncake master`` in its own process (read leases of 300 ms so the
lease-dependent calls can be exercised); the stores are real clients with their own engines,
segments and sockets. Assertions are on the published codes, result shapes and the bytes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import ErrorCode, InvalidArgumentError
from mooncake.store import (
    MooncakeDistributedStore,
    QueryTaskResponse,
    ReplicaStatus,
    ReplicateConfig,
    TaskStatus,
    TaskType,
)
from tests.helpers.store_procs import Master

MIB = 1 << 20
LEASE_S = 0.3
INVALID = int(ErrorCode.INVALID_PARAMS)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
NO_HANDLE = int(ErrorCode.NO_AVAILABLE_HANDLE)
HAS_LEASE = int(ErrorCode.OBJECT_HAS_LEASE)


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    m = Master("--default-kv-lease-ttl", str(int(LEASE_S * 1000)))
    try:
        yield m
    finally:
        m.stop()


def make(
    master: Master, segment: int = 16 * MIB, buffer: int = 16 * MIB
) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", segment, buffer, "tcp", "", master.address) == 0
    return s


@pytest.fixture
def store(master: Master) -> Iterator[MooncakeDistributedStore]:
    s = make(master)
    try:
        yield s
    finally:
        s.remove_all(True)
        s.close()


class Buf:
    """A registered numpy buffer."""

    def __init__(self, s: MooncakeDistributedStore, n: int, fill: int | None = None) -> None:
        rng = np.random.default_rng(n)
        self.a = (
            rng.integers(0, 256, n, dtype=np.uint8) if fill is None else np.full(n, fill, np.uint8)
        )
        self.p = int(self.a.ctypes.data)
        assert s.register_buffer(self.p, n) == 0

    def at(self, off: int, n: int) -> bytes:
        return self.a[off : off + n].tobytes()


def own(s: MooncakeDistributedStore) -> ReplicateConfig:
    c = ReplicateConfig()
    c.preferred_segments = [s.get_hostname()]
    return c


# -- multi-buffer --------------------------------------------------------------------------


def test_multi_buffer_put_is_the_concatenation_and_get_scatters_in_order(
    store: MooncakeDistributedStore,
) -> None:
    src, dst = Buf(store, 1 * MIB), Buf(store, 1 * MIB, fill=0)
    layers = [(i * 4096, 1000 + i) for i in range(8)]  # 8 buffers of different lengths
    keys = ["mb0", "mb1"]
    ptrs = [[src.p + o for o, _ in layers], [src.p + 500_000]]
    sizes = [[n for _, n in layers], [333]]
    assert store.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0, 0]
    want0 = b"".join(src.at(o, n) for o, n in layers)
    assert store.get_size("mb0") == len(want0)
    assert store.get("mb0") == want0
    # scatter over buffers of other lengths: in order, the total per key
    cuts = [100, 5000, len(want0) - 5100]
    dptrs = [[dst.p, dst.p + 10_000, dst.p + 20_000], [dst.p + 900_000]]
    got = store.batch_get_into_multi_buffers(
        [*keys, "missing"], [*dptrs, [dst.p]], [cuts, [333], [8]]
    )
    assert got == [len(want0), 333, NOT_FOUND]
    scattered = dst.at(0, 100) + dst.at(10_000, 5000) + dst.at(20_000, len(want0) - 5100)
    assert scattered == want0
    # as published, buffers larger than the value fail (it reads every buffer in full)
    assert store.batch_get_into_multi_buffers(["mb1"], [[dst.p]], [[334]]) == [
        int(ErrorCode.TRANSFER_FAIL)
    ]
    assert dst.at(900_000, 333) == src.at(500_000, 333)


def test_multi_buffer_bad_inputs_answer_per_key_codes(store: MooncakeDistributedStore) -> None:
    b = Buf(store, 64 * 1024)
    assert store.batch_put_from_multi_buffers(["a", "b"], [[b.p]], [[10]]) == [INVALID, INVALID]
    assert store.batch_put_from_multi_buffers(["a"], [[b.p, b.p]], [[10]]) == [INVALID]
    assert store.batch_put_from_multi_buffers([], [], []) == []
    unregistered = np.zeros(16, np.uint8)
    assert store.batch_put_from_multi_buffers(
        ["ok", "bad"], [[b.p], [int(unregistered.ctypes.data)]], [[10], [16]]
    ) == [0, INVALID]
    assert store.get("ok") == b.at(0, 10) and store.is_exist("bad") == 0
    # the buffers together are smaller than the value
    assert store.batch_get_into_multi_buffers(["ok"], [[b.p + 100, b.p + 200]], [[4, 5]]) == [
        INVALID
    ]


# -- batch lengths -------------------------------------------------------------------------


def test_unequal_batch_lists_answer_len_keys_results(store: MooncakeDistributedStore) -> None:
    b = Buf(store, 4096)
    assert store.batch_put_from(["x", "y"], [b.p], [10]) == [INVALID, INVALID]
    assert store.batch_put_from(["x"], [b.p, b.p + 10], [10, 10]) == [INVALID]
    assert store.batch_get_into(["x"], [b.p, b.p], [1, 2, 3]) == [INVALID]
    assert store.batch_upsert_from(["x", "y", "z"], [b.p], [1, 1]) == [INVALID] * 3
    assert store.batch_put_from([], [], []) == [] and store.batch_get_into([], [], []) == []


# -- ranges and sessions -------------------------------------------------------------------


def test_get_into_ranges_copies_exact_fragments(store: MooncakeDistributedStore) -> None:
    assert store.put("r1", b"0123456789") == 0
    assert store.put("r2", b"abcdefghij") == 0
    out = Buf(store, 4096, fill=0)
    out2 = Buf(store, 4096, fill=0)
    res = store.get_into_ranges(
        [out.p, out2.p],
        [["r1", "r2"], ["r2", "missing"]],
        [[[0, 10], [20]], [[0], [50]]],
        [[[2, 6], [1]], [[6], [0]]],
        [[[4, 3], [5]], [[4], [2]]],
    )
    assert res == [[[4, 3], [5]], [[4], [NOT_FOUND]]]
    assert out.at(0, 4) == b"2345" and out.at(10, 3) == b"678" and out.at(20, 5) == b"bcdef"
    assert out2.at(0, 4) == b"ghij"
    # a range past the object's end or the buffer's, and mismatched lists
    res = store.get_into_ranges([out.p], [["r1"]], [[[0, 4090]]], [[[8, 0]]], [[[3, 10]]])
    assert res == [[[INVALID, INVALID]]]
    assert store.get_into_ranges([out.p], [["r1"]], [[[0]]], [[[0, 1]]], [[[1]]]) == [[[INVALID]]]
    # lists of different lengths: one row per buffer, as the published client shapes it
    assert store.get_into_ranges([out.p, out.p], [["r1"]], [[[0]]], [[[0]]], [[[1]]]) == [
        [[INVALID]],
        [[INVALID]],
    ]


def test_get_session_reads_ranges_until_its_lease_ends(store: MooncakeDistributedStore) -> None:
    assert store.put("s", b"ABCDEFGHIJKLMNOP") == 0
    b = Buf(store, 4096, fill=0)
    assert store.batch_get_session_start(["s", "nope"]) == [0, NOT_FOUND]
    got = store.batch_get_into_multi_buffer_ranges(
        ["s", "nope"], [[b.p, b.p + 8], [b.p]], [[2, 3], [1]], [[0, 10], [0]]
    )
    assert got == [5, INVALID]  # no session for "nope"
    assert b.at(0, 2) == b"AB" and b.at(8, 3) == b"KLM"
    assert store.batch_get_into_multi_buffer_ranges(["s"], [[b.p]], [[4]], [[14]]) == [INVALID]
    time.sleep(LEASE_S + 0.1)
    assert store.batch_get_into_multi_buffer_ranges(["s"], [[b.p]], [[1]], [[0]]) == [
        int(ErrorCode.LEASE_EXPIRED)
    ]
    assert store.batch_get_session_end(["s"]) == 0


def test_put_session_writes_ranges_then_ends_or_revokes(store: MooncakeDistributedStore) -> None:
    b = Buf(store, 4096)
    assert store.batch_put_session_start(["p1", "p2"], [8, 4]) == [0, 0]
    assert store.batch_put_session_start(["p1"], [8]) == [INVALID]  # already in a session
    assert store.is_exist("p1") == 0  # not readable before the end
    got = store.batch_put_from_multi_buffer_ranges(
        ["p1", "p2", "none"],
        [[b.p, b.p + 100], [b.p], [b.p]],
        [[4, 4], [4], [1]],
        [[4, 0], [0], [0]],
    )
    assert got == [8, 4, INVALID]
    assert store.batch_put_from_multi_buffer_ranges(["p1"], [[b.p]], [[4]], [[6]]) == [INVALID]
    assert store.batch_put_session_end(["p1", "none"]) == [0, INVALID]
    assert store.get("p1") == b.at(100, 4) + b.at(0, 4)
    assert store.batch_put_session_revoke(["p2"]) == [0]
    assert store.is_exist("p2") == 0


# -- upsert and metadata -------------------------------------------------------------------


def test_upsert_family_inserts_replaces_in_place_and_reallocates(
    store: MooncakeDistributedStore,
) -> None:
    assert store.upsert("u", b"first") == 0 and store.get("u") == b"first"
    assert store.put("u", b"ignored") == 0 and store.get("u") == b"first"  # put keeps it
    assert store.upsert("u", b"FIRST") == 0 and store.get("u") == b"FIRST"  # same size
    assert store.upsert_parts("u", b"long", b"er value") == 0
    assert store.get("u") == b"longer value"
    # a part without the buffer protocol: the invalid-argument code, the value kept
    assert store.upsert_parts("u", b"x", object()) == INVALID
    assert store.put_parts("nope", object()) == INVALID and store.is_exist("nope") == 0
    assert store.get("u") == b"longer value"
    assert store.upsert_batch(["u", "v"], [b"1", b"22"]) == 0
    assert store.get_batch(["u", "v"]) == [b"1", b"22"]
    b = Buf(store, 4096)
    assert store.upsert_from("u", b.p, 64) == 0 and store.get("u") == b.at(0, 64)
    assert store.batch_upsert_from(["u", "w"], [b.p + 1, b.p + 2], [3, 5]) == [0, 0]
    assert store.get("u") == b.at(1, 3) and store.get("w") == b.at(2, 5)


def test_put_from_with_metadata_stores_metadata_then_data(store: MooncakeDistributedStore) -> None:
    b = Buf(store, 4096)
    assert store.put_from_with_metadata("m", b.p + 1000, b.p, 50, 16) == 0
    assert store.get("m") == b.at(0, 16) + b.at(1000, 50)
    assert store.put_from_with_metadata("m0", b.p, b.p, 0, 16) == 0 and store.is_exist("m0") == 0
    cfg = ReplicateConfig()
    cfg.prefer_alloc_in_same_node = True
    assert store.put_from_with_metadata("m1", b.p, b.p, 4, 4, cfg) == -1


# -- segments ------------------------------------------------------------------------------


def test_allocated_segment_takes_puts_until_it_is_freed(master: Master) -> None:
    s = make(master, segment=0)  # a pure client: nowhere to put
    try:
        assert s.put("nowhere", b"x" * 100) == NO_HANDLE
        r = s.allocate_and_mount_segment(5 * MIB)
        assert r["ret"] == 0 and r["allocated_size"] == 16 * MIB and len(r["segment_ids"]) == 1
        assert s.put("here", b"y" * 100) == 0 and s.get("here") == b"y" * 100
        assert s.unmount_segment(r["segment_ids"]) == -1  # not mount_segment's
        assert s.unmount_and_free_segment(r["segment_ids"]) == 0
        assert s.get("here") == b"" and s.put("again", b"z") == NO_HANDLE
        assert s.unmount_and_free_segment(r["segment_ids"]) == -1
        assert s.allocate_and_mount_segment(0)["ret"] == -1
        assert s.alloc_from_mem_pool(4096) == 0  # a real client has no dummy pool
    finally:
        s.close()


def test_mounted_file_segment_holds_the_bytes(master: Master) -> None:
    s = make(master, segment=0)
    fd, path = tempfile.mkstemp()
    try:
        os.ftruncate(fd, 8 * MIB)
        r = s.mount_segment(path, 4 * MIB, 4096)
        assert r["ret"] == 0 and len(r["segment_ids"]) == 1
        value = os.urandom(3000)
        assert s.put("in-file", value) == 0
        with mmap.mmap(fd, 8 * MIB) as m:  # the object's bytes are in the file
            assert m.find(value) >= 4096
        assert s.unmount_segment(r["segment_ids"]) == 0
        assert s.is_exist("in-file") == 0
        assert s.mount_segment(path, 16 * MIB)["ret"] == -1  # past the end
        assert s.mount_segment(path, 4096, 1)["ret"] == -1  # unaligned offset
        assert s.mount_segment(path + ".missing", 4096)["ret"] == -1
    finally:
        s.close()
        os.close(fd)
        os.unlink(path)


# -- replica admin: tasks and clearing -----------------------------------------------------


def _endpoints(s: MooncakeDistributedStore, key: str) -> set[str]:
    return {
        r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for r in s.get_replica_desc(key)
    }


def _wait_task(s: MooncakeDistributedStore, tid: tuple[int, int]) -> QueryTaskResponse:
    for _ in range(200):
        resp, code = s.query_task(tid)
        assert code == 0 and resp is not None
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        time.sleep(0.05)
    raise AssertionError(f"task {tid} did not finish")


def test_copy_and_move_tasks_run_and_report(master: Master) -> None:
    a, b = make(master), make(master)
    try:
        ha, hb = a.get_hostname(), b.get_hostname()
        assert a.put("c", b"copy me", own(a)) == 0 and a.put("m", b"move me", own(a)) == 0
        tid, code = a.create_copy_task("c", [hb])
        assert code == 0 and isinstance(tid, tuple) and tid != (0, 0)
        resp = _wait_task(a, tid)
        assert (resp.status, resp.type, resp.id) == (TaskStatus.SUCCESS, TaskType.REPLICA_COPY, tid)
        assert _endpoints(a, "c") == {ha, hb}
        tid, code = b.create_move_task("m", ha, hb)  # any client may ask; a runs it
        assert code == 0 and _wait_task(b, tid).status == TaskStatus.SUCCESS
        assert _endpoints(a, "m") == {hb}
        a.close()  # the copy on b survives its source
        assert b.get("c") == b"copy me" and b.get("m") == b"move me"
        assert b.create_copy_task("nope", [hb]) == ((0, 0), NOT_FOUND)
        assert b.create_copy_task("c", ["bogus:1"]) == ((0, 0), INVALID)
        tid, code = b.create_copy_task("c", [hb])  # already there: nothing to do, as published
        assert code == 0 and _wait_task(b, tid).status == TaskStatus.SUCCESS
        assert b.create_move_task("c", hb, hb) == ((0, 0), INVALID)
        assert b.create_move_task("m", "bogus:1", hb) == ((0, 0), INVALID)  # no replica there
        assert b.query_task((1, 2)) == (None, -1400)  # the published TASK_NOT_FOUND
        with pytest.raises(TypeError):
            b.query_task("not a pair")  # type: ignore[arg-type]
    finally:
        a.close()
        b.close()


def test_batch_replica_clear_takes_only_own_expired_objects(master: Master) -> None:
    a, b = make(master), make(master)
    try:
        two = own(a)
        two.replica_num = 2
        two.preferred_segments = [a.get_hostname(), b.get_hostname()]
        assert a.put("mine", b"1") == 0 and a.put("both", b"22", two) == 0
        assert b.put("theirs", b"3") == 0
        assert a.is_exist("mine") == 1  # grants a lease
        assert a.batch_replica_clear(["mine"]) == []
        time.sleep(LEASE_S + 0.1)
        assert a.batch_replica_clear(["both"], b.get_hostname()) == ["both"]
        assert _endpoints(a, "both") == {a.get_hostname()}
        time.sleep(LEASE_S + 0.1)
        assert a.batch_replica_clear(["mine", "theirs", "nope", "mine"]) == ["mine"]
        assert a.is_exist("mine") == 0 and a.is_exist("theirs") == 1
        assert a.batch_replica_clear([]) == []
    finally:
        a.close()
        b.close()


# -- config, groups ------------------------------------------------------------------------


def test_replicate_config_rejects_what_the_published_binding_rejects() -> None:
    c = ReplicateConfig()
    for bad in (-1, 2**64, 1.5, "1"):
        with pytest.raises(TypeError):
            c.soft_pin_ttl_ms = bad  # type: ignore[assignment]
    c.soft_pin_ttl_ms = 5
    c.soft_pin_ttl_ms = None
    with pytest.raises(TypeError):
        c.replica_num = -1
    with pytest.raises(TypeError):
        c.preferred_segments = "ab"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        c.group_ids = ["a", 1]  # type: ignore[list-item]
    c.group_ids = ("g1", "g2")  # type: ignore[assignment]
    assert c.group_ids == ["g1", "g2"] and str(c).endswith(
        "data_type: UNKNOWN, group_ids: [g1, g2] }"
    )


def test_group_members_share_read_leases(store: MooncakeDistributedStore) -> None:
    b = Buf(store, 4096)
    cfg = ReplicateConfig()
    cfg.group_ids = ["g", "g", "solo"]
    assert store.batch_put_from(["g1", "g2", "s"], [b.p, b.p + 1, b.p + 2], [1, 1, 1], cfg) == [
        0,
        0,
        0,
    ]
    time.sleep(LEASE_S + 0.1)
    assert store.is_exist("g1") == 1  # leases g1 and, through the group, g2
    assert store.remove("g2") == HAS_LEASE
    assert store.remove("s") == 0
    cfg.group_ids = ["only-one"]
    assert store.batch_put_from(["x", "y"], [b.p, b.p], [1, 1], cfg) == [INVALID, INVALID]


# -- setup ---------------------------------------------------------------------------------


def test_setup_without_port_picks_distinct_ports_in_the_published_range(master: Master) -> None:
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        for s in (a, b):
            assert (
                s.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MIB, 4 * MIB, "tcp", "", master.address)
                == 0
            )
        names = [a.get_hostname(), b.get_hostname()]
        assert names[0] != names[1]
        for n in names:
            host, port = n.rsplit(":", 1)
            assert host == "127.0.0.1" and 12300 <= int(port) <= 14300
    finally:
        a.close()
        b.close()


def test_setup_takes_published_protocols_and_warns_once_on_fallback(
    master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    s = MooncakeDistributedStore()
    with caplog.at_level(logging.WARNING, logger="mooncake.store"):
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MIB, 4 * MIB, "efa", "", master.address)
    try:
        assert rc == 0 and s.put("p", b"v") == 0 and s.get("p") == b"v"
        warnings = [r.getMessage() for r in caplog.records if "protocol" in r.getMessage()]
        assert len(warnings) == 1 and "'efa'" in warnings[0] and "'tcp'" in warnings[0]
    finally:
        s.close()
    t = MooncakeDistributedStore()
    assert (
        t.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MIB, 4 * MIB, "carrier-pigeon", "", master.address)
        == INVALID
    )


def test_setup_with_an_engine_shares_it(master: Master) -> None:
    from mooncake.engine import TransferEngine

    a = make(master)
    te = a.get_engine()
    c = MooncakeDistributedStore()
    try:
        assert isinstance(te, TransferEngine) and te.get_rpc_port() > 0
        assert c.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MIB, "tcp", "", master.address, te) == 0
        assert c.get_hostname() == a.get_hostname()  # one engine, one segment name
        assert c.put("shared", b"via c") == 0 and a.get("shared") == b"via c"
        assert c.close() == 0
        assert a.get("shared") == b"via c" and a.health_check() == 0  # a's engine lives on
        assert (
            c.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MIB, "tcp", "", master.address, object())
            == INVALID
        )
    finally:
        c.close()
        a.close()


def test_setup_with_ssd_offload_opens_the_tier(master: Master, tmp_path: str) -> None:
    s = MooncakeDistributedStore()
    path = os.path.join(str(tmp_path), "ssd")
    rc = s.setup(
        "127.0.0.1", "P2PHANDSHAKE", 4 * MIB, 4 * MIB, "tcp", "", master.address, None, True, path
    )
    try:
        assert rc == 0 and os.path.isdir(path)
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
        assert s.unmount_local_disk_segment() == 0
        assert s.get_offload_rpc_read_count() == 0
    finally:
        s.close()


def test_info_calls_before_and_after_setup(master: Master) -> None:
    s = MooncakeDistributedStore()
    assert s._get_pyclient_capsule() is None and s.get_engine() is None and s.get_hostname() == ""
    assert (
        s.setup(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "4MB",
                "local_buffer_size": "4 MB",
                "master_server_addr": master.address,
                "protocol": "rdma",
            }
        )
        == 0
    )
    try:
        cap = s._get_pyclient_capsule()
        assert type(cap).__name__ == "PyCapsule"
        name = ctypes.pythonapi.PyCapsule_GetName
        name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        assert name(cap) == b"mooncake.store.PyClient"
    finally:
        s.close()


def test_the_readme_store_example_runs(master: Master) -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("and so does the store")[1].split("```python")[1].split("```")[0]
    assert "batch_put_from_multi_buffers" in block
    assert "put_tensor" in block
    pytest.importorskip("torch")
    exec(block.replace('"127.0.0.1:50051"', repr(master.address)), {})


def test_ssd_offload_serves_evicted_objects_and_counts_them(tmp_path: str) -> None:
    m = Master("--offload-on-evict", "true", "--default-kv-lease-ttl", "50")
    s = MooncakeDistributedStore()
    try:
        path = os.path.join(str(tmp_path), "ssd")
        assert (
            s.setup(
                "127.0.0.1", "P2PHANDSHAKE", MIB, 4 * MIB, "tcp", "", m.address, None, True, path
            )
            == 0
        )
        values = {f"k{i}": os.urandom(64 * 1024) for i in range(40)}  # 2.5 MiB into 1 MiB
        for k, v in values.items():
            for _ in range(500):
                rc = s.put(k, v)
                if rc != NO_HANDLE:  # the segment is full while demotions are being copied
                    break
                time.sleep(0.02)
            assert rc == 0, k
        # an evicted object stays as a LOCAL_DISK-only replica (published offload_on_evict)
        descs = s.batch_get_replica_desc(list(values))
        assert set(descs) == set(values)
        cold = [k for k, d in descs.items() if d and not any(r.is_memory_replica() for r in d)]
        assert cold
        (disk,) = descs[cold[0]]
        assert disk.is_local_disk_replica() and not disk.is_disk_replica()
        assert disk.status == ReplicaStatus.COMPLETE
        with pytest.raises(InvalidArgumentError):
            disk.get_memory_descriptor()
        assert [r.is_local_disk_replica() for r in s.get_replica_desc(cold[0])] == [True]
        assert s.get_offload_rpc_read_count() == 0
        assert all(s.get(k) == v for k, v in values.items())
        served = s.get_offload_rpc_read_count()
        assert served >= 20  # most of them came back from the SSD tier
        # draining the tier drops what only it held
        assert s.unmount_local_disk_segment() == 0
        alive = sum(s.is_exist(k) for k in values)
        assert alive <= len(values) - served
    finally:
        s.close()
        m.stop()


def test_setup_retries_another_port_when_the_random_one_is_taken(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from mooncake.store import _setup

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real, picks = _setup.pick_port, []

    def first_taken(host: str) -> int:
        picks.append(host)
        return port if len(picks) == 1 else real(host)

    monkeypatch.setattr(_setup, "pick_port", first_taken)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master.address) == 0
        assert len(picks) == 2 and s.get_hostname() != f"127.0.0.1:{port}"
        t = MooncakeDistributedStore()  # an explicit port is used as given: no retry
        assert t.setup(f"127.0.0.1:{port}", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master.address) < 0
    finally:
        s.close()
        taken.close()


def test_setup_dict_takes_config_file_spellings(
    master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache passes its MOONCAKE_CONFIG_PATH keys to ``setup(dict)``: ``master_server_address``
    and ``device_name`` are read as ``master_server_addr`` / ``rdma_devices``, and a key the
    client does not read is ignored with a warning (as the published client ignores it)."""
    s = MooncakeDistributedStore()
    try:
        cfg = {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": "16MB",
            "local_buffer_size": "16MB",
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": master.address,
            "transfer_timeout": 1,
        }
        assert s.setup(cfg) == 0
        assert "transfer_timeout" in caplog.text
        assert s.is_exist("never-stored") == 0
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
    finally:
        s.close()
