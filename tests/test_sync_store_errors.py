"""The sync store facade keeps its published int codes and logs one clear line per cause."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake._sync import LoopThread
from mooncake.errors import ErrorCode
from mooncake.store import MooncakeDistributedStore
from mooncake.testing import local_master

INVALID = int(ErrorCode.INVALID_PARAMS)


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    loop = LoopThread(name="test-master")
    try:
        yield loop.enter(local_master())
    finally:
        loop.close()


def _store(master: str, local_buffer_size: int = 4 << 20) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, local_buffer_size, "tcp", "", master)
    assert rc == 0
    return s


@pytest.fixture
def store(master: str) -> Iterator[MooncakeDistributedStore]:
    s = _store(master)
    try:
        yield s
    finally:
        s.close()


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_setup_against_a_dead_master_says_why(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = sock.getsockname()[1]
        s = MooncakeDistributedStore()
        with caplog.at_level(logging.ERROR, logger="mooncake.store"):
            rc = s.setup(
                "127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", f"127.0.0.1:{port}"
            )
    assert rc == int(ErrorCode.RPC_FAIL)
    (line,) = _errors(caplog)
    assert f"cannot reach the master at 127.0.0.1:{port}" in line
    assert "TaskGroup" not in line and "sub-exception" not in line
    # nothing was mounted: no noise about unmounting
    assert not any("unmount" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("", b"v", "key must not be empty"),
        (b"k", b"v", "key must be a str, got bytes"),
        ("\udcff", b"v", "not valid UTF-8"),
        ("k", b"", "empty values cannot be stored"),
        ("big", b"x" * (5 << 20), "local_buffer_size=4194304"),
    ],
)
def test_put_refusals_name_the_cause(
    store: MooncakeDistributedStore,
    caplog: pytest.LogCaptureFixture,
    key: object,
    value: bytes,
    needle: str,
) -> None:
    with caplog.at_level(logging.ERROR, logger="mooncake.store"):
        assert store.put(key, value) == INVALID  # type: ignore[arg-type]
    (line,) = _errors(caplog)
    assert line.startswith("put: ") and needle in line


def test_get_into_refusals_name_the_cause(
    store: MooncakeDistributedStore, caplog: pytest.LogCaptureFixture
) -> None:
    assert store.put("k1", b"0123456789" * 10) == 0
    unregistered = np.zeros(128, dtype=np.uint8)
    small = np.zeros(4096, dtype=np.uint8)
    assert store.register_buffer(int(small.ctypes.data), small.nbytes) == 0
    with caplog.at_level(logging.ERROR, logger="mooncake.store"):
        assert store.get_into("k1", int(unregistered.ctypes.data), 128) == INVALID
        assert store.get_into("k1", int(small.ctypes.data), 8) == INVALID
    first, second = _errors(caplog)
    assert "not inside a registered buffer" in first and "register_buffer" in first
    assert "8 bytes" in second and "100-byte" in second
    assert store.unregister_buffer(int(small.ctypes.data)) == 0


def test_a_miss_is_not_an_error(
    store: MooncakeDistributedStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="mooncake.store"):
        assert store.get("never-put") == b""
        assert store.is_exist("never-put") == 0
    assert _errors(caplog) == []


def test_zero_local_buffer_names_the_setting(master: str, caplog: pytest.LogCaptureFixture) -> None:
    s = _store(master, local_buffer_size=0)
    try:
        with caplog.at_level(logging.ERROR, logger="mooncake.store"):
            assert s.put("k2", b"v") == INVALID
        (line,) = _errors(caplog)
        assert "local_buffer_size is 0" in line
    finally:
        s.close()
