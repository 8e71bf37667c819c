"""A put right after a force-remove of what was just read gets the space back (real master and
client): the master holds a removed version's space while its read window is open, so it waits
for that space instead of answering ``NO_AVAILABLE_HANDLE``, as Mooncake (which frees it at once)
never would; the put's object is then stored and stays."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_procs import Master

MIB = 1 << 20
#: each value's read window is 0.5 s + 10 ms/MiB (1.14 s): far longer than get -> remove -> put
VALUE = 64 * MIB
#: room for one value, not two
SEGMENT = 100 * MIB


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    m = Master("--client-ttl", "60")
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", SEGMENT, 80 * MIB, "tcp", "", m.address) == 0
        yield s
    finally:
        s.close()
        m.stop()


def _value(i: int, n: int) -> bytes:
    return np.full(n, i % 251, dtype=np.uint8).tobytes()


def test_put_after_reading_and_removing_gets_the_space(store: MooncakeDistributedStore) -> None:
    for i in range(4):
        key = f"k{i}"
        data = _value(i, VALUE)
        assert store.put(key, data) == 0, f"put {i}"
        assert store.get(key) == data
        assert store.remove(key, True) == 0
    # the last put's object is kept (the refused try's eviction run did not go on in the sweeps)
    assert store.put("last", _value(9, VALUE)) == 0
    time.sleep(0.3)  # several sweeps
    assert store.is_exist("last") == 1
    assert store.get("last") == _value(9, VALUE)


def test_batch_put_after_reading_and_removing_gets_the_space(
    store: MooncakeDistributedStore,
) -> None:
    half = VALUE // 2
    for i in range(3):
        keys = [f"b{i}a", f"b{i}b"]
        values = [_value(i, half), _value(i + 1, half)]
        assert store.put_batch(keys, values) == 0, f"batch {i}"
        assert store.get_batch(keys) == values
        assert store.remove_all(True) == 2
    assert store.is_exist("b2a") == 0


def test_held_space_does_not_make_the_watermark_evict(store: MooncakeDistributedStore) -> None:
    data = _value(1, VALUE)
    assert store.put("a", data) == 0
    assert store.get("a") == data
    assert store.remove("a", True) == 0  # 64 MiB held for the read window
    kept = _value(2, 30 * MIB)
    assert store.put("b", kept) == 0
    # 64 held + 30 + 5 MiB is over the 95 % watermark, but only counting the held bytes
    assert store.put("c", _value(3, 5 * MIB)) == 0
    assert store.is_exist("b") == 1
    assert store.get("b") == kept
