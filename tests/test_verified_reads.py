"""Verified reads end to end: real master, real clients, bytes flipped in a holder's segment.

Every read path checks the bytes it landed against the CRC32C its writer recorded; a corrupt
replica is reported and dropped, the read served from another replica, and with none left the
read fails with CHECKSUM_MISMATCH (-801) and the object is gone.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
import trio

import mooncake
from mooncake import _fast
from mooncake._core.master import MasterConfig
from mooncake._core.tiers import file_name
from mooncake._store.client import Store
from mooncake.errors import ChecksumMismatchError, ErrorCode, ObjectNotFoundError, TierDataError
from mooncake.store import ReplicateConfig
from mooncake.testing import local_master_server
from mooncake.testing.faults import flip_file, flip_replica, replicas_of

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not _fast.CRC_COMPILED, reason="the pure-Python CRC twin: too slow for these values"
)


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@asynccontextmanager
async def cluster(
    n_holders: int = 2, *, writer_verify: bool = True
) -> AsyncIterator[tuple[Store, list[Store], Store]]:
    """A writer, holders, and a reader without a segment of its own (every read is remote
    or same-host mapped, never its own memory); the master's server is ``r.master_server``."""
    # read windows long enough for a loaded machine: a read fenced -707 would hide the answer
    state = MasterConfig(read_fence_ttl=4.0, default_kv_lease_ttl=5.0)
    async with local_master_server(state=state) as server:
        addr = f"127.0.0.1:{server.rpc_port}"
        kw = {"segment_size": 8 * MIB, "local_buffer_size": 8 * MIB}
        async with mooncake.open_store(addr, **kw) as h0:
            holders = [h0]
            async with mooncake.open_store(addr, **kw) as h1:
                holders.append(h1)
                async with (
                    mooncake.open_store(
                        addr, segment_size=0, local_buffer_size=16 * MIB, verify=writer_verify
                    ) as w,
                    mooncake.open_store(
                        addr, segment_size=0, local_buffer_size=16 * MIB, verify=True
                    ) as r,
                ):
                    r.master_server = server  # type: ignore[attr-defined]
                    yield w, holders[:n_holders], r


def two() -> ReplicateConfig:
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    return cfg


def holder_of(holders: list[Store], seg: str) -> Store:
    return next(h for h in holders if h.segment_name == seg)


