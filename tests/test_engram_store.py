"""``mooncake.store.EngramStore`` on a real master and store client, and the published
wheel's on its own master (same keys, same raw bytes, same lookups)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ErrorCode, InvalidArgumentError, StoreError
from mooncake.store import EngramStore, EngramStoreConfig, MooncakeDistributedStore
from mooncake.store._engram import EngramArgumentError, EngramStoreError
from tests.conftest import ROOT, anchor_python
from tests.helpers.store_procs import Master

MIB = 1 << 20
SIZES = [17, 19, 23, 29]
DIM = 8
_layers = itertools.count(os.getpid() * 1000)


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


def _config(sizes: list[int] = SIZES, dim: int = DIM) -> EngramStoreConfig:
    cfg = EngramStoreConfig()
    cfg.table_vocab_sizes = sizes
    cfg.embedding_dim = dim
    return cfg


def _tables(sizes: list[int] = SIZES, dim: int = DIM, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim), dtype=np.float32) for n in sizes]


@pytest.fixture
def layer(store: MooncakeDistributedStore) -> Iterator[EngramStore]:
    e = EngramStore(next(_layers), _config(), store)
    try:
        yield e
    finally:
        e.remove_from_store(force=True)


@pytest.fixture(scope="module")
def filled(store: MooncakeDistributedStore) -> Iterator[tuple[EngramStore, list[np.ndarray]]]:
    e = EngramStore(next(_layers), _config(), store)
    tables = _tables(seed=3)
    e.populate(tables)
    try:
        yield e, tables
    finally:
        e.remove_from_store(force=True)


def _expected(tables: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=2)


# -- config and construction ---------------------------------------------------------------


def test_config_defaults_types_and_copies() -> None:
    cfg = EngramStoreConfig()
    assert (cfg.table_vocab_sizes, cfg.embedding_dim) == ([1024], 64)
    with pytest.raises(TypeError, match="embedding_dim"):
        cfg.embedding_dim = "8"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="table_vocab_sizes"):
        cfg.table_vocab_sizes = [3, 2.5]  # type: ignore[list-item]
    cfg.table_vocab_sizes = (3, 4)
    cfg.table_vocab_sizes.append(9)  # a copy
    assert cfg.table_vocab_sizes == [3, 4]
    e = EngramStore(layer_id=7, config=cfg)
    cfg.table_vocab_sizes = [1]
    assert e.get_table_vocab_sizes() == [3, 4]  # the layout was copied at construction
    assert e.get_store_keys() == ["engram:l7:h0", "engram:l7:h1"]
    assert (e.get_num_heads(), e.get_embedding_dim()) == (2, 64)
    assert "table_vocab_sizes=[1]" in repr(cfg)


@pytest.mark.parametrize(
    ("sizes", "dim", "match"),
    [([], 4, "must not be empty"), ([3, 0], 4, "positive values"), ([3], 0, "embedding_dim")],
)
def test_bad_layouts_are_value_errors(sizes: list[int], dim: int, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        EngramStore(1, _config(sizes, dim))


def test_without_a_usable_store() -> None:
    with pytest.raises(EngramArgumentError, match="lacks") as info:
        EngramStore(1, _config(), store=object())
    assert isinstance(info.value, RuntimeError)
    e = EngramStore(1, _config())
    for call in (lambda: e.populate(_tables()), lambda: e.lookup([[[0, 0, 0, 0]]])):
        with pytest.raises(EngramStoreError, match="without a store"):
            call()
    with pytest.raises(RuntimeError, match="rc=-600") as rinfo:
        e.remove_from_store()
    assert isinstance(rinfo.value, StoreError) and rinfo.value.rc == ErrorCode.INVALID_PARAMS


# -- populate, lookup, remove ----------------------------------------------------------------


def test_tables_are_raw_float32_rows(
    store: MooncakeDistributedStore, filled: tuple[EngramStore, list[np.ndarray]]
) -> None:
    e, tables = filled
    for key, table in zip(e.get_store_keys(), tables, strict=True):
        assert store.get(key) == table.tobytes()


@settings(max_examples=25)
@given(data=st.data())
def test_lookup_returns_the_rows_asked_for(
    filled: tuple[EngramStore, list[np.ndarray]], data: st.DataObject
) -> None:
    e, tables = filled
    b = data.draw(st.integers(1, 3), label="B")
    n = data.draw(st.integers(1, 5), label="L")
    ids = np.stack(
        [
            np.asarray(
                data.draw(st.lists(st.integers(0, size - 1), min_size=b * n, max_size=b * n))
            ).reshape(b, n)
            for size in SIZES
        ],
        axis=2,
    )
    want = _expected(tables, ids)
    for form in (ids, ids.tolist(), ids.astype(np.int32), np.asfortranarray(ids)):
        got = e.lookup(form)
        assert got.dtype == np.float32 and got.shape == (b, n, len(SIZES), DIM)
        assert np.array_equal(got, want)


def test_populate_converts_to_contiguous_float32(
    store: MooncakeDistributedStore, layer: EngramStore
) -> None:
    tables = [t.astype(np.float64).T.copy().T for t in _tables(seed=5)]  # Fortran order f64
    layer.populate(tables)
    ids = np.asarray([[[16, 18, 22, 28], [0, 0, 0, 0]]])
    assert np.array_equal(layer.lookup(ids), _expected([t.astype(np.float32) for t in tables], ids))


def test_populate_is_create_only(store: MooncakeDistributedStore, layer: EngramStore) -> None:
    first = _tables(seed=1)
    layer.populate(first)
    with pytest.raises(EngramStoreError, match="exists") as info:
        layer.populate(_tables(seed=2))
    assert isinstance(info.value, RuntimeError)
    ids = np.zeros((1, 1, 4), dtype=np.int64)
    assert np.array_equal(layer.lookup(ids), _expected(first, ids))
    assert layer.remove_from_store(force=True) == 4  # (the lookup holds a lease)
    assert [store.is_exist(k) for k in layer.get_store_keys()] == [0, 0, 0, 0]
    assert layer.remove_from_store(force=True) == 0
    layer.populate(_tables(seed=2))  # the layer id is reusable after removal
    assert np.array_equal(layer.lookup(ids), _expected(_tables(seed=2), ids))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t[:-1], "size must match num_heads"),
        (lambda t: [t[0][:-1], *t[1:]], r"embedding_buffers\[0\] has shape \(16, 8\)"),
        (lambda t: [t[0].reshape(-1), *t[1:]], "expected"),
        (lambda t: [t[0].tolist(), *t[1:]], "must be a NumPy array"),
    ],
)
def test_bad_tables_write_nothing(
    store: MooncakeDistributedStore, layer: EngramStore, mutate: Any, match: str
) -> None:
    with pytest.raises(EngramArgumentError, match=match) as info:
        layer.populate(mutate(_tables()))
    assert isinstance(info.value, RuntimeError)
    assert [store.is_exist(k) for k in layer.get_store_keys()] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("row_ids", "match"),
    [
        ([], "must not be empty"),
        ([[]], "must not be empty"),
        (np.zeros((0, 2, 4), dtype=np.int64), "must not be empty"),
        (np.zeros((1, 1, 3), dtype=np.int64), r"num_heads \(3 != 4\)"),
        (np.zeros((2, 4), dtype=np.int64), r"shape \[B, L, H\]"),
        ([[[0, 1, 2]], [[0, 1, 2, 3]]], "nested list"),
        ([[[999, 1, 2, 3]]], r"row_ids\[0\]\[0\]\[0\] = 999 is outside head 0's table \[0, 17\)"),
        ([[[0, 1, 2, 3], [0, -1, 0, 0]]], r"row_ids\[0\]\[1\]\[1\] = -1"),
        ([[[0.0, 1.0, 2.0, 3.0]]], "integers"),
        ("abc", "nested list or array"),
    ],
)
def test_bad_row_ids(
    filled: tuple[EngramStore, list[np.ndarray]], row_ids: Any, match: str
) -> None:
    with pytest.raises(EngramArgumentError, match=match):
        filled[0].lookup(row_ids)


def test_lookup_of_missing_tables_fails(store: MooncakeDistributedStore) -> None:
    e = EngramStore(next(_layers), _config(), store)
    with pytest.raises(EngramStoreError, match="engram:l") as info:
        e.lookup([[[0, 1, 2, 3]]])
    assert info.value.rc == ErrorCode.OBJECT_NOT_FOUND


class _FailingPut:
    """The real store, except that ``batch_put_from`` writes every head but the last."""

    def __init__(self, real: MooncakeDistributedStore) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        codes = self._real.batch_put_from(keys[:-1], ptrs[:-1], sizes[:-1])
        return [*codes, int(ErrorCode.NO_AVAILABLE_HANDLE)]


def test_a_failed_populate_removes_what_it_wrote(store: MooncakeDistributedStore) -> None:
    e = EngramStore(next(_layers), _config(), _FailingPut(store))
    with pytest.raises(EngramStoreError, match="populate failed") as info:
        e.populate(_tables())
    assert info.value.rc == ErrorCode.NO_AVAILABLE_HANDLE
    assert [store.is_exist(k) for k in e.get_store_keys()] == [0, 0, 0, 0]


# -- against the published wheel -------------------------------------------------------------

ANCHOR = anchor_python()

_PUBLISHED = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import sidemaster
    from mooncake.store import EngramStore, EngramStoreConfig, MooncakeDistributedStore
    proc, rpc = sidemaster.start_master(True)
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                       f"127.0.0.1:{rpc}") == 0
        spec = json.loads(sys.argv[2])
        cfg = EngramStoreConfig()
        cfg.table_vocab_sizes = spec["sizes"]
        cfg.embedding_dim = spec["dim"]
        e = EngramStore(spec["layer"], cfg, s)
        rng = np.random.default_rng(spec["seed"])
        e.populate([rng.standard_normal((n, spec["dim"]), dtype=np.float32) for n in spec["sizes"]])
        out = {
            "keys": e.get_store_keys(),
            "raw": [hashlib.sha256(s.get(k)).hexdigest() for k in e.get_store_keys()],
            "lookup": hashlib.sha256(e.lookup(np.asarray(spec["ids"])).tobytes()).hexdigest(),
            "removed": e.remove_from_store(force=True),
        }
        s.close()
        print(json.dumps(out))
    finally:
        proc.kill()
        proc.wait()
    """
)


