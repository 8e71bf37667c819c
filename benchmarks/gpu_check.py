"""GPU throughput table: CUDA IPC and staged device<->host transfers between two processes.

    python benchmarks/gpu_check.py [--out DIR] [--max-size BYTES] [--seconds S]
    python benchmarks/gpu_check.py --fake      # no GPU: plumbing check on the FAKE runtime

Run by ``benchmarks/gpu_check.sh`` (docs/gpu.md). The peer is ``tests/helpers/gpu_peer.py`` in a
child process on the same GPU; this process is the initiator. For every path and size it
warms up once, repeats the transfer for about ``--seconds`` (at least twice), then verifies the
peer's bytes against the pattern written. Rows:

  cuda  dev->dev     CUDA IPC (cudaMemcpyAsync on the peer stream, eventfd completion)
  tcp   dev->dev     loopback TCP, both ends staging through pinned chunks
  tcp   dev->host    loopback TCP, this side staging
  shm   dev->host    (when the shm transport is in the tree) this side staging
  cuda/tcp 512x16K   one batch of 512 blocks of 16 KiB (KV-cache-like), dev->dev
  cuda  pageable/pinned host<->dev   this side's host memory, MC_CUDA_PIN_HOST off/on

plus the machine's own limits measured with cupy in this process (device memcpy, pinned
H2D/D2H), and the completion bridge: 4 KiB IPC writes one at a time, ``eventfd`` vs ``thread``.
Prints a markdown table; with ``--out`` (default ``$OUT`` if set) writes ``gpu_check.json`` and
``gpu_check.md`` there. Numbers from ``--fake`` say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from gpu_peer import DeviceMem  # type: ignore[import-not-found]  # noqa: E402

from mooncake._core.transfer import TransferRequest  # noqa: E402
from mooncake._engine.engine import open_engine  # noqa: E402
from mooncake._engine.transports import TRANSPORTS  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB]


class Peer:
    def __init__(self, size: int, host_size: int, transports: str, fake: bool) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        argv = [
            sys.executable,
            str(ROOT / "tests" / "helpers" / "gpu_peer.py"),
            "--size",
            str(size),
            "--host-size",
            str(host_size),
            "--transports",
            transports,
        ] + (["--fake"] if fake else [])
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("gpu_peer did not start (its stderr is above)")
        self.info: dict[str, Any] = json.loads(line)

    def cmd(self, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        if not out.get("ok"):
            raise RuntimeError(f"peer: {out}")
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def timed(fn: Any, seconds: float, max_reps: int = 100_000) -> tuple[int, float]:
    """Run ``await fn()`` once to warm up, then for ~``seconds`` (at least twice)."""
    await fn()
    reps = 0
    t0 = time.perf_counter()
    while True:
        await fn()
        reps += 1
        el = time.perf_counter() - t0
        if (reps >= 2 and el >= seconds) or reps >= max_reps:
            return reps, el


def limits(max_size: int) -> list[dict[str, Any]]:
    """This GPU's own copy rates, measured with cupy (the ceiling for every row)."""
    import cupy

    n = min(max_size, 256 * MiB)
    a = cupy.empty(n, dtype=cupy.uint8)
    b = cupy.empty(n, dtype=cupy.uint8)
    pinned = cupy.cuda.alloc_pinned_memory(n)
    import numpy as np

    h = np.frombuffer(pinned, dtype=np.uint8, count=n)
    out = []
    fns: list[tuple[str, Callable[[], Any]]] = [
        ("cupy dev->dev memcpy", lambda: b.__setitem__(slice(None), a)),
        ("cupy pinned host->dev", lambda: a.set(h)),
        ("cupy dev->pinned host", lambda: a.get(out=h)),
    ]
    for name, fn in fns:
        fn()
        cupy.cuda.Device(0).synchronize()
        reps, t0 = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - t0 < 0.3:
            fn()
            reps += 1
        cupy.cuda.Device(0).synchronize()
        el = time.perf_counter() - t0
        out.append({"path": name, "size": n, "reps": reps, "GBps": reps * n / el / 1e9})
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    fake = args.fake
    max_size = args.max_size or (16 * MiB if fake else GiB)
    sizes = [s for s in SIZES if s <= max_size]
    host_size = min(max_size, 256 * MiB)
    have_shm = "shm" in TRANSPORTS
    transports = "tcp,cuda" + (",shm" if have_shm else "")
    rt: Any = None
    if fake:
        from mooncake.testing.fake_cuda import FakeCudaRuntime

        rt = FakeCudaRuntime()
    peer = Peer(max_size, host_size, transports, fake)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rows": rows, "fake": fake}
    try:
        async with open_engine("127.0.0.1", transports=transports.split(","), cuda_runtime=rt) as e:
            result["backend"] = e.cuda.backend
            result["completion"] = e.cuda_completions.mode
            result["staging_chunk"] = e.staging.chunk
            local = await e.allocate(max_size, location="cuda:0")
            mem = DeviceMem(local.addr, max_size, local, fake)
            seg = peer.info["segment"]
            paths = [("cuda", "dev"), ("tcp", "dev"), ("tcp", "host")]
            if have_shm:
                paths.append(("shm", "host"))
            seed = 100
            for transport, which in paths:
                remote = peer.info[which]
                for size in sizes:
                    if which == "host" and size > host_size:
                        continue
                    for op in ("write", "read"):
                        seed += 1
                        if op == "write":
                            mem.fill(0, size, seed)
                            req = TransferRequest.write(local.addr, remote, size)
                        else:
                            peer.cmd(op="fill", which=which, offset=0, length=size, seed=seed)
                            req = TransferRequest.read(local.addr, remote, size)

                        async def once(req: TransferRequest = req, t: str = transport) -> None:
                            (res,) = await e.transfer(seg, [req], transport=t)
                            if not res.ok:
                                raise RuntimeError(f"{t} {req}: {res.error}")

                        reps, el = await timed(once, args.seconds)
                        if op == "write":
                            ok = peer.cmd(
                                op="check", which=which, offset=0, length=size, seed=seed
                            )["equal"]
                        else:
                            ok = mem.check(0, size, seed)
                        row = {
                            "transport": transport,
                            "path": f"dev->{which}" if op == "write" else f"dev<-{which}",
                            "op": op,
                            "size": size,
                            "reps": reps,
                            "GBps": reps * size / el / 1e9,
                            "us_per_op": el / reps * 1e6,
                            "verified": ok,
                        }
                        rows.append(row)
                        print(fmt_row(row), flush=True)
            # a KV-cache-like batch: 512 blocks of 16 KiB in one transfer call
            block, count = 16 * KiB, 512
            if block * count <= max_size:
                for transport in ("cuda", "tcp"):
                    seed += 1
                    mem.fill(0, block * count, seed)
                    reqs = [
                        TransferRequest.write(
                            local.addr + k * block, peer.info["dev"] + k * block, block
                        )
                        for k in range(count)
                    ]

                    async def batch(reqs: list[TransferRequest] = reqs, t: str = transport) -> None:
                        res = await e.transfer(seg, reqs, transport=t)
                        if not all(r.ok for r in res):
                            raise RuntimeError(
                                f"{t} batch: {[r.error for r in res if not r.ok][:2]}"
                            )

                    reps, el = await timed(batch, args.seconds)
                    ok = peer.cmd(
                        op="check", which="dev", offset=0, length=block * count, seed=seed
                    )["equal"]
                    row = {
                        "transport": transport,
                        "path": "512x16K",
                        "op": "write",
                        "size": block * count,
                        "reps": reps,
                        "GBps": reps * block * count / el / 1e9,
                        "us_per_op": el / reps * 1e6,
                        "verified": ok,
                    }
                    rows.append(row)
                    print(fmt_row(row), flush=True)
        # local host memory <-> the peer's GPU over IPC: pageable vs page-locked (MC_CUDA_PIN_HOST)
        hsize = min(max_size, 256 * MiB)
        for pin in ("0", "1"):
            os.environ["MC_CUDA_PIN_HOST"] = pin
            async with open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=rt) as e3:
                hbuf = await e3.allocate(hsize)
                for op in ("write", "read"):
                    req = (
                        TransferRequest.write(hbuf.addr, peer.info["dev"], hsize)
                        if op == "write"
                        else TransferRequest.read(hbuf.addr, peer.info["dev"], hsize)
                    )

                    async def host_once(e3: Any = e3, req: TransferRequest = req) -> None:
                        (res,) = await e3.transfer(peer.info["segment"], [req], transport="cuda")
                        if not res.ok:
                            raise RuntimeError(f"host<->dev: {res.error}")

                    reps, el = await timed(host_once, args.seconds)
                    row = {
                        "transport": "cuda",
                        "path": ("pinned" if pin == "1" else "pageable")
                        + ("->dev" if op == "write" else "<-dev"),
                        "op": op,
                        "size": hsize,
                        "reps": reps,
                        "GBps": reps * hsize / el / 1e9,
                        "us_per_op": el / reps * 1e6,
                        "verified": True,  # the bytes are checked by tests/test_gpu.py
                    }
                    rows.append(row)
                    print(fmt_row(row), flush=True)
        os.environ.pop("MC_CUDA_PIN_HOST", None)
        # the completion bridge, both ways: small IPC writes one at a time
        bridge = []
        for mode in ("eventfd", "thread"):
            os.environ["MC_CUDA_COMPLETION"] = mode
            async with open_engine("127.0.0.1", transports=["tcp", "cuda"], cuda_runtime=rt) as e2:
                buf = await e2.allocate(4 * KiB, location="cuda:0")
                req = TransferRequest.write(buf.addr, peer.info["dev"], 4 * KiB)

                async def small(e2: Any = e2, req: TransferRequest = req) -> None:
                    (res,) = await e2.transfer(peer.info["segment"], [req], transport="cuda")
                    assert res.ok, res.error

                reps, el = await timed(small, args.seconds)
                bridge.append({"mode": mode, "reps": reps, "us_per_op": el / reps * 1e6})
                print(
                    f"completion {mode:8s} 4 KiB IPC write: {el / reps * 1e6:8.1f} us/op",
                    flush=True,
                )
        os.environ.pop("MC_CUDA_COMPLETION", None)
        result["completion_bridge"] = bridge
    finally:
        peer.close()
        if rt is not None:
            rt.close()
    if not fake:
        result["limits"] = limits(max_size)
    return result


