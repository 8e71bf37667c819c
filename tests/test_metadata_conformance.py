"""The metadata conformance suite (mooncake.testing.metadata) against every backend, each a
real service started by the test: our HTTP metadata server, etcd, Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from mooncake.testing.metadata import CHECKS, Check, Unsupported
from tests import services


@pytest.fixture(scope="module")
def http_conn() -> Iterator[str]:
    with services.http_metadata_server() as url:
        yield url


@pytest.fixture(scope="module")
def etcd_conn() -> Iterator[str]:
    with services.etcd_cluster(1) as cluster:
        yield cluster.conn


@pytest.fixture(scope="module")
def redis_conn() -> Iterator[str]:
    with services.redis_server() as conn:
        yield conn


BACKENDS = [
    pytest.param("http_conn", id="http"),
    pytest.param("etcd_conn", id="etcd", marks=pytest.mark.etcd),
    pytest.param("redis_conn", id="redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance(backend: str, check: Check, request: pytest.FixtureRequest) -> None:
    conn = request.getfixturevalue(backend)
    try:
        trio.run(check.run, conn)
    except Unsupported as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", ["put_get_delete", "engine_republish"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_under_asyncio(backend: str, name: str, request: pytest.FixtureRequest) -> None:
    """The same client code runs on asyncio (httpx and anyio sockets, no trio)."""
    import asyncio

    conn = request.getfixturevalue(backend)
    check = next(c for c in CHECKS if c.name == name)
    asyncio.run(check.run(conn))
