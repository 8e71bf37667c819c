"""Conformance checks for metadata services, runnable against any connection string.

::

    from mooncake.testing.metadata import CHECKS
    for check in CHECKS:
        await check.run("etcd://127.0.0.1:2379")      # raises AssertionError on a violation

Each check uses its own unique keys and segment names and removes what it wrote. A check whose
feature the backend lacks (leases on HTTP) raises :class:`Unsupported`, so a test runner can
skip it with that reason instead of passing it vacuously.

``python -m mooncake.testing.metadata engine CONN SEGMENT`` runs an engine that publishes
``SEGMENT`` and then waits to be killed (used by the lease check; handy by hand too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from mooncake._engine.metadata import make_kv, open_kv
from mooncake._engine.metadata.kv import KeyLayout
from mooncake.errors import MetadataError, SegmentNotFoundError


class Unsupported(Exception):
    """The backend does not offer what the check tests."""


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[str], Awaitable[None]]
    doc: str

    async def run(self, conn: str) -> None:
        await self.fn(conn)


def _uid() -> str:
    return uuid.uuid4().hex[:12]


async def check_put_get_delete(conn: str) -> None:
    """Missing keys read as None; put/overwrite/get/delete behave; deleting twice says so."""
    key = f"mooncake-test/{_uid()}/k"
    async with open_kv(conn) as kv:
        assert await kv.get(key) is None, "a never-written key must read as missing"
        assert await kv.delete(key) is False, "deleting a missing key must report False"
        await kv.put(key, b'{"v": 1}')
        assert await kv.get(key) == b'{"v": 1}'
        await kv.put(key, b'{"v": 2}')
        assert await kv.get(key) == b'{"v": 2}', "put must overwrite"
        assert await kv.delete(key) is True
        assert await kv.get(key) is None, "a deleted key must read as missing"
        assert await kv.delete(key) is False


async def check_concurrent_updates(conn: str) -> None:
    """Concurrent writers: one key ends whole and equal to one of the writes; distinct keys all land."""
    base = f"mooncake-test/{_uid()}"
    n = 16
    values = [json.dumps({"writer": i, "pad": "x" * (100 * i)}).encode() for i in range(n)]
    async with open_kv(conn) as kv:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(kv.put, f"{base}/same", values[i])
                tg.start_soon(kv.put, f"{base}/k{i}", values[i])
        final = await kv.get(f"{base}/same")
        assert final in values, f"concurrent puts left a value no writer wrote: {final!r:.80}"
        for i in range(n):
            assert await kv.get(f"{base}/k{i}") == values[i], f"key k{i} lost in concurrent puts"
        for i in range(n):
            await kv.delete(f"{base}/k{i}")
        await kv.delete(f"{base}/same")


async def _descriptor(kv: Any, layout: KeyLayout, segment: str) -> dict[str, Any] | None:
    raw = await kv.get(layout.ram(segment))
    return None if raw is None else dict(json.loads(raw))


async def check_engine_republish(conn: str) -> None:
    """An engine's descriptor is published at start, on every register/unregister (also
    concurrent ones) and removed at close; a second engine finds it and moves verified bytes."""
    from mooncake._engine.engine import open_engine

    layout = KeyLayout()
    a_name, b_name = f"mc-test-a-{_uid()}", f"mc-test-b-{_uid()}"
    async with open_kv(conn) as kv:
        async with open_engine("127.0.0.1", conn, segment_name=a_name) as a:
            desc = await _descriptor(kv, layout, a_name)
            assert desc is not None and desc["name"] == a_name, "descriptor not published at start"
            rpc = json.loads(await kv.get(layout.rpc_meta(a_name)) or b"null")
            assert rpc == {"ip_or_host_name": "127.0.0.1", "rpc_port": a.rpc_port}, rpc
            buf = await a.allocate(1 << 16)
            desc = await _descriptor(kv, layout, a_name)
            assert desc is not None
            assert [(b["addr"], b["length"]) for b in desc["buffers"]] == [(buf.addr, buf.length)]
            # concurrent registrations: the published descriptor ends with all of them
            bufs: list[Any] = []

            async def alloc() -> None:
                bufs.append(await a.allocate(4096))

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(alloc)
            desc = await _descriptor(kv, layout, a_name)
            assert desc is not None
            published = {b["addr"] for b in desc["buffers"]}
            assert published == {buf.addr} | {b.addr for b in bufs}, "a registration is missing"
            await a.unregister(bufs[0])
            desc = await _descriptor(kv, layout, a_name)
            assert desc is not None and bufs[0].addr not in {b["addr"] for b in desc["buffers"]}

            async with open_engine("127.0.0.1", conn, segment_name=b_name) as b:
                pattern = bytes(range(256)) * 256
                buf.view[:] = pattern
                local = await b.allocate(1 << 16)
                await b.read(a_name, local.addr, buf.addr, 1 << 16)
                assert bytes(local.view) == pattern, "bytes read through the metadata differ"
                local.view[:] = bytes(reversed(pattern))
                await b.write(a_name, local.addr, buf.addr, 1 << 16)
                assert bytes(buf.view) == bytes(reversed(pattern))
                try:
                    await b.peer(f"mc-test-missing-{_uid()}")
                except SegmentNotFoundError:
                    pass
                else:
                    raise AssertionError("looking up an unpublished segment must fail")
        assert await kv.get(layout.ram(a_name)) is None, "descriptor left behind after close"
        assert await kv.get(layout.rpc_meta(a_name)) is None, "rpc_meta left behind after close"


async def check_bad_descriptors(conn: str) -> None:
    """Malformed or implausible published data is a clear MetadataError; nothing is cached."""
    from mooncake._engine.engine import open_engine

    layout = KeyLayout()
    seg = f"mc-test-bad-{_uid()}"
    good_rpc = b'{"ip_or_host_name": "127.0.0.1", "rpc_port": 9}'

    def desc(buffers: list[dict[str, Any]], name: str = seg) -> bytes:
        return json.dumps(
            {"name": name, "protocol": "tcp", "tcp_data_port": 9, "buffers": buffers}
        ).encode()

    cases: list[tuple[bytes, bytes, str]] = [
        (b'{"name": "' + seg.encode() + b'", "buffers": [', good_rpc, "not valid JSON"),
        (desc([{"addr": 4096, "length": 8192}, {"addr": 8192, "length": 10}]), good_rpc, "overlap"),
        (desc([{"addr": 1 << 60, "length": 4096}]), good_rpc, "user-space"),
        (desc([{"addr": 4096, "length": -1}]), good_rpc, "'length'"),
        (desc([{"addr": "0x1000", "length": 1}]), good_rpc, "'addr'"),
        (desc([], name="someone-else"), good_rpc, "names segment"),
        (desc([{"addr": 4096, "length": 1}]), b'{"rpc_port": 9}', "ip_or_host_name"),
        (
            desc([{"addr": 4096, "length": 1}]),
            b'{"ip_or_host_name": "h", "rpc_port": 70000}',
            "rpc_port",
        ),
    ]
    async with open_kv(conn) as kv, open_engine("127.0.0.1", conn, segment_name=f"{seg}-me") as me:
        tried = 0
        for ram, rpc, needle in cases:
            try:
                await kv.put(layout.ram(seg), ram)
                await kv.put(layout.rpc_meta(seg), rpc)
            except MetadataError:
                continue  # the store itself refused it (the HTTP server checks JSON)
            tried += 1
            try:
                await me.peer(seg)
            except MetadataError as e:
                assert needle in str(e), f"error should mention {needle!r}: {e}"
                assert layout.ram(seg) in str(e) or layout.rpc_meta(seg) in str(e), (
                    f"error should name the key: {e}"
                )
            else:
                raise AssertionError(f"a descriptor with {needle!r} problem was accepted")
            assert me.cached_peer(seg) is None, "a bad descriptor was cached"
            await kv.delete(layout.rpc_meta(seg))
        assert tried >= len(cases) - 1
        await kv.delete(layout.ram(seg))
        await kv.delete(layout.rpc_meta(seg))


def _engine_proc(conn: str, segment: str, lease_ttl: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, MC_METADATA_LEASE_TTL=str(lease_ttl))
    return subprocess.Popen(
        [sys.executable, "-m", "mooncake.testing.metadata", "engine", conn, segment],
        stdout=subprocess.PIPE,
        env=env,
    )


async def check_dead_engine_keys_vanish(conn: str, lease_ttl: int = 2) -> None:
    """An engine killed with SIGKILL loses its keys once its lease runs out; while alive, its
    keys outlive several TTLs (the lease is renewed)."""
    layout = KeyLayout()
    seg = f"mc-test-lease-{_uid()}"
    probe = make_kv(conn)
    if not probe.leases:
        raise Unsupported(f"{probe.describe()} has no leases: a dead engine's keys stay")
    async with open_kv(conn) as kv:
        proc = _engine_proc(conn, seg, lease_ttl)
        try:
            assert proc.stdout is not None
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
            assert line.startswith(b"ready"), f"engine process did not start: {line!r}"
            assert await kv.get(layout.ram(seg)) is not None
            await anyio.sleep(lease_ttl * 2.5)
            assert await kv.get(layout.ram(seg)) is not None, "a live engine's lease expired"
            os.kill(proc.pid, signal.SIGKILL)
            await anyio.to_thread.run_sync(proc.wait)
            with anyio.fail_after(lease_ttl * 4 + 10):
                while await kv.get(layout.ram(seg)) is not None:  # noqa: ASYNC110 (polls another process)
                    await anyio.sleep(0.25)
            assert await kv.get(layout.rpc_meta(seg)) is None, "rpc_meta outlived the lease"
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


CHECKS = [
    Check(f.__name__.removeprefix("check_"), f, (f.__doc__ or "").strip())
    for f in (
        check_put_get_delete,
        check_concurrent_updates,
        check_engine_republish,
        check_bad_descriptors,
        check_dead_engine_keys_vanish,
    )
]


def _serve_engine(conn: str, segment: str) -> None:
    import trio

    from mooncake._engine.engine import open_engine

    async def main() -> None:
        async with open_engine("127.0.0.1", conn, segment_name=segment) as engine:
            await engine.allocate(4096)
            print("ready", engine.segment_name, flush=True)
            await trio.sleep_forever()

    trio.run(main)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "engine":
        _serve_engine(sys.argv[2], sys.argv[3])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
