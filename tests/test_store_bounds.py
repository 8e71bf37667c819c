"""Master answers naming addresses outside this client's segment, or inconsistent lengths, fail
the operation with a clear error; the own-segment copies never touch such an address.

The master here is real; its answers are altered on their way into the client (the client's
RPC connection, or the sync fast path's), as a corrupt or hostile master would send them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import trio

import mooncake
from mooncake._core import store_types as st
from mooncake.errors import ErrorCode, TransferError
from tests.helpers.store_procs import Master
from tests.test_store_client import MIB, master
from tests.test_store_multiprocess import local_store

BAD_ADDR = 8  # the null page: any access would be a SIGSEGV


def _bad_addr(r: st.ReplicaDescriptor) -> st.ReplicaDescriptor:
    return msgspec.structs.replace(r, addr=BAD_ADDR)


def _short(r: st.ReplicaDescriptor) -> st.ReplicaDescriptor:
    return msgspec.structs.replace(r, length=r.length // 2)


def _doctor(resp: Any, change: Callable[[st.ReplicaDescriptor], st.ReplicaDescriptor]) -> Any:
    if isinstance(resp, st.GetReplicaListResponse):
        return msgspec.structs.replace(resp, replicas=[change(r) for r in resp.replicas])
    return resp


@pytest.mark.parametrize("change", [_bad_addr, _short], ids=["outside-segment", "short-replica"])
def test_async_client_refuses_bad_replicas_of_its_own_segment(
    change: Callable[[st.ReplicaDescriptor], st.ReplicaDescriptor],
) -> None:
    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=1 * MIB) as s,
        ):
            await s.put("k", b"x" * 4096)
            assert await s.get("k") == b"x" * 4096
            real = s.master.call

            async def call(method: str, params: Any, *args: Any) -> Any:
                res = await real(method, params, *args)
                if method == "GetReplicaList":
                    return _doctor(res, change)
                if method == "BatchGetReplicaList":
                    return [
                        msgspec.structs.replace(it, value=_doctor(it.value, change)) for it in res
                    ]
                return res

            s.master.call = call  # type: ignore[method-assign]
            with pytest.raises(TransferError, match=r"outside|replica"):
                await s.get("k")
            buf = await s.engine.allocate(8192)
            with pytest.raises(TransferError):
                await s.get_into("k", buf.addr, 8192)
            got = await s.batch_get_into(["k"], [buf.addr], [8192])
            assert isinstance(got[0], TransferError)
            vals = await s.get_batch(["k"])
            assert isinstance(vals[0], TransferError)
            s.master.call = real  # type: ignore[method-assign]
            assert await s.get("k") == b"x" * 4096

    trio.run(main)


@pytest.fixture
def proc_master() -> Iterator[Master]:
    m = Master("--client-ttl", "5")
    try:
        yield m
    finally:
        m.stop()


class _Doctored:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def call(self, method: str, params: Any, *args: Any) -> Any:
        res = self.inner.call(method, params, *args)
        if method == "GetReplicaList":
            return _doctor(res, _bad_addr)
        if method in ("PutStart", "UpsertStart"):
            return [_bad_addr(r) for r in res]
        return res

    def close(self) -> None:
        self.inner.close()


def test_sync_fast_path_refuses_addresses_outside_its_own_segment(proc_master: Master) -> None:
    me = local_store(proc_master.address, segment_mib=8, buffer_mib=8)
    buf = np.zeros(8192, dtype=np.uint8)
    try:
        assert me.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert me.put("k", b"y" * 4096) == 0
        assert me.get("k") == b"y" * 4096
        fast = me._fast
        assert fast is not None
        real = fast.master
        fast.master = lambda: _Doctored(real())  # type: ignore[method-assign]
        assert me.get("k") == b""  # an error, reported as the published client does
        code = me.get_into("k", buf.ctypes.data, buf.nbytes)
        assert code == int(ErrorCode.TRANSFER_FAIL)
        # a put whose replica is outside the segment is revoked, not written
        assert me.put("k2", b"z" * 4096) == int(ErrorCode.TRANSFER_FAIL)
        fast.master = real  # type: ignore[method-assign]
        assert me.get("k") == b"y" * 4096
        assert me.is_exist("k2") == 0
    finally:
        me.unregister_buffer(buf.ctypes.data)
        me.close()
