"""One-shot GPU check for the store's tiers (run it on a machine with a CUDA GPU and cupy).

Steps, each reported as ok / skipped (why) / FAILED (what):

1. ``device``: cupy imports, a device is present; prints its name and memory.
2. ``alloc``: allocates ``--mib`` MiB of device memory and fills it with a known pattern.
3. ``register``: registers that device memory with a transfer engine as ``cuda:0`` (needs the
   CUDA transport; skipped with the reason when this build has none).
4. ``store``: starts a master in-process and a store client, puts ``--objects`` objects whose
   bytes come from device memory (device -> pinned host -> store), gets them back into device
   memory (store -> pinned host -> device) and verifies every byte on the device.
5. ``store-device``: the store's zero-copy APIs on device memory: ``register_buffer`` the device
   pointers, ``put_from`` each object straight from device memory and ``get_into`` another
   device buffer, verified on the device (docs/gpu.md: same-host replicas are copied on the
   engine's CUDA stream).
6. ``store-gpu-segment``: the GPU tier: a store client mounts a ``cuda:0`` segment
   (``open_store(segment_location="cuda:0")``); it, a host-segment client and a pure client put
   objects into that segment and get them back (all through the engine: own-segment copies on
   its CUDA stream, the others over the ``cuda`` transport or TCP staging), verified byte for
   byte, including the replica bytes read straight from device memory; the master must report
   the segment in its ``gpu`` tier.
7. ``engine``: with step 3 done, a loopback ``engine.write`` from the device buffer into a host
   buffer and back, verified.

Exit status 0 if nothing FAILED (skips are fine), 1 otherwise. ``--json PATH`` writes the
report. Takes a few seconds::

    python benchmarks/gpu_tier_check.py --json gpu_tier_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

MIB = 1 << 20


class Report:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def ok(self, step: str, **info: Any) -> None:
        self.steps.append({"step": step, "status": "ok", **info})
        print(f"  ok       {step} {info or ''}", flush=True)

    def skip(self, step: str, why: str) -> None:
        self.steps.append({"step": step, "status": "skipped", "why": why})
        print(f"  skipped  {step}: {why}", flush=True)

    def fail_exc(self, step: str, exc: BaseException) -> None:
        """Record ``exc``; exception groups are reported by their leaves."""
        leaves: list[BaseException] = []

        def walk(e: BaseException) -> None:
            subs = getattr(e, "exceptions", None)  # an exception group (3.11+ or the backport)
            if isinstance(subs, tuple):
                for sub in subs:
                    walk(sub)
            else:
                leaves.append(e)

        walk(exc)
        self.fail(
            step, "; ".join("".join(traceback.format_exception_only(e)).strip() for e in leaves)
        )

    def fail(self, step: str, why: str) -> None:
        self.steps.append({"step": step, "status": "FAILED", "why": why})
        print(f"  FAILED   {step}: {why}", flush=True)

    @property
    def failed(self) -> bool:
        return any(s["status"] == "FAILED" for s in self.steps)


async def run_checks(mib: int, objects: int, report: Report) -> None:
    try:
        import cupy as cp
    except ImportError as e:
        report.skip("device", f"cupy is not installed ({e}); pip install 'mooncake-py[cuda]'")
        return
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises its own runtime errors
        report.skip("device", f"no usable CUDA device ({e})")
        return
    if n < 1:
        report.skip("device", "no CUDA device")
        return
    props = cp.cuda.runtime.getDeviceProperties(0)
    free, total = cp.cuda.runtime.memGetInfo()
    report.ok(
        "device",
        name=props["name"].decode(),
        devices=n,
        free_mib=free // MIB,
        total_mib=total // MIB,
    )

    size = mib * MIB
    dev = cp.arange(size, dtype=cp.uint8)  # pattern: i & 0xff
    dev ^= cp.uint8(0x5A)
    cp.cuda.runtime.deviceSynchronize()
    report.ok("alloc", bytes=size, ptr=hex(dev.data.ptr))

    from mooncake import open_engine
    from mooncake._core.master import MasterConfig
    from mooncake._store.client import open_store
    from mooncake._store.master import MasterServerConfig, serve_master

    async with open_engine("127.0.0.1", "P2PHANDSHAKE") as engine:
        region = None
        try:
            region = await engine.register((dev.data.ptr, size), location="cuda:0")
            report.ok("register", location="cuda:0")
        except Exception as e:
            report.skip("register", f"this build cannot register device memory ({e!r})")

        cfg = MasterServerConfig(
            rpc_port=0, enable_metric_reporting=False, state=MasterConfig(seed=1)
        )
        async with anyio.create_task_group() as tg:
            server = await tg.start(serve_master, cfg)
            addr = f"127.0.0.1:{server.rpc_port}"
            try:
                async with open_store(
                    addr,
                    segment_size=3 * size + 64 * MIB,  # the host objects, then the zero-copy ones
                    local_buffer_size=size + 16 * MIB,
                ) as store:
                    chunk = size // objects
                    pinned = cp.cuda.alloc_pinned_memory(chunk)
                    import numpy as np

                    host = np.frombuffer(pinned, dtype=np.uint8, count=chunk)
                    await store.register_buffer(host.ctypes.data, chunk)
                    t0 = time.perf_counter()
                    for i in range(objects):
                        cp.asnumpy(dev[i * chunk : (i + 1) * chunk], out=host)
                        await store.put(f"gpu-obj-{i}", host)
                    back = cp.zeros(size, dtype=cp.uint8)
                    for i in range(objects):
                        n_read = await store.get_into(f"gpu-obj-{i}", host.ctypes.data, chunk)
                        if n_read != chunk:
                            raise AssertionError(f"object {i}: {n_read} bytes, want {chunk}")
                        back[i * chunk : (i + 1) * chunk].set(host)
                    cp.cuda.runtime.deviceSynchronize()
                    dt = time.perf_counter() - t0
                    bad = int(cp.count_nonzero(back != dev))
                    if bad:
                        report.fail("store", f"{bad} bytes differ after the round trip")
                    else:
                        report.ok("store", objects=objects, bytes=size, seconds=round(dt, 4))
                    await device_zero_copy(store, cp, dev, objects, report)
            except Exception as e:
                report.fail_exc("store", e)
            await gpu_segment(addr, cp, min(size, 64 * MIB), objects, report)
            tg.cancel_scope.cancel()

        if region is None:
            report.skip("engine", "device memory is not registered (step register)")
            return
        try:
            hostbuf = await engine.allocate(size)
            await engine.write(engine.segment_name, dev.data.ptr, hostbuf.addr, size)
            ok = bytes(hostbuf.view[:4096]) == cp.asnumpy(dev[:4096]).tobytes()
            if not ok:
                report.fail("engine", "device -> host bytes differ")
                return
            dev2 = cp.zeros(size, dtype=cp.uint8)
            await engine.register((dev2.data.ptr, size), location="cuda:0")
            await engine.write(engine.segment_name, hostbuf.addr, dev2.data.ptr, size)
            cp.cuda.runtime.deviceSynchronize()
            bad = int(cp.count_nonzero(dev2 != dev))
            if bad:
                report.fail("engine", f"{bad} bytes differ host -> device")
            else:
                report.ok("engine", bytes=size)
        except Exception as e:
            report.fail_exc("engine", e)


async def device_zero_copy(store: Any, cp: Any, dev: Any, objects: int, report: Report) -> None:
    """``put_from`` / ``get_into`` straight from and into device memory (no host staging in
    the caller): the store copies replicas of this host on the engine's CUDA stream."""
    size = dev.nbytes
    chunk = size // objects
    back = cp.zeros(size, dtype=cp.uint8)
    try:
        await store.register_buffer(dev.data.ptr, size)
        await store.register_buffer(back.data.ptr, size)
        t0 = time.perf_counter()
        for i in range(objects):
            await store.put_from(f"gpu-zc-{i}", dev.data.ptr + i * chunk, chunk)
        for i in range(objects):
            n = await store.get_into(f"gpu-zc-{i}", back.data.ptr + i * chunk, chunk)
            if n != chunk:
                raise AssertionError(f"object {i}: {n} bytes, want {chunk}")
        cp.cuda.runtime.deviceSynchronize()
        dt = time.perf_counter() - t0
    except Exception as e:
        report.fail_exc("store-device", e)
        return
    bad = int(cp.count_nonzero(back != dev))
    if bad:
        report.fail("store-device", f"{bad} bytes differ after put_from/get_into on device memory")
    else:
        report.ok("store-device", objects=objects, bytes=size, seconds=round(dt, 4))


