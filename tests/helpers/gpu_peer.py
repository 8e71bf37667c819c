"""Our engine in a child process with GPU memory (tests/test_gpu.py, benchmarks/gpu_check.py).

Allocates ``--size`` bytes of device memory (``engine.allocate(location="cuda:0")``) and
``--host-size`` bytes of host memory (default: the same), prints
``{"segment", "dev", "host", "backend"}``, then serves one JSON command per stdin line
(``which`` is "dev" or "host"):

  {"op": "fill",  "which": w, "offset": o, "length": n, "seed": s}
  {"op": "check", "which": w, "offset": o, "length": n, "seed": s}  -> {"equal": bool}
  {"op": "push",  "segment": seg, "remote": a, "length": n, "seed": s, "transport": t|null}
        fill our device buffer with pattern s and write it to ``seg`` at ``a``

Patterns are computed on the GPU with cupy (``gpu_pattern``) or with numpy (``host_pattern``),
identically, so a gigabyte is verified without moving it through Python. ``--fake`` runs on the
FAKE runtime of mooncake.testing (no GPU, no cupy: plumbing checks of the benchmark only).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import numpy as np

from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import open_engine

_MUL = np.uint32(2654435761)


def gpu_pattern(cupy: Any, n: int, seed: int) -> Any:
    x = cupy.arange(n, dtype=cupy.uint32)
    return ((x * _MUL + np.uint32(seed * 977)) >> np.uint32(13)).astype(cupy.uint8)


def host_pattern(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    x = np.arange(n, dtype=np.uint32)
    out: np.ndarray[Any, np.dtype[np.uint8]] = (
        (x * _MUL + np.uint32(seed * 977)) >> np.uint32(13)
    ).astype(np.uint8)
    return out


def device_view(cupy: Any, ptr: int, n: int, owner: Any = None) -> Any:
    """A cupy uint8 array over ``[ptr, +n)`` of device memory (not owning it)."""
    mem = cupy.cuda.UnownedMemory(ptr, n, owner)
    return cupy.ndarray((n,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))


class DeviceMem:
    """Fill/check device memory: on the GPU with cupy, or in host memory under the fake."""

    def __init__(self, ptr: int, n: int, owner: Any, fake: bool) -> None:
        self.fake = fake
        if fake:
            from mooncake.testing.fake_cuda import view

            self.v = view(ptr, n)
            self.cupy = None
        else:
            import cupy

            self.cupy = cupy
            self.v = device_view(cupy, ptr, n, owner)

    def fill(self, o: int, n: int, seed: int) -> None:
        if self.cupy is None:
            self.v[o : o + n] = host_pattern(n, seed)
        else:
            self.v[o : o + n] = gpu_pattern(self.cupy, n, seed)
            self.cupy.cuda.Device(0).synchronize()

    def check(self, o: int, n: int, seed: int) -> bool:
        if self.cupy is None:
            return bool(np.array_equal(self.v[o : o + n], host_pattern(n, seed)))
        return bool(self.cupy.array_equal(self.v[o : o + n], gpu_pattern(self.cupy, n, seed)))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--host-size", type=int, default=0)
    ap.add_argument("--transports", default="tcp,cuda")
    ap.add_argument("--fake", action="store_true")
    args = ap.parse_args()
    host_size = args.host_size or args.size
    rt: Any = None
    if args.fake:
        from mooncake.testing.fake_cuda import FakeCudaRuntime

        rt = FakeCudaRuntime()
    async with open_engine(
        "127.0.0.1", transports=args.transports.split(","), cuda_runtime=rt
    ) as engine:
        dev = await engine.allocate(args.size, location="cuda:0")
        host = await engine.allocate(host_size)
        dmem = DeviceMem(dev.addr, args.size, dev, args.fake)
        hview = host.numpy()
        print(
            json.dumps(
                {
                    "segment": engine.segment_name,
                    "dev": dev.addr,
                    "host": host.addr,
                    "backend": engine.cuda.backend,
                }
            ),
            flush=True,
        )
        stdin = anyio.wrap_file(sys.stdin)
        async for line in stdin:
            cmd = json.loads(line)
            out: dict[str, Any] = {"ok": True}
            op = cmd["op"]
            if op in ("fill", "check"):
                o, n, seed = cmd["offset"], cmd["length"], cmd["seed"]
                if cmd["which"] == "dev":
                    if op == "fill":
                        dmem.fill(o, n, seed)
                    else:
                        out["equal"] = dmem.check(o, n, seed)
                elif op == "fill":
                    hview[o : o + n] = host_pattern(n, seed)
                else:
                    out["equal"] = bool(np.array_equal(hview[o : o + n], host_pattern(n, seed)))
            elif op == "push":
                n = cmd["length"]
                dmem.fill(0, n, cmd["seed"])
                (res,) = await engine.transfer(
                    cmd["segment"],
                    [TransferRequest.write(dev.addr, cmd["remote"], n)],
                    transport=cmd.get("transport"),
                )
                out["transfer_ok"] = res.ok
                out["error"] = str(res.error) if res.error else None
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
            print(json.dumps(out), flush=True)
        del hview, dmem  # drop our views before the engine unmaps the memory
    if rt is not None:
        rt.close()


if __name__ == "__main__":
    anyio.run(main, backend="trio")
