"""The shm control socket against hostile local users: other uids, squatters, junk, lies.

The socket is abstract (no file permissions), so every boundary is checked with SO_PEERCRED.
Attackers of another uid run as ``nobody`` (65534) in a child (``os.setgid/os.setuid`` before
exec, so the test needs root); they use only the standard library (a system ``python3``).
Same-uid junk (a buggy or malicious peer of our own user) must cost at most its connection.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import pytest

from mooncake._core.descriptor import BufferDesc
from mooncake._core.transfer import TransferRequest
from mooncake._engine.engine import Engine, open_engine
from mooncake._engine.transports import shm as shm_mod
from mooncake._engine.transports.shm import available

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not available(), reason="shm needs Linux (AF_UNIX, memfd_create, /proc)"),
]

R = TransferRequest
NOBODY = 65534


def _nobody_python() -> str | None:
    """An interpreter uid 65534 can run (ours may live under an unreadable /root)."""
    if os.geteuid() != 0:
        return None
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        try:
            r = subprocess.run(
                [cand, "-c", "pass"], preexec_fn=_drop, capture_output=True, timeout=30
            )
        except OSError:
            continue
        if r.returncode == 0:
            return cand
    return None


def _drop() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def as_nobody(code: str, *args: str) -> subprocess.Popen[str]:
    py = NOBODY_PY
    assert py is not None
    return subprocess.Popen(
        [py, "-c", code, *args],
        preexec_fn=_drop,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


NOBODY_PY = _nobody_python()
needs_nobody = pytest.mark.skipif(
    NOBODY_PY is None, reason="needs root and an interpreter uid 65534 can run"
)

ATTACK_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(5)
s.connect("\0" + sys.argv[1])
got = []
try:
    for m in ({"op": "ack", "seq": "x"}, {"op": "list"}, {"op": "ack", "seq": [1]}):
        s.send(json.dumps(m).encode())
    while True:
        d = s.recv(1 << 18)
        if not d:
            break
        got.append(d.decode(errors="replace"))
except (OSError, socket.timeout) as e:
    got.append("error: " + type(e).__name__)
print(json.dumps(got))
"""

ATTACK_SQUAT = r"""
import json, socket, sys, os
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind("\0" + sys.argv[1])
s.listen(8)
print(json.dumps({"pid": os.getpid()}), flush=True)
s.settimeout(10)
got = []
try:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        while True:
            d = c.recv(1 << 16)
            if not d:
                break
            got.append(d.decode(errors="replace"))
    except (OSError, socket.timeout):
        pass
except socket.timeout:
    got.append("no connection")
print(json.dumps(got), flush=True)
"""


def shm_socket_name(engine: Engine) -> str:
    return str(engine.descriptor().extra["shm_socket"]).removeprefix("@")


@needs_nobody
async def test_another_uid_is_refused_and_cannot_crash_the_engine() -> None:
    async with (
        open_engine("127.0.0.1") as server,
        open_engine("127.0.0.1") as client,
    ):
        buf = await server.allocate(1 << 20)
        buf.numpy()[:8] = 42
        p = as_nobody(ATTACK_CLIENT, shm_socket_name(server))
        try:
            out, err = await anyio.to_thread.run_sync(p.communicate)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        assert p.returncode == 0, err
        got = json.loads(out)
        # disconnected before a single answer (not even the buffer list)
        assert not any("buffers" in g for g in got), got
        # and the engine lives on, serving its own user
        local = await client.allocate(1 << 20)
        await client.read(server.segment_name, local.addr, buf.addr, 8)
        assert (local.numpy()[:8] == 42).all()


