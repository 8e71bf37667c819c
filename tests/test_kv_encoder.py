"""The KV event batch encoder's twins (``mooncake._fast._kvenc`` compiled and pure): each gives
the reference codec's bytes (:func:`mooncake._core.kv_events.encode_batch`) for every kind of
key, and each parses sequence hashes as the reference does; the event queue asks its producers
to publish a full or due batch."""

from __future__ import annotations

import importlib
import random
from types import ModuleType
from typing import Any

import pytest

from mooncake._core import kv_events as kv
from mooncake._fast import _kvenc_pure

try:
    _kvenc_c: ModuleType | None = importlib.import_module("mooncake._fast._kvenc")
except ImportError:
    _kvenc_c = None

TWINS = [
    pytest.param(_kvenc_pure, id="pure"),
    pytest.param(
        _kvenc_c,
        id="compiled",
        marks=pytest.mark.skipif(_kvenc_c is None, reason="extension not built"),
    ),
]

KEYS = [
    "k",
    "7",
    "0",
    "0xff",
    "0XAbC",
    "0x",
    "0x1g",
    "0x" + "0" * 40 + "1",  # leading zeros: still a u64
    "0x1" + "0" * 16,  # 2**64
    str((1 << 64) - 1),
    str(1 << 64),
    str(1 << 63),
    str((1 << 63) - 1),
    "00012",
    "",
    "12ab",
    "1_000",
    "١٢",  # non-ASCII digits: not a hash
    "ключ",
    "x" * 31,
    "x" * 32,
    "y" * 255,
    "y" * 256,
    "z" * 70000,
    "\0a\0k",
    "\0a\07",
    "\0tenant-b\0" + str(1 << 63),
]


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("object_key", [True, False])
def test_twin_is_byte_identical_to_the_reference(
    twin: ModuleType, legacy: bool, object_key: bool, monkeypatch: Any
) -> None:
    monkeypatch.setattr(kv, "_encode_events", twin.encode_events)
    rng = random.Random(7)
    enc = kv.BatchEncoder(
        backend_id="b", tenant_id="t", epoch=1 << 40, emit_legacy=legacy, emit_object_key=object_key
    )
    unparsed = 0
    for n, first_id, ts in ((0, 1, 5), (1, 127, 128), (16, 255, 1 << 16), (64, 1 << 33, 1 << 41)):
        events = [
            (rng.choice((kv.STORED, kv.REMOVED)), rng.choice(KEYS), rng.choice(("cpu", "disk", "")))
            for _ in range(n)
        ]
        want = kv.encode_batch(
            events,
            timestamp_ms=ts,
            first_event_id=first_id,
            backend_id="b",
            tenant_id="t",
            epoch=1 << 40,
            emit_legacy=legacy,
            emit_object_key=object_key,
        )
        assert enc.encode(events, ts, first_id) == want
        if object_key:
            unparsed += sum(
                1
                for _, k, _ in events
                if kv.parse_seq_hash(kv.split_tenant(k)[0]) is None and kv.split_tenant(k)[0]
            )
    assert enc.unparsed == unparsed


@pytest.mark.parametrize("twin", TWINS)
def test_twin_parses_hashes_as_the_reference(twin: ModuleType) -> None:
    for key in [*KEYS, "0x" + "f" * 16, "0x" + "f" * 17, "18446744073709551616", "-1", "+1"]:
        assert twin.parse_seq_hash(key) == kv.parse_seq_hash(key), key


def test_queue_asks_producers_to_publish_full_and_due_batches() -> None:
    import time

    calls: list[int] = []
    q = kv.EventQueue(capacity=4 * kv.INLINE_EVENTS)
    q.publish_inline(lambda: calls.append(len(q)), 3600.0)  # nothing gets due by waiting
    for i in range(kv.INLINE_EVENTS - 1):
        q.put(kv.STORED, f"k{i}", "cpu")
    assert calls == []  # full batches wait for the delay, to go out together
    q.put(kv.STORED, "full", "cpu")
    assert calls == [kv.INLINE_EVENTS]  # enough pending: published without waiting more
    while q.take()[0]:  # (what the publisher's drain does: batch after batch)
        pass
    q.publish_inline(lambda: calls.append(-len(q)), 1e-6)
    q.put(kv.STORED, "a", "cpu")
    assert calls == [kv.INLINE_EVENTS]  # the first event of a batch is not due yet
    time.sleep(0.002)  # (far more than the delay)
    q.put(kv.REMOVED, "b", "cpu")
    assert calls == [kv.INLINE_EVENTS, -2]  # the oldest waited past the delay
    q.take()
    q.publish_inline(lambda: calls.append(0), 0.0)  # no delay: every event at once
    q.put(kv.STORED, "c", "cpu")
    assert calls[-1] == 0
    q.take()
    q.publish_inline(None, 0.0)  # off: only the consumer publishes
    for i in range(2 * kv.MAX_BATCH):
        q.put(kv.STORED, f"n{i}", "cpu")
    assert len(calls) == 3 and len(q) == 2 * kv.MAX_BATCH
