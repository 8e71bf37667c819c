"""``mooncake.structured_object_store`` on a real master and store client, and against the
published module (each side writes, the other reads the raw keys back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake._structured import msgpack_lite  # noqa: E402
from mooncake.store import MooncakeDistributedStore  # noqa: E402
from mooncake.structured_object_store import (  # noqa: E402
    FieldSchema,
    MooncakeBundleTransfer,
    StructuredObjectPayload,
    _decode_manifest,
    export_ref,
    import_ref,
    raw_destination,
    tensor_object_buffer,
)
from tests.conftest import ROOT, anchor_python  # noqa: E402
from tests.helpers.store_procs import Master  # noqa: E402

MIB = 1 << 20
DRIVER = ROOT / "tests" / "helpers" / "structured_driver.py"


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeDistributedStore]:
    m = Master()
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MIB, 16 * MIB, "tcp", "", m.address) == 0
        yield s
    finally:
        s.close()
        m.stop()


def _data(n: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "batch": {
            "ids": torch.randint(0, 1000, (n, 9), generator=g),
            "lp": torch.randn(n, 70_000, generator=g).to(torch.bfloat16),
            "mask": torch.rand(n, 5, generator=g) > 0.5,
        },
        "non_tensor_batch": {
            "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
            "score": np.array([i / 4 for i in range(n)], dtype=object),
            "extra": np.array([{"k": i, "v": [i, "x"]} for i in range(n)], dtype=object),
            "turns": np.array([list(range(i)) for i in range(n)], dtype=object),
            "intkeys": np.array([{i: b"v"} for i in range(n)], dtype=object),
            "raw": np.array([b"z" * i if i % 2 else None for i in range(n)], dtype=object),
            "ints": np.arange(n, dtype=np.int16),
        },
        "meta_info": {"step": 4},
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got["batch"]) == set(want["batch"])
    for k, v in want["batch"].items():
        assert got["batch"][k].dtype == v.dtype and torch.equal(got["batch"][k], v), k
    assert set(got["non_tensor_batch"]) == set(want["non_tensor_batch"])
    for k, v in want["non_tensor_batch"].items():
        g = got["non_tensor_batch"][k]
        if v.dtype == object:
            assert g.dtype == object and list(g) == list(v), k
        else:
            assert g.dtype == v.dtype and np.array_equal(g, v), k


def test_dataproto_round_trip_through_an_exported_handle(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store, default_chunk_bytes=64 * 1024)
    data = _data()
    ref = t.put_dataproto(data)
    handle = json.loads(json.dumps(export_ref(ref)))
    got = t.get_dataproto(import_ref(handle))
    _same(got, data)
    assert got["meta_info"] == {"step": 4}
    view = t.dataproto_manifest_view(handle)
    assert view["non_tensor_fields"]["uid"]["spec"]["codec"] == "utf8_ragged"
    # dict rows: msgpack with the compiled package, else JSON when it holds them exactly
    dict_codec = "msgpack_ragged" if msgpack_lite.NATIVE is not None else "json_ragged"
    assert view["non_tensor_fields"]["extra"]["spec"]["codec"] == dict_codec
    assert view["non_tensor_fields"]["intkeys"]["spec"]["codec"] == "msgpack_ragged"
    t.cleanup_dataproto(ref)
    assert store.is_exist(ref.stage_refs["default"].manifest_key) == 0


def test_rows_slices_and_indices(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store)
    data = _data()
    ref = t.put_dataproto(data)
    fields = ["lp", "ids", "uid", "extra", "ints"]
    part = t.get_dataproto(ref, rows=slice(1, 7, 2), fields=fields)
    assert torch.equal(part["batch"]["lp"], data["batch"]["lp"][1:7:2])
    assert list(part["non_tensor_batch"]["uid"]) == ["u1", "u3", "u5"]
    assert np.array_equal(part["non_tensor_batch"]["ints"], data["non_tensor_batch"]["ints"][1:7:2])
    picked = t.get_dataproto(ref, rows=[6, 0, -1], fields=fields)
    assert torch.equal(picked["batch"]["ids"], data["batch"]["ids"][[6, 0, 7]])
    assert list(picked["non_tensor_batch"]["extra"]) == [
        data["non_tensor_batch"]["extra"][i] for i in (6, 0, 7)
    ]
    with pytest.raises(IndexError):
        t.get_dataproto(ref, rows=[8])
    with pytest.raises(KeyError):
        t.get_dataproto(ref, fields=["nope"])
    t.cleanup_dataproto(ref)


def test_row_indices_into_destinations(store: MooncakeDistributedStore) -> None:
    """Rows picked by index land in the caller's ndarray, tensor, raw memory or tensor object
    buffer; a destination of the wrong shape is refused by name."""
    from mooncake.store import _deserialize_tensor

    t = MooncakeBundleTransfer(store, default_chunk_bytes=100)  # rows span several chunks
    arr = np.arange(12 * 7, dtype=np.int64).reshape(12, 7)
    ten = torch.randn(12, 3, generator=torch.Generator().manual_seed(3))
    ref = t.put_dataproto({"batch": {"arr": arr, "ten": ten}, "non_tensor_batch": {}})
    rows = [11, 3, 3, 0]
    into = np.empty((4, 7), dtype=np.int64)
    tdest = torch.empty(4, 3)
    got = t.get_dataproto(ref, rows=rows, destinations={"arr": into, "ten": tdest})
    assert got["batch"]["arr"] is into and np.array_equal(into, arr[rows])
    assert got["batch"]["ten"] is tdest and torch.equal(tdest, ten[rows])
    raw = np.zeros(4 * 7 * 8, dtype=np.uint8)
    got = t.get_dataproto(
        ref,
        batch_fields=["arr"],
        rows=rows,
        destinations={"arr": raw_destination(int(raw.ctypes.data), raw.nbytes, raw)},
    )
    assert np.array_equal(raw.view(np.int64).reshape(4, 7), arr[rows])
    assert np.array_equal(got["batch"]["arr"], arr[rows])
    blob = np.zeros(4096, dtype=np.uint8)
    buf = tensor_object_buffer(int(blob.ctypes.data), blob.nbytes, blob)
    got = t.get_dataproto(ref, batch_fields=["ten"], rows=rows, destinations={"ten": buf})
    assert got["batch"]["ten"] is buf
    assert torch.equal(_deserialize_tensor(blob.tobytes()[: 304 + 4 * 3 * 4]), ten[rows])
    with pytest.raises(ValueError, match="arr destination shape mismatch"):
        t.get_dataproto(ref, rows=[0, 1, 2], destinations={"arr": np.empty((2, 7), np.int64)})
    t.cleanup_dataproto(ref)


def test_append_keeps_the_old_handle_and_cleanup_of_the_append(
    store: MooncakeDistributedStore,
) -> None:
    t = MooncakeBundleTransfer(store)
    data = _data(4)
    ref = t.put_dataproto(data)
    adv = torch.randn(4, 3)
    ref2 = t.append_dataproto_fields(ref, {"batch": {"adv": adv}}, stage="default")
    ref3 = t.append_dataproto_fields(
        ref2, {"non_tensor_batch": {"tag": np.array(list("abcd"), dtype=object)}}, stage="s2"
    )
    got = t.get_dataproto(ref3, fields=["adv", "ids", "tag"])
    assert torch.equal(got["batch"]["adv"], adv) and torch.equal(
        got["batch"]["ids"], data["batch"]["ids"]
    )
    assert list(got["non_tensor_batch"]["tag"]) == list("abcd")
    with pytest.raises(ValueError, match="already exist"):
        t.append_dataproto_fields(ref3, {"batch": {"adv": adv}}, stage="default")
    t.cleanup_dataproto_append(ref, ref2)
    assert store.is_exist(ref2.stage_refs["default"].manifest_key) == 0
    _same(t.get_dataproto(ref), data)  # the previous handle still reads
    t.cleanup_dataproto(ref3)
    t.cleanup_dataproto(ref)


def test_flat_dict_and_objects(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store)
    ref = t.put(
        {"x": torch.arange(6).reshape(3, 2), "names": ["a", None, "c"], "lr": 0.5}, type="dict"
    )
    got = t.get(ref, type="dict")
    assert torch.equal(got["x"], torch.arange(6).reshape(3, 2))
    assert got["names"] == ["a", None, "c"] and got["lr"] == 0.5
    for value in (
        torch.arange(5, dtype=torch.float64),
        torch.tensor(3.5),
        np.arange(12).reshape(3, 4),
    ):
        obj = t.get_object(t.put_object(value))
        assert (
            torch.equal(obj, value)
            if isinstance(value, torch.Tensor)
            else np.array_equal(obj, value)
        )
    mapping = t.get_object(t.put_object({"a": b"bytes!", "b": np.ones(3, np.float32)}))
    assert mapping["a"] == b"bytes!" and np.array_equal(mapping["b"], np.ones(3, np.float32))


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_bytes_member_reads_back_as_bytes(store: MooncakeDistributedStore, chunk: Any) -> None:
    """A bytes-like member (``bytes``, ``bytearray``, ``memoryview``, empty) is read back as
    ``bytes`` with the same content, whole and chunked, through the real store and a plain one."""
    members = {
        "b": b"payload",
        "ba": bytearray(b"\x00\xffab"),
        "mv": memoryview(b"0123456789"),
        "empty": b"",
    }
    for backend in (store, _DictStore()):
        t = MooncakeBundleTransfer(backend, default_chunk_bytes=chunk or 64 * MIB)
        ref = t.put_structured_object(StructuredObjectPayload({"k": 1}, dict(members)))
        got = t.materialize(t.read_spec(ref)).objects
        for name, value in members.items():
            assert type(got[name]) is bytes and got[name] == bytes(value), (backend, name)
        t.remove_bundle(ref)


def test_materialize_into_destinations_and_slices(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store, default_chunk_bytes=1000)  # chunked payloads
    arr = np.arange(4000, dtype=np.float32).reshape(400, 10)
    ref = t.put_structured_object(
        StructuredObjectPayload({"k": 1}, {"a": arr, "t": torch.arange(400.0)})
    )
    dest = np.zeros_like(arr)
    res = t.materialize_into(t.read_spec(ref), {"a": dest})
    assert res.objects["a"] is dest and np.array_equal(dest, arr) and res.metadata["k"] == 1
    raw = np.zeros(arr.nbytes, np.uint8)
    spec = t.read_spec(ref).select_members(["a"])
    t.materialize_into(spec, {"a": raw_destination(int(raw.ctypes.data), raw.nbytes, raw)})
    assert np.array_equal(raw.view(np.float32).reshape(400, 10), arr)
    # a tensor read into a tensor object buffer answers the tensor viewing that memory
    blob = np.zeros(int(ref.manifest["buffers"]["t"]["bytes"]), np.uint8)
    spec = t.read_spec(ref).select_members(["t"])
    buf = tensor_object_buffer(int(blob.ctypes.data), blob.nbytes, blob, batch_size=400)
    view = t.materialize_into(spec, {"t": buf}).objects["t"]
    assert torch.equal(view, torch.arange(400.0)) and view.data_ptr() == blob.ctypes.data + 304
    sl = t.materialize(
        t.read_spec(ref).slice_member("a", 0, 33, 390, 7).slice_member("t", 0, 5, 260)
    )
    assert np.array_equal(sl.objects["a"], arr[33:390:7])
    assert torch.equal(sl.objects["t"], torch.arange(400.0)[5:260])
    with pytest.raises(ValueError, match="selected no members"):
        t.materialize(t.read_spec(ref).select_members([]))
    t.remove_bundle(ref)
    assert store.is_exist(ref.manifest_key) == 0


def test_schemas_handles_and_policies(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store)
    vals = np.array(['{"a": 1}', None, "x"], dtype=object)
    ref = t.put_dataproto(
        {"non_tensor_batch": {"j": vals, "n": np.array([1, 2, 3], dtype=object)}},
        field_schemas={
            "j": FieldSchema("utf8_ragged"),
            "n": FieldSchema("ndarray", metadata={"dtype": "float32"}),
        },
    )
    assert ref.encoded_non_tensor["n"]["metadata"]["dtype"] == "float32"
    got = t.get_dataproto(ref)["non_tensor_batch"]
    assert list(got["j"]) == list(vals) and list(got["n"]) == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="not nullable"):
        t.put_dataproto(
            {"non_tensor_batch": {"j": vals}},
            field_schemas={"j": FieldSchema("utf8_ragged", nullable=False)},
        )
    handle = export_ref(ref)
    for bad in (
        {**handle, "version": 9},
        {**handle, "kind": "x"},
        {**handle, "field_index": {"j": {"stage": "zz", "member": "m", "section": "batch"}}},
    ):
        with pytest.raises(ValueError):
            import_ref(bad)
    from mooncake.structured_object_store import BundleTransferPolicy

    with pytest.raises(ValueError, match="max_inflight_put"):
        t.put_object(np.ones(2), policy=BundleTransferPolicy(max_inflight_put=0))
    entry = dict(ref.encoded_non_tensor["j"], codec="no_such_codec")
    ref.encoded_non_tensor["j"] = entry
    with pytest.raises(ValueError, match="unknown structured non-tensor codec"):
        t.get_dataproto(ref)
    t.cleanup_dataproto(ref)


def test_rollout_dict_with_schemas_as_miles_puts_it(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store, key_prefix="miles-object-store")
    value = {
        "tokens": [
            torch.tensor([1, 2, 3], dtype=torch.int32),
            torch.tensor([4, 5], dtype=torch.int32),
        ],
        "rewards": [0.5, 1.0],
        "response_lengths": [3, 2],
        "prompt": [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}],
        "mm": [{"pixel_values": torch.ones(2, 3), "grid": torch.tensor([1, 2, 2])}, None],
        "note": "run-7",
    }
    schemas = {
        "tokens": FieldSchema(
            "typed_ragged", nullable=False, metadata={"section": "non_tensor_batch"}
        ),
        "rewards": FieldSchema(
            "ndarray", nullable=False, metadata={"section": "non_tensor_batch", "dtype": "float32"}
        ),
        "response_lengths": FieldSchema(
            "ndarray", nullable=False, metadata={"section": "non_tensor_batch", "dtype": "int64"}
        ),
        "prompt": FieldSchema(
            "msgpack_ragged", nullable=False, metadata={"section": "non_tensor_batch"}
        ),
        "mm": FieldSchema("ragged_tensor_dict", metadata={"section": "non_tensor_batch"}),
    }
    ref = t.put(value, type="dict", namespace="miles", stage="rollout", field_schemas=schemas)
    assert ref.encoded_non_tensor["mm"]["codec"] == "ragged_tensor_dict"
    got = t.get(import_ref(export_ref(ref)), type="dict")
    assert got["tokens"] == [[1, 2, 3], [4, 5]]
    assert got["rewards"] == [0.5, 1.0] and got["response_lengths"] == [3, 2]
    assert got["prompt"] == value["prompt"] and got["note"] == "run-7"
    assert got["mm"][1] is None and torch.equal(got["mm"][0]["pixel_values"], torch.ones(2, 3))
    assert torch.equal(got["mm"][0]["grid"], torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="not declared"):
        t.put(
            {"mm": value["mm"]},
            type="dict",
            field_schemas={
                "mm": FieldSchema(
                    "ragged_tensor_dict", metadata={"section": "non_tensor_batch", "keys": ["grid"]}
                )
            },
        )
    t.cleanup_dataproto(ref)


class _DictStore:
    """The published ``BundleStore`` protocol and nothing more: put/get/remove/is_exist."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put(self, key: str, value: Any, config: Any = None) -> int:
        self.objects[key] = bytes(value)
        return 0

    def get(self, key: str) -> bytes:
        return self.objects.get(key, b"")

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.objects.pop(key, None) is not None else -704

    def is_exist(self, key: str) -> int:
        return int(key in self.objects)


