"""Store tiers end to end: a real master (sockets) and store clients with SSD tiers on disk.

Demotion on eviction, serving from SSD, promotion, SSD full, SSD files corrupted or deleted
under the store (clear error, object dropped, never wrong bytes), client restart with SSD data,
and miss attribution through the client API.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from mooncake._core.master import MasterConfig
from mooncake._core.misses import MissReason
from mooncake._core.tiers import file_name
from mooncake._store.client import Store, open_store
from mooncake._store.master import MasterServerConfig, serve_master
from mooncake.errors import NoAvailableHandleError, ObjectNotFoundError, RpcError, TierDataError

pytestmark = pytest.mark.anyio

KiB = 1 << 10
MiB = 1 << 20
OBJ = 64 * KiB


@asynccontextmanager
async def running_master(**state: Any) -> AsyncIterator[str]:
    cfg = MasterServerConfig(
        rpc_port=0,
        enable_metric_reporting=False,
        sweep_interval=0.02,
        state=MasterConfig(seed=1, default_kv_lease_ttl=0.05, **state),
    )
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        yield f"127.0.0.1:{server.rpc_port}"
        tg.cancel_scope.cancel()


def value(i: int, n: int = OBJ) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


async def put_retrying(s: Store, key: str, data: bytes) -> None:
    """Puts may find the segment full while demotions are still being copied: retry."""
    with anyio.fail_after(20):
        while True:
            try:
                await s.put(key, data)
                return
            except NoAvailableHandleError:
                await anyio.sleep(0.02)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, limit: float = 20) -> None:
    with anyio.move_on_after(limit):
        # the state lives in the master (another task, over a socket): nothing to wait on
        while not await check():  # noqa: ASYNC110
            await anyio.sleep(0.02)
        return
    pytest.fail(f"gave up waiting for {what}")


async def where(s: Store, key: str) -> str:
    """'dram', 'ssd' or 'gone' as the master lists ``key``."""
    try:
        resp, _ = await s._query(key, for_read=False)
    except ObjectNotFoundError:
        return "gone"
    return "dram" if resp.replicas else "ssd"


async def fill_and_demote(s: Store, n: int) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    for i, k in enumerate(keys):
        await put_retrying(s, k, value(i))
    return keys


async def ssd_keys(s: Store, keys: list[str]) -> list[str]:
    return [k for k in keys if await where(s, k) == "ssd"]


async def test_eviction_demotes_and_gets_are_served_from_ssd(tmp_path: Path) -> None:
    async with (
        running_master() as addr,
        open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="never",
        ) as s,
    ):
        keys = await fill_and_demote(s, 40)  # 2.5 MiB into a 1 MiB segment
        on_ssd = await ssd_keys(s, keys)
        assert len(on_ssd) >= 20
        for i, k in enumerate(keys):
            assert await s.get(k) == value(i), k  # every object still readable, exact bytes
        for k in on_ssd:
            assert (tmp_path / "objects" / file_name(k)).exists()
        stats = await s.tier_stats()
        assert stats["ssd"]["demotions"] >= len(on_ssd)
        assert stats["local_ssd"]["hits"] >= len(on_ssd)
        assert stats["dram"]["evictions"] >= len(on_ssd)
        got = await s.get_batch([*on_ssd[:3], "k-none"])
        assert got[:3] == [value(keys.index(k)) for k in on_ssd[:3]]
        assert isinstance(got[3], ObjectNotFoundError)


async def test_ssd_hit_is_promoted_back_to_dram(tmp_path: Path) -> None:
    async with (
        running_master() as addr,
        open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="hits:2",
        ) as s,
    ):
        keys = await fill_and_demote(s, 24)
        await eventually(lambda: _any_on_ssd(s, keys), "a demotion")
        k = (await ssd_keys(s, keys))[0]
        assert await s.get(k) == value(keys.index(k))  # first hit: not admitted
        await anyio.sleep(0.1)
        assert await where(s, k) == "ssd"
        assert await s.get(k) == value(keys.index(k))  # second hit: promoted

        async def back() -> bool:
            return await where(s, k) == "dram"

        await eventually(back, f"{k} promoted")
        assert await s.get(k) == value(keys.index(k))
        stats = await s.tier_stats()
        assert stats["ssd"]["promotions"] >= 1 and stats["local_ssd"]["promotions"] >= 1


async def _any_on_ssd(s: Store, keys: list[str]) -> bool:
    return bool(await ssd_keys(s, keys))


async def test_ssd_full_evicts_by_its_policy_and_attributes_the_miss(tmp_path: Path) -> None:
    cap = 6 * (OBJ + 8 * KiB)  # room for six objects on SSD
    async with (
        running_master() as addr,
        open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=cap,
            ssd_policy="fifo",
            promotion="never",
        ) as s,
    ):
        keys = await fill_and_demote(s, 40)
        assert s.ssd is not None and s.ssd.used <= cap

        async def lost() -> bool:
            return any([await where(s, k) == "gone" for k in keys])

        await eventually(lost, "an object lost to SSD eviction")
        gone = [k for k in keys if await where(s, k) == "gone"]
        with pytest.raises(ObjectNotFoundError) as ei:
            await s.get(gone[0])
        miss = ei.value.miss
        assert miss is not None
        assert (miss.reason, miss.policy, miss.tier) == (MissReason.EVICTED, "fifo", "ssd")
        assert (await s.explain_miss(gone[0])).tier == "ssd"
        assert (await s.tier_stats())["local_ssd"]["evictions"] >= len(gone)
        for i, k in enumerate(keys):  # exact bytes, or a miss attributed to the SSD
            try:
                assert await s.get(k) == value(i)
            except ObjectNotFoundError as e:
                assert e.miss is not None and e.miss.tier == "ssd"


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
async def test_ssd_file_damaged_under_the_store(tmp_path: Path, damage: str) -> None:
    async with (
        running_master() as addr,
        open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="never",
        ) as s,
    ):
        keys = await fill_and_demote(s, 24)
        await eventually(lambda: _any_on_ssd(s, keys), "a demotion")
        k = (await ssd_keys(s, keys))[0]
        path = tmp_path / "objects" / file_name(k)
        if damage == "delete":
            path.unlink()
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                os.pwrite(fd, b"\xff\x00\xff", 4096 + 1000)
            finally:
                os.close(fd)
        with pytest.raises(TierDataError, match="dropped") as ei:
            await s.get(k)
        assert ("missing" if damage == "delete" else "checksum") in str(ei.value)
        assert s.miss_stats()[("transfer_failed", "", "ssd")] == 1

        async def dropped() -> bool:
            return await where(s, k) == "gone"

        await eventually(dropped, "the master dropping the damaged object")
        with pytest.raises(ObjectNotFoundError) as ei2:
            await s.get(k)
        assert ei2.value.miss is not None and ei2.value.miss.tier == "ssd"
        assert (await s.tier_stats())["local_ssd"]["errors"] == 1


async def test_client_restart_reannounces_ssd_objects(tmp_path: Path) -> None:
    async with running_master(client_ttl=1.5) as addr:
        async with open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="never",
        ) as s:
            keys = await fill_and_demote(s, 30)
            await eventually(lambda: _any_on_ssd(s, keys), "a demotion")
            on_ssd = await ssd_keys(s, keys)
        # the client is gone: its DRAM objects with it, its SSD objects once its TTL ran out
        async with open_store(addr, segment_size=MiB) as other:

            async def all_gone() -> bool:
                return all([await where(other, k) == "gone" for k in keys])

            await eventually(all_gone, "the dead client's objects to go")
            with pytest.raises(ObjectNotFoundError) as ei:
                await other.get(on_ssd[0])
            miss = ei.value.miss
            assert miss is not None and miss.reason is MissReason.OWNER_DIED
            await other.put(on_ssd[1], b"a newer life")  # re-put while the owner is away
            async with open_store(
                addr,
                segment_size=MiB,
                ssd_path=str(tmp_path),
                ssd_capacity=64 * MiB,
                promotion="never",
            ) as s2:
                assert s2.ssd is not None
                assert {e.key for e in s2.ssd.recovered} >= set(on_ssd)
                assert await s2.get(on_ssd[0]) == value(keys.index(on_ssd[0]))
                assert await where(s2, on_ssd[0]) == "ssd"
                assert await s2.get(on_ssd[1]) == b"a newer life"  # the stale copy was dropped
                assert on_ssd[1] not in s2.ssd
                for k in on_ssd[2:]:
                    assert await s2.get(k) == value(keys.index(k))


async def test_without_ssd_evictions_are_attributed_to_the_policy() -> None:
    async with (
        running_master(eviction_policy="s3fifo") as addr,
        open_store(addr, segment_size=MiB) as s,
    ):
        keys = await fill_and_demote(s, 40)
        gone = [k for k in keys if await where(s, k) == "gone"]
        assert gone
        with pytest.raises(ObjectNotFoundError) as ei:
            await s.get(gone[0])
        m = ei.value.miss
        assert m is not None
        assert (m.reason, m.policy, m.tier) == (MissReason.EVICTED, "s3fifo", "dram")
        with pytest.raises(ObjectNotFoundError) as ei:
            await s.get("never-put")
        m = ei.value.miss
        assert m is not None and m.reason is MissReason.NEVER_STORED
        counts = s.miss_stats()
        assert counts[("evicted", "s3fifo", "dram")] == 1
        assert counts[("never_stored", "", "")] == 1


async def test_metrics_export_misses_and_tier_counters(tmp_path: Path) -> None:
    import httpx

    cfg = MasterServerConfig(
        rpc_port=0,
        metrics_port=0,
        sweep_interval=0.02,
        state=MasterConfig(seed=1, default_kv_lease_ttl=0.05),
    )
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        async with open_store(
            f"127.0.0.1:{server.rpc_port}",
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="never",
        ) as s:
            keys = await fill_and_demote(s, 24)
            await eventually(lambda: _any_on_ssd(s, keys), "a demotion")
            with pytest.raises(ObjectNotFoundError):
                await s.get("never-put")
            async with httpx.AsyncClient() as http:
                r = await http.get(f"http://127.0.0.1:{server.metrics_port}/metrics")
            text = r.text
            assert 'master_misses_total{policy="",reason="never_stored",tier=""} 1.0' in text
            assert 'master_tier_demotions_total{tier="ssd"}' in text
            line = next(
                ln
                for ln in text.splitlines()
                if ln.startswith('master_tier_demotions_total{tier="ssd"}')
            )
            assert float(line.split()[-1]) >= 1
        tg.cancel_scope.cancel()


async def test_a_lost_demote_end_answer_keeps_the_ssd_copy(tmp_path: Path) -> None:
    """The master applied DemoteEnd but its answer was lost (a reset): the copy must stay,
    since the master now lists it as the object's only replica."""
    async with (
        running_master() as addr,
        open_store(
            addr, segment_size=MiB, ssd_path=str(tmp_path), ssd_capacity=64 * MiB, promotion="never"
        ) as s,
    ):
        real = s.master.call
        lost: list[str] = []

        async def call(method: str, params: Any, *args: Any) -> Any:
            res = await real(method, params, *args)
            if method == "DemoteEnd" and not lost:
                lost.append(params.key)
                raise RpcError("master RPC DemoteEnd failed: connection reset (after it applied)")
            return res

        s.master.call = call  # type: ignore[method-assign]
        keys = await fill_and_demote(s, 40)

        async def one_lost() -> bool:
            return bool(lost)

        await eventually(one_lost, "a demotion")
        key = lost[0]
        assert await where(s, key) == "ssd"
        assert s.ssd is not None and key in s.ssd
        assert await s.get(key) == value(keys.index(key))  # readable: on main, a dangling key
        assert not s._unsettled


