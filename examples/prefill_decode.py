"""A toy prefill/decode pair sharing KV blocks through the store.

KV caches are cut into blocks of ``BLOCK_TOKENS`` tokens; a block's key is a hash chained over
every token before and in it (``h_i = sha256(h_{i-1} || tokens_i)``, as vLLM, SGLang and LMCache
key prefix blocks), so two prompts share exactly the blocks of their common prefix. The "model"
is a deterministic numpy function of the tokens, so every reused block can be checked.

* The prefill node computes the KV of a prompt and puts every block (zero-copy ``batch_put_from``
  out of a registered numpy array).
* The decode node receives a longer prompt that shares a prefix; it asks the store which of its
  blocks exist (``batch_exists``), fetches the longest cached prefix (``batch_get_into`` straight
  into its own registered KV array), computes only the rest, checks the reused blocks against a
  recomputation, and reports what it reused.

Both nodes are store clients with their own segments, as on two hosts (here: one process, one
master; the bytes move between the two clients' segments). Run::

    python examples/prefill_decode.py
"""

from __future__ import annotations

import hashlib
import sys

import anyio
import numpy as np

import mooncake
from mooncake import MasterServerConfig, serve_master

BLOCK_TOKENS = 16
LAYERS, HEADS, HEAD_DIM = 4, 2, 32
BLOCK_SHAPE = (LAYERS, 2, BLOCK_TOKENS, HEADS * HEAD_DIM)  # (layer, K/V, token, hidden)
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2  # float16


def block_keys(tokens: list[int], model: str = "toy-llama") -> list[str]:
    """One key per *full* block, chained over the whole prefix (a partial tail is not cached)."""
    keys, h = [], hashlib.sha256(model.encode()).digest()
    for i in range(len(tokens) // BLOCK_TOKENS):
        chunk = np.asarray(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], dtype=np.int64)
        h = hashlib.sha256(h + chunk.tobytes()).digest()
        keys.append(f"{model}/kv/{h.hex()[:32]}")
    return keys


def compute_kv(tokens: list[int], start_block: int, out: np.ndarray) -> None:
    """The toy model: KV of block b depends on every token up to the end of block b."""
    for b in range(start_block, len(tokens) // BLOCK_TOKENS):
        seed = int.from_bytes(
            hashlib.sha256(str(tokens[: (b + 1) * BLOCK_TOKENS]).encode()).digest()[:8], "little"
        )
        out[b] = np.random.default_rng(seed).standard_normal(BLOCK_SHAPE).astype(np.float16)


async def prefill(store: mooncake.Store, tokens: list[int]) -> int:
    n = len(tokens) // BLOCK_TOKENS
    kv = np.empty((n, *BLOCK_SHAPE), dtype=np.float16)
    compute_kv(tokens, 0, kv)
    await store.register_buffer(kv.ctypes.data, kv.nbytes)
    keys = block_keys(tokens)
    results = await store.batch_put_from(
        keys, [kv.ctypes.data + i * BLOCK_BYTES for i in range(n)], [BLOCK_BYTES] * n
    )
    await store.unregister_buffer(kv.ctypes.data)
    failed = [k for k, r in zip(keys, results, strict=True) if r is not None]
    assert not failed, f"puts failed: {failed}"
    return n


async def decode(store: mooncake.Store, tokens: list[int]) -> tuple[int, int, bool]:
    """Returns (blocks reused, blocks computed, reused blocks equal a recomputation)."""
    keys = block_keys(tokens)
    kv = np.zeros((len(keys), *BLOCK_SHAPE), dtype=np.float16)
    await store.register_buffer(kv.ctypes.data, kv.nbytes)
    present = await store.batch_exists(keys)
    hit = next((i for i, p in enumerate(present) if p != 1), len(keys))  # longest cached prefix
    got = await store.batch_get_into(
        keys[:hit], [kv.ctypes.data + i * BLOCK_BYTES for i in range(hit)], [BLOCK_BYTES] * hit
    )
    reused = next((i for i, g in enumerate(got) if g != BLOCK_BYTES), hit)  # a read can still miss
    compute_kv(tokens, reused, kv)  # only the suffix is computed
    await store.unregister_buffer(kv.ctypes.data)
    check = np.empty_like(kv)
    compute_kv(tokens, 0, check)
    return reused, len(keys) - reused, bool(np.array_equal(kv[:reused], check[:reused]))


async def main() -> int:
    rng = np.random.default_rng(7)
    system_prompt = rng.integers(0, 32000, 10 * BLOCK_TOKENS).tolist()
    first = system_prompt + rng.integers(0, 32000, 3 * BLOCK_TOKENS + 5).tolist()
    second = system_prompt + rng.integers(0, 32000, 6 * BLOCK_TOKENS).tolist()

    async with anyio.create_task_group() as tg:
        master = await tg.start(
            serve_master, MasterServerConfig(rpc_port=0, enable_metric_reporting=False)
        )
        addr = f"127.0.0.1:{master.rpc_port}"
        async with (
            mooncake.open_store(addr, segment_size=32 << 20) as prefill_node,
            mooncake.open_store(addr, segment_size=32 << 20) as decode_node,
        ):
            put = await prefill(prefill_node, first)
            reused, computed, equal = await decode(decode_node, second)
        tg.cancel_scope.cancel()

    ok = reused == 10 and computed == 6 and equal
    print(
        f"prefill put {put} blocks ({put * BLOCK_BYTES >> 10} KiB); decode reused {reused} blocks "
        f"({reused * BLOCK_TOKENS} tokens, {reused * BLOCK_BYTES >> 10} KiB) from the store, "
        f"computed {computed}; reused KV equals a recomputation: {equal}: {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