def test_any_store_with_put_and_get_works() -> None:
    store = _DictStore()
    t = MooncakeBundleTransfer(store, default_chunk_bytes=16)
    data = _data(4)
    ref = t.put_dataproto(data)
    assert any("/chunk/" in k for k in store.objects)  # chunked through plain puts
    _same(t.get_dataproto(ref), data)
    part = t.get_dataproto(ref, rows=slice(1, 3), fields=["lp"])
    assert torch.equal(part["batch"]["lp"], data["batch"]["lp"][1:3])
    t.cleanup_dataproto(ref)
    assert store.objects == {}


class _PublishedCallsStore:
    """A real store showing only the calls the published module moves bytes with (no
    ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``); counts them."""

    CALLS = (
        "put",
        "get",
        "remove",
        "batch_remove",
        "is_exist",
        "put_tensor",
        "pub_tensor",
        "put_from",
        "get_tensor",
        "batch_get_into",
        "get_into_ranges",
        "register_buffer",
        "unregister_buffer",
    )

    def __init__(self, store: MooncakeDistributedStore) -> None:
        self._store = store
        self.calls: dict[str, int] = dict.fromkeys(self.CALLS, 0)

    def __getattr__(self, name: str) -> Any:
        if name not in self.CALLS:
            raise AttributeError(name)
        fn = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


