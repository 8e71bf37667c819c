"""Errors out of ``open_engine`` / ``open_store`` / ``local_master``: as themselves, on both backends.

A context manager that owns a task group must not wrap the caller's exception, or its own setup
error, in an ``ExceptionGroup``: ``except KeyError`` / ``except MooncakeError`` around the block
has to fire.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator

import anyio
import pytest

import mooncake
from mooncake._groups import single
from mooncake.errors import InvalidArgumentError, MasterUnreachableError, MooncakeError
from mooncake.testing import local_master

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, never listening, for the test's span)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


async def test_engine_body_exception_is_itself() -> None:
    with pytest.raises(KeyError, match="mine") as info:
        async with mooncake.open_engine("127.0.0.1"):
            raise KeyError("mine")
    assert not isinstance(info.value, BaseExceptionGroup)
    assert info.value.__context__ is None  # the group is not in the chain either


async def test_engine_body_mooncake_error_is_caught_by_the_root() -> None:
    caught: MooncakeError | None = None
    try:
        async with mooncake.open_engine("127.0.0.1") as engine:
            await engine.allocate(-1)
    except MooncakeError as e:
        caught = e
    assert isinstance(caught, InvalidArgumentError)


async def test_engine_busy_rpc_port_names_the_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = int(s.getsockname()[1])
        with pytest.raises(InvalidArgumentError, match=f"rpc_port {port}"):
            async with mooncake.open_engine("127.0.0.1", rpc_port=port):
                pass


async def test_store_setup_error_is_itself(dead_port: int) -> None:
    with pytest.raises(MasterUnreachableError, match=f"127.0.0.1:{dead_port}"):
        async with mooncake.open_store(f"127.0.0.1:{dead_port}"):
            pass


async def test_store_body_exception_is_itself() -> None:
    async with local_master() as addr:
        with pytest.raises(KeyError, match="mine") as info:
            async with mooncake.open_store(addr, segment_size=1 << 20) as store:
                await store.put("k", b"v")
                raise KeyError("mine")
        assert info.value.__context__ is None


async def test_local_master_body_exception_is_itself() -> None:
    with pytest.raises(ValueError, match="mine"):
        async with local_master():
            raise ValueError("mine")


async def test_cancellation_still_cancels() -> None:
    # a cancel scope around the block still ends it quietly (the cancellation is not swallowed
    # nor turned into an error)
    with anyio.move_on_after(0.01) as scope:
        async with mooncake.open_engine("127.0.0.1"):
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_concurrent_failures_stay_a_group() -> None:
    a, b = KeyError("a"), ValueError("b")
    assert single(ExceptionGroup("x", [a, b])) is None
    assert single(ExceptionGroup("x", [ExceptionGroup("y", [a])])) is a


def test_public_names_are_listed() -> None:
    names = dir(mooncake)
    for name in ("open_engine", "open_store", "serve_master", "MooncakeError"):
        assert name in names
    assert callable(mooncake.serve_master)


async def test_engine_rpc_port_out_of_range() -> None:
    with pytest.raises(InvalidArgumentError, match="70000 is out of range"):
        async with mooncake.open_engine("127.0.0.1", rpc_port=70000):
            pass


async def test_buffer_supports_the_buffer_protocol() -> None:
    async with mooncake.open_engine("127.0.0.1") as a, mooncake.open_engine("127.0.0.1") as b:
        src, dst = await a.allocate(1 << 16), await b.allocate(1 << 16)
        with memoryview(src) as m:
            m[:5] = b"hello"
        await a.write(b.segment_name, src.addr, dst.addr, 4096)
        assert bytes(memoryview(dst)[:5]) == b"hello"
        with pytest.raises(InvalidArgumentError, match="unregister"):
            dst.close()  # registered memory is never unmapped under the engine
        await b.unregister(dst)


async def test_failed_start_logs_only_its_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mooncake._store.master_conn import MasterConnection
    from mooncake.errors import RpcError

    real = MasterConnection.call

    async def refuse(self: MasterConnection, method: str, *args: object, **kw: object) -> object:
        if method in ("MountSegment", "UnmountSegment"):
            raise RpcError(f"{method} refused for the test")
        return await real(self, method, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(MasterConnection, "call", refuse)
    async with local_master() as addr:
        with caplog.at_level(logging.WARNING), pytest.raises(RpcError, match="MountSegment"):
            async with mooncake.open_store(addr, segment_size=1 << 20):
                pass
    assert not [r for r in caplog.records if "unmounting" in r.getMessage()]
