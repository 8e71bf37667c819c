"""The TCP protocol state machines of ``mooncake._fast`` (compiled and pure twins, and across).

``ServeConn`` and ``ClientPipe`` are stepped by hand over a non-blocking socketpair, so every
WANT_READ/WANT_WRITE resumption is exercised without an event loop; then the engine path is
checked against the published Mooncake (its venv, when present) in both directions.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake._fast import _tcp_pure

try:
    _tcp_c: ModuleType | None = importlib.import_module("mooncake._fast._tcp")
except ImportError:
    _tcp_c = None

DONE, WANT_READ, WANT_WRITE, YIELD, CLOSE, PEER_CLOSED = 0, 1, 2, 3, 4, 5
E_PROTO = 100000
MAGIC = 0x4D43545600000000


def twins() -> list[Any]:
    out: list[Any] = [pytest.param(_tcp_pure, id="pure")]
    out.append(
        pytest.param(
            _tcp_c,
            id="compiled",
            marks=pytest.mark.skipif(_tcp_c is None, reason="extension not built"),
        )
    )
    return out


@pytest.fixture(params=twins())
def mod(request: pytest.FixtureRequest) -> ModuleType:
    m = request.param
    assert m is not None
    return m  # type: ignore[no-any-return]


@pytest.fixture(params=[("pure", "compiled"), ("compiled", "pure")], ids=["srv-pure", "srv-c"])
def cross(request: pytest.FixtureRequest) -> tuple[ModuleType, ModuleType]:
    if _tcp_c is None:
        pytest.skip("extension not built")
    by = {"pure": _tcp_pure, "compiled": _tcp_c}
    s, c = request.param
    return by[s], by[c]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def addr_of(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.ctypes.data)


def run(server: Any, client: Any, srv_sock: socket.socket) -> int:
    """Step both until the client finishes; returns the client's last result."""
    server_open = True
    for _ in range(1_000_000):
        rc = client.step()
        if rc not in (WANT_READ, WANT_WRITE):
            return int(rc)
        if server_open:
            rs = server.step()
            if rs in (CLOSE, PEER_CLOSED) or rs < 0:
                server.close()
                srv_sock.shutdown(socket.SHUT_RDWR)
                server_open = False
    raise AssertionError("no progress")


def test_region_table_basics(mod: ModuleType) -> None:
    t = mod.RegionTable()
    t.add(1000, 100)
    t.add(1100, 50)  # adjacent is fine
    with pytest.raises(ValueError):
        t.add(1050, 10)
    with pytest.raises(ValueError):
        t.add(990, 20)
    with pytest.raises(ValueError):
        t.add(5000, 0)
    assert t.find(1000, 100) and t.find(1100, 50) and t.find(1149, 1)
    assert not t.find(1090, 20)  # straddles two regions: refused, as the published engine does
    assert not t.find(999, 2) and not t.find(1150, 1) and not t.find(1000, 0)
    assert t.remove(1000) and not t.remove(1000)
    assert not t.find(1000, 1) and len(t) == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 64), st.integers(1, 8)), max_size=12),
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 10)), max_size=20),
)
def test_region_table_matches_a_model(
    adds: list[tuple[int, int]], probes: list[tuple[int, int]]
) -> None:
    for m in (_tcp_pure, _tcp_c):
        if m is None:
            continue
        t = m.RegionTable()
        model: list[tuple[int, int]] = []
        for a, n in adds:
            overlaps = any(a < s + ln and s < a + n for s, ln in model)
            if overlaps:
                with pytest.raises(ValueError):
                    t.add(a, n)
            else:
                t.add(a, n)
                model.append((a, n))
        for a, n in probes:
            want = n > 0 and any(s <= a and a + n <= s + ln for s, ln in model)
            assert t.find(a, n) == want, (m.__name__, model, a, n)


def make(mod_s: ModuleType, mod_c: ModuleType, pair: Any, size: int = 1 << 20) -> Any:
    srv_sock, cli_sock = pair
    remote = np.zeros(size, dtype=np.uint8)
    local = np.zeros(size, dtype=np.uint8)
    table = mod_s.RegionTable()
    table.add(addr_of(remote), size)
    server = mod_s.ServeConn(srv_sock.fileno(), table, 64 << 10)
    return srv_sock, cli_sock, remote, local, table, server