@needs_nobody
async def test_a_squatted_socket_name_is_never_talked_to() -> None:
    """A listener of another uid under the name a descriptor gives: the client says nothing to it,
    maps nothing from it, and the requests go over TCP to the real peer."""
    async with (
        open_engine("127.0.0.1") as server,
        open_engine("127.0.0.1") as client,
    ):
        buf = await server.allocate(1 << 20)
        buf.numpy()[:8] = 9
        name = f"mooncake-shm/squat/{os.getpid()}"
        p = as_nobody(ATTACK_SQUAT, name)
        try:
            assert p.stdout is not None
            hello = json.loads(await anyio.to_thread.run_sync(p.stdout.readline))
            peer = await client.peer(server.segment_name)
            extra = dict(peer.descriptor.extra, shm_socket="@" + name, shm_pid=hello["pid"])
            peer.descriptor = replace(peer.descriptor, extra=extra)
            local = await client.allocate(1 << 20)
            await client.read(server.segment_name, local.addr, buf.addr, 8)
            assert (local.numpy()[:8] == 9).all()  # over TCP
            assert isinstance(peer.state["shm"], shm_mod._Untrusted)
            out, _ = await anyio.to_thread.run_sync(p.communicate)
            got = json.loads(out.strip().splitlines()[-1])
            assert got == [], got  # it heard nothing from us
        finally:
            if p.poll() is None:
                p.kill()
            p.communicate()


async def test_a_listener_with_the_wrong_pid_is_not_trusted() -> None:
    async with (
        open_engine("127.0.0.1") as server,
        open_engine("127.0.0.1") as client,
    ):
        buf = await server.allocate(1 << 20)
        peer = await client.peer(server.segment_name)
        extra = dict(peer.descriptor.extra, shm_pid=1)  # published pid != the listener's
        peer.descriptor = replace(peer.descriptor, extra=extra)
        local = await client.allocate(1 << 20)
        await client.read(server.segment_name, local.addr, buf.addr, 8)
        assert isinstance(peer.state["shm"], shm_mod._Untrusted)


def _raw_client(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect("\0" + name)
    return s


@pytest.mark.parametrize(
    "junk",
    [
        b'{"op": "ack", "seq": "x"}',
        b'{"op": "ack", "seq": [1]}',
        b'{"op": "ack", "seq": 1.5}',
        b'{"op": "ack"}',
        b'{"op": 7}',
        b"[1, 2]",
        b"\xff\xfe",
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
async def test_same_uid_junk_costs_only_its_connection(junk: bytes) -> None:
    async with (
        open_engine("127.0.0.1") as server,
        open_engine("127.0.0.1") as client,
    ):
        buf = await server.allocate(1 << 20)
        buf.numpy()[:4] = 5

        def attack() -> bytes:
            s = _raw_client(shm_socket_name(server))
            try:
                s.send(junk)
                return s.recv(1 << 16)  # b"": dropped
            finally:
                s.close()

        assert await anyio.to_thread.run_sync(attack) == b""
        local = await client.allocate(1 << 20)
        await client.read(server.segment_name, local.addr, buf.addr, 4)
        assert (local.numpy()[:4] == 5).all()


# -- a malicious shm *server*: the client engine must survive whatever it answers ----------


def _memfd(size: int, seal: bool) -> int:
    import fcntl

    fd = os.memfd_create("x", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seal else 0))
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _lies(pid: int, addr: int) -> list[tuple[dict[str, Any], str]]:
    """``buffers`` answers that must each end the session cleanly, or never be mapped; the
    second field says which fd goes with it ("", "short" or "unsealed" memfd)."""
    good = {"addr": addr, "length": 1 << 16, "fd": -1}
    return [
        ({"op": "buffers", "pid": "1", "buffers": [good]}, ""),
        ({"op": "buffers", "pid": pid + 1, "buffers": [good]}, ""),  # not the listener
        ({"op": "buffers", "pid": pid, "buffers": "nope"}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [{"addr": addr, "length": 0, "fd": -1}]}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [{"addr": -1, "length": 4, "fd": -1}]}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [{"addr": addr, "length": 4, "fd": 3}]}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [good], "more": "yes"}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [good, dict(good, addr=addr + 4096)]}, ""),
        ({"op": "buffers", "pid": pid, "buffers": [1]}, ""),
        ({"op": "revoke", "addr": "x", "seq": 1}, ""),
        ({"op": "revoke", "addr": addr, "seq": None}, ""),
        ({"op": "surprise"}, ""),
        # a memfd shorter than it claims, and one that is not sealed: never mapped
        ({"op": "buffers", "pid": pid, "buffers": [dict(good, fd=0)]}, "short"),
        ({"op": "buffers", "pid": pid, "buffers": [dict(good, fd=0)]}, "unsealed"),
    ]


