"""The shm transport between two real processes: data, bounds, revocation, peer death, unmapping.

The peer is ``tests/helpers/engine_peer.py`` (our engine in a child process): one
``engine.allocate`` buffer (memfd, mapped by us) and one registered numpy array (reached with
process_vm_readv/writev). Our side is an engine in this process on trio.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from mooncake import _fast
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import open_engine
from mooncake._engine.transports import default_transports
from mooncake._engine.transports.shm import available
from mooncake.errors import PeerDiedError, RemoteAccessError
from tests.helpers.driver import LineDriver

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not available(), reason="shm needs Linux (AF_UNIX, memfd_create, /proc)"),
]

HELPER = Path(__file__).parent / "helpers" / "engine_peer.py"
ROOT = Path(__file__).parent.parent
SIZE = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


class Peer(LineDriver):
    def __init__(self, alloc: int = SIZE, array: int = SIZE, no_dumpable: bool = False) -> None:
        super().__init__(
            [sys.executable, str(HELPER), "--alloc", str(alloc), "--array", str(array)]
            + (["--no-dumpable"] if no_dumpable else []),
            what="engine_peer",
        )

    def dump(self, which: str, off: int, n: int) -> bytes:
        return bytes.fromhex(self.cmd(op="dump", which=which, offset=off, length=n)["data_hex"])


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.close()


def initial(n: int, off: int = 0) -> bytes:
    return ((np.arange(off, off + n, dtype=np.uint64) * 7 + 1).astype(np.uint8)).tobytes()


def mapped_bases(engine: Any, segment: str) -> list[tuple[int, int]]:
    s = engine._peers[segment].state["shm"]
    return [(e.base, e.length) for e in s.entries if e.mm is not None]


def in_maps(base: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == base for line in f)


def test_default_transports_prefer_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("MOONCAKE_TRANSPORTS", raising=False)
    assert default_transports() == ["shm", "tcp"]
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert default_transports() == ["tcp"]
    monkeypatch.setenv("MOONCAKE_TRANSPORTS", "tcp, shm")
    assert default_transports() == ["tcp", "shm"]


async def test_read_write_mapped_and_vm(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        arr = local.numpy()
        p = await engine.peer(peer.segment)
        assert engine._pick(p, None).name == "shm"
        for which in ("alloc", "array"):
            base = peer.info[which]
            # read 1000 bytes at offset 4093 (crosses a page) and a whole-buffer read
            await engine.read(peer.segment, local.addr, base + 4093, 1000)
            assert arr[:1000].tobytes() == initial(1000, 4093)
            res = await engine.transfer(
                peer.segment, [TransferRequest.read(local.addr, base, SIZE)], transport="shm"
            )
            assert res[0].ok and res[0].transferred == SIZE
            assert arr.tobytes() == initial(SIZE)
            # a batch of writes, then read them back from the peer's own view
            arr[:8192] = np.frombuffer(os.urandom(8192), dtype=np.uint8)
            reqs = [
                TransferRequest.write(local.addr + k * 1024, base + 100 + k * 1024, 1024)
                for k in range(8)
            ]
            res = await engine.transfer(peer.segment, reqs, transport="shm")
            assert all(r.ok for r in res)
            assert peer.dump(which, 100, 8192) == arr[:8192].tobytes()
        assert mapped_bases(engine, peer.segment)  # the memfd was mapped, not copied by vm
        del arr


async def test_buffer_registered_later_is_listed_and_mapped(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        await engine.read(peer.segment, local.addr, peer.info["alloc"], 64)  # first listing
        before = len(mapped_bases(engine, peer.segment))
        reply = await anyio.to_thread.run_sync(
            lambda: peer.cmd(op="allocate", which="late", length=SIZE, value=9)
        )
        res = await engine.transfer(
            peer.segment,
            [TransferRequest.read(local.addr, reply["addr"] + 10, 4096)],
            transport="shm",
        )
        assert res[0].ok and (local.numpy()[:4096] == 9).all()
        assert len(mapped_bases(engine, peer.segment)) == before + 1  # mapped, not process_vm


async def test_large_batch_goes_through_worker_thread(peer: Peer) -> None:
    big = 8 << 20
    bigpeer = Peer(alloc=big, array=4096)
    try:
        async with open_engine("127.0.0.1") as engine:
            local = await engine.allocate(big)
            arr = local.numpy()
            arr[:] = 5
            await engine.write(bigpeer.segment, local.addr, bigpeer.info["alloc"], big)
            assert bigpeer.dump("alloc", big - 16, 16) == b"\x05" * 16
            del arr
    finally:
        bigpeer.close()


async def test_bounds_are_the_peers_registered_ranges(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(2 * SIZE)
        for which in ("alloc", "array"):
            base = peer.info[which]
            bad = [
                TransferRequest.read(local.addr, base + SIZE - 10, 11),  # runs past the end
                TransferRequest.write(local.addr, base - 1, 2),  # starts before
                TransferRequest.read(local.addr, base, SIZE + 1),
            ]
            res = await engine.transfer(peer.segment, bad, transport="shm")
            assert [r.ok for r in res] == [False] * 3
            assert all(isinstance(r.error, RemoteAccessError) for r in res)
        # the transport's own check (not only the engine's cached descriptor): ask it directly
        p = await engine.peer(peer.segment)
        shm = next(t for t in engine.transports if t.name == "shm")
        out = await shm.execute(
            p, [TransferRequest.write(local.addr, peer.info["alloc"] + SIZE, 8)]
        )
        assert not out[0].ok and isinstance(out[0].error, RemoteAccessError)
        assert peer.dump("alloc", 0, 16) == initial(16)


async def test_unregister_revokes_and_unmaps(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        await engine.read(peer.segment, local.addr, peer.info["alloc"], 64)
        ((base, _),) = mapped_bases(engine, peer.segment)
        assert in_maps(base)
        # in a thread: the peer's unregister waits for our engine (this loop) to acknowledge
        await anyio.to_thread.run_sync(lambda: peer.cmd(op="unregister", which="alloc"))
        assert not in_maps(base)
        res = await engine.transfer(
            peer.segment,
            [TransferRequest.read(local.addr, peer.info["alloc"], 64)],
            transport="shm",
        )
        assert not res[0].ok and isinstance(res[0].error, RemoteAccessError)
        # the other buffer still works
        await engine.read(peer.segment, local.addr, peer.info["array"], 64)


async def test_peer_death_leaves_no_mapping(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        await engine.read(peer.segment, local.addr, peer.info["alloc"], 64)
        ((base, _),) = mapped_bases(engine, peer.segment)
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait()
        res = await engine.transfer(
            peer.segment,
            [TransferRequest.write(local.addr, peer.info["alloc"], 64)],
            transport="shm",
        )
        assert not res[0].ok and isinstance(res[0].error, PeerDiedError)
        assert not in_maps(base)


async def test_engine_close_unmaps(peer: Peer) -> None:
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        await engine.read(peer.segment, local.addr, peer.info["alloc"], 64)
        ((base, _),) = mapped_bases(engine, peer.segment)
        assert in_maps(base)
    assert not in_maps(base)


async def test_transport_override_and_force_tcp(peer: Peer) -> None:
    async with open_engine("127.0.0.1", transports=["tcp"]) as engine:
        local = await engine.allocate(SIZE)
        p = await engine.peer(peer.segment)
        assert engine._pick(p, None).name == "tcp"
        await engine.read(peer.segment, local.addr, peer.info["alloc"], 4096)
        assert local.numpy()[:4096].tobytes() == initial(4096)
    async with open_engine("127.0.0.1") as engine:
        local = await engine.allocate(SIZE)
        res = await engine.transfer(
            peer.segment,
            [TransferRequest.read(local.addr, peer.info["array"], 4096)],
            transport="tcp",
        )
        assert res[0].ok and "shm" not in (await engine.peer(peer.segment)).state


CLIENT = """
import anyio, json, sys
from mooncake._engine.engine import open_engine
from mooncake._core.transfer import TransferRequest

