"""Write or read a fixed DataProto with ``mooncake.structured_object_store``, in either venv.

Run by the published wheel's python (its module, its ``mooncake_master``) or by this checkout's
(``PYTHONPATH`` at the repository; our module and master). It starts its own master and one
store client, then:

  write DIR   put the fixed DataProto (plus an appended stage), dump every key the handle
              reaches (manifests, metadata, members, chunks) as raw bytes to DIR with the
              exported handle, print the digest of what was put
  read DIR    put DIR's raw keys into its own store, import the handle, read it back (all of
              it, a row slice and picked rows), print the digests

A digest is JSON: per field, dtype, shape and a hash of the bytes for tensors and arrays, the
values themselves for columns. Both sides must print the same digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sidemaster

PUBLISHED = os.environ.get("MC_STRUCTURED_PUBLISHED") == "1"
N = 6


def data() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "batch": {
            "input_ids": torch.randint(0, 50000, (N, 33), generator=g),
            "log_probs": torch.randn(N, 33, generator=g).to(torch.bfloat16),
            "values": torch.randn(N, 33, generator=g, dtype=torch.float32),
            "mask": torch.rand(N, 33, generator=g) > 0.5,
            "half": torch.randn(N, 4, 5, generator=g).to(torch.float16),
        },
        "non_tensor_batch": {
            "uid": np.array([f"uid-{i}-é" for i in range(N)], dtype=object),
            "score": np.array([i * 0.5 for i in range(N)], dtype=object),
            "extra": np.array(
                [{"a": i, "tag": f"t{i}", "l": [1, 2, i]} for i in range(N)], dtype=object
            ),
            "turns": np.array([list(range(i)) for i in range(N)], dtype=object),
            "raw": np.array([bytes([i]) * i if i % 3 else None for i in range(N)], dtype=object),
            "ints": np.arange(N, dtype=np.int32) * 3,
            # ndarray rows (typed_ragged): 1-D of varying length with a null, and 2-D rows
            "tok": _column(
                [None if i == 1 else np.arange(i, dtype=np.int32) * 7 for i in range(N)]
            ),
            "patch": _column(
                [np.arange(2 * (i + 1), dtype=np.float32).reshape(i + 1, 2) for i in range(N)]
            ),
            "mm": _column(
                [
                    None
                    if i == 2
                    else {
                        "pixel_values": torch.randn(i + 1, 3, generator=g),
                        "grid": torch.tensor([i, 2, 2]),
                    }
                    for i in range(N)
                ]
            ),
        },
        "meta_info": {"global_step": 12, "temperature": 0.7, "names": ["a", "b"]},
    }


def _column(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def appended() -> dict[str, Any]:
    g = torch.Generator().manual_seed(8)
    jag = [torch.randn(i % 3 + 1, 2, generator=g) for i in range(N)]  # jagged rows, 2-D
    return {
        "batch": {
            "advantages": torch.randn(N, 33, generator=g),
            "jag": torch.nested.as_nested_tensor(jag, layout=torch.jagged),
        }
    }


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"t": str(v.dtype), "shape": list(v.shape), "v": v.tolist()}
    if isinstance(v, np.ndarray):
        return {"nd": str(v.dtype), "v": _plain(v.tolist())}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"b": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items())}
    if isinstance(v, np.generic):
        return v.item()
    return v


def digest(dp: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in sorted(dp["batch"].items()):
        if t.is_nested:
            out[name] = [str(t.dtype), "nested", t._ragged_idx, _plain(list(t.unbind()))]
            continue
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    for name, col in sorted(dp["non_tensor_batch"].items()):
        if isinstance(col, np.ndarray) and col.dtype != object:
            out[name] = [str(col.dtype), list(col.shape), hashlib.sha256(col.tobytes()).hexdigest()]
        else:
            out[name] = _plain(list(col))
    out["meta_info"] = _plain(dp["meta_info"])
    return out


def select(dp: dict[str, Any], rows: Any, fields: list[str]) -> dict[str, Any]:
    b = {k: v[rows] for k, v in dp["batch"].items() if k in fields}
    nt = {}
    for k, v in dp["non_tensor_batch"].items():
        if k in fields:
            nt[k] = v[rows] if isinstance(rows, slice) else v[np.asarray(rows)]
    return {"batch": b, "non_tensor_batch": nt, "meta_info": dp["meta_info"]}


def start_master() -> tuple[subprocess.Popen[bytes], str]:
    proc, rpc = sidemaster.start_master(PUBLISHED)
    return proc, f"127.0.0.1:{rpc}"


def reached_keys(store: Any, handle: dict[str, Any]) -> list[str]:
    keys: list[str] = []
    for stage in handle["stage_refs"].values():
        mkey = stage["manifest_key"]
        manifest = json.loads(bytes(store.get(mkey)).decode())
        keys.append(mkey)
        for spec in [manifest["meta"], *manifest["buffers"].values()]:
            keys.extend(c["key"] for c in spec["chunks"])
    return list(dict.fromkeys(keys))


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    from mooncake.store import MooncakeDistributedStore
    from mooncake.structured_object_store import (
        FieldSchema,
        MooncakeBundleTransfer,
        export_ref,
        import_ref,
    )

    master, address = start_master()
    try:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", address)
        assert rc == 0, rc
        transfer = MooncakeBundleTransfer(store, default_chunk_bytes=512)
        full = data()
        if mode == "write":
            ref = transfer.put_dataproto(
                full, field_schemas={"mm": FieldSchema("ragged_tensor_dict")}
            )
            ref = transfer.append_dataproto_fields(ref, appended(), stage="adv")
            handle = export_ref(ref)
            keys = reached_keys(store, handle)
            folder.mkdir(parents=True, exist_ok=True)
            index = {}
            for i, key in enumerate(keys):
                (folder / f"{i}.bin").write_bytes(bytes(store.get(key)))
                index[key] = f"{i}.bin"
            (folder / "index.json").write_text(json.dumps({"handle": handle, "keys": index}))
            expected = {**full, "batch": {**full["batch"], **appended()["batch"]}}
            print(json.dumps({"full": digest(expected), "keys": len(keys)}))
        else:
            saved = json.loads((folder / "index.json").read_text())
            for key, file in saved["keys"].items():
                assert store.put(key, (folder / file).read_bytes()) == 0, key
            ref = import_ref(saved["handle"])
            got = transfer.get_dataproto(ref)
            fields = ["values", "uid", "extra", "turns", "ints"]
            sliced = transfer.get_dataproto(ref, rows=slice(1, 5), fields=fields)
            picked = transfer.get_dataproto(ref, rows=[4, 0, 2], fields=fields)
            expected = {**full, "batch": {**full["batch"], **appended()["batch"]}}
            print(
                json.dumps(
                    {
                        "full": digest(got),
                        "sliced": digest(sliced) == digest(select(expected, slice(1, 5), fields)),
                        "picked": digest(picked) == digest(select(expected, [4, 0, 2], fields)),
                    }
                )
            )
        store.close()
    finally:
        master.terminate()
        master.wait(20)


if __name__ == "__main__":
    main()