@pytest.mark.parametrize("case", range(14))
async def test_a_lying_shm_server_cannot_crash_the_client(case: int) -> None:
    target = np.zeros(1 << 16, dtype=np.uint8)  # the "remote" buffer: our own memory
    addr = int(target.ctypes.data)
    name = f"mooncake-shm/liar/{os.getpid()}/{case}"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind("\0" + name)
    lsock.listen(4)
    msg, fd_kind = _lies(os.getpid(), addr)[case]
    fds = {"": [], "short": [_memfd(4096, True)], "unsealed": [_memfd(1 << 16, False)]}[fd_kind]

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            try:
                conn.recv(1 << 16)  # the list request
                if fds:
                    socket.send_fds(conn, [json.dumps(msg).encode()], fds)
                else:
                    conn.send(json.dumps(msg).encode())
                conn.recv(1 << 16)  # until the client drops us
            except OSError:
                pass

    try:
        async with open_engine("127.0.0.1", transports=["shm", "tcp"]) as client:
            local = await client.allocate(1 << 16)
            peer = await client.peer(client.segment_name)  # a descriptor to doctor
            peer = replace(peer, segment="liar")
            peer.state = {}
            peer.descriptor = replace(
                peer.descriptor,
                name="liar",
                buffers=(BufferDesc("cpu:0", addr, 1 << 16),),
                extra=dict(peer.descriptor.extra, shm_socket="@" + name, shm_pid=os.getpid()),
            )
            client._peers["liar"] = peer
            shm = next(t for t in client.transports if t.name == "shm")
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, serve)
                with anyio.fail_after(30):  # hang guard
                    out = await shm.execute(peer, [R.write(local.addr, addr, 64)])
                s = peer.state["shm"]
                if fd_kind:  # well-formed, but the fd is not safe to map: process_vm instead
                    assert s.entries and all(e.mm is None for e in s.entries)
                    assert out[0].ok
                else:  # malformed: that session ends, the batch fails cleanly
                    assert s.closed and not out[0].ok
                client.forget("liar")  # drops our end: the fake server's thread returns
            # ... and the engine is alive: its own segment still works
            other = await client.allocate(1 << 16)
            (res,) = await client.transfer(
                client.segment_name, [R.write(local.addr, other.addr, 64)]
            )
            assert res.ok
    finally:
        lsock.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.mark.parametrize("reads", [True, False])
async def test_a_client_that_never_acknowledges_cannot_hold_unregister(
    monkeypatch: pytest.MonkeyPatch, reads: bool
) -> None:
    """A same-uid client that lists, then never answers a revoke (or stops reading at all, so
    the revokes fill its socket): unregister returns after REVOKE_ACK_S and drops it."""
    monkeypatch.setattr(shm_mod, "REVOKE_ACK_S", 0.5)
    async with open_engine("127.0.0.1") as server:
        bufs = [await server.allocate(4096) for _ in range(4)]
        sock = _raw_client(shm_socket_name(server))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.send(b'{"op": "list"}')
            if reads:
                await anyio.to_thread.run_sync(lambda: socket.recv_fds(sock, 1 << 18, 64))
            with anyio.fail_after(30):  # hang guard
                for b in bufs:
                    await server.unregister(b)
            with pytest.raises(OSError):  # dropped: a reset, or the end of the stream
                sock.setblocking(True)
                sock.settimeout(5)
                while True:
                    data, fds, _, _ = socket.recv_fds(sock, 1 << 18, 64)
                    for fd in fds:
                        os.close(fd)
                    if not data:
                        raise ConnectionResetError("closed")
        finally:
            sock.close()