def test_a_store_without_multi_buffer_calls_uses_the_published_calls_and_formats(
    store: MooncakeDistributedStore,
) -> None:
    """Tensors go through ``put_tensor``/``pub_tensor`` and back through ``get_tensor``,
    other payloads are read by ``batch_get_into`` and slices by ``get_into_ranges``; what is
    written either way reads back the other way (the same keys and bytes on the store)."""
    from mooncake.store import ReplicateConfig

    narrow = _PublishedCallsStore(store)
    slow = MooncakeBundleTransfer(narrow, default_chunk_bytes=64 * 1024)
    fast = MooncakeBundleTransfer(store, default_chunk_bytes=64 * 1024)
    data = _data()
    ref = slow.put_dataproto(data)  # a DataProto's keys share one storage group
    assert (narrow.calls["pub_tensor"], narrow.calls["put_tensor"]) == (len(data["batch"]), 0)
    stage = ref.stage_refs["default"]
    assert _decode_manifest(store.get(stage.manifest_key)) == stage.manifest
    spec = stage.manifest["buffers"]["batch.lp"]
    assert spec["kind"] == "tensor"
    assert torch.equal(store.get_tensor(spec["key"]), data["batch"]["lp"])  # a tensor object
    _same(fast.get_dataproto(ref), data)
    _same(slow.get_dataproto(ref), data)
    assert narrow.calls["get_tensor"] == len(data["batch"])
    assert narrow.calls["batch_get_into"] > 0
    part = slow.get_dataproto(ref, rows=slice(2, 5), fields=["lp"])
    assert torch.equal(part["batch"]["lp"], data["batch"]["lp"][2:5])
    assert narrow.calls["get_into_ranges"] > 0
    slow.cleanup_dataproto(ref)

    back = fast.put_dataproto(data)  # the batched fast path, read the published way
    _same(slow.get_dataproto(back), data)
    fast.cleanup_dataproto(back)

    config = ReplicateConfig()
    config.group_ids = ["g-published-calls"]
    grouped = slow.put_dataproto(data, config=config)
    assert narrow.calls["pub_tensor"] == 2 * len(data["batch"])
    _same(fast.get_dataproto(grouped), data)
    slow.cleanup_dataproto(grouped)
    assert store.is_exist(grouped.stage_refs["default"].manifest_key) == 0

    tensor = data["batch"]["ids"]
    obj = slow.put_object({"t": tensor, "a": np.arange(5)})  # ungrouped: put_tensor
    assert narrow.calls["put_tensor"] == 1
    got = fast.get_object(obj)
    assert torch.equal(got["t"], tensor) and np.array_equal(got["a"], np.arange(5))
    slow.remove_bundle(obj)


