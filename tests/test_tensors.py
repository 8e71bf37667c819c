"""The 42 tensor methods against a real master and a real store client (one process each).

The store class is the facade, ``MooncakeDistributedStore``, which includes
:class:`TensorMethods`. Values are checked element by element; shards by key name
and header, so what these tests store is what the published binding would find.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake._core import tensor_layout as tl
from mooncake._store import tensor_support as ts
from mooncake._store.facade_tensors import (
    ParallelAxis,
    ReadTarget,
    TensorMethods,
    TensorParallelism,
    TorchMissingError,
)
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_procs import Master

torch = pytest.importorskip("torch")
MIB = 1 << 20
INVALID = -600


Store = MooncakeDistributedStore
assert issubclass(Store, TensorMethods)


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    m = Master()
    s = Store()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MIB, 64 * MIB, "tcp", "", m.address) == 0
        yield s
    finally:
        s.close()
        m.stop()


@pytest.fixture
def buf(store: Store) -> Iterator[np.ndarray[Any, Any]]:
    b = np.zeros(4 * MIB, dtype=np.uint8)
    assert store.register_buffer(b.ctypes.data, b.nbytes) == 0
    yield b
    store.unregister_buffer(b.ctypes.data)


def axis(kind: str, rank: int, size: int, split_dim: int | None = None, **ids: int) -> Any:
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    for k, v in ids.items():
        setattr(a, k, v)
    return a


def par(*axes: Any) -> Any:
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def target(mode: str, p: Any = None) -> Any:
    t = ReadTarget()
    t.mode, t.parallelism = mode, p
    return t


def sample(dtype: Any = None, shape: tuple[int, ...] = (4, 6)) -> Any:
    x = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    return x.to(dtype or torch.float16)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ],
)
def test_put_get_every_dtype(store: Store, dtype: Any) -> None:
    t = sample(dtype, (3, 5))
    key = f"dt-{dtype}"
    assert store.put_tensor(key, t) == 0
    got = store.get_tensor(key)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    assert store.get_size(key) == 304 + t.numel() * t.element_size()


def test_single_upsert_pub_and_missing(store: Store) -> None:
    t = sample()
    assert store.put_tensor("s1", t) == 0
    assert store.upsert_tensor("s1", t * 2) == 0
    assert torch.equal(store.get_tensor("s1"), t * 2)
    cfg = ReplicateConfig()
    assert store.pub_tensor("s2", t[1:], cfg) == 0
    assert store.upsert_pub_tensor("s2", t[:1], cfg) == 0
    assert torch.equal(store.get_tensor("s2"), t[:1])
    assert store.get_tensor("never-put") is None
    non_contig = t.T
    assert store.put_tensor("s3", non_contig) == 0
    assert torch.equal(store.get_tensor("s3"), non_contig)
    assert store.put_tensor("s4", "not a tensor") == INVALID
    bad = ReplicateConfig()
    bad.preferred_segments = ["a", "b"]
    assert store.pub_tensor("s5", t, bad) == INVALID


def test_big_tensor_grows_the_staging_buffer(store: Store) -> None:
    t = torch.randn(3 * MIB // 4)  # 3 MiB of float32
    assert store.put_tensor("big", t) == 0
    assert torch.equal(store.get_tensor("big"), t)


def test_batch_forms(store: Store) -> None:
    ts_ = [sample(shape=(2, 2)), sample(torch.int32, (5,)), torch.zeros(0, 3)]
    keys = ["b1", "b2", "b3"]
    assert store.batch_put_tensor(keys, ts_) == [0, 0, 0]
    got = store.batch_get_tensor([*keys, "b-missing"])
    assert got[3] is None
    for g, t in zip(got, ts_, strict=False):
        assert torch.equal(g, t)
    assert store.batch_put_tensor(keys, ts_[:2]) == [INVALID] * 3
    assert store.batch_put_tensor([], []) == []
    assert store.batch_upsert_tensor(keys[:2], [ts_[1], ts_[0]]) == [0, 0]
    assert torch.equal(store.get_tensor("b1"), ts_[1])
    assert store.batch_pub_tensor(["b4"], [ts_[0]], ReplicateConfig()) == [0]
    assert store.batch_upsert_pub_tensor(["b4"], [ts_[1]], ReplicateConfig()) == [0]
    assert torch.equal(store.get_tensor("b4"), ts_[1])
    assert store.batch_put_tensor(["b5", "b6"], [ts_[0], object()]) == [0, INVALID]


def test_tp_shards_land_under_key_tp_rank(store: Store) -> None:
    t = sample(shape=(4, 6))
    assert store.put_tensor_with_tp("tp", t, tp_size=3, split_dim=1) == 0
    for r in range(3):
        shard = store.get_tensor_with_tp("tp", r, 3)
        assert torch.equal(shard, t[:, 2 * r : 2 * r + 2])
        raw = store.get_buffer(f"tp_tp_{r}")
        meta = tl.parse_metadata(raw, len(raw))
        assert meta.layout_kind == tl.LayoutKind.SHARD
        assert meta.global_shape == (4, 6) and meta.local_shape == (4, 2)
        assert (meta.axes[0].shard_rank, meta.axes[0].shard_count, meta.axes[0].split_dim) == (
            r,
            3,
            1,
        )
    assert store.put_tensor_with_tp("tp-bad", t, tp_size=4, split_dim=1) == INVALID
    assert store.pub_tensor_with_tp("tp2", t, ReplicateConfig(), 0, 2, 0) == 0
    assert store.batch_put_tensor_with_tp(["tp3", "tp4"], [t, t], 0, 2, 0) == [0, 0]
    assert store.batch_pub_tensor_with_tp(["tp5"], [t], ReplicateConfig(), 0, 2, 0) == [0]
    got = store.batch_get_tensor_with_tp(["tp2", "tp3", "tp5"], 1, 2)
    assert all(torch.equal(g, t[2:]) for g in got)
    assert store.get_tensor_with_tp("tp2", 0, 1) is None  # tp_size 1 reads the key itself
    assert torch.equal(store.get_tensor_with_tp("tp2_tp_0", 0, 1), t[:2])


def test_into_and_from_registered_buffers(store: Store, buf: Any) -> None:
    t = sample(torch.float32, (8, 8))
    assert store.put_tensor("into", t) == 0
    addr = buf.ctypes.data
    view = store.get_tensor_into("into", addr, buf.nbytes)
    assert torch.equal(view, t)
    view[0, 0] = 99.0  # a view of the caller's buffer, not a copy
    assert ctypes.c_float.from_address(addr + 304).value == 99.0
    n = 304 + t.numel() * 4
    assert store.put_tensor_from("from", addr, n) == 0
    assert store.get_tensor("from")[0, 0] == 99.0
    assert store.upsert_tensor_from("from", addr, n) == 0
    assert store.put_tensor_from("from-bad", addr, n - 1) == INVALID  # header disagrees
    assert store.put_tensor_from("from-bad", addr, 100) == INVALID
    assert store.get_tensor_into("nope", addr, buf.nbytes) is None
    half = buf.nbytes // 2
    assert store.batch_put_tensor_from(["f1", "f2"], [addr, addr], [n, n]) == [0, 0]
    assert store.batch_upsert_tensor_from(["f1"], [addr], [n]) == [0]
    assert store.batch_put_tensor_from(["f1"], [addr], [n - 4]) == [INVALID]
    got = store.batch_get_tensor_into(["f1", "f2"], [addr, addr + half], [half, half])
    assert torch.equal(got[0], got[1]) and got[0][0, 0] == 99.0
    assert store.batch_get_tensor_into(["f1"], [addr], []) == [INVALID]
    assert store.put_tensor_with_tp_from("tpf", addr, n, 0, 2, 0) == 0
    assert torch.equal(store.get_tensor_with_tp_into("tpf", addr + half, half, 1, 2), got[0][4:])
    assert store.batch_put_tensor_with_tp_from(["tpf2"], [addr], [n], 0, 4, 1) == [0]
    got = store.batch_get_tensor_with_tp_into(["tpf2"], [addr + half], [half], 3, 4)
    assert got[0].shape == (8, 2)


def test_into_cuda_checks_the_destination(store: Store) -> None:
    t = sample(torch.float32, (3, 3))
    assert store.put_tensor("cu", t) == 0
    dst = torch.empty(3, 3)
    assert store.get_tensor_into_cuda("cu", dst) == 36
    assert torch.equal(dst, t)
    assert store.get_tensor_into_cuda("cu", torch.empty(9)) == INVALID
    assert store.batch_get_tensor_into_cuda(["cu", "none"], [dst, dst]) == [36, INVALID]


def test_parallelism_routes(store: Store) -> None:
    full = sample(shape=(4, 6))
    # lone TP axis: each rank puts its local shard
    for r in range(2):
        p = par(axis("tp", r, 2, 0))
        assert store.put_tensor_with_parallelism("p1", full[2 * r : 2 * r + 2], p) == 0
    assert torch.equal(store.get_tensor("p1_tp_1"), full[2:])
    assert torch.equal(
        store.get_tensor_with_parallelism("p1", target("full", par(axis("tp", 0, 2, 0)))), full
    )
    assert torch.equal(
        store.get_tensor_with_parallelism("p1", target("shard", par(axis("tp", 1, 2, 0)))), full[2:]
    )
    assert tl.parse_manifest(store.get_buffer("p1__parallelism_manifest")).global_shape == (4, 6)
    # writer partitions: each writer holds the full tensor
    for r in range(3):
        w = type("W", (), {"rank": r, "size": 3, "split_dim": 1})()
        assert store.put_tensor_with_parallelism("p2", full, writer_partition=w) == 0
    assert store.is_exist("p2__writer_2of3_sd1") == 1
    assert torch.equal(store.get_tensor_with_parallelism("p2", target("full")), full)
    shard = store.get_tensor_with_parallelism("p2", target("shard", par(axis("tp", 1, 3, 1))))
    assert torch.equal(shard, full[:, 2:4])
    # TP with another axis: the full tensor, rank's slice under the axes' key
    p = par(axis("dp", 1, 2), axis("tp", 1, 2, 1))
    assert store.upsert_tensor_with_parallelism("p3", full, p) == 0
    assert torch.equal(store.get_tensor("p3__dp_1of2__tp_1of2_sd1"), full[:, 3:])
    # no TP: stored as is under the axes' key
    assert store.put_tensor_with_parallelism("p4", full, par(axis("ep", 0, 2, expert_id=3))) == 0
    assert torch.equal(
        store.get_tensor_with_parallelism(
            "p4", target("shard", par(axis("ep", 0, 2, expert_id=3)))
        ),
        full,
    )
    assert (
        store.get_tensor_with_parallelism("p4", target("shard", par(axis("ep", 1, 2, expert_id=3))))
        is None
    )
    # bad requests
    assert store.put_tensor_with_parallelism("p5", full, par(axis("tp", 0, 2))) == INVALID
    w = type("W", (), {"rank": 0, "size": 2, "split_dim": 0})()
    assert (
        store.put_tensor_with_parallelism("p5", full, par(axis("tp", 0, 2, 0)), None, w) == INVALID
    )
    assert store.get_tensor_with_parallelism("p4") is None  # as stored: nothing under "p4" itself


def test_parallelism_batch_and_buffer_forms(store: Store, buf: Any) -> None:
    full = sample(shape=(4, 6))
    ps = [par(axis("tp", r, 2, 1)) for r in range(2)]
    assert store.batch_put_tensor_with_parallelism(
        ["q1", "q1"], [full[:, :3], full[:, 3:]], ps
    ) == [0, 0]
    assert store.batch_upsert_tensor_with_parallelism(["q2"], [full], None, ReplicateConfig()) == [
        0
    ]
    assert store.batch_put_tensor_with_parallelism(["q3"], [full], ps) == [INVALID]
    got = store.batch_get_tensor_with_parallelism(["q1", "q2"], [target("full", ps[0]), None])
    assert torch.equal(got[0], full) and torch.equal(got[1], full)
    addr = buf.ctypes.data
    assert store.put_tensor("qsrc", full) == 0
    assert store.get_tensor_into("qsrc", addr, buf.nbytes) is not None
    n = 304 + full.numel() * 2
    assert store.put_tensor_with_parallelism_from("q4", addr, n, par(axis("dp", 0, 2))) == 0
    assert store.upsert_tensor_with_parallelism_from("q4", addr, n, par(axis("dp", 0, 2))) == 0
    assert store.batch_put_tensor_with_parallelism_from(["q5"], [addr], [n]) == [0]
    assert store.batch_upsert_tensor_with_parallelism_from(
        ["q5"], [addr], [n], [par(axis("dp", 1, 2))]
    ) == [0]
    assert torch.equal(store.get_tensor("q5__dp_1of2"), full)
    half = buf.nbytes // 2
    v = store.get_tensor_with_parallelism_into("q1", addr + half, half, target("full", ps[1]))
    assert torch.equal(v, full)
    assert tl.parse_metadata(bytes(buf[half : half + 304]), 304 + 48).global_shape == (4, 6)
    got = store.batch_get_tensor_with_parallelism_into(
        ["q1"], [addr + half], [half], [target("shard", ps[1])]
    )
    assert torch.equal(got[0], full[:, 3:])
    assert store.get_tensor_with_parallelism_into("q1", addr, 100, target("full", ps[1])) is None


def test_safetensors_round_trip(store: Store, tmp_path: Path) -> None:
    t = sample(torch.bfloat16, (2, 5))
    assert store.put_tensor("st", t) == 0
    f = tmp_path / "st.safetensors"
    assert store.save_tensor_to_safetensor("st", str(f)) == 0
    assert store.save_tensor_to_safetensor("no-such-key", str(f) + "x") == -1100
    loaded = store.load_tensor_from_safetensor("st2", str(f))  # not in the file: first entry
    assert torch.equal(loaded, t) and torch.equal(store.get_tensor("st2"), t)
    assert torch.equal(store.load_tensor_from_safetensor(file_name=str(f)), t)
    assert torch.equal(store.get_tensor(str(f)), t)
    assert store.load_tensor_from_safetensor("x", str(tmp_path / "missing")) is None
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(f))["st"], t)


def test_module_helpers_round_trip() -> None:
    t = sample(torch.float16, (2, 3))
    meta, ptr, n, owner = ts._serialize_tensor(t)
    assert (len(meta), n, ptr) == (304, 12, owner.data_ptr())
    back = ts._deserialize_tensor(meta + bytes(owner.view(torch.uint8).numpy()))
    assert torch.equal(back, t)
    with pytest.raises(ValueError, match="invalid serialized"):
        ts._deserialize_tensor(meta)
    with pytest.raises(ValueError, match="unsupported"):
        ts._serialize_tensor(torch.zeros(2, dtype=torch.complex64))
    assert ts._tensor_metadata_size() == 304
    rt = ReadTarget()
    rt.mode = "FULL"
    assert rt.mode == "full"
    with pytest.raises(RuntimeError):
        rt.mode = "sideways"


def test_without_torch_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts, "_torch", None)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    s = Store()
    with pytest.raises(TorchMissingError, match=r"mooncake-py\[torch\]"):
        s.get_tensor("k")
    with pytest.raises(ImportError):
        s.batch_get_tensor(["k"])


def _mode_par(mode: str, rank: int, size: int, split_dim: int) -> Any:
    """The request shapes the published tests build for each parallelism mode."""
    tp = axis("tp", rank, size, split_dim)
    if mode == "tp":
        return par(tp)
    if mode == "dp_tp":
        return par(axis("dp", 0, 2), tp)
    if mode == "pp_tp":
        return par(axis("pp", 0, 2, stage_id=7), tp)
    assert mode == "ep_tp"
    return par(axis("ep", 0, 2, expert_id=11), tp)


@pytest.mark.parametrize(
    ("index", "shape", "split_dim", "put_tp", "get_tp", "mode"),
    [
        (0, (8, 12, 6), 0, 4, 2, "tp"),
        (1, (8, 12, 6), 1, 4, 2, "dp_tp"),
        (2, (8, 12, 6), 2, 2, 4, "pp_tp"),
        (3, (8, 12, 6), 1, 2, 4, "ep_tp"),
        (4, (12, 8, 6), 0, 2, 2, "tp"),
        (5, (12, 8, 8), 2, 4, 4, "dp_tp"),
        (6, (8, 12, 6), 0, 2, 4, "tp"),
        (7, (8, 12, 6), 2, 2, 4, "tp"),
    ],
)
def test_shard_reads_resplit_to_the_requested_tp_size(
    store: Store,
    buf: Any,
    index: int,
    shape: tuple[int, ...],
    split_dim: int,
    put_tp: int,
    get_tp: int,
    mode: str,
) -> None:
    """Written with ``put_tp`` writers, a shard read for ``get_tp`` ranks is rank's chunk of
    the full tensor (``tensor.chunk(get_tp, split_dim)[rank]``), direct and into a buffer; a
    TP size that does not divide the dimension reads None."""
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    key = f"resplit_{index}"
    for r in range(put_tp):
        value = full.chunk(put_tp, split_dim)[r].contiguous() if mode == "tp" else full
        assert (
            store.put_tensor_with_parallelism(key, value, _mode_par(mode, r, put_tp, split_dim))
            == 0
        )
    if shape[split_dim] % get_tp:
        req = target("shard", _mode_par(mode, 0, get_tp, split_dim))
        assert store.get_tensor_with_parallelism(key, req) is None
        return
    for r in range(get_tp):
        expected = full.chunk(get_tp, split_dim)[r].contiguous()
        req = target("shard", _mode_par(mode, r, get_tp, split_dim))
        got = store.get_tensor_with_parallelism(key, req)
        assert got is not None and torch.equal(got, expected), (mode, r)
        into = store.get_tensor_with_parallelism_into(key, buf.ctypes.data, buf.nbytes, req)
        assert into is not None and torch.equal(into, expected), (mode, r)
    whole = store.get_tensor_with_parallelism(
        key, target("full", _mode_par(mode, 0, get_tp, split_dim))
    )
    assert whole is not None and torch.equal(whole, full)