async def test_master_restart_reannounces_the_ssd_tier(tmp_path: Path) -> None:
    """A restarted master knows nothing; the client's NEED_REMOUNT re-mounts its segment and
    re-announces every SSD object, which stays readable."""
    scopes: list[anyio.CancelScope] = []
    stopped = anyio.Event()

    async def serve(
        cfg: MasterServerConfig,
        *,
        task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await serve_master(cfg, task_status=task_status)
        stopped.set()  # its listener is closed

    def config(port: int) -> MasterServerConfig:
        return MasterServerConfig(
            rpc_port=port,
            enable_metric_reporting=False,
            sweep_interval=0.02,
            state=MasterConfig(seed=1, default_kv_lease_ttl=0.05),
        )

    async with anyio.create_task_group() as tg:
        server = await tg.start(serve, config(0))
        port = server.rpc_port
        async with open_store(
            f"127.0.0.1:{port}",
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="never",
        ) as s:
            keys = await fill_and_demote(s, 30)
            await eventually(lambda: _any_on_ssd(s, keys), "a demotion")
            on_ssd = await ssd_keys(s, keys)
            scopes[0].cancel()  # the master dies ...
            await stopped.wait()
            server2 = await tg.start(serve, config(port))  # ... and comes back, empty

            async def reannounced() -> bool:
                return server2.state.has_client(s.client_id) and all(
                    [await where(s, k) == "ssd" for k in on_ssd]
                )

            await eventually(reannounced, "the SSD objects to be re-announced")
            for k in on_ssd:
                assert await s.get(k) == value(keys.index(k))
            assert server2.state.segment_count == 1
        tg.cancel_scope.cancel()