async def gpu_segment(master: str, cp: Any, size: int, objects: int, report: Report) -> None:
    """The GPU tier: objects stored in a ``cuda:0`` segment, written and read by its owner, by a
    host-segment client and by a pure client; bytes verified (also on the device)."""
    import numpy as np

    from mooncake._store.client import open_store
    from mooncake.store import ReplicateConfig

    chunk = max(1, size // objects)
    try:
        async with (
            # three writers each put `objects` chunks into it: room for all of them
            open_store(master, segment_size=3 * size + 16 * MIB, segment_location="cuda:0") as g,
            open_store(master, segment_size=16 * MIB, local_buffer_size=chunk + MIB) as h,
            open_store(master, segment_size=0, local_buffer_size=chunk + MIB) as p,
        ):
            on_g = ReplicateConfig()
            on_g.preferred_segment = g.segment_name
            rng = np.random.default_rng(7)
            writers = {"owner": g, "host-client": h, "pure-client": p}
            t0 = time.perf_counter()
            moved = 0
            for i in range(objects):
                for wname, w in writers.items():
                    key = f"gpu-seg-{i}-{wname}"
                    v = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes()
                    await w.put(key, v, on_g)
                    (r,) = await g.replica_descriptors(key)
                    if r.segment_name != g.segment_name:
                        raise AssertionError(f"{key}: replica on {r.segment_name}, not the GPU one")
                    mem = cp.cuda.UnownedMemory(r.addr, chunk, None)
                    on_dev = cp.ndarray((chunk,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
                    if cp.asnumpy(on_dev).tobytes() != v:
                        raise AssertionError(f"{key}: device memory differs from what was put")
                    for rname, reader in writers.items():
                        if await reader.get(key) != v:
                            raise AssertionError(f"{key}: {rname} read different bytes")
                    moved += 4 * chunk
            dt = time.perf_counter() - t0
            tiers = await p.segment_tiers()
            if tiers.get("gpu", {}).get("segments") != 1:
                raise AssertionError(f"master's segment tiers {tiers}: want one gpu segment")
            report.ok(
                "store-gpu-segment",
                objects=3 * objects,
                bytes_moved=moved,
                seconds=round(dt, 4),
                gpu_tier=tiers["gpu"],
            )
    except Exception as e:
        report.fail_exc("store-gpu-segment", e)


def main(argv: list[str] | None = None, run: Callable[..., Any] = anyio.run) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    report = Report()
    print("GPU tier check:", flush=True)
    run(run_checks, args.mib, args.objects, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.steps, indent=2))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