def human(n: int) -> str:
    return f"{n >> 30} GiB" if n >= GiB else f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def fmt_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['transport']:4s} | {r['path']:14s} | {human(r['size']):>7s} | {r['GBps']:8.2f} | "
        f"{r['us_per_op']:10.1f} | {r['reps']:6d} | {'yes' if r['verified'] else 'NO'} |"
    )


def markdown(result: dict[str, Any], env: dict[str, Any]) -> str:
    lines = [
        "| transport | path | size | GB/s | us/op | reps | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [fmt_row(r) for r in result["rows"]]
    lines.append("")
    for b in result.get("completion_bridge", []):
        lines.append(f"- completion `{b['mode']}`: 4 KiB IPC write {b['us_per_op']:.1f} us/op")
    for lim in result.get("limits", []):
        lines.append(f"- limit, {lim['path']} ({human(lim['size'])}): {lim['GBps']:.1f} GB/s")
    lines.append("")
    lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines)


def environment(fake: bool) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    if fake:
        env["runtime"] = "FAKE (host memory; not a GPU measurement)"
        return env
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    env["driver"] = cupy.cuda.runtime.driverGetVersion()
    env["cuda_runtime(cupy)"] = cupy.cuda.runtime.runtimeGetVersion()
    env["cupy"] = cupy.__version__
    return env


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--fake", action="store_true", help="FAKE runtime, no GPU (plumbing only)")
    ap.add_argument("--max-size", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    env = environment(args.fake)
    print("environment:", env, flush=True)
    print("| transport | path | size | GB/s | us/op | reps | verified |", flush=True)
    result = anyio.run(run, args, backend="trio")
    result["environment"] = env
    md = markdown(result, env)
    print()
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
        (out / "gpu_check.md").write_text(md + "\n")
    bad = [r for r in result["rows"] if not r["verified"]]
    if bad:
        raise SystemExit(f"{len(bad)} transfers did not verify")


if __name__ == "__main__":
    main()
