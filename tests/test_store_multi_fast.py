"""The caller-thread multi-buffer path and the copy under it.

``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` copy every part of every key
in one ``memcpy_batch`` from the caller's thread when the replicas are memcpy-able, and hand
the keys that are not (a peer's segment not yet mapped, or not mappable) to the async client.
Both routes must store and return the same bytes and the same codes as the loop path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from mooncake import _fast
from mooncake._fast import _pure
from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_procs import Master

MIB = 1 << 20
INVALID = int(ErrorCode.INVALID_PARAMS)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)


@pytest.mark.parametrize("mod", [_fast, _pure], ids=["fast", "pure"])
@pytest.mark.parametrize("gap", [0, 1, 16, 63, 64, 4080, 4095])
@pytest.mark.parametrize("n", [1, 1023, 1024, 16384 + 7, 3 * 4096 + 65])
def test_copies_in_the_4k_aliasing_band_are_exact(mod: ModuleType, gap: int, n: int) -> None:
    # dst sits ``gap`` bytes above src modulo 4 KiB (the band the compiled copy special-cases)
    src = np.random.default_rng(n + gap).integers(0, 256, n + 8192, dtype=np.uint8)
    dst = np.zeros(2 * n + 3 * 8192, np.uint8)
    s = int(src.ctypes.data)
    d0 = int(dst.ctypes.data)
    d = d0 + ((s + gap - d0) % 4096)
    mod.memcpy_batch([d, d + n + 4096], [s, s], [n, n])
    got = ctypes.string_at(d, n)
    assert got == src[:n].tobytes()
    assert ctypes.string_at(d + n + 4096, n) == got
    # non-temporal stores (puts into segments), from an unaligned destination
    mod.memcpy_batch([d + 3, d + n + 4096], [s + 5, s + 2], [n, n], stream=True)
    assert ctypes.string_at(d + 3, n) == src[5 : n + 5].tobytes()
    assert ctypes.string_at(d + n + 4096, n) == src[2 : n + 2].tobytes()
    mod.memcpy_at(d, s + 1, n)
    assert ctypes.string_at(d, n) == src[1 : n + 1].tobytes()
    # nothing outside the destination was written
    assert not dst[: d - d0].any()


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.stop()


def _make(master: Master) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master.address) == 0
    return s


def _buf(s: MooncakeDistributedStore, n: int, seed: int | None) -> np.ndarray:
    a = (
        np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        if seed is not None
        else np.zeros(n, np.uint8)
    )
    assert s.register_buffer(int(a.ctypes.data), n) == 0
    return a


def _layout(
    a: np.ndarray, keys: int, parts: int, per: int
) -> tuple[list[list[int]], list[list[int]]]:
    base = int(a.ctypes.data)
    ptrs = [[base + (k * parts + j) * per for j in range(parts)] for k in range(keys)]
    return ptrs, [[per] * parts for _ in range(keys)]


def _count_handoffs(s: MooncakeDistributedStore, mp: pytest.MonkeyPatch) -> list[int]:
    """Count the caller-thread path's handovers of started puts to the async client."""
    n = [0]
    inner = s._s._complete_puts

    async def counted(*args: Any) -> Any:
        n[0] += 1
        return await inner(*args)

    mp.setattr(s._s, "_complete_puts", counted)
    return n


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-mapped", "network-only"])
def test_multi_buffer_to_a_peer_segment_round_trips(
    master: Master, monkeypatch: pytest.MonkeyPatch, memcpy: str
) -> None:
    """Replicas on another client's segment: the first call hands the keys to the async client
    (the peer is not mapped yet), later ones copy into the mapping (or, network-only, keep
    handing over); every route stores the concatenation and reads it back in order."""
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)
    a, b = _make(master), _make(master)
    handed = _count_handoffs(a, monkeypatch)
    try:
        src, dst = _buf(a, 4 * 8 * 4096, 7), _buf(a, 4 * 8 * 4096, None)
        ptrs, sizes = _layout(src, 4, 8, 4096)
        dptrs, _ = _layout(dst, 4, 8, 4096)
        cfg = ReplicateConfig()
        cfg.preferred_segments = [b.get_hostname()]
        for rnd in range(3):
            keys = [f"peer{rnd}_{k}" for k in range(4)]
            assert a.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg) == [0] * 4
            # the bytes live on b's segment: b reads them from its own segment
            assert b.get(keys[2]) == src[2 * 8 * 4096 : 3 * 8 * 4096].tobytes()
            dst[:] = 0
            got = a.batch_get_into_multi_buffers(
                [*keys, "nope"], [*dptrs, dptrs[0]], [*sizes, sizes[0]]
            )
            assert got == [8 * 4096] * 4 + [NOT_FOUND]
            assert (dst == src).all()
        assert handed[0] == (3 if memcpy == "0" else 1)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("fast", ["1", "0"], ids=["caller-thread", "loop"])