def test_a_store_without_multi_buffer_calls_writes_tensor_object_buffers_by_put_from(
    store: MooncakeDistributedStore,
) -> None:
    from mooncake.structured_object_store import BundleTransferPolicy

    narrow = _PublishedCallsStore(store)
    slow = MooncakeBundleTransfer(narrow)
    source = np.frombuffer(b"tensor-object-payload", dtype=np.uint8).copy()
    ptr = int(source.ctypes.data)
    assert store.register_buffer(ptr, source.nbytes) == 0
    try:
        ref = slow.put_structured_object(
            StructuredObjectPayload(
                buffers={"t": tensor_object_buffer(ptr, source.nbytes, source, batch_size=1)}
            ),
            policy=BundleTransferPolicy(copy_mode="zero_copy"),
        )
    finally:
        store.unregister_buffer(ptr)
    spec = ref.manifest["buffers"]["t"]
    assert narrow.calls["put_from"] == 1
    assert spec["chunks"] == [{"key": spec["key"], "bytes": source.nbytes}]
    assert store.get(spec["key"]) == source.tobytes()
    dest = np.zeros(source.nbytes, dtype=np.uint8)
    slow.materialize_into(
        slow.read_spec(ref),
        {"t": tensor_object_buffer(int(dest.ctypes.data), dest.nbytes, dest, batch_size=1)},
    )
    assert narrow.calls["get_into_ranges"] == 1
    assert dest.tobytes() == source.tobytes()
    slow.remove_bundle(ref)