@pytest.mark.anchor
@pytest.mark.skipif(ANCHOR is None, reason="published Mooncake wheel not installed")
def test_same_keys_bytes_and_lookups_as_the_published_wheel(
    store: MooncakeDistributedStore,
) -> None:
    assert ANCHOR is not None
    layer = next(_layers)
    ids = [[[16, 0, 22, 3], [1, 18, 0, 28]], [[5, 5, 5, 5], [0, 0, 0, 0]]]
    spec = {"sizes": SIZES, "dim": DIM, "layer": layer, "seed": 11, "ids": ids}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MC_LOG_LEVEL"] = "ERROR"
    res = subprocess.run(
        [ANCHOR, "-c", _PUBLISHED, str(ROOT / "tests" / "helpers"), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    e = EngramStore(layer, _config(), store)
    rng = np.random.default_rng(11)
    e.populate([rng.standard_normal((n, DIM), dtype=np.float32) for n in SIZES])
    try:
        assert e.get_store_keys() == theirs["keys"]
        assert [hashlib.sha256(store.get(k)).hexdigest() for k in e.get_store_keys()] == theirs[
            "raw"
        ]
        assert hashlib.sha256(e.lookup(np.asarray(ids)).tobytes()).hexdigest() == theirs["lookup"]
    finally:
        assert e.remove_from_store(force=True) == theirs["removed"] == len(SIZES)
