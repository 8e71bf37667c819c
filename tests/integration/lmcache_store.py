"""LMCache's own ``mooncakestore://`` remote connector on our store, both metadata modes.

Run with the python of the venv that ``scripts/integration-lmcache.sh`` builds (lmcache 0.5.6
``--no-deps``, torch 2.13.0 CPU) and this checkout first on ``PYTHONPATH``::

    python tests/integration/lmcache_store.py [--json OUT]

Everything on LMCache's side is its own code, unstubbed: ``MooncakestoreConnector`` from
``lmcache/v1/storage_backend/connector/mooncakestore_connector.py`` over a real
``LocalCPUBackend`` (``lmcache/v1/storage_backend/local_cpu_backend.py``) whose allocator is a
real ``MixedMemoryAllocator`` (its ``pin_allocator.buffer`` is what the connector hands to
``register_buffer``), ``LMCacheEngineConfig.from_defaults`` and ``LMCacheMetadata``. It starts
our master and writes the ``MOONCAKE_CONFIG_PATH`` JSON that the connector reads (the connector
calls ``setup`` with the dict form first, as it does with a current Mooncake).

Per ``save_chunk_meta`` mode (``extra_config``):

* ``False`` (zero-copy): ``put`` -> ``put_from`` of each chunk, ``batched_put`` ->
  ``batch_put_from``; ``batched_get`` -> ``batch_get_into`` into chunks the backend allocates;
* ``True``: ``put``/``batched_put`` -> ``put_parts(key, 28-byte RemoteMetadata, kv bytes)``;
  ``batched_get`` -> ``batch_get_buffer`` and LMCache's own header parsing.

``setup``: the connector's ``setup_mooncake_store`` calls ``store.setup(dict)`` first (falling
back to the seven positional arguments only on ``TypeError``) and ignores the return value. The
dict it builds holds its config file's keys (``device_name``, ``master_server_address``,
``transfer_timeout``...); our ``setup(dict)`` reads the config-file spellings and ignores keys it
does not use, with a warning. The check ``dict_setup`` builds a connector the default way and
asks ``is_exist`` of an absent key (0, not a negative code, which LMCache would read as
"exists"), and the data checks run on that same default path: nothing of LMCache is changed.

Each mode writes N chunks in this process, checks ``exists``/``batched_async_contains``, reads
them back here (``batched_get``) and from a second process with its own connector; the chunks'
bytes (sha256) must equal what was put. Prints one JSON object (bytes, keys, seconds) and a
last line ending in ``OK`` when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
    MooncakestoreConnector,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 64  # tokens per chunk
KV_SHAPE = (4, 2, CHUNK, 2, 64)  # (layers, k/v, chunk tokens, kv heads, head size)
CHUNKS = 12  # per mode: half through put, half through batched_put


async def dict_setup_check() -> dict[str, Any]:
    conn, _, _ = build(False)
    res = {
        "absent_key_is_exist": conn.store.is_exist("absent-key"),
        "registered": conn.registered_buffer_ptr is not None,
    }
    res["ok"] = res["absent_key_is_exist"] == 0 and res["registered"]
    await conn.close()
    return res


def build(save_chunk_meta: bool) -> tuple[MooncakestoreConnector, LocalCPUBackend, LMCacheMetadata]:
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,
        max_local_cpu_size=0.0625,
        extra_config={"save_chunk_meta": save_chunk_meta},
    )
    md = LMCacheMetadata(
        model_name="tiny/model",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )
    backend = LocalCPUBackend(cfg, md, memory_allocator=MixedMemoryAllocator(32 << 20))
    conn = MooncakestoreConnector(asyncio.get_running_loop(), backend, cfg)
    return conn, backend, md


def keys_for(mode: bool) -> list[CacheEngineKey]:
    return [
        CacheEngineKey("tiny/model", 1, 0, 10_000 * int(mode) + i, torch.bfloat16)
        for i in range(CHUNKS)
    ]


def digest(obj: Any) -> str:
    return hashlib.sha256(bytes(obj.byte_array)).hexdigest()


async def read_back(conn: MooncakestoreConnector, keys: list[CacheEngineKey]) -> dict[str, Any]:
    t0 = time.monotonic()
    got = await conn.batched_get(keys)
    took = time.monotonic() - t0
    out = {
        "digests": [digest(o) if o is not None else None for o in got],
        "get_s": round(took, 4),
        "shapes_ok": all(
            o is not None and list(o.get_shapes()[0]) == list(got[0].get_shapes()[0]) for o in got
        ),
    }
    for o in got:
        if o is not None:
            o.ref_count_down()
    return out


async def reader(mode: bool) -> dict[str, Any]:
    conn, _, _ = build(mode)
    keys = keys_for(mode)
    res = {"contains": await conn.batched_async_contains("r", keys)}
    res.update(await read_back(conn, keys))
    await conn.close()
    return res


async def run_mode(mode: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    conn, backend, md = build(mode)
    res: dict[str, Any] = {
        "setup_s": round(time.monotonic() - t0, 3),
        "registered": conn.registered_buffer_ptr is not None,
    }
    keys = keys_for(mode)
    fmt = MemoryFormat.KV_MLA_FMT if md.use_mla else MemoryFormat.KV_2LTD
    objs = []
    g = torch.Generator().manual_seed(7 + int(mode))
    for _ in keys:
        obj = backend.allocate(md.get_shapes(), md.get_dtypes(), fmt)
        assert obj is not None and obj.raw_tensor is not None
        obj.raw_tensor.copy_(
            torch.randint(0, 256, obj.raw_tensor.shape, dtype=torch.uint8, generator=g).view(
                obj.raw_tensor.dtype
            )
        )
        objs.append(obj)
    want = [digest(o) for o in objs]
    res["contains_before"] = await conn.batched_async_contains("w", keys)
    half = CHUNKS // 2
    t1 = time.monotonic()
    for k, o in zip(keys[:half], objs[:half], strict=True):
        await conn.put(k, o)
    await conn.batched_put(keys[half:], objs[half:])
    res["put_s"] = round(time.monotonic() - t1, 4)
    res["keys"] = CHUNKS
    res["chunk_bytes"] = objs[0].get_size()
    res["bytes"] = sum(o.get_size() for o in objs)
    res["exists"] = [bool(await conn.exists(k)) for k in keys].count(True)
    res["contains_after"] = await conn.batched_async_contains("w", keys)
    local = await read_back(conn, keys)
    res["local_get_s"] = local["get_s"]
    res["local_bytes_equal"] = local["digests"] == want
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, __file__, "--reader", json.dumps(mode)],
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
        res["remote_bytes_equal"] = remote.pop("digests") == want
        res["remote"] = remote
    for o in objs:
        o.ref_count_down()
    conn.store.remove_all()
    await conn.close()
    res["ok"] = (
        res["registered"]
        and res["contains_before"] == 0
        and res["exists"] == CHUNKS
        and res["contains_after"] == CHUNKS
        and res["local_bytes_equal"]
        and res["remote_bytes_equal"]
        and res["remote"].get("contains") == CHUNKS
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reader")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.reader:
        print("RESULT " + json.dumps(asyncio.run(reader(json.loads(args.reader)))), flush=True)
        return 0
    import mooncake

    result: dict[str, Any] = {"mooncake": mooncake.__file__}
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0", "--no-metrics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split("rpc=", 1)[1].split()[0]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "mooncake.json"
            cfg.write_text(
                json.dumps(
                    {
                        "local_hostname": "127.0.0.1",
                        "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": 64 << 20,
                        "local_buffer_size": 32 << 20,
                        "protocol": os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
                        "device_name": "",
                        "master_server_address": address,
                        "transfer_timeout": 30,
                    }
                )
            )
            os.environ["MOONCAKE_CONFIG_PATH"] = str(cfg)
            try:
                result["dict_setup"] = asyncio.run(dict_setup_check())
            except Exception as exc:
                result["dict_setup"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            for mode in (False, True):
                name = f"save_chunk_meta={mode}"
                try:
                    result[name] = asyncio.run(run_mode(mode))
                except Exception as exc:
                    result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        master.terminate()
        master.wait(10)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    modes = [k for k in result if k.startswith("save_chunk_meta")]
    ok = all(result[m]["ok"] for m in modes) and result["dict_setup"]["ok"]
    summary = ", ".join(
        f"{m}: {'ok' if result[m]['ok'] else 'FAILED'} ({result[m].get('keys')} chunks, {result[m].get('bytes')} B)"
        for m in modes
    )
    dict_ok = "ok" if result["dict_setup"]["ok"] else "FAILED"
    print(f"lmcache store: dict setup: {dict_ok}, {summary}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