class _FailingManifestPut:
    """A store whose plain ``put`` (the manifest write) fails; the rest is the real store."""

    def __init__(self, real: MooncakeDistributedStore) -> None:
        self.real = real
        self.keys: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def batch_put_from_multi_buffers(self, keys: list[str], *a: Any, **k: Any) -> list[int]:
        self.keys.extend(keys)
        out: list[int] = self.real.batch_put_from_multi_buffers(keys, *a, **k)
        return out

    def put(self, key: str, value: Any, config: Any = None) -> int:
        return -1


def test_jagged_nested_tensor_members(store: MooncakeDistributedStore) -> None:
    """A jagged nested tensor in ``batch`` round-trips (whole, sliced, picked, no rows) in the
    published ``tensor_parts`` format, 1-D and 2-D rows (``_ragged_idx`` kept); a strided one
    is refused by name."""
    rows = [torch.arange(2), torch.arange(10, 14), torch.arange(20, 21)]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    t = MooncakeBundleTransfer(store, default_chunk_bytes=256)  # payload over several chunks
    ref = t.put_dataproto({"batch": {"tokens": nested}, "non_tensor_batch": {}})
    spec = t.dataproto_manifest_view(ref)["batch_fields"]["tokens"]["spec"]
    assert spec["nested"] is True and spec["format"] == "tensor_parts"
    assert len(spec["part_bytes"]) == 2 and spec["dtype"] == "torch.int64"
    for sel, want in (
        (None, rows),
        (slice(1, 3), rows[1:3]),
        ([2, 0], [rows[2], rows[0]]),
        ([], []),
    ):
        got = t.get_dataproto(ref, rows=sel)["batch"]["tokens"]
        assert got.is_nested and got.layout == torch.jagged and len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want, strict=True))
    m_rows = [torch.arange(6).reshape(2, 3), torch.arange(10).reshape(2, 5)]
    m = torch.nested.as_nested_tensor(m_rows, layout=torch.jagged)
    mref = t.put_dataproto({"batch": {"pos": m}, "non_tensor_batch": {}})
    got = t.get_dataproto(mref)["batch"]["pos"]
    assert got._ragged_idx == 2
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), m_rows, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
        strided = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"torch\.jagged layout"):
        t.put_structured_object(StructuredObjectPayload({}, {"s": strided}))
    t.cleanup_dataproto(ref)
    t.cleanup_dataproto(mref)