@pytest.mark.parametrize("memcpy", ["1", "0"], ids=["same-host-memcpy", "network"])
def test_corrupt_replica_failover_then_removal(
    memcpy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MC_STORE_MEMCPY", memcpy)

    async def main() -> None:
        async with cluster() as (w, holders, r):
            value = pattern(300_000, 1)
            await w.put("k", value, two())
            resp = await replicas_of(r, "k")
            assert resp.crc == _fast.crc32c(value) and len(resp.replicas) == 2
            first = r._order(resp.replicas)[0]
            flip_replica(holder_of(holders, first.segment_name), first, 12345)
            assert await r.get("k") == value  # served by the other replica
            st = r.verify.stats()
            assert st["mismatches"] == {f"dram/{first.segment_name}": 1}
            assert st["replicas_reported"] == 1
            left = await replicas_of(r, "k")
            assert [x.segment_name for x in left.replicas] != [first.segment_name]
            assert len(left.replicas) == 1
            # the last one corrupt too: -801, and the object is gone
            last = left.replicas[0]
            flip_replica(holder_of(holders, last.segment_name), last, 0, 0x80)
            with pytest.raises(ChecksumMismatchError) as ei:
                await r.get("k")
            assert ei.value.code == ErrorCode.CHECKSUM_MISMATCH == -801
            with pytest.raises(ObjectNotFoundError):
                await r.get("k")
            assert r.verify.stats()["replicas_reported"] == 2
            assert r.verify.verified == 1

    trio.run(main)


def test_every_read_path_detects_a_flipped_byte() -> None:
    async def main() -> None:
        async with cluster() as (w, holders, r):
            n = 64 * 1024
            keys = [f"p{i}" for i in range(5)]
            values = {k: pattern(n, i + 10) for i, k in enumerate(keys)}
            for k in keys:
                await w.put(k, values[k], two())
            buf = await r.engine.allocate(8 * n)
            base = buf.addr
            # each key gets its first replica corrupt, then is read through one path
            for k in keys:
                resp = await replicas_of(r, k)
                first = r._order(resp.replicas)[0]
                flip_replica(holder_of(holders, first.segment_name), first, n - 1)
            assert await r.get("p0") == values["p0"]
            assert await r.get_into("p1", base, n) == n
            assert ctypes.string_at(base, n) == values["p1"]
            got = await r.get_batch(["p2"])
            assert got == [values["p2"]]
            assert await r.batch_get_into(["p3"], [base], [n]) == [n]
            assert ctypes.string_at(base, n) == values["p3"]
            # multi-buffer: the value scattered over two buffers
            half = n // 2
            assert await r.batch_get_parts(["p4"], [[(base, half), (base + 4 * n, half)]]) == [n]
            assert (
                ctypes.string_at(base, half) + ctypes.string_at(base + 4 * n, half) == values["p4"]
            )
            st = r.verify.stats()
            assert sum(st["mismatches"].values()) == 5 and st["replicas_reported"] == 5
            assert st["verified"] == 5
            for k in keys:
                assert len((await replicas_of(r, k)).replicas) == 1

    trio.run(main)


def test_values_without_a_crc_are_read_unverified_and_counted() -> None:
    async def main() -> None:
        async with cluster(writer_verify=False) as (w, _holders, r):
            await w.put("old", b"x" * 5000)
            assert (await replicas_of(r, "old")).crc == -1
            assert await r.get("old") == b"x" * 5000
            assert r.verify.unverified == 1 and r.verify.verified == 0

    trio.run(main)


def test_readers_with_injection_never_return_wrong_bytes() -> None:
    """Readers loop over keys while an injector flips one byte of a random key's only
    replica at a time: every read returns the key's bytes or fails closed (-801 then
    not-found), and every injected corruption is detected and its replica dropped."""

    async def main() -> None:
        async with cluster() as (w, holders, r):
            n_keys, size = 24, 16 * 1024
            values = {f"c{i}": pattern(size, 100 + i) for i in range(n_keys)}
            for k, v in values.items():
                await w.put(k, v)
            rng = random.Random(7)
            injected: set[str] = set()
            wrong = reads = 0
            done = anyio.Event()

            async def reader(seed: int) -> None:
                nonlocal wrong, reads
                lr = random.Random(seed)
                while not done.is_set():
                    k = lr.choice(list(values))
                    try:
                        got = await r.get(k)
                    except (ChecksumMismatchError, ObjectNotFoundError):
                        assert k in injected
                        continue
                    reads += 1
                    wrong += got != values[k]
                    await anyio.lowlevel.checkpoint()

            async def injector() -> None:
                for _ in range(8):
                    k = rng.choice([k for k in values if k not in injected])
                    resp = await replicas_of(r, k)
                    rep = resp.replicas[0]
                    injected.add(k)
                    flip_replica(holder_of(holders, rep.segment_name), rep, rng.randrange(size))
                    await anyio.sleep(0.02)
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader, 1)
                tg.start_soon(reader, 2)
                tg.start_soon(injector)
            for k in injected:  # a corruption no reader happened to read: read it now
                with pytest.raises((ChecksumMismatchError, ObjectNotFoundError)):
                    await r.get(k)
            assert wrong == 0 and reads > 0
            # two readers may both read a corrupt replica before it is dropped: each reports
            assert r.verify.replicas_reported == sum(r.verify.mismatches.values()) >= 8
            stats = r.master_server.state.stats  # type: ignore[attr-defined]
            assert stats.corrupt_replicas_dropped == stats.corrupt_objects_removed == 8
            for k in injected:
                with pytest.raises(ObjectNotFoundError):
                    await replicas_of(r, k)
            for k in values.keys() - injected:
                assert await r.get(k) == values[k]

    trio.run(main)