def test_read_write_roundtrip(mod: ModuleType, pair: Any) -> None:
    srv_sock, cli_sock, remote, local, _, server = make(mod, mod, pair)
    rng = np.random.default_rng(1)
    local[:] = rng.integers(0, 256, len(local), dtype=np.uint8)
    la, ra = addr_of(local), addr_of(remote)
    # 64 writes of 16 KiB: more than one step's worth, and more than the socket buffer
    n, bs = 64, 16 << 10
    w = mod.ClientPipe(
        cli_sock.fileno(),
        True,
        True,
        [la + i * bs for i in range(n)],
        [ra + i * bs for i in range(n)],
        [bs] * n,
    )
    assert run(server, w, srv_sock) == DONE
    assert w.statuses == [0] * n and w.done == n
    assert np.array_equal(remote[: n * bs], local[: n * bs])
    local[:] = 0
    r = mod.ClientPipe(cli_sock.fileno(), False, True, [la + 7], [ra + 3], [(1 << 20) - 3])
    assert run(server, r, srv_sock) == DONE
    assert r.statuses == [0]
    assert np.array_equal(local[7 : 7 + (1 << 20) - 3 - 4], remote[3 : 3 + (1 << 20) - 7])
    assert server.served == n + 1 and server.refused == 0


def test_cross_twin_wire_is_identical(cross: tuple[ModuleType, ModuleType], pair: Any) -> None:
    ms, mc = cross
    srv_sock, cli_sock, remote, local, _, server = make(ms, mc, pair)
    local[:4096] = 9
    la, ra = addr_of(local), addr_of(remote)
    w = mc.ClientPipe(cli_sock.fileno(), True, True, [la], [ra + 100], [4096])
    assert run(server, w, srv_sock) == DONE and w.statuses == [0]
    assert (remote[100:4196] == 9).all()
    r = mc.ClientPipe(
        cli_sock.fileno(), False, True, [la + 8192, la], [ra + 100, ra + (1 << 30)], [4096, 8]
    )
    assert run(server, r, srv_sock) == DONE
    assert r.statuses == [0, 1]
    assert (local[8192 : 8192 + 4096] == 9).all()


def test_refusals_keep_the_connection(mod: ModuleType, pair: Any) -> None:
    srv_sock, cli_sock, remote, local, _, server = make(mod, mod, pair)
    la, ra = addr_of(local), addr_of(remote)
    size = len(remote)
    local[:] = 3
    # good, past the end (WRITE payload drained), straddling, good
    reqs = [(la, ra, 100), (la, ra + size - 10, 4096), (la, ra - 8, 16), (la + 200, ra + 200, 50)]
    w = mod.ClientPipe(cli_sock.fileno(), True, True, *[list(x) for x in zip(*reqs, strict=True)])
    assert run(server, w, srv_sock) == DONE
    assert w.statuses == [0, 1, 1, 0]
    assert (remote[:100] == 3).all() and (remote[200:250] == 3).all()
    assert (remote[100:200] == 0).all() and (remote[size - 10 :] == 0).all()
    assert server.refused == 2
    # the same connection still serves
    r = mod.ClientPipe(cli_sock.fileno(), False, True, [la + 1000], [ra], [100])
    local[1000:1100] = 0
    assert run(server, r, srv_sock) == DONE and r.statuses == [0]
    assert (local[1000:1100] == 3).all()


def test_oversized_refused_write_closes_after_status(mod: ModuleType, pair: Any) -> None:
    srv_sock, cli_sock, remote, local, _, server = make(mod, mod, pair)
    big = 128 << 10  # above the 64 KiB drain limit of make()
    w = mod.ClientPipe(
        cli_sock.fileno(),
        True,
        True,
        [addr_of(local), addr_of(local)],
        [addr_of(remote) - big, addr_of(remote)],
        [big, 10],
    )
    rc = run(server, w, srv_sock)
    assert w.statuses[0] == 1 and w.done == 1
    # the server answered the refusal, then closed: the client reports that, not a result
    assert rc == PEER_CLOSED or rc < 0


def test_v1_refusal_closes(mod: ModuleType, pair: Any) -> None:
    srv_sock, cli_sock, remote, local, _, server = make(mod, mod, pair)
    r = mod.ClientPipe(cli_sock.fileno(), False, False, [addr_of(local)], [addr_of(remote)], [64])
    remote[:64] = 5
    assert run(server, r, srv_sock) == DONE and (local[:64] == 5).all()
    bad = mod.ClientPipe(cli_sock.fileno(), False, False, [addr_of(local)], [8], [64])
    assert run(server, bad, srv_sock) < 0  # v1 cannot say no: the connection ends