def test_zero_dimensional_arrays_keep_their_shape() -> None:
    """A 0-d ndarray member and 0-d rows of a typed_ragged column read back 0-d (not (1,)),
    whole and picked by row; such a column (0-d beside 1-D rows) keeps the general layout."""
    t = MooncakeBundleTransfer(_DictStore())
    obj = t.get_object(t.put_object(np.asarray(2.5, dtype=np.float32)))
    assert obj.shape == () and obj.dtype == np.float32 and float(obj) == 2.5
    rows = [np.asarray(7, np.int32), np.arange(3, dtype=np.int32), None, np.asarray(1, np.int32)]
    schema = {"v": FieldSchema(codec="typed_ragged", metadata={"section": "non_tensor_batch"})}
    ref = t.put({"v": rows}, field_schemas=schema, type="dict")
    assert "physical_layout" not in ref.encoded_non_tensor["v"]["metadata"]
    got = t.get(ref, type="dict")["v"]
    assert [None if r is None else (r.shape, r.tolist()) for r in got] == [
        ((), 7),
        ((3,), [0, 1, 2]),
        None,
        ((), 1),
    ]
    picked = t.get_dataproto(ref, non_tensor_fields=["v"], rows=[3, 0])["non_tensor_batch"]["v"]
    assert [r.shape for r in picked] == [(), ()]


