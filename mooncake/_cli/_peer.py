"""A target engine in its own process, driven over stdin/stdout (one JSON object per line).

``python -m mooncake._cli._peer [--size N] [--host H]`` starts an engine, allocates a registered
buffer of ``N`` bytes and prints ``{"segment": ..., "addr": ..., "size": ...}``. Commands:

* ``{"op": "fill", "offset": o, "length": n, "seed": s}``: write the pattern ``pattern(s, n)``
* ``{"op": "digest", "offset": o, "length": n}`` -> ``{"digest": sha256 hex}``
* ``{"op": "quit"}`` (or end of input): close the engine and exit

Used by ``mooncake demo`` and by the multi-process tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import anyio
import numpy as np

import mooncake


def pattern(seed: int, n: int) -> np.ndarray:  # type: ignore[type-arg]
    """Deterministic pseudo-random bytes (same on both sides of a test)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def digest(view: np.ndarray) -> str:  # type: ignore[type-arg]
    return hashlib.sha256(view.tobytes()).hexdigest()


async def serve(size: int, host: str) -> None:
    async with mooncake.open_engine(host) as engine:
        buf = await engine.allocate(size)
        arr = buf.numpy()
        print(
            json.dumps({"segment": engine.segment_name, "addr": buf.addr, "size": buf.length}),
            flush=True,
        )
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd.get("op")
            out: dict[str, object] = {"ok": True}
            if op == "quit":
                print(json.dumps(out), flush=True)
                return
            if op == "fill":
                o, n = cmd["offset"], cmd["length"]
                arr[o : o + n] = pattern(cmd["seed"], n)
            elif op == "digest":
                o, n = cmd["offset"], cmd["length"]
                out["digest"] = digest(arr[o : o + n])
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
            print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    anyio.run(serve, args.size, args.host, backend="trio")


if __name__ == "__main__":
    main()
