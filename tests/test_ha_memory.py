"""Master failover on the in-memory election and log (:mod:`mooncake._store.ha_memory`):
the HA node's real driver and commit path, three masters, no etcd, trio's ``MockClock``.

The etcd-backed failover tests (tests/test_master_ha*.py) stay the ones that prove it on the
real consensus store; this one runs the same role loop where a partition can be cut exactly.
"""

from __future__ import annotations

import itertools

import msgspec
import trio
import trio.testing

from mooncake._core import rpc
from mooncake._core.store_types import Segment
from mooncake._store.ha import HaConfig, HaNode
from mooncake._store.ha_memory import MemoryCluster
from mooncake._store.master import MasterServer, MasterServerConfig

_ids = itertools.count(1)


def _one(frame: bytes) -> rpc.Message:
    dec = rpc.MessageDecoder()
    dec.feed(frame)
    (msg,) = list(dec)
    return msg


async def _call(server: MasterServer, method: str, params: msgspec.Struct) -> int | None:
    """The call's answer code once the master may send it; None: it sends nothing."""
    req = _one(rpc.encode_request(next(_ids), method, params))
    assert isinstance(req, rpc.Request)
    reply, ticket = server.execute(req, server.now())
    if ticket and server.ha is not None and not await server.ha.wait_durable(ticket):
        return None
    resp = _one(reply)
    assert isinstance(resp, rpc.Response)
    return resp.code


async def _put(server: MasterServer, key: str) -> int | None:
    code = await _call(server, "PutStart", rpc.PutStartParams("c", key, 100))
    if code != 0:
        return code
    return await _call(server, "PutEnd", rpc.PutEndParams("c", key))


async def _serving(nodes: list[HaNode], within: float = 60.0) -> HaNode:
    with trio.fail_after(within):
        while True:
            leaders = [n for n in nodes if n.role == "leader" and n.serving]
            if leaders:
                assert len(leaders) == 1, [n.address for n in leaders]
                return leaders[0]
            await trio.sleep(0.1)


def test_a_partitioned_leader_is_replaced_and_no_acknowledged_write_is_lost() -> None:
    async def main() -> None:
        cluster = MemoryCluster()
        nodes: list[HaNode] = []
        for i in range(3):
            server = MasterServer(MasterServerConfig(rpc_port=0))
            server.rpc_port = 50_000 + i  # its advertised address (nothing listens here)
            node = HaNode(
                server,
                HaConfig(cluster_id="mem", fast_failover=False),
                election=cluster.election(f"m{i}"),
                log=cluster.log(f"m{i}"),
            )
            server.ha = server.ha_node = node
            nodes.append(node)
        async with trio.open_nursery() as nursery:
            for n in nodes:
                nursery.start_soon(n.run)
            old = await _serving(nodes)
            srv = old.server
            assert isinstance(srv, MasterServer)
            seg = Segment(id="s", name="h:1", base=0, size=1 << 20)
            assert await _call(srv, "MountSegment", rpc.MountSegmentParams("c", seg)) == 0
            keys = [f"k{i}" for i in range(10)]
            for k in keys:
                assert await _put(srv, k) == 0
            # a standby refuses, naming the leader
            standby = next(n for n in nodes if n is not old)
            refusal = standby.refusal()
            assert refusal is not None and f"leader={old.address}" in refusal

            cluster.partition(f"m{nodes.index(old)}")
            late = await _put(srv, "late")  # applied on the old leader, never acknowledged
            assert late is None
            assert old.role == "standby" and old.refusal() is not None
            new = await _serving([n for n in nodes if n is not old])
            assert new.term > old.term
            got = new.server.state.all_keys()
            assert sorted(got) == keys, got  # every acknowledged write, nothing else
            assert await _put(new.server, "after") == 0  # type: ignore[arg-type]

            cluster.heal(f"m{nodes.index(old)}")  # it rejoins as a standby of the new term
            with trio.fail_after(60):
                while old.applied_seq < new.applied_seq or old.role != "standby":  # noqa: ASYNC110
                    await trio.sleep(0.1)
            assert sorted(old.server.state.all_keys()) == sorted([*keys, "after"])
            assert old.leader_addr == new.address
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