def test_ssd_copies_are_verified_against_the_writers_crc(tmp_path: Path) -> None:
    """A replica corrupted in DRAM before its demotion gives a self-consistent SSD file that
    still fails the writer's CRC; a byte flipped in an SSD file fails the tier's own check.
    Both are counted as SSD mismatches, dropped from the tier, and the object is gone."""
    from tests.test_store_tiers import (
        eventually,
        fill_and_demote,
        put_retrying,
        running_master,
        ssd_keys,
        value,
        where,
    )

    async def main() -> None:
        async with (
            running_master() as addr,
            mooncake.open_store(
                addr,
                segment_size=MIB,
                ssd_path=str(tmp_path),
                ssd_capacity=64 * MIB,
                promotion="never",
                verify=True,
            ) as s,
        ):
            await put_retrying(s, "bad", value(999))
            rep = (await replicas_of(s, "bad")).replicas[0]
            flip_replica(s, rep, 100)  # before the object is demoted
            keys = await fill_and_demote(s, 40)
            # A fast host can put all 40 within the lease ``replicas_of`` gave "bad", and
            # every GetReplicaList (``where``) extends it and makes it most recently used: so
            # wait on its SSD file, not the master, and add pressure until it is demoted.
            extra = 0
            with anyio.fail_after(60):
                while not (tmp_path / "objects" / file_name("bad")).exists():
                    await anyio.sleep(0.1)  # past the 50 ms lease: evictable again
                    await put_retrying(s, f"extra{extra}", value(1000 + extra))
                    extra += 1

            async def bad_on_ssd() -> bool:
                return await where(s, "bad") == "ssd"

            await eventually(bad_on_ssd, "the master listing the corrupt replica on the SSD")
            other = (await ssd_keys(s, keys))[0]
            with pytest.raises(TierDataError, match="writer recorded"):
                await s.get("bad")
            flip_file(tmp_path / "objects" / file_name(other), 4096 + 10)
            with pytest.raises(TierDataError, match="checksum"):
                await s.get(other)
            assert s.verify.mismatches[("ssd", s.client_id)] == 2

            async def gone() -> bool:
                return await where(s, "bad") == "gone" and await where(s, other) == "gone"

            await eventually(gone, "the master dropping both")
            last = keys[-1]
            assert await s.get(last) == value(len(keys) - 1)  # the others read (and verify)

    trio.run(main)


def test_the_switch_default_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake._store import verify

    monkeypatch.delenv(verify.ENV, raising=False)
    assert verify.ReadVerifier().enabled is verify.DEFAULT
    for v, want in (("1", True), ("on", True), ("0", False), ("false", False)):
        monkeypatch.setenv(verify.ENV, v)
        assert verify.ReadVerifier().enabled is want
    assert verify.ReadVerifier(enabled=True).enabled is True

    async def main() -> None:  # off: the writer records nothing, the reader checks nothing
        monkeypatch.setenv(verify.ENV, "0")
        async with cluster(writer_verify=False) as (w, holders, r):
            r.verify.enabled = False
            await w.put("plain", b"p" * 4096)
            rep = (await replicas_of(r, "plain")).replicas[0]
            flip_replica(holder_of(holders, rep.segment_name), rep, 1)
            got = await r.get("plain")
            assert got != b"p" * 4096  # what verification exists to catch
            assert r.verify.unverified == 1 and not r.verify.mismatches

    trio.run(main)


def test_setup_verify_flag_reaches_open_store() -> None:
    """``setup(..., verify=...)`` (keyword or ``setup(dict)`` key) turns verified reads on or
    off for that client; unset, ``open_store`` decides (the variable, else the default)."""
    from mooncake.store import _setup

    base = ("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "127.0.0.1:1")
    assert "verify" not in _setup.open_store_options(_setup.collect(base, {}))
    for given, want in ((False, False), (True, True), ("0", False), ("on", True)):
        opts = _setup.open_store_options(_setup.collect(base, {"verify": given}))
        assert opts["verify"] is want, given
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "verify": "false"}
    assert _setup.open_store_options(_setup.collect((cfg,), {}))["verify"] is False
