"""The store's same-host segment sockets across a uid boundary: real processes of another uid.

The attacker runs as ``nobody`` (uid 65534) in a child process started by this (root) test: it
either connects to a store client's segment socket and asks for the memfd, or binds a segment's
socket name first and serves a memfd of its own to whoever connects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import anyio
import pytest
import trio

import mooncake
from mooncake._core import auth
from mooncake._store import shm
from tests.test_store_client import MIB, master

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run the attacker as another uid"
)

# Everything is imported before dropping privileges: the interpreter's files may not be
# readable by nobody.
_PRELUDE = """
import json, mmap, os, socket, sys, time
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
"""

_STEAL = _PRELUDE + textwrap.dedent(
    """
    name = "\\0" + sys.argv[1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    out = {"uid": os.getuid(), "fds": 0, "read": None}
    try:
        s.connect(name)
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        out["fds"] = len(fds)
        out["hello"] = msg.decode()
        if fds:
            info = json.loads(msg)
            mm = mmap.mmap(fds[0], info["size"])
            out["read"] = mm.find(b"SECRET-VALUE") >= 0
    except OSError as e:
        out["error"] = str(e)
    print(json.dumps(out), flush=True)
    """
)

_SQUAT = _PRELUDE + textwrap.dedent(
    """
    name, segment = "\\0" + sys.argv[1], sys.argv[2]
    fd = os.memfd_create("fake")
    os.ftruncate(fd, 1 << 20)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(name)
    s.listen(8)
    print("listening", flush=True)
    s.settimeout(30)
    while True:
        try:
            c, _ = s.accept()
        except OSError:
            break
        hello = {"segment": segment, "base": 1 << 30, "size": 1 << 20, "pid": os.getpid()}
        socket.send_fds(c, [json.dumps(hello).encode()], [fd])
        print("served", flush=True)
    """
)


def _attacker(script: str, name: str, *args: str) -> subprocess.Popen[str]:
    """Run ``script`` as nobody with the abstract socket ``name`` (its NUL is re-added there)."""
    assert name.startswith("\0")
    return subprocess.Popen(
        [sys.executable, "-c", script, name[1:], *args],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ.get("PATH", "")},
    )


def test_another_uid_gets_no_memfd_from_a_store_segment() -> None:
    async def main() -> None:
        async with (
            master() as addr,
            mooncake.open_store(addr, segment_size=4 * MIB, local_buffer_size=1 * MIB) as s,
        ):
            await s.put("k", b"SECRET-VALUE" * 100)
            name = shm.socket_name(s.segment_name)
            proc = _attacker(_STEAL, name)
            out, _ = await anyio.to_thread.run_sync(proc.communicate)
            res = json.loads(out)
            assert res["uid"] == NOBODY
            assert res["fds"] == 0, res  # disconnected without the memfd
            assert res["read"] is None
            assert await s.get("k") == b"SECRET-VALUE" * 100

    trio.run(main)


def test_a_squatted_segment_name_is_refused_and_the_owner_stays_reachable() -> None:
    segment = "127.0.0.1:1"
    proc = _attacker(_SQUAT, shm.socket_name(segment), segment)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "listening"

        async def main() -> None:
            peers = shm.ShmPeers("127.0.0.1:2")
            try:
                assert await peers.lookup(segment) is None  # not mapped: the network is used
                assert peers.refused == 1
                # the owner cannot bind the squatted name and stays network-only (no impostor)
                seg = shm.SharedSegment(1 << 20)
                try:
                    async with anyio.create_task_group() as tg:
                        served = await tg.start(shm.ShmServer(seg, segment).serve)
                        assert served == ""
                        tg.cancel_scope.cancel()
                finally:
                    seg.close()
            finally:
                peers.close()

        trio.run(main)
    finally:
        proc.kill()
        proc.communicate()


def test_with_a_cluster_secret_the_name_cannot_be_squatted_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    segment = "127.0.0.1:3"
    plain = shm.socket_name(segment)
    proc = _attacker(_SQUAT, plain, segment)  # squats the name a secret-less owner would use
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "listening"
        monkeypatch.setenv(auth.SECRET_ENV, "s3cret")
        assert shm.socket_name(segment) != plain

        async def main() -> None:
            seg = shm.SharedSegment(1 << 20)
            peers = shm.ShmPeers("127.0.0.1:4")
            try:
                async with anyio.create_task_group() as tg:
                    assert await tg.start(shm.ShmServer(seg, segment).serve) == segment
                    p = await peers.lookup(segment)
                    assert p is not None and p.base == seg.addr and p.size == seg.size
                    tg.cancel_scope.cancel()
            finally:
                peers.close()
                seg.close()

        trio.run(main)
    finally:
        proc.kill()
        proc.communicate()


def test_allowed_uids_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_STORE_SHM_ALLOWED_UIDS", raising=False)
    monkeypatch.setenv(shm.ALLOWED_UIDS_ENV, "1000, 1001")
    assert shm._unix.allowed_uids() == {os.geteuid(), 1000, 1001}
    monkeypatch.setenv("MC_STORE_SHM_ALLOWED_UIDS", "1002")  # the earlier spelling still counts
    assert shm._unix.allowed_uids() == {os.geteuid(), 1000, 1001, 1002}
    monkeypatch.setenv(shm.ALLOWED_UIDS_ENV, "nobody")
    with pytest.raises(mooncake.errors.InvalidArgumentError, match="nobody"):
        shm._unix.allowed_uids()
