"""SGLang's own HiCache L3 backend ``MooncakeStore`` on our store, two layouts, two processes.

Run with the python of the venv that ``scripts/integration-sglang.sh`` builds (sglang 0.5.23
``--no-deps``, torch 2.13.0 CPU) and this checkout first on ``PYTHONPATH``::

    python tests/integration/sglang_hicache.py [--json OUT] [--layouts mha,mla]

It starts our master (``python -m mooncake master --rpc-port 0 --no-metrics``), then, per
layout, builds SGLang's real ``MooncakeStore(HiCacheStorageConfig(...))`` from
``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py`` (its ``setup`` with eight
positional arguments and its ``warmup``: ``put``/``is_exist``/``get`` of 4 KiB), registers a
host KV pool with ``register_mem_pool_host`` (``register_buffer`` of the whole pool), and runs:

* ``batch_exists`` (0 before), ``batch_set_v1`` of N pages (every page True), ``batch_exists``
  (N after), a second ``batch_set_v1`` of the same pages (already there: True, nothing put);
* ``batch_get_v1`` into other host indices of the same pool: bytes equal the written pages;
* a second process with its own ``MooncakeStore`` and a zeroed pool: ``batch_exists`` N and
  ``batch_get_v1`` of the same keys: bytes equal (sha256 of the pages) to the writer's.

Layouts (host pool geometry as SGLang's ``init_kv_buffer`` lays it out; see
``sglang_stubs.py`` for which pool methods are SGLang's own):

* ``mha``: ``MHATokenToKVPoolHost``, ``page_first``: two objects per page (``_k``, ``_v``),
  flat pointers: ``batch_put_from`` / ``batch_get_into``;
* ``mla``: ``MLATokenToKVPoolHost``, ``layer_first``: one object per page made of one buffer
  per layer: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``.

The store config comes through ``extra_config`` with ``protocol`` from ``MOONCAKE_PROTOCOL``,
default ``"rdma"`` as in SGLang's ``environ.py`` (without an RNIC our store falls back to
``"tcp"`` with one warning). Prints one JSON object (bytes,
keys, seconds per step) and a last line ending in ``OK`` when every check held.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_stubs  # noqa: E402

ROOT = sglang_stubs.install()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (  # noqa: E402
    MooncakeStore,
)

PAGES = 24  # pages per batch
PAGE_SIZE = 16  # tokens per page
LAYERS = 4

_MHA = sglang_stubs.sglang_methods(
    ROOT / "srt/mem_cache/pool_host/mha.py", "MHATokenToKVPoolHost", ("get_page_buffer_meta",)
)
_MLA = sglang_stubs.sglang_methods(
    ROOT / "srt/mem_cache/pool_host/mla.py",
    "MLATokenToKVPoolHost",
    ("get_page_buffer_meta", "_storage_page_index"),
)


class MHAHostPool:
    """Geometry of ``MHATokenToKVPoolHost`` (``page_first``); ``get_page_buffer_meta`` is SGLang's."""

    get_page_buffer_meta = _MHA["get_page_buffer_meta"]

    def __init__(self, size: int, fill: bool) -> None:
        self.layout = "page_first"
        self.page_size = PAGE_SIZE
        self.layer_num = LAYERS
        self.size = size
        self.head_num = 2
        self.head_dim = 64
        self.dtype = torch.bfloat16
        dims = (2, size, self.layer_num, self.head_num, self.head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)
        if fill:
            g = torch.Generator().manual_seed(1)
            self.kv_buffer.copy_(torch.randn(dims, generator=g).to(self.dtype))

    def get_ksize_per_token(self) -> int:
        return self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize

    def pages(self, start: int, n: int) -> torch.Tensor:
        return self.kv_buffer[:, start : start + n]


class MLAHostPool:
    """Geometry of ``MLATokenToKVPoolHost`` (``layer_first``); the methods named are SGLang's."""

    get_page_buffer_meta = _MLA["get_page_buffer_meta"]
    _storage_page_index = _MLA["_storage_page_index"]

    def __init__(self, size: int, fill: bool) -> None:
        self.layout = "layer_first"
        self.page_size = PAGE_SIZE
        self.logical_page_size = PAGE_SIZE
        self.dcp_size = 1
        self.layer_num = LAYERS
        self.size = size
        self.kv_cache_dim = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
        self.dtype = torch.bfloat16
        dims = (self.layer_num, size, 1, self.kv_cache_dim)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)
        if fill:
            g = torch.Generator().manual_seed(2)
            self.kv_buffer.copy_(torch.randn(dims, generator=g).to(self.dtype))

    def get_ksize_per_token(self) -> int:
        return self.kv_cache_dim * self.layer_num * self.dtype.itemsize

    def pages(self, start: int, n: int) -> torch.Tensor:
        return self.kv_buffer[:, start : start + n]


POOLS = {"mha": MHAHostPool, "mla": MLAHostPool}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_store(layout: str, master: str) -> MooncakeStore:
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=layout == "mla",
        enable_storage_metrics=False,
        is_page_first_layout=layout == "mha",
        model_name="tiny/model",
        extra_config={
            "master_server_address": master,
            "metadata_server": "P2PHANDSHAKE",
            "local_hostname": "127.0.0.1",
            "protocol": os.environ.get("MOONCAKE_PROTOCOL", "rdma"),
            "device_name": "",
            "global_segment_size": 64 << 20,
        },
    )
    return MooncakeStore(cfg)


