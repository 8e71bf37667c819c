"""Big answers in pages: key and segment listings paged, the all-at-once forms bounded with a
clear error, batch calls split into chunks (the async client and the caller-thread path), and
the admin HTTP listings' page form."""

from __future__ import annotations

import json

import anyio
import pytest

import mooncake
from mooncake._core import paging, rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake._store import batching
from mooncake._store.listing_http import admin_listing
from mooncake._store.master_conn import MasterConnection
from mooncake.errors import InvalidArgumentError
from mooncake.store import MooncakeDistributedStore
from mooncake.testing import local_master_server
from tests.helpers.store_procs import Master

MiB = 1 << 20


def state_with(n: int) -> MasterState:
    m = MasterState(MasterConfig(seed=0))
    m.mount_segment("c", Segment(id="s", name="127.0.0.1:1", base=1 << 30, size=64 * MiB), 0)
    for i in range(n):
        m.put_start("c", f"key-{i:05d}", 16, ReplicateConfig(), 0)
        m.put_end("c", f"key-{i:05d}", 0)
    return m


def scan(m: MasterState, limit: int) -> tuple[list[str], int]:
    out: list[str] = []
    cursor, pages = 0, 0
    while cursor >= 0:
        keys, cursor = m.all_keys_page(cursor, limit)
        out += keys
        pages += 1
    return out, pages


def test_pages_list_every_key_once() -> None:
    m = state_with(2500)
    keys, pages = scan(m, 1000)
    assert pages == 3
    assert sorted(keys) == sorted(m.all_keys())
    assert len(keys) == len(set(keys)) == 2500


def test_keys_present_during_the_whole_scan_are_listed_once() -> None:
    m = state_with(300)
    first, cursor = m.all_keys_page(0, 100)
    for k in first[:50]:  # removed behind the cursor, and ahead of it
        m.remove(k, True, 1)
    m.remove("key-00250", True, 1)
    for i in range(20):  # added meanwhile (may or may not be listed)
        m.put_start("c", f"new-{i}", 16, ReplicateConfig(), 1)
        m.put_end("c", f"new-{i}", 1)
    rest: list[str] = []
    while cursor >= 0:
        keys, cursor = m.all_keys_page(cursor, 100)
        rest += keys
    listed = first + rest
    assert len(listed) == len(set(listed))
    survivors = {f"key-{i:05d}" for i in range(300)} - set(first[:50]) - {"key-00250"}
    assert survivors <= set(listed)
    assert "key-00250" not in rest


def test_a_bad_page_limit_is_refused_naming_it() -> None:
    m = state_with(1)
    for bad in (0, -1, paging.PAGE_ITEMS_MAX + 1):
        with pytest.raises(InvalidArgumentError, match="page limit"):
            m.all_keys_page(0, bad)


def test_all_at_once_listings_are_refused_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    m = state_with(200)
    assert len(m.all_keys_bounded()) == 200
    monkeypatch.setattr(paging, "ONE_FRAME_ANSWER_MAX", 1000)
    with pytest.raises(InvalidArgumentError, match="GetAllKeysPage"):
        m.all_keys_bounded()
    segs, nxt = m.all_segments_page(0, 10)
    assert len(segs) == 1 and nxt == -1


def test_admin_http_listing_pages() -> None:
    m = state_with(250)
    code, _, body = admin_listing(m, "/get_all_keys", {})
    assert code == 200 and len(json.loads(body)) == 250  # the published form: everything
    seen: list[str] = []
    cursor = 0
    while cursor >= 0:
        code, _, body = admin_listing(
            m, "/get_all_keys", {"limit": ["100"], "cursor": [str(cursor)]}
        )
        assert code == 200
        doc = json.loads(body)
        seen += doc["keys"]
        cursor = doc["next"]
    assert sorted(seen) == sorted(m.all_keys())
    code, _, body = admin_listing(m, "/get_all_keys", {"limit": ["lots"]})
    assert code == 400 and b"limit" in body


def test_batches_split_by_keys_and_bytes() -> None:
    keys = [f"k{i}" for i in range(batching.CHUNK_KEYS * 2 + 5)]
    cfg = ReplicateConfig(group_ids=[str(i) for i in range(len(keys))])
    parts = batching.split(
        "BatchPutStart",
        rpc.BatchPutStartParams(client_id="c", keys=keys, sizes=list(range(len(keys))), config=cfg),
    )
    assert parts is not None and len(parts) == 3
    assert [k for p in parts for k in p.keys] == keys
    assert [s for p in parts for s in p.sizes] == list(range(len(keys)))
    assert [g for p in parts for g in p.config.group_ids] == cfg.group_ids
    big = ["x" * (1 << 20)] * 5  # 5 MiB of keys: over the byte bound
    parts = batching.split("BatchExistKey", rpc.KeysParams(keys=big))
    assert parts is not None and len(parts) >= 3
    assert batching.split("BatchExistKey", rpc.KeysParams(keys=["a", "b"])) is None
    assert batching.split("GetReplicaList", rpc.KeyParams(key="a")) is None


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 64 keys: a batch of a few hundred keys is split (and read well inside its
    read windows on a loaded machine)."""
    monkeypatch.setattr(batching, "CHUNK_KEYS", 64)
    return 64


@pytest.mark.anyio
async def test_the_async_client_pages_and_chunks_against_a_master(
    small_chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = small_chunks * 4 + 10
    split = batching.split
    chunked: list[tuple[str, int]] = []

    def spy(method: str, params: object) -> object:
        parts = split(method, params)
        chunked.append((method, 0 if parts is None else len(parts)))
        return parts

    monkeypatch.setattr(batching, "split", spy)
    async with local_master_server() as server:
        addr = f"127.0.0.1:{server.rpc_port}"
        async with mooncake.open_store(addr, segment_size=64 * MiB) as store:
            keys = [f"b{i}" for i in range(n)]
            res = await store.put_batch(keys, [b"v%d" % i for i in range(n)])
            assert res == [None] * n
            assert ("BatchPutStart", 5) in chunked  # sent as 5 calls
            assert await store.batch_exists(keys) == [1] * n
            assert ("BatchExistKey", 5) in chunked
            got = await store.get_batch(keys)
            assert got == [b"v%d" % i for i in range(n)]
            listed = await store.all_keys(page=50)
            assert sorted(listed) == sorted(keys)
            assert server.requests["GetAllKeysPage"] >= 1
            segs = await store.all_segments()
            assert len(segs) == 1 and segs[0].status == "OK"
            # the all-at-once call is refused past its limit, naming the paged method
            conn = MasterConnection(addr)
            await conn.connect()
            try:
                old = paging.ONE_FRAME_ANSWER_MAX
                paging.ONE_FRAME_ANSWER_MAX = 1000
                try:
                    with pytest.raises(InvalidArgumentError, match="GetAllKeysPage"):
                        await conn.call("GetAllKeys", rpc.Empty())
                finally:
                    paging.ONE_FRAME_ANSWER_MAX = old
                assert len(await conn.call("GetAllKeys", rpc.Empty())) == n
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.aclose()


def test_the_sync_facade_chunks_big_batches(small_chunks: int) -> None:
    n = small_chunks * 4 + 10
    master = Master()
    try:
        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 16 * MiB, "tcp", "", master.address)
        assert rc == 0
        try:
            keys = [f"f{i}" for i in range(n)]
            assert s.put_batch(keys, [b"w%d" % i for i in range(n)]) == 0
            assert s.batch_is_exist(keys) == [1] * n
            assert s.get_batch(keys) == [b"w%d" % i for i in range(n)]
        finally:
            s.close()
    finally:
        master.stop()
