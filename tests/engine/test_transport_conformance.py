"""Every transport this machine has passes :mod:`mooncake.testing.transport`.

One test per (transport, check): tcp and shm (its memfd mappings and its process_vm copies)
against an engine in a child process, the engine's own local path, and rdma over the software
verbs provider where it is built (skipped, saying why, where it is not).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake._engine.transports.shm import available as shm_available
from mooncake.testing import check_transport
from mooncake.testing.transport import CHECKS, MakePair, Unsupported, local_pair, process_pair

pytestmark = pytest.mark.anyio

KINDS = ["tcp", "shm-memfd", "shm-process_vm", "local", "rdma-soft"]


def _rdma_skip() -> str | None:
    try:
        from mooncake._fast import verbs
    except ImportError as e:
        return f"the verbs layer does not import ({e})"
    if not verbs.AVAILABLE:
        return "the verbs layer is not built"
    if not os.path.exists(verbs.soft_provider_path()):
        return f"the software verbs provider is not built ({verbs.soft_provider_path()})"
    return None


@pytest.fixture
def make_pair(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[MakePair]:
    kind: str = request.param
    if kind.startswith("shm") and not shm_available():
        pytest.skip("shm needs Linux (AF_UNIX, memfd_create, /proc)")
    if kind == "tcp":
        yield process_pair(["tcp"], transport="tcp")
    elif kind == "shm-memfd":
        yield process_pair(["shm", "tcp"], transport="shm", memory="alloc")
    elif kind == "shm-process_vm":
        yield process_pair(["shm", "tcp"], transport="shm", memory="array")
    elif kind == "local":
        yield local_pair()
    else:
        why = _rdma_skip()
        if why is not None:
            pytest.skip(why)
        from mooncake._fast import verbs

        monkeypatch.setenv("MOONCAKE_IBVERBS", "soft")
        monkeypatch.setenv("MC_SOFTVERBS_FABRIC", str(tmp_path / "fabric"))
        monkeypatch.setenv("MC_SOFTVERBS_DEVICES", "soft0,soft1")
        monkeypatch.delenv("MC_SOFTVERBS_LINK_LAYER", raising=False)
        verbs.load(verbs.soft_provider_path())
        yield process_pair(["rdma"], transport="rdma")
        assert set(verbs.live_objects().values()) == {0}, verbs.live_objects()


@pytest.mark.parametrize("check", [c.name for c in CHECKS])
@pytest.mark.parametrize("make_pair", KINDS, indirect=True)
async def test_transport_conformance(make_pair: MakePair, check: str) -> None:
    try:
        assert await check_transport(make_pair, only=[check]) == []
    except Unsupported as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(("memory", "mapped"), [("alloc", True), ("array", False)])
async def test_shm_pairs_exercise_the_path_they_name(memory: str, mapped: bool) -> None:
    """The shm kinds above really are a mapping (memfd) and process_vm (plain memory)."""
    if not shm_available():
        pytest.skip("shm needs Linux (AF_UNIX, memfd_create, /proc)")
    import numpy as np

    async with process_pair(["shm", "tcp"], transport="shm", memory=memory)() as p:
        buf = np.zeros(4096, dtype=np.uint8)
        await p.engine.register(buf)
        await p.engine.read(p.peer.segment, int(buf.ctypes.data), p.peer.addr, 4096)
        info = p.engine.cached_peer(p.peer.segment)
        assert info is not None
        entries = info.state["shm"].entries
        ent = next(e for e in entries if e.addr <= p.peer.addr < e.addr + e.length)
        assert (ent.mm is not None) is mapped