def test_malformed_header_and_status(mod: ModuleType, pair: Any) -> None:
    srv_sock, cli_sock, remote, local, _table, server = make(mod, mod, pair)
    cli_sock.send(struct.pack("<QQB7x", 8, addr_of(remote), 0x85))  # opcode 5
    assert server.step() == -E_PROTO
    # a client seeing a status frame without the magic
    srv_sock.send(struct.pack("<Q", 0x1234))
    c = mod.ClientPipe(cli_sock.fileno(), True, True, [addr_of(local)], [addr_of(remote)], [8])
    rc = WANT_WRITE
    while rc in (WANT_READ, WANT_WRITE):
        rc = c.step()
        if rc == WANT_READ:
            break
    assert c.step() == -E_PROTO or rc == -E_PROTO


def test_peer_gone_mid_request(mod: ModuleType, pair: Any) -> None:
    _srv_sock, cli_sock, remote, _local, table, server = make(mod, mod, pair)
    cli_sock.send(struct.pack("<QQB7x", 4096, addr_of(remote), 0x81) + b"x" * 100)
    cli_sock.close()
    rc = server.step()
    assert rc < 0 and rc != -E_PROTO
    server.close()
    assert table.remove(addr_of(remote))  # the held region was released: remove does not block


def test_clean_eof_between_requests(mod: ModuleType, pair: Any) -> None:
    _srv_sock, cli_sock, _remote, _local, _table, server = make(mod, mod, pair)
    assert server.step() == WANT_READ
    cli_sock.shutdown(socket.SHUT_WR)
    assert server.step() == PEER_CLOSED


# -- against the published Mooncake ----------------------------------------------------------

ANCHOR_PY = next(
    (
        str(p)
        for p in (
            Path.home() / ".cache" / "mooncake-anchor-venv" / "bin" / "python",
            Path("/opt/anchor-venv/bin/python"),
        )
        if p.exists()
    ),
    None,
)
PEER = Path(__file__).parent / "helpers" / "published_peer.py"