async def main():
    seg, alloc, array = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    async with open_engine("127.0.0.1") as e:
        b = await e.allocate(8192)
        r = await e.transfer(seg, [TransferRequest.read(b.addr, array, 4096),
                                   TransferRequest.read(b.addr + 4096, alloc, 4096)])
        s = (await e.peer(seg)).state["shm"]
        print(json.dumps({"ok": [x.ok for x in r], "data": b.numpy()[:16].tobytes().hex(),
                          "vm_denied": s.vm_denied,
                          "mapped": len([x for x in s.entries if x.mm is not None])}))

anyio.run(main, backend="trio")
"""


def test_vm_refused_by_kernel_falls_back_to_tcp(tmp_path: Path) -> None:
    """process_vm on a non-dumpable peer without CAP_SYS_PTRACE: EPERM, then TCP carries it."""
    prefix: list[str] = []
    if os.geteuid() == 0:  # root holds CAP_SYS_PTRACE: drop it for the client
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and util-linux's setpriv is missing")
        prefix = [setpriv, "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"]
    p = Peer(no_dumpable=True)
    try:
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run(
            [
                *prefix,
                sys.executable,
                str(script),
                p.segment,
                str(p.info["alloc"]),
                str(p.info["array"]),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        p.close()
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"] == [True, True] and bytes.fromhex(got["data"]) == initial(16)
    assert got["vm_denied"] is True  # the array went over TCP
    assert got["mapped"] == 1  # the memfd buffer is still mapped and copied directly
    assert "ptrace policy" in out.stderr


def test_compiled_twin_is_what_the_environment_asks_for() -> None:
    forced = os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0")
    if forced:
        assert _fast.COMPILED is False
    elif not _fast.COMPILED:
        pytest.skip("extension not built (python setup.py build_ext --inplace)")


async def test_process_vm_write_stops_before_the_peers_unregister_returns() -> None:
    """A large process_vm write into the peer's (non-engine) array is a user of it: the peer's
    ``unregister`` returns only once our copy no longer writes there (it used to be acknowledged
    at once, and hundreds of MB landed after it returned)."""
    n = 512 << 20
    p = Peer(array=n)
    try:
        async with open_engine("127.0.0.1") as engine:
            local = await engine.allocate(n)
            await engine.read(p.segment, local.addr, p.info["array"], 64)  # listed, not mapped
            local.numpy()[:] = 0xEE
            shm = (await engine.peer(p.segment)).state["shm"]
            (entry,) = [e for e in shm.entries if e.addr == p.info["array"]]
            assert entry.mm is None  # reached with process_vm_writev
            out: list[Any] = []

            async def write() -> None:
                out.extend(
                    await engine.transfer(
                        p.segment, [TransferRequest.write(local.addr, p.info["array"], n)]
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                await anyio.wait_all_tasks_blocked()  # the copy runs on a worker thread
                assert entry.users == 1
                reply = await anyio.to_thread.run_sync(
                    lambda: p.cmd(op="unregister_watch", wait_s=0.5)
                )
            # the last byte is written last: if it changed after unregister returned, the copy
            # was still writing into memory its owner had taken back
            assert reply["before"] == reply["after"], reply
            assert entry.users == 0
            # stopped at the revoke (the rest failed), or finished before it
            assert out[0].ok or isinstance(out[0].error, RemoteAccessError)
    finally:
        p.close()


async def test_session_ending_during_a_process_vm_copy_is_a_peer_death() -> None:
    """The connection to the peer ends (as when it dies) while a process_vm write runs on a
    worker thread: the copy stops at the next piece and the transfer fails with
    PeerDiedError. The session's end also marks its entries dead, which used to make it read
    as a local unregister (RemoteAccessError "buffer unregistered during the copy")."""
    n = 512 << 20
    p = Peer(array=n)
    try:
        async with open_engine("127.0.0.1") as engine:
            local = await engine.allocate(n)
            await engine.read(p.segment, local.addr, p.info["array"], 64)  # listed, not mapped
            shm = (await engine.peer(p.segment)).state["shm"]
            (entry,) = [e for e in shm.entries if e.addr == p.info["array"]]
            assert entry.mm is None  # reached with process_vm_writev
            out: list[Any] = []

            async def write() -> None:
                out.extend(
                    await engine.transfer(
                        p.segment, [TransferRequest.write(local.addr, p.info["array"], n)]
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                await anyio.wait_all_tasks_blocked()  # the copy runs on a worker thread
                assert entry.users == 1
                shm.close()  # what the reader task does when the peer's end closes
            assert not out[0].ok and isinstance(out[0].error, PeerDiedError), out[0].error
    finally:
        p.close()


CLOSE_MID_COPY = """
import anyio, sys
from mooncake._engine.engine import open_engine
from mooncake._core.transfer import TransferRequest

async def main():
    n = 256 << 20
    async with open_engine("127.0.0.1", transports=["shm", "tcp"]) as server:
        dst = await server.allocate(n)
        async with open_engine("127.0.0.1", transports=["shm", "tcp"]) as client:
            src = await client.allocate(n)
            await client.read(server.segment_name, src.addr, dst.addr, 64)  # mapped now
            shm = next(t for t in client.transports if t.name == "shm")
            h = client.submit(server.segment_name, [TransferRequest.write(src.addr, dst.addr, n)])
            while not shm._copier._waiters:  # until the batch sits in a CopyQueue copy
                await anyio.sleep(0)
        # closing cancelled Copier.run with the copy in flight, and returned
        print("closed", h.done, h.status.name, flush=True)

anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_close_during_a_copy_queue_copy_returns(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "close_mid_copy.py"
    script.write_text(CLOSE_MID_COPY)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run(
            [sys.executable, str(script), backend],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,  # a hang guard: it used to hang forever
        )
    except subprocess.TimeoutExpired:
        pytest.fail("closing the engine hung with a copy in flight")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["closed", "True"], out.stdout
