"""Published names around the store: the buffer pool's argument checks and lease views, the
NVMe-oF registration class, and ``mooncake.http_metadata_server``."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake.errors import NotSupportedError
from tests.helpers.store_procs import Master

MIB = 1 << 20


@pytest.fixture(scope="module")
def store() -> Iterator[object]:
    from mooncake.store import MooncakeDistributedStore

    m = Master()
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", m.address) == 0
        yield s
    finally:
        s.close()
        m.stop()


def test_buffer_pool_checks_arguments_as_published(store: object) -> None:
    from mooncake.buffer_pool import BufferPool

    for bad in (3, 1000, 4, 12):
        with pytest.raises(RuntimeError, match=rf"alignment must be a power of two.*\(got {bad}\)"):
            BufferPool(store, alignment=bad)
    kws: list[dict[str, Any]] = [{"alignment": 0}, {"min_size_class": 0}]
    for kw in kws:
        with pytest.raises(RuntimeError, match="min_size_class and alignment must be positive"):
            BufferPool(store, **kw)
    kws = [{"alignment": -8}, {"max_bytes": -1}, {"min_size_class": -5}, {"prewarm_count": -1}]
    for kw in kws:
        with pytest.raises(TypeError):
            BufferPool(store, **kw)
    kws = [{"max_regions": -1}, {"prewarm_size": -1, "prewarm_count": 1}]
    for kw in kws:
        with pytest.raises(RuntimeError, match="non-negative"):
            BufferPool(store, **kw)
    pool = BufferPool(store, min_size_class=4096, alignment=8)
    try:
        empty = pool.acquire(0)
        assert empty.size == 0 and empty.buffer.nbytes == 0
        empty.release()
        with pytest.raises(TypeError):
            pool.acquire(-1)
        with pytest.raises(TypeError):
            pool.prewarm(-1, 1)
        with pytest.raises(TypeError):
            pool.prewarm(4096, -1)
    finally:
        pool.close()


def test_lease_views_must_be_released_before_the_lease(store: object) -> None:
    import mooncake.store as ms
    from mooncake.buffer_pool import BufferLease, BufferLeaseView, BufferPool

    assert ms.BufferLeaseView is BufferLeaseView and ms.RegisteredBufferLeaseView is BufferLeaseView
    assert ms.RegisteredBufferLease is BufferLease and ms.BufferLease is BufferLease
    with pytest.raises(TypeError, match="No constructor defined"):
        BufferLeaseView()
    pool = BufferPool(store, min_size_class=4096, alignment=4096)
    try:
        lease = pool.acquire(1000)
        view = lease.buffer
        assert isinstance(view.obj, BufferLeaseView) and view.nbytes == 1000 and not view.readonly
        view[:3] = b"abc"
        with pytest.raises(RuntimeError, match="exported views exist"):
            lease.release()
        view.release()
        lease.buffer[3:5] = b"de"  # a temporary view is gone at once
        lease.release()
        lease.release()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            _ = lease.ptr
        with pytest.raises(ValueError):
            view[0]
    finally:
        pool.close()


def test_nof_register_imports_and_refuses_by_name() -> None:
    from mooncake.store import MooncakeDistributedNoFRegister

    reg = MooncakeDistributedNoFRegister()
    with pytest.raises(NotSupportedError, match="NVMe-oF"):
        reg.real_register("nqn", 1, "10.0.0.1", 4420, 0, 1 << 30, "127.0.0.1:50051")
    with pytest.raises(NotSupportedError, match="real_unregister_by_endpoint"):
        reg.real_unregister_by_endpoint("nqn", 1, "10.0.0.1", 4420, "127.0.0.1:50051")


def test_http_metadata_server_module_serves_and_stops() -> None:
    from mooncake.http_metadata_server import KVBootstrapServer, KVPoll, parse_args

    assert parse_args([]).port == 8080 and parse_args([]).host == "0.0.0.0"
    server = KVBootstrapServer(port=0, host="127.0.0.1")
    assert server.poll() is KVPoll.Failed  # not started
    server.run()
    try:
        assert server.poll() is KVPoll.Success and server.port > 0
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

        def call(method: str, body: bytes | None = None) -> tuple[int, bytes]:
            conn.request(method, "/metadata?key=seg/a", body=body)
            resp = conn.getresponse()
            return resp.status, resp.read()

        assert call("PUT", b'{"x": 1}')[0] == 200
        assert call("GET") == (200, b'{"x": 1}')
        assert server.store.get("seg/a") == b'{"x": 1}'
        assert call("DELETE")[0] == 200
        assert call("GET")[0] == 404
        conn.close()
    finally:
        server.close()
    assert server.poll() is KVPoll.Failed


def test_buffer_pool_serves_sizes_above_max_size_class_from_their_own_region(store: object) -> None:
    from mooncake.buffer_pool import BufferPool

    pool = BufferPool(store, 1 << 20, max_size_class=128 * 1024, alignment=4096)
    try:
        big = pool.acquire(128 * 1024 + 1)
        assert big.size == 128 * 1024 + 1 and big.buffer.nbytes == 128 * 1024 + 1
        assert big.ptr % 4096 == 0
        big.buffer[-3:] = b"end"
        assert len(pool._regions) == 1
        big.release()
        assert pool._regions == [] and pool._free == {}  # not pooled: gone on release
        with pytest.raises(RuntimeError, match="exceeds pool capacity"):
            pool.acquire((1 << 20) + 1)  # still bounded by max_bytes
        small = pool.acquire(10)
        first = small.ptr
        small.release()
        again = pool.acquire(10)
        assert again.ptr == first  # the pooled classes still reuse
        again.release()
    finally:
        pool.close()
