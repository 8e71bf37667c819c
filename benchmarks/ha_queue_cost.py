"""CPU cost of a replicated leader's commit-queue path, per command, in one process.

``HaNode.append`` (size check, ticket, barrier) for 1000 ``PutStart`` commands, then one
take-and-commit of the batch, 100 rounds, repeated 7 times; prints the median microseconds per
command. No etcd is contacted (the node is put in the leader role by hand). Also runs on trees
from before :mod:`mooncake._core.commitlog` existed (the queue then lived inside ``HaNode``),
so one command compares both in the same run:

    (cd OLD_TREE && python /path/to/benchmarks/ha_queue_cost.py before)
    python benchmarks/ha_queue_cost.py after
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import trio

from mooncake._core import commands
from mooncake._store.ha import HaConfig, HaNode
from mooncake._store.master import MasterServer, MasterServerConfig


async def main(label: str) -> None:
    node: Any = HaNode(
        MasterServer(MasterServerConfig(rpc_port=0)),
        HaConfig(endpoints=["http://127.0.0.1:1"], cluster_id="queue-cost"),
    )
    node.role = "leader"
    cmds = [commands.rpc_command("PutStart", b"x" * 64, 1.0) for _ in range(1000)]
    q = getattr(node, "queue", None)
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(100):
            for c in cmds:
                node.append(c)
            if q is not None:
                q.committed(len(q.take_batch()))
            else:  # the older HaNode's own fields
                node._pending.clear()
                node._durable = node._ticket
        runs.append((time.perf_counter() - t0) / (100 * len(cmds)) * 1e6)
    print(
        f"{label}: {statistics.median(runs):.3f} us per command (median of 7; "
        f"{', '.join(f'{x:.3f}' for x in runs)})"
    )


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "this tree")
