"""Apply a pseudo-random command sequence to a fresh master state; print its digest.

  python tests/helpers/replay_digest.py SEED STEPS [--snapshot-at N] [--policy NAME]

The tests run it under different ``PYTHONHASHSEED`` values (as separate master processes
would be) and compare the digests: replicas must not depend on the process's string hashing.
With ``--snapshot-at N`` the state is snapshotted and restored after step N (as a standby that
started from a snapshot), which must not change the outcome either.
"""

from __future__ import annotations

import random
import sys

import msgspec

from mooncake._core import commands, rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import ReplicateConfig, Segment, SoftPinAction
from mooncake.errors import MooncakeError

MiB = 1 << 20


def script(seed: int, steps: int) -> list[commands.Command]:
    r = random.Random(seed)
    now = 1.0
    out = [commands.Promote(now, seed, genesis=True)]
    clients = [f"client-{i}" for i in range(4)]
    keys = [f"key-{i}" for i in range(60)]

    def c(method: str, params: msgspec.Struct) -> None:
        out.append(commands.rpc_command(method, msgspec.msgpack.encode(params), now))

    for cl in clients:
        c("MountLocalDisk", rpc.LocalDiskParams(cl, 64 * MiB))
    for _ in range(steps):
        now += r.uniform(0, 0.5)
        op = r.random()
        cl = r.choice(clients)
        k = r.choice(keys)
        if op < 0.12:
            i = r.randrange(4)
            seg = Segment(id=f"{cl}-{i}", name=f"{cl}:{i}", base=(i + 1) << 32, size=MiB)
            c("MountSegment", rpc.MountSegmentParams(cl, seg))
        elif op < 0.17:
            c("UnmountSegment", rpc.UnmountSegmentParams(cl, f"{cl}-{r.randrange(4)}"))
        elif op < 0.55:
            cfg = ReplicateConfig(
                replica_num=r.randint(1, 3),
                soft_pin_action=SoftPinAction.ENABLE
                if r.random() < 0.4
                else SoftPinAction.PRESERVE,
                soft_pin_ttl_ms=r.choice([None, 500, 3000]),
            )
            c("PutStart", rpc.PutStartParams(cl, k, r.randint(1000, 200_000), cfg))
            if r.random() < 0.9:
                c("PutEnd", rpc.KeyClientParams(cl, k))
        elif op < 0.7:
            c("GetReplicaList", rpc.KeyParams(k))
        elif op < 0.75:
            c("Remove", rpc.RemoveParams(k, r.random() < 0.5))
        elif op < 0.8:
            c("FetchTierTasks", rpc.ClientParams(cl))
        elif op < 0.85:
            c("PromoteStart", rpc.TierKeyParams(cl, k, r.randrange(1, 50)))
        elif op < 0.9:
            c("Ping", rpc.ClientParams(cl))
        else:
            out.append(commands.Sweep(now))
    return out


def main(argv: list[str]) -> None:
    seed, steps = int(argv[0]), int(argv[1])
    snap_at = int(argv[argv.index("--snapshot-at") + 1]) if "--snapshot-at" in argv else -1
    policy = argv[argv.index("--policy") + 1] if "--policy" in argv else "lru"
    cfg = MasterConfig(client_ttl=1e6, eviction_high_watermark_ratio=0.7, eviction_policy=policy)
    state = MasterState(cfg)
    for i, cmd in enumerate(script(seed, steps)):
        if i == snap_at:
            state = MasterState.restore(state.snapshot(), cfg)
        try:
            commands.apply(state, cmd)
        except MooncakeError:
            pass
    state.check_invariants()
    print(commands.digest(state), state.object_count, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