@pytest.mark.parametrize("fail_on", [1, 2, 3, 4])
def test_a_raising_plain_put_leaves_no_keys(fail_on: int) -> None:
    """A store whose ``put`` raises part way (chunked payload, metadata or manifest write)
    keeps nothing of the bundle: the keys written before are removed, the error propagates."""

    class Raising(_DictStore):
        calls = 0

        def put(self, key: str, value: Any, config: Any = None) -> int:
            self.calls += 1
            if self.calls == fail_on:
                raise RuntimeError("injected put failure")
            return super().put(key, value, config)

    store = Raising()
    t = MooncakeBundleTransfer(store)
    with pytest.raises(RuntimeError, match="injected put failure"):
        t.put_bundle(b"meta", {"payload": b"data"}, chunk_bytes=2)
    assert store.objects == {}


def test_zero_copy_puts_only_tensor_object_buffers() -> None:
    """``copy_mode="zero_copy"`` takes tensor-object buffers (and empty members) only; a plain
    tensor is a ValueError, other members a RuntimeError, both before anything is written."""
    from mooncake.structured_object_store import BundleTransferPolicy

    store = _DictStore()
    t = MooncakeBundleTransfer(store)
    zero = BundleTransferPolicy(copy_mode="zero_copy")
    with pytest.raises(ValueError, match=r"BufferPool tensor-object buffer.*'t'"):
        t.put_structured_object(StructuredObjectPayload({}, {"t": torch.ones(3)}), policy=zero)
    with pytest.raises(RuntimeError, match=r"zero-copy put requires tensor-object buffers.*'b'"):
        t.put_structured_object(StructuredObjectPayload({}, {"b": b"data"}), policy=zero)
    rows = np.empty(2, dtype=object)
    rows[:] = [np.arange(2, dtype=np.int32), np.arange(1, dtype=np.int32)]
    with pytest.raises(RuntimeError, match="zero-copy put"):
        t.put_dataproto({"non_tensor_batch": {"tokens": rows}}, policy=zero)
    assert store.objects == {}
    blob = np.frombuffer(b"\x07" * 16, dtype=np.uint8).copy()
    buf = tensor_object_buffer(int(blob.ctypes.data), blob.nbytes, blob)
    ref = t.put_bundle(b"m", {"raw": buf, "empty": b""}, policy=zero)
    assert store.objects[ref.manifest["buffers"]["raw"]["key"]] == b"\x07" * 16
    t.remove_bundle(ref)


