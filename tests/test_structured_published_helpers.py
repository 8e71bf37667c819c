"""The published ``structured_object_store`` private helpers this package provides (payload
members, typed-ragged and msgpack-ragged codecs, ``_bundle_store``, the pooled write and the
``torch_save`` fallback), on a real master and store client where a store is involved."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mooncake.structured_object_store as sos  # noqa: E402
from mooncake.buffer_pool import BufferPool  # noqa: E402
from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402
from mooncake.structured_object_store import (  # noqa: E402
    FieldSchema,
    MooncakeBundleTransfer,
    StructuredObjectPayload,
)
from tests.helpers.store_procs import Master  # noqa: E402

MIB = 1 << 20


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


def _data_of(payload: dict[str, Any], dtype: Any) -> np.ndarray:
    data = payload["data"]
    bufs = data.arrays if isinstance(data, sos._DirectCopyPayload) else data.buffers
    flat = [
        b.reshape(-1).view(dtype) if isinstance(b, np.ndarray) else np.frombuffer(b, dtype=dtype)
        for b in bufs
    ]
    return np.concatenate(flat) if flat else np.empty(0, dtype=dtype)


def test_typed_ragged_helpers_round_trip_as_views() -> None:
    regular = [np.arange(6, dtype=np.int32).reshape(2, 3) + 10 * i for i in range(3)]
    assert sos._encode_typed_ragged_regular_ndarray_rows(regular, np.dtype(np.int32)) is not None
    for rows in (
        regular,
        [regular[0]],
        [regular[0], None, regular[1]],
        [np.arange(2, dtype=np.int32), np.arange(3, dtype=np.int32)],
    ):
        payload, meta = sos._encode_typed_ragged_values(rows, np.int32)
        assert meta["physical_layout"] == "contiguous_flat" and meta["row_format"] == "ndarray"
        data = _data_of(payload, np.int32)
        got = sos._decode_typed_ragged_values({**payload, "data": data}, len(rows), meta)
        for g, r in zip(got, rows, strict=True):
            assert (g is None) == (r is None)
            if r is not None:
                assert np.shares_memory(g, data) and g.tolist() == r.tolist()
    lists = [[1, 2], None, [3]]
    payload, meta = sos._encode_typed_ragged_values(lists)
    assert meta["row_format"] == "list" and meta["dtype"] == "int64"
    data = _data_of(payload, np.int64)
    assert sos._decode_typed_ragged_values({**payload, "data": data}, 3, meta) == lists
    with pytest.raises(ValueError, match="non-object dtype"):
        sos._encode_typed_ragged_values([np.asarray([object()])], np.dtype(object))


def test_msgpack_ragged_helpers_check_their_members() -> None:
    rows = [{"a": 1}, None, [1, "x", b"y"]]
    payload, meta = sos._encode_msgpack_ragged_values("f", rows)
    assert (
        meta == {}
        and payload["offsets"].tolist()[0] == 0
        and payload["nulls"].tolist()
        == [
            False,
            True,
            False,
        ]
    )
    assert sos._decode_msgpack_ragged_values(payload, 3) == rows
    with pytest.raises(ValueError, match="offsets length"):
        sos._decode_msgpack_ragged_values(payload, 2)
    short = {**payload, "data": bytes(payload["data"])[:1]}
    with pytest.raises(ValueError, match="msgpack_ragged"):
        sos._decode_msgpack_ragged_values(short, 3)
    with pytest.raises(ValueError, match="msgpack codec cannot encode value"):
        sos._encode_msgpack_ragged_values("f", [object()])
    with pytest.raises(ValueError, match="unable to infer a safe codec"):
        sos._encode_with_schema(
            "f", np.asarray([object(), None], dtype=object), FieldSchema(codec="auto")
        )
    leaf = sos._encode_with_schema("f", np.arange(3, dtype=np.int16), FieldSchema(codec="auto"))
    assert leaf.codec == "ndarray" and leaf.rows == 3


def test_a_non_str_utf8_value_is_a_type_and_attribute_error(
    store: MooncakeDistributedStore,
) -> None:
    t = MooncakeBundleTransfer(store)
    data = {"non_tensor_batch": {"text": np.asarray([b"x"], dtype=object)}}
    for kind in (TypeError, AttributeError):
        with pytest.raises(kind, match=r"failed to encode.*'text'.*utf8_ragged"):
            t.put_dataproto(data, field_schemas={"text": FieldSchema(codec="utf8_ragged")})


def test_payload_members_are_written_from_their_buffers(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store, default_chunk_bytes=8)
    arrays = [np.arange(3, dtype=np.int32), np.arange(3, 5, dtype=np.int32)]
    parts = [bytearray(b"ab"), bytearray(b"cde")]
    ref = t.put_structured_object(
        StructuredObjectPayload(
            metadata={"k": 1},
            buffers={
                "direct": sos._DirectCopyPayload.from_flat_arrays(arrays, np.int32, 5),
                "multi": sos._MultiBufferPayload(tuple(memoryview(p) for p in parts), tuple(parts)),
            },
        )
    )
    got = t.materialize(t.read_spec(ref)).objects
    assert got["direct"].tolist() == [0, 1, 2, 3, 4] and got["multi"] == b"abcde"
    t.remove_bundle(ref)
    bad = sos._MultiBufferPayload((memoryview(b"abc"),), dtype="<i4", shape=(1,))
    with pytest.raises(ValueError, match="holds 3 bytes"):
        t.put_structured_object(StructuredObjectPayload(metadata={}, buffers={"x": bad}))


class _BatchPutFromStore:
    """The real store showing the calls of a store without the multi-buffer calls, with
    ``batch_put_from``; records each ``batch_put_from`` call's keys and group ids and fails
    the call numbered ``fail_on`` (1-based; 0: none)."""

    CALLS = ("put", "get", "remove", "is_exist", "register_buffer", "unregister_buffer")

    def __init__(self, real: MooncakeDistributedStore, fail_on: int = 0) -> None:
        self.real = real
        self.fail_on = fail_on
        self.batches: list[tuple[list[str], Any]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in self.CALLS:
            raise AttributeError(name)
        return getattr(self.real, name)

    def batch_put_from(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        self.batches.append((list(keys), None if config is None else list(config.group_ids)))
        if len(self.batches) == self.fail_on:
            return [-1] * len(keys)
        if config is None:
            return list(self.real.batch_put_from(keys, ptrs, sizes))
        return list(self.real.batch_put_from(keys, ptrs, sizes, config))


def test_a_buffer_pool_stages_each_key_for_batch_put_from(store: MooncakeDistributedStore) -> None:
    narrow = _BatchPutFromStore(store)
    pool = BufferPool(store, alignment=4096)
    t = MooncakeBundleTransfer(narrow, default_chunk_bytes=16, buffer_pool=pool)
    config = ReplicateConfig()
    config.group_ids = ["g-pooled"]
    values = np.arange(10, dtype=np.int32)  # 40 bytes: three chunks of 16
    ref = t.put_structured_object(
        StructuredObjectPayload(metadata={"k": 1}, buffers={"v": values}), config=config
    )
    assert len(narrow.batches) >= 3 and all(len(keys) == 1 for keys, _ in narrow.batches)
    assert all(ids == ["g-pooled"] for _, ids in narrow.batches)
    assert MooncakeBundleTransfer(store).materialize(sos.StructuredObjectReadSpec(ref)).objects[
        "v"
    ].tolist() == list(range(10))
    t.remove_bundle(ref)

    failing = _BatchPutFromStore(store, fail_on=3)
    t = MooncakeBundleTransfer(failing, default_chunk_bytes=16, buffer_pool=pool)
    with pytest.raises(RuntimeError, match="batch_put_from failed"):
        t.put_structured_object(StructuredObjectPayload(metadata={}, buffers={"v": values}))
    written = [k for keys, _ in failing.batches for k in keys]
    assert written and all(store.is_exist(k) == 0 for k in written)
    pool.close()


def test_a_parallel_put_mode_stages_keys_at_once(store: MooncakeDistributedStore) -> None:
    narrow = _BatchPutFromStore(store)
    both_in = threading.Barrier(2, timeout=120)  # broken unless two puts overlap
    real_put = narrow.batch_put_from

    def overlapping(
        keys: list[str], ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        if len(narrow.batches) < 2:
            both_in.wait()
        return real_put(keys, ptrs, sizes, config)

    narrow.batch_put_from = overlapping  # type: ignore[method-assign]
    pool = BufferPool(store, alignment=4096)
    t = MooncakeBundleTransfer(narrow, default_chunk_bytes=16, buffer_pool=pool)
    values = np.arange(16, dtype=np.int32)  # four chunks
    parallel = sos.BundleTransferPolicy(max_inflight_put=4, put_mode="parallel")
    ref = t.put_structured_object(
        StructuredObjectPayload(metadata={}, buffers={"v": values}), policy=parallel
    )
    assert not both_in.broken and len(narrow.batches) >= 4
    got = t.materialize(t.read_spec(ref)).objects["v"]
    assert got.tolist() == list(range(16))
    t.remove_bundle(ref)
    pool.close()
    choose = t._transport._resolve_buffer_group_put_mode
    auto = sos.BundleTransferPolicy(max_inflight_put=8)
    assert choose([[b"x" * MIB]] * 128, auto) == "parallel"
    assert choose([[b"x" * MIB]] * 4, auto) == "batch"  # too few chunks
    assert choose([[b"x"]] * 128, auto) == "batch"  # too few bytes
    assert choose([[b"x"]], parallel) == "parallel"


def test_bundle_store_merges_stored_payloads_and_cleans_up(store: MooncakeDistributedStore) -> None:
    t = MooncakeBundleTransfer(store)
    old = t.put_structured_object(
        StructuredObjectPayload(metadata={"kind": "old"}, buffers={"a": np.arange(4)})
    )
    cleanup = [old.manifest_key, *t._bundle_store.payload_keys(old.manifest["meta"])]
    merged = t._bundle_store.put_bundle_manifest(
        b'{"kind":"merged"}',
        {"a": old.manifest["buffers"]["a"]},
        partition="default",
        chunk_bytes=None,
        policy=None,
        cleanup_keys=cleanup,
    )
    got = t.materialize(t.read_spec(merged))
    # the raw meta carries no field specs: the member reads back as its bytes
    assert got.metadata == {"kind": "merged"} and got.objects["a"] == np.arange(4).tobytes()
    assert old.manifest["object_id"] in merged.manifest["buffer_object_ids"]
    with pytest.raises(ValueError, match="outside the bundle namespace"):
        t._bundle_store.put_bundle_manifest(
            b"{}",
            {"x": {"key": "elsewhere/x", "bytes": 0, "chunks": []}},
            partition="default",
            chunk_bytes=None,
            policy=None,
        )
    t.remove_bundle(merged)
    keys = [*cleanup, merged.manifest_key, old.manifest["buffers"]["a"]["key"]]
    assert all(store.is_exist(k) == 0 for k in keys)


def test_without_tensor_helpers_tensors_are_torch_save_blobs(
    store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sos._has_tensor_codec_helpers()
    monkeypatch.setattr(sos, "_has_tensor_codec_helpers", lambda: False)
    t = MooncakeBundleTransfer(store)
    tensor = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ref = t.put_dataproto({"batch": {"t": tensor}})
    assert ref.stage_refs["default"].manifest["buffers"]["batch.t"]["format"] == "torch_save"
    for rows in (slice(1, 6, 2), [4, 1, 4], [-1, 0]):
        assert torch.equal(t.get_dataproto(ref, rows=rows)["batch"]["t"], tensor[rows])
    with pytest.raises(ValueError, match="does not support destinations"):
        t.get_dataproto(ref, rows=[1], destinations={"t": torch.empty(1, 4)})
    t.cleanup_dataproto(ref)
