"""The store call sequences of vLLM, SGLang and LMCache, replayed on the published sync API.

Each test makes exactly the ``mooncake.store.MooncakeDistributedStore`` calls one integration
makes, with the argument shapes and the return conventions it relies on (docs/integrations.md
lists them, read from the integrations' sources), against a real master process, with a second
client process contributing a segment so that objects land in another process's memory as well
as ours. Values are numpy stand-ins for the integrations' KV tensors (same pointers-and-sizes
shapes); every byte read back is compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.helpers.store_procs import Client, Master

MiB = 1 << 20


@pytest.fixture
def cluster() -> Iterator[tuple[Master, Client]]:
    master = Master()
    other = Client(master.address, 64)
    try:
        yield master, other
    finally:
        other.stop()
        master.stop()


def _store(
    master: Master, protocol: str, segment: int = 64 * MiB, *extra: object
) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, protocol, "", master.address, *extra
    )
    assert rc == 0, f"setup answered {rc}"
    return store


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}@{hashlib.sha256(str(i).encode()).hexdigest()[:32]}" for i in range(n)]


def test_vllm_store_connector(cluster: tuple[Master, Client]) -> None:
    """MooncakeStoreWorker + KVCacheStoreSendingThread/RecvingThread: 7-positional ``setup`` with
    the config default ``"rdma"``, ``register_buffer`` per KV cache tensor, ``batch_is_exist``
    (``== 1``), ``batch_put_from_multi_buffers`` (one segment per layer's K and V block,
    ``< 0`` = failed key), ``batch_get_into_multi_buffers`` (``>= 0`` = loaded),
    ``remove_all(force=True)``, ``close``."""
    master, _ = cluster
    store = _store(master, "rdma")
    try:
        layers, block = 4, 8 << 10
        nblocks = 16
        # vLLM's layout: per layer one K and one V cache tensor of nblocks blocks
        kv = [
            np.random.default_rng(i).integers(0, 256, nblocks * block, dtype=np.uint8)
            for i in range(2 * layers)
        ]
        for t in kv:
            assert store.register_buffer(int(t.ctypes.data), t.nbytes) == 0
        cfg = ReplicateConfig()
        cfg.preferred_segment = store.get_hostname()
        keys = _keys("toy@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0", 8)
        assert store.batch_is_exist(keys) == [0] * len(keys)
        addrs = [[int(t.ctypes.data) + b * block for t in kv] for b in range(len(keys))]
        sizes = [[block] * len(kv) for _ in keys]
        codes = store.batch_put_from_multi_buffers(keys, addrs, sizes, cfg)
        assert isinstance(codes, list) and len(codes) == len(keys)
        assert all(c >= 0 for c in codes), codes
        assert store.batch_is_exist(keys) == [1] * len(keys)
        # load into the other half of the caches (blocks 8..15), as a later request would
        dst = [[int(t.ctypes.data) + (8 + b) * block for t in kv] for b in range(len(keys))]
        got = store.batch_get_into_multi_buffers(keys, dst, sizes)
        assert got == [block * len(kv)] * len(keys)
        for t in kv:
            assert np.array_equal(t[: 8 * block], t[8 * block :])
        # a miss is negative for that key only
        mixed = store.batch_get_into_multi_buffers([keys[0], "never-stored"], dst[:2], sizes[:2])
        assert mixed[0] == block * len(kv) and mixed[1] < 0
        assert store.remove_all(force=True) >= len(keys)
        assert store.batch_is_exist(keys) == [0] * len(keys)
        for t in kv:
            assert store.unregister_buffer(int(t.ctypes.data)) == 0
    finally:
        assert store.close() == 0


def test_vllm_store_full_answers_minus_200(cluster: tuple[Master, Client]) -> None:
    """vLLM switches on back-pressure when a put answers -200 (NO_AVAILABLE_HANDLE): a store
    filled with hard-pinned objects (nothing evictable) must answer exactly that."""
    master, other = cluster
    other.stop()  # only our segment: full means full
    store = _store(master, "rdma", 8 * MiB)
    try:
        value = np.ones(MiB, dtype=np.uint8)
        assert store.register_buffer(int(value.ctypes.data), value.nbytes) == 0
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        codes = []
        for i in range(16):
            (code,) = store.batch_put_from_multi_buffers(
                [f"full-{i}"], [[int(value.ctypes.data)]], [[MiB]], cfg
            )
            codes.append(code)
            if code < 0:
                break
        assert codes[-1] == -200, codes
        assert all(c == 0 for c in codes[:-1]) and len(codes) > 1
    finally:
        store.close()


def test_sglang_hicache(cluster: tuple[Master, Client]) -> None:
    """HiCache's MooncakeStore: 8-positional ``setup`` (``"rdma"``, engine ``None``), the
    warm-up (``put`` of 4096 zero bytes, ``is_exist == 1``, ``get`` equal), ``register_buffer``
    of the host KV pool, then an MHA page layout (flat pointers: ``batch_put_from`` ``== 0``,
    ``batch_get_into`` ``> 0``) and an MLA layer-first layout (multi-buffer: a page's key holds
    one slice per layer), ``batch_is_exist`` as long as its input, ``remove_all``."""
    master, _ = cluster
    store = _store(master, "rdma", 64 * MiB, None)
    try:
        warm = "warmup_key_" + "0" * 8
        assert store.put(warm, bytes(4096)) == 0
        assert store.is_exist(warm) == 1
        assert store.get(warm) == bytes(4096)

        page = 16 << 10
        pool = np.random.default_rng(5).integers(0, 256, 64 * page, dtype=np.uint8)
        assert store.register_buffer(int(pool.ctypes.data), pool.nbytes) == 0
        base = int(pool.ctypes.data)
        # MHA: page i's K at page 2i and V at 2i+1 of the pool; keys carry the rank and k/v
        hashes = _keys("mha", 8)
        mha_keys = [f"{h}_0_{kv}" for h in hashes for kv in ("k", "v")]
        ptrs = [base + j * page for j in range(len(mha_keys))]
        assert store.batch_put_from(mha_keys, ptrs, [page] * len(mha_keys)) == [0] * len(mha_keys)
        exist = store.batch_is_exist([*mha_keys, "absent_0_k"])
        assert (
            len(exist) == len(mha_keys) + 1 and exist[:-1] == [1] * len(mha_keys) and exist[-1] == 0
        )
        back = [base + (32 + j) * page for j in range(len(mha_keys))]
        got = store.batch_get_into(mha_keys, back, [page] * len(mha_keys))
        assert all(g > 0 for g in got), got
        assert np.array_equal(pool[: 16 * page], pool[32 * page : 48 * page])

        # MLA layer-first: 4 layers, each page of the pool holds 4 layer slices of 4 KiB
        layers, piece = 4, 4 << 10
        mla_keys = [f"{h}_0" for h in _keys("mla", 4)]
        src = [
            [base + (48 + i) * page + layer * piece for layer in range(layers)] for i in range(4)
        ]
        sizes = [[piece] * layers for _ in mla_keys]
        assert store.batch_put_from_multi_buffers(mla_keys, src, sizes) == [0] * 4
        dst = [
            [base + (56 + i) * page + layer * piece for layer in range(layers)] for i in range(4)
        ]
        got = store.batch_get_into_multi_buffers(mla_keys, dst, sizes)
        assert got == [layers * piece] * 4
        assert np.array_equal(pool[48 * page : 52 * page], pool[56 * page : 60 * page])
        # clear(): objects under a read lease (we just read them) stay, as in Mooncake
        assert isinstance(store.remove_all(), int)
    finally:
        store.close()


def test_lmcache_mooncakestore_connector(cluster: tuple[Master, Client]) -> None:
    """LMCache's ``mooncakestore://`` connector: 7-positional ``setup`` with ``"tcp"``,
    ``ReplicateConfig(replica_num=1, preferred_segment=get_hostname())``, ``put_from`` of a
    chunk from its registered CPU buffer, ``batch_get_into`` (``> 0``), and with
    ``save_chunk_meta`` ``put_parts(key, 28-byte header, memoryview)`` read back through
    ``batch_get_buffer`` (buffer-protocol objects, the payload at offset 28)."""
    master, _ = cluster
    store = _store(master, "tcp")
    try:
        hostname = store.get_hostname()
        assert isinstance(hostname, str) and hostname
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.preferred_segment = hostname
        chunk = 256 << 10
        buf = np.random.default_rng(9).integers(0, 256, 8 * chunk, dtype=np.uint8)
        base = int(buf.ctypes.data)
        assert store.register_buffer(base, buf.nbytes) == 0
        keys = [f"vllm@toy@1@0@{i:016x}" for i in range(3)]
        assert not store.is_exist(keys[0])
        for i, k in enumerate(keys):
            store.put_from(k, base + i * chunk, chunk, cfg)  # return ignored, as upstream
        assert all(store.is_exist(k) for k in keys)
        got = store.batch_get_into(keys, [base + (4 + i) * chunk for i in range(3)], [chunk] * 3)
        assert all(g > 0 for g in got)
        assert np.array_equal(buf[: 3 * chunk], buf[4 * chunk : 7 * chunk])

        header = np.arange(7, dtype=np.int32).tobytes()  # 28 bytes: shape, dtype, fmt
        assert len(header) == 28
        meta_key = "vllm@toy@1@0@meta"
        store.put_parts(meta_key, header, memoryview(buf[:chunk]))
        (obj,) = store.batch_get_buffer([meta_key])
        assert obj is not None
        view = memoryview(obj)
        assert bytes(view[:28]) == header
        assert np.array_equal(np.frombuffer(view, dtype=np.uint8, offset=28), buf[:chunk])
        assert store.batch_get_buffer(["never-stored"]) == [None]
        assert store.unregister_buffer(base) == 0
    finally:
        store.close()
