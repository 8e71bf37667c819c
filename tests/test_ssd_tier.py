"""SSD tier: the file format, the index, admission rules, and the async file store on a real disk."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from mooncake._core.policies import FIFOPolicy
from mooncake._core.tiers import (
    BLOCK,
    AlwaysAdmit,
    HitCountAdmission,
    NeverAdmit,
    SsdHeader,
    SsdIndex,
    decode_header,
    encode_header,
    file_length,
    file_name,
    make_admission,
)
from mooncake._store import ssd as ssd_mod
from mooncake._store.ssd import SsdTier, open_ssd_tier
from mooncake.errors import (
    BufferOverflowError,
    ClosedError,
    ErrorCode,
    InvalidArgumentError,
    NoAvailableHandleError,
    NotSupportedError,
    ObjectNotFoundError,
    TierDataError,
)

pytestmark = pytest.mark.anyio

# -- format ---------------------------------------------------------------------------------


@given(
    key=hs.text(min_size=1, max_size=300),
    size=hs.integers(0, 1 << 40),
    gen=hs.integers(0, (1 << 64) - 1),
    crc=hs.integers(0, (1 << 32) - 1),
)
def test_header_roundtrip(key: str, size: int, gen: int, crc: int) -> None:
    h = SsdHeader(key, size, gen, crc)
    block = encode_header(h)
    assert len(block) % BLOCK == 0
    assert len(block) == h.header_length
    assert decode_header(block) == h


def test_header_every_byte_flip_is_detected() -> None:
    block = encode_header(SsdHeader("layer0/blk-17", 123456, 42, 0xDEADBEEF))
    used = 40 + len("layer0/blk-17") + 4
    for i in range(used):
        for bit in (0x01, 0x80):
            bad = bytearray(block)
            bad[i] ^= bit
            with pytest.raises(ValueError):
                decode_header(bad)


def test_header_truncation_is_detected() -> None:
    block = encode_header(SsdHeader("k", 1, 1, 1))
    for n in range(0, 40 + 1 + 4):
        with pytest.raises(ValueError, match="truncated"):
            decode_header(block[:n])


def test_header_rejects_bad_fields() -> None:
    with pytest.raises(InvalidArgumentError):
        encode_header(SsdHeader("k", -1, 0, 0))
    with pytest.raises(InvalidArgumentError, match="too long"):
        encode_header(SsdHeader("k" * 70000, 1, 0, 0))


def test_file_name_is_stable_and_sharded() -> None:
    name = file_name("abc")
    assert name == file_name("abc") != file_name("abd")
    assert name[:2] == name[3:5] and name.endswith(".obj")


# -- index ----------------------------------------------------------------------------------


def test_index_reserve_commit_abort_accounting() -> None:
    idx = SsdIndex(10 * BLOCK)
    r = idx.reserve("a", 100)
    assert idx.used == 2 * BLOCK and "a" not in idx
    e = idx.commit(r, 7)
    assert e is None and idx.get("a") is not None and idx.used == 2 * BLOCK
    r2 = idx.reserve("a", 5000)  # replace: old bytes stay counted until commit
    assert idx.used == 2 * BLOCK + 3 * BLOCK
    old = idx.commit(r2, 8)
    assert old is not None and old.size == 100
    assert idx.used == 3 * BLOCK and idx.entries["a"].generation > old.generation
    r3 = idx.reserve("b", 1)
    idx.abort(r3)
    assert idx.used == 3 * BLOCK and "b" not in idx
    with pytest.raises(InvalidArgumentError, match="in flight"):
        idx.reserve("c", 1)
        idx.reserve("c", 1)


def test_index_evicts_by_policy_and_spares_readers() -> None:
    idx = SsdIndex(6 * BLOCK, FIFOPolicy())
    for k in "abc":
        idx.commit(idx.reserve(k, 1), 0)
    assert idx.begin_read("a") is not None  # a is being read: not evictable
    r = idx.reserve("d", 1)
    assert [v.key for v in r.victims] == ["b"]
    idx.commit(r, 0)
    idx.end_read("a")
    r = idx.reserve("e", 1)
    assert [v.key for v in r.victims] == ["a"]
    assert idx.used <= idx.capacity


def test_index_full_evicts_nothing() -> None:
    idx = SsdIndex(4 * BLOCK)
    idx.commit(idx.reserve("a", 1), 0)
    idx.begin_read("a")
    with pytest.raises(NoAvailableHandleError, match="SSD tier full"):
        idx.reserve("b", BLOCK + 1)
    assert "a" in idx and idx.used == 2 * BLOCK
    with pytest.raises(NoAvailableHandleError, match="more than the tier's capacity"):
        idx.reserve("c", 10 * BLOCK)


@settings(max_examples=60, deadline=None)
@given(
    ops=hs.lists(
        hs.tuples(hs.sampled_from("rcaxe"), hs.sampled_from("abcdef"), hs.integers(0, 3 * BLOCK)),
        max_size=60,
    )
)
def test_index_model(ops: list[tuple[str, str, int]]) -> None:
    idx = SsdIndex(8 * BLOCK)
    pending: dict[str, Any] = {}
    for op, key, size in ops:
        if op == "r" and key not in pending:
            try:
                pending[key] = idx.reserve(key, size)
            except NoAvailableHandleError:
                pass
        elif op == "c" and key in pending:
            idx.commit(pending.pop(key), 0)
        elif op == "a" and key in pending:
            idx.abort(pending.pop(key))
        elif op == "x":
            idx.remove(key)
        elif op == "e":
            idx.evict(size)
        committed = sum(e.disk_bytes for e in idx.entries.values())
        assert idx.used == committed + sum(r.disk_bytes for r in pending.values())
        assert idx.used <= idx.capacity
        assert set(idx.entries) == {k for k in "abcdef" if k in idx.policy}
        idx.policy.self_check()


def test_index_recover_keeps_newest_within_capacity() -> None:
    idx = SsdIndex(5 * BLOCK)
    hs_ = [SsdHeader(k, BLOCK, g, 0) for g, k in enumerate("abc", start=3)]
    dropped = idx.recover(hs_)
    assert [h.key for h in dropped] == ["a"]
    assert set(idx.entries) == {"b", "c"} and idx.used == 4 * BLOCK
    assert idx.reserve("z", 0).generation == 6  # past the largest recovered generation


# -- admission ------------------------------------------------------------------------------


def test_admission_rules() -> None:
    assert isinstance(make_admission("always"), AlwaysAdmit)
    assert isinstance(make_admission("NEVER"), NeverAdmit)
    rule = make_admission("hits:3")
    assert isinstance(rule, HitCountAdmission) and rule.threshold == 3
    assert [rule.admit("k") for _ in range(4)] == [False, False, True, True]
    assert make_admission("hits").admit("x") is False
    for bad in ("sometimes", "hits:x", "hits:0", "always:1"):
        with pytest.raises(InvalidArgumentError):
            make_admission(bad)


def test_hitcount_ages_out() -> None:
    rule = HitCountAdmission(2, window=4)
    assert rule.admit("a") is False
    for k in "bcd":
        rule.admit(k)  # window of 4 hits: counts halve
    assert rule.count("a") == 0
    assert rule.admit("a") is False


# -- async tier -----------------------------------------------------------------------------

SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * 65536 + 17]


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def test_put_get_roundtrip(tmp_path: Path, direct: bool) -> None:
    async with open_ssd_tier(tmp_path, 1 << 22, direct_io=direct, chunk=65536) as tier:
        assert tier.direct_io is direct
        for i, n in enumerate(SIZES):
            data = _payload(n, i)
            entry = await tier.put(f"k{i}", data)
            assert entry.size == n and entry.checksum == zlib.crc32(data)
            assert await tier.get(f"k{i}") == data
            buf = bytearray(n + 10)
            assert await tier.get_into(f"k{i}", buf) == n
            assert bytes(buf[:n]) == data
            path = tmp_path / "objects" / entry.name
            assert path.stat().st_size == file_length(len(f"k{i}"), n)
        assert tier.stats()["hits"] == 2 * len(SIZES)
        assert tier.used == sum(file_length(len(f"k{i}"), n) for i, n in enumerate(SIZES))
        assert os.listdir(tmp_path / "tmp") == []


async def test_replace_and_remove(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        await tier.put("k", b"old" * 1000)
        e2 = await tier.put("k", b"new!")
        assert await tier.get("k") == b"new!" and tier.size_of("k") == 4
        assert tier.used == e2.disk_bytes
        assert await tier.remove("k") is True
        assert await tier.remove("k") is False
        assert not (tmp_path / "objects" / e2.name).exists()
        with pytest.raises(ObjectNotFoundError):
            await tier.get("k")
        with pytest.raises(ObjectNotFoundError):
            tier.size_of("k")
        assert tier.used == 0 and tier.stats()["misses"] == 1


async def test_capacity_evicts_by_policy(tmp_path: Path) -> None:
    dropped: list[tuple[str, str]] = []
    cap = 8 * BLOCK  # four 1-block objects (header + payload = 2 blocks each)
    async with open_ssd_tier(
        tmp_path, cap, policy="lru", on_drop=lambda e, why: dropped.append((e.key, why))
    ) as tier:
        for k in "abcd":
            await tier.put(k, k.encode() * BLOCK)
        await tier.get("a")  # a becomes most recent: b is the LRU victim
        await tier.put("e", b"e" * BLOCK)
        assert sorted(tier.keys()) == ["a", "c", "d", "e"]
        assert dropped == [("b", "evicted")]
        assert tier.stats()["evictions"] == 1 and tier.used == cap
        assert not (tmp_path / "objects" / file_name("b")).exists()
        for k in "acde":
            assert await tier.get(k) == k.encode() * BLOCK


async def test_ssd_full(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 4 * BLOCK) as tier:
        await tier.put("a", b"x")
        with pytest.raises(NoAvailableHandleError, match="capacity") as ei:
            await tier.put("big", bytes(10 * BLOCK))
        assert ei.value.code is ErrorCode.NO_AVAILABLE_HANDLE
        assert tier.keys() == ["a"] and await tier.get("a") == b"x"
        assert os.listdir(tmp_path / "tmp") == []


async def test_corrupted_payload_is_dropped_never_returned(tmp_path: Path, direct: bool) -> None:
    drops: list[str] = []
    async with open_ssd_tier(
        tmp_path, 1 << 20, direct_io=direct, on_drop=lambda e, why: drops.append(why)
    ) as tier:
        data = _payload(10000)
        e = await tier.put("k", data)
        path = tmp_path / "objects" / e.name
        _flip(path, e.disk_bytes - round_block(10000) + 5000)
        buf = bytearray(10000)
        with pytest.raises(TierDataError, match="checksum mismatch") as ei:
            await tier.get_into("k", buf)
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH
        assert "k" not in tier and not path.exists()
        assert drops == ["corrupt"] and tier.stats()["errors"] == 1
        with pytest.raises(ObjectNotFoundError):
            await tier.get("k")


def _poke(path: Path, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _flip(path: Path, off: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        b = os.pread(fd, 1, off)
    finally:
        os.close(fd)
    _poke(path, off, bytes([b[0] ^ 0x40]))


def round_block(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("damage", ["delete", "truncate", "header", "swap", "extend"])
async def test_damaged_file_is_a_clear_error(tmp_path: Path, damage: str, direct: bool) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20, direct_io=direct) as tier:
        e = await tier.put("k", _payload(5000))
        other = await tier.put("other", _payload(5000, 1))
        path = tmp_path / "objects" / e.name
        if damage == "delete":
            path.unlink()
        elif damage == "truncate":
            os.truncate(path, BLOCK + 100)
        elif damage == "extend":
            os.truncate(path, e.disk_bytes + BLOCK)
        elif damage == "header":
            _poke(path, 20, b"\xff")
        else:  # another object's (valid) file under this name
            os.replace(tmp_path / "objects" / other.name, path)
        with pytest.raises(TierDataError, match="dropped") as ei:
            await tier.get("k")
        msg = str(ei.value)
        assert {
            "delete": "missing",
            "truncate": "length",
            "extend": "length",
            "header": "bad header",
            "swap": "holds key 'other'",
        }[damage] in msg
        assert "k" not in tier


async def test_restart_recovers_and_drops_bad_files(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        for i in range(5):
            await tier.put(f"k{i}", _payload(3000, i))
        names = {f"k{i}": tier.index.entries[f"k{i}"].name for i in range(5)}
    # a write that never finished, a corrupted payload, a bad header, a stray file
    (tmp_path / "tmp" / "deadbeef.7").write_bytes(b"partial")
    _flip(tmp_path / "objects" / names["k1"], BLOCK + 10)
    _poke(tmp_path / "objects" / names["k2"], 0, b"JUNK")
    (tmp_path / "objects" / "00" / "stray.obj").write_bytes(b"x" * 10)

    async with open_ssd_tier(tmp_path, 1 << 20, verify="full") as tier:
        assert [e.key for e in tier.recovered] == ["k0", "k3", "k4"]
        why = {os.path.basename(p): w for p, w in tier.dropped}
        assert why["deadbeef.7"] == "unfinished write"
        assert why[os.path.basename(names["k1"])] == "payload checksum mismatch"
        assert why[os.path.basename(names["k2"])].startswith("bad header")
        assert why["stray.obj"].startswith("bad header")
        for i in (0, 3, 4):
            assert await tier.get(f"k{i}") == _payload(3000, i)
        e = await tier.put("k5", b"after restart")
        assert e.generation > max(r.generation for r in tier.recovered)
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        assert sorted(tier.keys()) == ["k0", "k3", "k4", "k5"]


async def test_restart_with_smaller_capacity_keeps_newest(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        for k in "abcd":
            await tier.put(k, b"x")
    async with open_ssd_tier(tmp_path, 4 * BLOCK) as tier:
        assert tier.keys() == ["c", "d"]
        assert sorted(w for _, w in tier.dropped) == ["does not fit the capacity"] * 2
        assert not (tmp_path / "objects" / file_name("a")).exists()


async def test_header_only_recovery_still_verifies_on_read(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        e = await tier.put("k", _payload(9000))
    _flip(tmp_path / "objects" / e.name, BLOCK + 8999)
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        assert tier.keys() == ["k"]  # header and length are fine
        with pytest.raises(TierDataError, match="checksum"):
            await tier.get("k")
        assert tier.keys() == []


async def test_directory_is_locked(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20):
        with pytest.raises(InvalidArgumentError, match="in use"):
            async with open_ssd_tier(tmp_path, 1 << 20):
                pass
    async with open_ssd_tier(tmp_path, 1 << 20):  # released at close
        pass


async def test_direct_io_required_but_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssd_mod, "_probe_direct", lambda root: False)
    with pytest.raises(NotSupportedError, match="O_DIRECT"):
        async with open_ssd_tier(tmp_path, 1 << 20, direct_io=True):
            pass
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        assert tier.direct_io is False
        await tier.put("k", b"v")
        assert await tier.get("k") == b"v"


async def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        async with open_ssd_tier(tmp_path, 100):
            pass
    with pytest.raises(InvalidArgumentError, match="chunk"):
        async with open_ssd_tier(tmp_path, 1 << 20, chunk=1000):
            pass
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        with pytest.raises(InvalidArgumentError, match="key"):
            await tier.put("", b"x")
        await tier.put("k", b"12345")
        with pytest.raises(BufferOverflowError):
            await tier.get_into("k", bytearray(4))
        with pytest.raises(InvalidArgumentError, match="writable"):
            await tier.get_into("k", b"12345")
    with pytest.raises(ClosedError):
        await tier.put("k", b"x")


async def test_concurrent_puts_and_gets_same_key(tmp_path: Path) -> None:
    values = [_payload(20000, s) for s in range(6)]
    seen: list[bytes] = []
    async with open_ssd_tier(tmp_path, 1 << 22, io_threads=3) as tier:
        await tier.put("k", values[0])

        async def reader() -> None:
            for _ in range(10):
                seen.append(await tier.get("k"))

        async with anyio.create_task_group() as tg:
            for v in values[1:]:
                tg.start_soon(tier.put, "k", v)
            for _ in range(3):
                tg.start_soon(reader)
        assert all(s in values for s in seen) and len(seen) == 30
        assert await tier.get("k") in values
        assert len(tier) == 1 and tier.used == tier.index.entries["k"].disk_bytes


async def test_concurrent_eviction_and_reput(tmp_path: Path) -> None:
    """A put of a key whose eviction is still deleting its file must not lose the new file."""
    async with open_ssd_tier(tmp_path, 6 * BLOCK, policy="fifo", io_threads=4) as tier:
        for k in "abc":
            await tier.put(k, k.encode())
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.put, "d", b"d")  # evicts a
            tg.start_soon(tier.put, "a", b"a2")  # re-puts a, evicting b
        for k in list(tier):
            assert (await tier.get(k))[:1] == k.encode()


async def test_cancelled_put_still_commits_or_leaves_nothing(tmp_path: Path) -> None:
    """Cancelled while its file is being written (the worker thread is held inside the write
    until the cancellation has been requested): the write completes and is committed, whole;
    cancelled before it started: nothing is left."""
    data = _payload(1 << 20)
    async with open_ssd_tier(tmp_path, 1 << 24) as tier:
        in_write, release = threading.Event(), threading.Event()
        real_write = tier._io.write

        def write(res: Any, mv: memoryview) -> int:
            in_write.set()
            release.wait(30)
            return real_write(res, mv)

        tier._io.write = write  # type: ignore[method-assign]
        scope = anyio.CancelScope()
        state: list[str] = []

        async def put() -> None:
            with scope:
                await tier.put("k", data)
                state.append("returned")

        async with anyio.create_task_group() as tg:
            tg.start_soon(put)
            await anyio.to_thread.run_sync(in_write.wait)
            scope.cancel()  # mid-write
            await anyio.sleep(0.05)
            assert state == [] and "k" not in tier  # still writing: the cancel did not cut it
            release.set()
        # the shielded write finished and was committed; the put either returned or had its
        # cancellation delivered after the commit
        assert "k" in tier and await tier.get("k") == data
        assert os.listdir(tmp_path / "tmp") == []
        assert tier.used > 0

        tier._io.write = real_write  # type: ignore[method-assign]
        with anyio.CancelScope() as before:
            before.cancel()
            await tier.put("k2", data)  # cancelled at its first checkpoint, before any write
        assert before.cancelled_caught and "k2" not in tier
        assert os.listdir(tmp_path / "tmp") == []


async def test_tier_is_a_tier(tmp_path: Path) -> None:
    async with open_ssd_tier(tmp_path, 1 << 20) as tier:
        assert isinstance(tier, SsdTier) and tier.path == str(tmp_path)
        assert tier.capacity == 1 << 20 and len(tier) == 0
