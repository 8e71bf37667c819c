#!/usr/bin/env python3
"""Verified reads under fault injection: bytes flipped in holders' segments while readers run.

One process, real parts: a master, two holders (memfd segments), a writer and a reader (pure
clients, verification on). ``--keys`` values of ``--size`` bytes are stored with two replicas.
Reader tasks ``get_batch`` random keys (``--batch`` per call) until ``--reads`` verified reads
have been made; an injector flips one byte of a random live replica every ``--every`` reads
(a corrupt replica stays corrupt until a reader finds it); a key whose object was removed
(both its replicas found corrupt) is written again by the writer (a new generation).

At the end every injected corruption that no read happened to meet is read on purpose (that
replica alone), so each one is either detected or still there (counted: must be 0). Printed:
reads, verified reads, wrong bytes returned (must be 0), injected / detected corruptions,
replicas the master dropped, objects removed, reads that failed closed, and the rate.

    python benchmarks/verify_faults.py --reads 1000000
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reads", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--every", type=int, default=2000, help="reads between two injections")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    import trio

    out: dict[str, Any] = {}
    trio.run(run, args, out)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = out["wrong_reads"] or out["undetected"] or not out["all_injected_dropped"]
    return 1 if bad else 0


async def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import anyio
    import msgspec
    import numpy as np

    import mooncake
    from mooncake._store.verify import NO_CRC
    from mooncake.errors import ChecksumMismatchError, MooncakeError, ObjectNotFoundError
    from mooncake.store import ReplicateConfig
    from mooncake.testing import local_master_server
    from mooncake.testing.faults import flip_replica, replicas_of

    rng = random.Random(args.seed)
    values = {
        f"k{i}": np.random.default_rng(i).integers(0, 256, args.size, dtype=np.uint8).tobytes()
        for i in range(args.keys)
    }
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    seg = max(64 * MIB, 4 * args.keys * args.size)
    async with local_master_server() as server:
        addr = f"127.0.0.1:{server.rpc_port}"
        kw: dict[str, Any] = {"segment_size": seg, "local_buffer_size": 16 * MIB}
        async with (
            mooncake.open_store(addr, **kw) as h0,
            mooncake.open_store(addr, **kw) as h1,
            mooncake.open_store(addr, segment_size=0, local_buffer_size=16 * MIB, verify=True) as w,
            mooncake.open_store(addr, segment_size=0, local_buffer_size=64 * MIB, verify=True) as r,
        ):
            holders = {h.segment_name: h for h in (h0, h1)}
            keys = list(values)
            for k in keys:
                await w.put(k, values[k], cfg)
            injected: dict[tuple[str, int, str, int], None] = {}  # (key, vid, seg, addr)
            st = {"reads": 0, "wrong": 0, "failed_closed": 0, "rewrites": 0, "errors": 0}
            done = anyio.Event()
            kinds: collections.Counter[str] = collections.Counter()
            t0 = time.perf_counter()

            async def reader(seed: int) -> None:
                lr = random.Random(seed)
                while not done.is_set():
                    batch = [lr.choice(keys) for _ in range(args.batch)]
                    got = await r.get_batch(batch)
                    for k, g in zip(batch, got, strict=True):
                        if isinstance(g, ChecksumMismatchError | ObjectNotFoundError):
                            st["failed_closed"] += 1
                        elif isinstance(g, MooncakeError):
                            st["errors"] += 1
                            kinds[f"{type(g).__name__} {int(g.code)}"] += 1
                        else:
                            st["reads"] += 1
                            st["wrong"] += g != values[k]
                    if r.verify.verified >= args.reads:
                        done.set()

            async def injector() -> None:
                last = 0
                while not done.is_set():
                    if r.verify.verified - last < args.every:
                        await anyio.sleep(0.001)
                        continue
                    last = r.verify.verified
                    k = rng.choice(keys)
                    try:
                        resp = await replicas_of(r, k)
                    except ObjectNotFoundError:  # both replicas found corrupt: write it again
                        await w.put(k, values[k], cfg)
                        st["rewrites"] += 1
                        continue
                    if resp.crc == NO_CRC or not resp.replicas:
                        continue
                    rep = rng.choice(resp.replicas)
                    ident = (k, resp.vid, rep.segment_name, rep.addr)
                    if ident in injected:
                        continue
                    flip_replica(
                        holders[rep.segment_name],
                        rep,
                        rng.randrange(args.size),
                        rng.randrange(1, 256),
                    )
                    injected[ident] = None

            async with anyio.create_task_group() as tg:
                for i in range(args.readers):
                    tg.start_soon(reader, 100 + i)
                tg.start_soon(injector)
            elapsed = time.perf_counter() - t0
            # every injected corruption no reader met: read that replica on purpose
            undetected = 0
            swept = 0
            buf = await r.engine.allocate(args.size)
            for k, vid, seg_name, raddr in injected:
                try:
                    resp = await replicas_of(r, k)
                except ObjectNotFoundError:
                    continue
                if resp.vid != vid:
                    continue
                mine = [x for x in resp.replicas if (x.segment_name, x.addr) == (seg_name, raddr)]
                if not mine:
                    continue  # dropped: it was detected
                swept += 1
                one = msgspec.structs.replace(resp, replicas=mine)
                try:
                    await r._read_one(one, buf.addr, args.size, anyio.current_time() + 5, k)
                    undetected += 1
                except ChecksumMismatchError:
                    pass
            stats = server.state.stats
            v = r.verify
            out.update(
                reads=st["reads"],
                verified_reads=v.verified,
                unverified_reads=v.unverified,
                wrong_reads=st["wrong"],
                failed_closed=st["failed_closed"],
                other_errors=st["errors"],
                other_errors_by_kind=dict(kinds),
                lease_fences=r.lease_fences,
                injected=len(injected),
                detected_replicas=stats.corrupt_replicas_dropped,
                detected_in_sweep=swept,
                undetected=undetected,
                mismatches=sum(v.mismatches.values()),
                mismatches_by_holder={f"{t}/{h}": n for (t, h), n in v.mismatches.items()},
                reported=v.replicas_reported,
                dropped=stats.corrupt_replicas_dropped,
                objects_removed=stats.corrupt_objects_removed,
                rewrites=st["rewrites"],
                seconds=round(elapsed, 1),
                verified_reads_per_s=round(v.verified / elapsed),
                loadavg=os.getloadavg(),
                args=vars(args),
            )
            # every injected corruption is accounted for: dropped by the master
            out["all_injected_dropped"] = stats.corrupt_replicas_dropped == len(injected)


if __name__ == "__main__":
    raise SystemExit(main())