@pytest.fixture
def published() -> Iterator[Any]:
    if ANCHOR_PY is None:
        pytest.skip("published Mooncake venv absent (bash shared/anchor/setup.sh)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MC_LOG_LEVEL"] = "ERROR"
    proc = subprocess.Popen(
        [ANCHOR_PY, str(PEER), "--size", str(4 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    info = json.loads(proc.stdout.readline())

    def cmd(**kw: Any) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(kw) + "\n")
        proc.stdin.flush()
        out: dict[str, Any] = json.loads(proc.stdout.readline())
        return out

    try:
        yield info, cmd
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.anchor
@pytest.mark.anyio
async def test_against_published_both_directions(published: Any) -> None:
    from mooncake._core.transfer import TransferRequest
    from mooncake._engine.engine import open_engine

    info, cmd = published
    seg, base = info["segment"], info["addr"]
    async with open_engine("127.0.0.1") as engine:
        p = await engine.peer(seg)
        assert engine._pick(p, None).name == "tcp"  # a published peer never gets shm
        buf = await engine.allocate(4 << 20)
        arr = buf.numpy()
        arr[: 1 << 20] = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
        # our client -> published server: a batch with a refused request in the middle
        reqs = [
            TransferRequest.write(buf.addr + k * 65536, base + k * 65536, 65536) for k in range(16)
        ]
        reqs.insert(5, TransferRequest.write(buf.addr, base + (64 << 20), 4096))
        res = await engine.transfer(seg, reqs)
        assert [r.ok for r in res] == [True] * 5 + [False] + [True] * 11
        got = bytes.fromhex(cmd(op="dump", offset=0, length=1 << 20)["data_hex"])
        assert got == arr[: 1 << 20].tobytes()
        arr[: 1 << 20] = 0
        await engine.read(seg, buf.addr, base, 1 << 20)
        assert arr[: 1 << 20].tobytes() == got
        # published client -> our server (from a thread: our loop must keep serving)
        mine = engine.segment_name

        async def acmd(**kw: Any) -> dict[str, Any]:
            out: dict[str, Any] = await anyio.to_thread.run_sync(lambda: cmd(**kw))
            return out

        arr[2 << 20 : (2 << 20) + 4096] = 77
        out = await acmd(
            op="read", segment=mine, local_off=0, remote=buf.addr + (2 << 20), length=4096
        )
        assert out["rc"] == 0
        assert bytes.fromhex(cmd(op="dump", offset=0, length=4096)["data_hex"]) == b"\x4d" * 4096
        cmd(op="fill", offset=8192, data_hex=(b"\x21" * 1000).hex())
        out = await acmd(
            op="write", segment=mine, local_off=8192, remote=buf.addr + 12345, length=1000
        )
        assert out["rc"] == 0 and (arr[12345:13345] == 0x21).all()
        out = await acmd(
            op="write", segment=mine, local_off=0, remote=buf.addr + (8 << 20), length=64
        )
        assert out["rc"] != 0
        tcp = next(t for t in engine.transports if t.name == "tcp")
        assert tcp.refused_requests >= 1
        del arr


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


# -- copy queue: completions on an eventfd ---------------------------------------------------


def copyq_twins() -> list[Any]:
    from mooncake._fast import _copyq_pure

    try:
        c: ModuleType | None = importlib.import_module("mooncake._fast._copyq")
    except ImportError:
        c = None
    return [
        pytest.param(_copyq_pure, id="pure"),
        pytest.param(c, id="compiled", marks=pytest.mark.skipif(c is None, reason="not built")),
    ]


@pytest.mark.parametrize("cq", copyq_twins())
def test_copy_queue_bursts_and_close(cq: ModuleType) -> None:
    import select

    q = cq.CopyQueue(2)
    src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
    dst = np.zeros(1 << 20, dtype=np.uint8)
    s, d = addr_of(src), addr_of(dst)
    n = 64
    blk = (1 << 20) // n
    for k in range(n):  # one job per block, each of two ranges
        half = blk // 2
        q.submit(
            k,
            [d + k * blk, d + k * blk + half],
            [s + k * blk, s + k * blk + half],
            [half, blk - half],
        )
    got: list[int] = []
    while len(got) < n:
        r, _, _ = select.select([q.fileno()], [], [], 10)
        assert r, "no completion within 10 s"
        got += q.drain()
    assert sorted(got) == list(range(n))
    assert np.array_equal(src, dst)
    assert q.drain() == []  # nothing pending: an empty burst
    # close() finishes what is queued before stopping
    dst[:] = 0
    q.submit(99, [d], [s], [1 << 20])
    q.close()
    assert q.drain() == [99] and np.array_equal(src, dst)
    with pytest.raises(ValueError):
        q.submit(100, [d], [s], [1])
    with pytest.raises(ValueError):
        cq.CopyQueue(0)


@pytest.mark.anyio
async def test_copier_cancellation_waits_for_the_copy() -> None:
    from mooncake._engine._copier import Copier

    big = 64 << 20
    src = np.ones(big, dtype=np.uint8)
    dst = np.zeros(big, dtype=np.uint8)
    c = Copier()
    async with anyio.create_task_group() as tg:
        await tg.start(c.run)
        with anyio.CancelScope() as scope:
            scope.cancel()  # already cancelled: copy must still not return before the copy ends
            await c.copy([addr_of(dst)], [addr_of(src)], [big])
        assert dst[-1] == 1 and dst[0] == 1
        await c.copy([addr_of(dst)], [addr_of(src) + 1], [big - 1])
        assert c.completions == 2
        tg.cancel_scope.cancel()
    c.close()


def test_serve_blocking_on_a_thread_and_stop(mod: ModuleType, pair: Any) -> None:
    import select
    import threading

    _srv_sock, cli_sock, remote, local, table, server = make(mod, mod, pair)
    with pytest.raises(ValueError):
        server.serve_blocking()  # prepare_blocking() first
    server.prepare_blocking()
    box: list[int] = []
    th = threading.Thread(target=lambda: box.append(server.serve_blocking()))
    th.start()
    try:
        remote[:8192] = 42
        for _ in range(3):  # the thread keeps serving request after request
            c = mod.ClientPipe(
                cli_sock.fileno(), False, True, [addr_of(local)], [addr_of(remote)], [8192]
            )
            rc = c.step()
            while rc in (WANT_READ, WANT_WRITE):
                want_w = [cli_sock] if rc == WANT_WRITE else []
                r, w, _ = select.select([cli_sock], want_w, [], 10)
                assert r or w, "no progress within 10 s"
                rc = c.step()
            assert rc == DONE and c.statuses == [0] and (local[:8192] == 42).all()
            local[:8192] = 0
    finally:
        server.stop()
        th.join(10)
    assert not th.is_alive() and box == [PEER_CLOSED]
    server.close()
    assert table.remove(addr_of(remote))


def _serve_in_thread(server: Any, *args: int) -> tuple[Any, list[int]]:
    import threading

    server.prepare_blocking()
    box: list[int] = []
    th = threading.Thread(target=lambda: box.append(server.serve_blocking(*args)))
    th.start()
    return th, box


def test_region_table_close_and_reopen(mod: ModuleType) -> None:
    t = mod.RegionTable()
    t.add(1000, 100)
    assert t.close(1000) is False  # no users right now
    assert not t.find(1000, 10)  # refused from the moment it is closing
    assert t.reopen(1000) and t.find(1000, 10)
    assert not t.close(5000) and not t.reopen(5000)


@pytest.mark.parametrize("cut", [10, 24 + 100])
def test_serve_blocking_progress_deadline(mod: ModuleType, pair: Any, cut: int) -> None:
    import errno as errno_

    _srv, cli, remote, _, table, server = make(mod, mod, pair)
    th, box = _serve_in_thread(server, 200, -1)
    frame = struct.pack("<QQB7x", 4096, addr_of(remote), 0x81) + b"x" * 4096
    cli.sendall(frame[:cut])  # a header or payload cut short, then silence
    th.join(30)
    assert not th.is_alive() and box == [-errno_.ETIMEDOUT]
    server.close()
    assert table.remove(addr_of(remote))  # the region was released


def test_serve_blocking_idle_deadline_and_eviction(mod: ModuleType, pair: Any) -> None:
    _srv, _cli, _remote, _, table, server = make(mod, mod, pair)
    th, box = _serve_in_thread(server, -1, 200)
    th.join(30)
    assert not th.is_alive() and box == [CLOSE]  # idle past idle_ms from the start
    server2 = mod.ServeConn(_srv.fileno(), table, 64 << 10)
    th, box = _serve_in_thread(server2, -1, -1)
    server2.evict()  # idle: goes
    th.join(30)
    assert not th.is_alive() and box == [CLOSE]


def test_serve_blocking_wake_drops_a_holder_of_a_closing_range(mod: ModuleType, pair: Any) -> None:
    import errno as errno_
    import threading

    _srv, cli, remote, _, table, server = make(mod, mod, pair)
    th, box = _serve_in_thread(server, -1, -1)
    cli.sendall(struct.pack("<QQB7x", 8192, addr_of(remote), 0x81) + b"x" * 100)
    for _ in range(3000):  # until the server is inside the write
        if not server.idle:
            break
        threading.Event().wait(0.01)
    assert not server.idle
    server.evict()  # busy: eviction is refused, the request goes on
    threading.Event().wait(0.1)
    assert th.is_alive()
    assert table.close(addr_of(remote)) is True  # it has a user: the connection above
    server.wake()
    th.join(30)
    assert not th.is_alive() and box == [-errno_.ECONNABORTED]
    server.close()
    assert table.remove(addr_of(remote))


@pytest.mark.anyio
async def test_copier_run_cancelled_mid_copy_still_completes_it() -> None:
    """Closing an engine cancels every task at once, the copier's ``run`` among them: a copy in
    flight must still be delivered (it used to wait forever for an event nobody would set)."""
    from mooncake._engine._copier import Copier
    from mooncake.errors import ClosedError

    big = 128 << 20
    src = np.ones(big, dtype=np.uint8)
    dst = np.zeros(big, dtype=np.uint8)
    c = Copier()
    done: list[str] = []

    async def copy() -> None:
        await c.copy([addr_of(dst)], [addr_of(src)], [big])
        done.append("copied")

    with anyio.fail_after(60):  # a hang guard, not a timing assertion
        async with anyio.create_task_group() as outer, anyio.create_task_group() as runner:
            await runner.start(c.run)
            outer.start_soon(copy)
            await anyio.wait_all_tasks_blocked()
            assert c._waiters, "the copy is not in flight"
            runner.cancel_scope.cancel()  # run is cancelled while the copy is running
    assert done == ["copied"] and dst[0] == 1 and dst[-1] == 1
    with pytest.raises(ClosedError):  # run has ended: nothing is submitted
        await c.copy([addr_of(dst)], [addr_of(src)], [1])
    c.close()