CALLS = (
    "batch_is_exist",
    "batch_put_from",
    "batch_get_into",
    "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers",
)


def observe(store: MooncakeStore) -> dict[str, dict[str, int]]:
    """Counts what our store answered to SGLang's calls (per call: per return code, a count).

    Only observes: each call's arguments and result pass through unchanged.
    """
    seen: dict[str, dict[str, int]] = {}
    inner = store.store
    for name in CALLS:
        fn = getattr(inner, name)

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name) -> Any:
            out = _fn(*args)
            codes = seen.setdefault(_name, {})
            for code in out if isinstance(out, list) else [out]:
                key = "bytes>0" if _name.startswith("batch_get") and code > 0 else str(code)
                codes[key] = codes.get(key, 0) + 1
            return out

        setattr(inner, name, wrapped)
    return seen


def reader(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a second process: a fresh MooncakeStore and a zeroed pool read the writer's pages."""
    layout, n = spec["layout"], spec["pages"]
    t0 = time.monotonic()
    store = make_store(layout, spec["master"])
    seen = observe(store)
    pool = POOLS[layout](2 * n * PAGE_SIZE, fill=False)
    store.register_mem_pool_host(pool)
    setup_s = time.monotonic() - t0
    exists = store.batch_exists(spec["keys"])
    t1 = time.monotonic()
    got = store.batch_get_v1(spec["keys"], torch.arange(n * PAGE_SIZE, dtype=torch.int64))
    get_s = time.monotonic() - t1
    return {
        "exists": exists,
        "get_true": sum(got),
        "digest": digest(pool.pages(0, n * PAGE_SIZE)),
        "setup_s": round(setup_s, 3),
        "get_s": round(get_s, 4),
        "store_answers": seen,
    }


def run_layout(layout: str, master: str) -> dict[str, Any]:
    n = PAGES
    tokens = n * PAGE_SIZE
    t0 = time.monotonic()
    store = make_store(layout, master)  # setup (8 positional) + warm-up
    seen = observe(store)
    pool = POOLS[layout](2 * tokens, fill=True)
    store.register_mem_pool_host(pool)
    res: dict[str, Any] = {"setup_and_warmup_s": round(time.monotonic() - t0, 3)}
    keys = [hashlib.sha256(f"{layout}-page-{i}".encode()).hexdigest() for i in range(n)]
    written = pool.pages(0, tokens).clone()
    page_bytes = written.numel() * written.element_size() // n
    res.update(keys=n, page_bytes=page_bytes, bytes=page_bytes * n)
    res["exists_before"] = store.batch_exists(keys)
    t1 = time.monotonic()
    res["set_true"] = sum(store.batch_set_v1(keys, torch.arange(tokens, dtype=torch.int64)))
    res["set_s"] = round(time.monotonic() - t1, 4)
    res["exists_after"] = store.batch_exists(keys)
    res["set_again_true"] = sum(store.batch_set_v1(keys, torch.arange(tokens, dtype=torch.int64)))
    # local read-back into the second half of the pool
    pool.kv_buffer[:, tokens:] = 0
    t2 = time.monotonic()
    res["get_local_true"] = sum(
        store.batch_get_v1(keys, torch.arange(tokens, 2 * tokens, dtype=torch.int64))
    )
    res["get_local_s"] = round(time.monotonic() - t2, 4)
    res["local_bytes_equal"] = bool(torch.equal(pool.pages(tokens, tokens), written))
    # a second process reads the same keys through its own client
    spec = {"layout": layout, "pages": n, "keys": keys, "master": master}
    proc = subprocess.run(
        [sys.executable, __file__, "--reader", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        res["remote"] = {"error": f"reader rc={proc.returncode}"}
        res["remote_bytes_equal"] = False
    else:
        remote = json.loads(lines[-1][len("RESULT ") :])
        res["remote"] = remote
        res["remote_bytes_equal"] = remote["digest"] == digest(written)
    res["store_answers"] = seen
    store.clear()
    res["ok"] = (
        res["exists_before"] == 0
        and res["set_true"] == n
        and res["exists_after"] == n
        and res["set_again_true"] == n
        and res["get_local_true"] == n
        and res["local_bytes_equal"]
        and res["remote_bytes_equal"]
        and res["remote"].get("exists") == n
        and res["remote"].get("get_true") == n
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reader")
    ap.add_argument("--json")
    ap.add_argument("--layouts", default="mha,mla")
    args = ap.parse_args()
    if args.reader:
        print("RESULT " + json.dumps(reader(json.loads(args.reader))), flush=True)
        return 0
    import mooncake

    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--no-metrics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    result: dict[str, Any] = {"mooncake": mooncake.__file__}
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split("rpc=", 1)[1].split()[0]
        for layout in args.layouts.split(","):
            try:
                result[layout] = run_layout(layout, address)
            except Exception as exc:  # report the layout, go on with the next
                result[layout] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        master.terminate()
        master.wait(10)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    layouts = args.layouts.split(",")
    ok = all(result[ly]["ok"] for ly in layouts)
    summary = ", ".join(
        f"{ly}: {'ok' if result[ly]['ok'] else 'FAILED'}"
        + (
            f" ({result[ly].get('keys')} pages, {result[ly].get('bytes')} B)"
            if "bytes" in result[ly]
            else ""
        )
        for ly in layouts
    )
    print(f"sglang hicache: {summary}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
