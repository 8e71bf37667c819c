"""Verified reads next to the published wheel: its engine reads and writes the replicas of our
store's objects (the value bytes, nothing else: the CRC lives only in the master's metadata),
and an object written the published client's way (PutEnd without a CRC) is read unverified.

The published store client cannot talk to this master (coro_rpc vs msgpack, docs/store.md), so
the store-level halves run through our master with the published *engine* moving the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import mooncake
from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake.testing import local_master
from mooncake.testing.faults import replicas_of
from tests.test_interop import ANCHOR, Published

pytestmark = [
    pytest.mark.anchor,
    pytest.mark.skipif(ANCHOR is None, reason="published Mooncake wheel not installed"),
    pytest.mark.skipif(not _fast.CRC_COMPILED, reason="compiled CRC32C not built"),
    pytest.mark.anyio,
]

MIB = 1 << 20


@pytest.fixture
def published() -> Iterator[Published]:
    p = Published()
    try:
        yield p
    finally:
        p.close()


async def test_published_engine_reads_our_verified_object_bytes(published: Published) -> None:
    async with (
        local_master() as addr,
        mooncake.open_store(addr, segment_size=8 * MIB, local_buffer_size=MIB) as holder,
        mooncake.open_store(addr, segment_size=0, local_buffer_size=4 * MIB, verify=True) as w,
    ):
        value = bytes(range(256)) * 1000
        await w.put("ours", value)
        resp = await replicas_of(w, "ours")
        assert resp.crc == _fast.crc32c(value)
        (rep,) = resp.replicas
        assert rep.segment_name == holder.segment_name and rep.length == len(value)
        r = await published.cmd(
            op="read", segment=rep.segment_name, local_off=0, remote=rep.addr, length=rep.length
        )
        assert r["rc"] == 0
        got = bytes.fromhex(
            (await published.cmd(op="dump", offset=0, length=rep.length))["data_hex"]
        )
        assert got == value and _fast.crc32c(got) == resp.crc


async def test_an_object_written_the_published_way_is_read_unverified(
    published: Published,
) -> None:
    async with (
        local_master() as addr,
        mooncake.open_store(addr, segment_size=8 * MIB, local_buffer_size=MIB) as holder,
        mooncake.open_store(addr, segment_size=0, local_buffer_size=4 * MIB, verify=True) as r,
    ):
        value = bytes(range(251)) * 300
        reps: list[st.ReplicaDescriptor] = await r.master.call(
            "PutStart",
            rpc.PutStartParams(client_id=r.client_id, key="theirs", size=len(value)),
        )
        (rep,) = reps
        assert rep.segment_name == holder.segment_name
        await published.cmd(op="fill", offset=0, data_hex=value.hex())
        w = await published.cmd(
            op="write", segment=rep.segment_name, local_off=0, remote=rep.addr, length=len(value)
        )
        assert w["rc"] == 0
        # the published client's PutEnd: key and client id, no CRC
        await r.master.call("PutEnd", rpc.KeyClientParams(client_id=r.client_id, key="theirs"))
        assert (await replicas_of(r, "theirs")).crc == -1
        assert await r.get("theirs") == value
        assert r.verify.unverified == 1 and r.verify.verified == 0