def test_a_failed_put_leaves_no_keys(store: MooncakeDistributedStore) -> None:
    wrapper = _FailingManifestPut(store)
    t = MooncakeBundleTransfer(wrapper)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="manifest"):
        t.put_dataproto(_data(2))
    assert wrapper.keys and all(store.is_exist(k) == 0 for k in wrapper.keys)


def test_msgpack_subset_matches_known_bytes() -> None:
    saved = msgpack_lite._msgpack
    msgpack_lite._msgpack = None
    try:
        cases: list[tuple[Any, bytes]] = [
            (None, b"\xc0"),
            (True, b"\xc3"),
            (1, b"\x01"),
            (-1, b"\xff"),
            (300, b"\xcd\x01\x2c"),
            (-200, b"\xd1\xff\x38"),
            (1.5, b"\xcb\x3f\xf8" + b"\x00" * 6),
            ("é", b"\xa2\xc3\xa9"),
        ]
        for value, packed in cases:
            assert msgpack_lite.packb(value) == packed
        assert msgpack_lite.packb({"a": [1, b"x"]}) == b"\x81\xa1a\x92\x01\xc4\x01x"
        big = {"s" * 40: list(range(20)), "n": -(2**40), "u": 2**40}
        assert msgpack_lite.unpack_all(msgpack_lite.packb(big) + msgpack_lite.packb("z" * 300)) == [
            big,
            "z" * 300,
        ]
        with pytest.raises(TypeError):
            msgpack_lite.packb((1, 2))
    finally:
        msgpack_lite._msgpack = saved


# -- against the published module ------------------------------------------------------------

ANCHOR = anchor_python()


def _run(python: str, env: dict[str, str], mode: str, folder: Path, cwd: str) -> dict[str, Any]:
    res = subprocess.run(
        [python, str(DRIVER), mode, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.anchor
@pytest.mark.skipif(
    ANCHOR is None, reason="published Mooncake wheel not installed (run scripts/setup-anchor.sh)"
)
def test_published_and_ours_read_each_others_bundles(tmp_path: Path) -> None:
    assert ANCHOR is not None
    probe = subprocess.run(
        [ANCHOR, "-c", "import torch, mooncake.structured_object_store"],
        capture_output=True,
        cwd="/",
    )
    if probe.returncode:
        pytest.skip("torch or structured_object_store missing in the published venv")
    published = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    published.update(MC_STRUCTURED_PUBLISHED="1", MC_LOG_LEVEL="ERROR")
    ours = dict(os.environ, PYTHONPATH=str(ROOT))
    for writer, reader in (
        ((ANCHOR, published, "/"), (sys.executable, ours, str(ROOT))),
        ((sys.executable, ours, str(ROOT)), (ANCHOR, published, "/")),
    ):
        folder = tmp_path / ("from-published" if writer[1] is published else "from-ours")
        wrote = _run(writer[0], writer[1], "write", folder, writer[2])
        read = _run(reader[0], reader[1], "read", folder, reader[2])
        assert wrote["keys"] > 10
        assert read["full"] == wrote["full"]
        assert read["sliced"] is True and read["picked"] is True