def test_multi_buffer_codes_are_the_same_on_both_paths(
    master: Master, monkeypatch: pytest.MonkeyPatch, fast: str
) -> None:
    monkeypatch.setenv("MC_STORE_SYNC_FASTPATH", fast)
    s = _make(master)
    try:
        assert (s._fast is not None) == (fast == "1")
        src, dst = _buf(s, 64 * 1024, 3), _buf(s, 64 * 1024, None)
        p, d = int(src.ctypes.data), int(dst.ctypes.data)
        unregistered = np.zeros(64, np.uint8)
        u = int(unregistered.ctypes.data)
        keys = [f"c{fast}_a", f"c{fast}_b", f"c{fast}_c", f"c{fast}_d"]
        put = s.batch_put_from_multi_buffers(
            keys, [[p, p + 100], [p + 5000], [u], [p, 0]], [[100, 50], [7], [64], [3, 3]]
        )
        assert put == [0, 0, INVALID, INVALID]
        # a put of an existing key succeeds and leaves the value alone
        assert s.batch_put_from_multi_buffers(keys[:1], [[p + 9]], [[150]]) == [0]
        assert s.get(keys[0]) == src[:100].tobytes() + src[100:150].tobytes()
        got = s.batch_get_into_multi_buffers(
            [keys[0], keys[1], keys[1], keys[2], keys[0]],
            [[d, d + 1000], [d + 2000], [d + 3000], [d + 4000], [u]],
            [[20, 130], [6], [8], [64], [150]],
        )
        # scatter; buffers smaller / larger than the value; missing; unregistered buffer
        assert got == [150, INVALID, TRANSFER_FAIL, NOT_FOUND, INVALID]
        assert dst[:20].tobytes() + dst[1000:1130].tobytes() == s.get(keys[0])
    finally:
        s.remove_all(True)
        s.close()


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-mapped", "network-only"])
def test_tensors_on_a_peer_segment_round_trip(
    master: Master, monkeypatch: pytest.MonkeyPatch, memcpy: str
) -> None:
    """Tensor puts go straight from the tensor's memory into memcpy-able replicas; a replica
    that is not (the peer unmapped yet, or network-only) is staged and written by the async
    client. Either way the object is the published layout and reads back equal."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)
    a, b = _make(master), _make(master)
    handed = _count_handoffs(a, monkeypatch)
    try:
        cfg = ReplicateConfig()
        cfg.preferred_segments = [b.get_hostname()]
        for rnd in range(3):
            ts = [torch.arange(1000 * (i + 1), dtype=torch.float16) + rnd for i in range(3)]
            assert a.pub_tensor(f"pt{rnd}", ts[0], cfg) == 0
            keys = [f"bt{rnd}_{i}" for i in range(3)]
            assert a.batch_pub_tensor(keys, ts, cfg) == [0, 0, 0]
            for s in (a, b):
                got = s.get_tensor(f"pt{rnd}")
                assert got is not None and torch.equal(got, ts[0])
                many = s.batch_get_tensor([*keys, "absent"])
                assert many[3] is None
                assert all(torch.equal(g, t) for g, t in zip(many[:3], ts, strict=True))
        assert a.get_tensor("absent") is None
        # network-only: every round handed over; mapped: only until the peer was mapped
        assert handed[0] == (6 if memcpy == "0" else 1)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("fast", ["1", "0"], ids=["caller-thread", "loop"])
def test_batch_put_from_and_batch_is_exist_take_the_caller_thread(
    master: Master, monkeypatch: pytest.MonkeyPatch, fast: str
) -> None:
    """``batch_put_from`` (host buffers, own segment) and ``batch_is_exist`` make no loop
    crossing when the fast path is on, and answer the same codes on both paths."""
    monkeypatch.setenv("MC_STORE_SYNC_FASTPATH", fast)
    s = _make(master)
    crossings = [0]
    assert s._loop is not None
    inner = s._loop.call

    def counted(*args: Any) -> Any:
        crossings[0] += 1
        return inner(*args)

    monkeypatch.setattr(s._loop, "call", counted)
    try:
        src = _buf(s, 64 * 1024, 5)
        p = int(src.ctypes.data)
        u = int(np.zeros(64, np.uint8).ctypes.data)
        crossings[0] = 0  # from here on: the calls under test only
        keys = [f"bf{fast}_{i}" for i in range(5)]
        ptrs = [p, p + 64, u, p + 128, p + 192]
        sizes = [64, 64, 64, 0, 64]
        assert s.batch_put_from(keys, ptrs, sizes) == [0, 0, INVALID, INVALID, 0]
        assert s.batch_put_from(keys[:1], [p + 999], [64]) == [0]  # exists: left alone
        assert s.batch_is_exist([*keys, "nope"]) == [1, 1, 0, 0, 1, 0]
        assert (crossings[0] == 0) == (fast == "1")
        assert s.batch_put_from(keys, ptrs[:2], sizes) == [INVALID] * 5
        assert s.batch_is_exist([]) == []
        assert s.batch_is_exist(["ok", ""]) == [int(ErrorCode.INVALID_PARAMS)] * 2
        assert s.get(keys[0]) == src[:64].tobytes()
        assert s.get(keys[4]) == src[192:256].tobytes()
    finally:
        s.remove_all(True)
        s.close()
