"""An asyncio service that awaits the engine and the store while it serves other requests.

The async API is written against anyio, so an asyncio program awaits it directly: no thread pool,
no background loop. This script runs, in one asyncio process:

* a store master (``serve_master``) and one store client (``open_store``) that mounts 64 MiB;
* a second engine standing in for a decode node (``open_engine``);
* a tiny HTTP/1.1 endpoint (plain ``asyncio.start_server``)::

      PUT /kv/<key>      body -> store.put
      GET /kv/<key>      store.get_into a pooled, registered buffer -> body (404 on a miss)
      POST /ship/<n>     write n KiB to the decode engine with engine.transfer, read them back

Then a client in the same loop fires concurrent requests at it and checks every byte. Run::

    python examples/asyncio_service.py            # prints a summary line, exits 0 on success
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys

import anyio
import numpy as np

import mooncake
from mooncake import MasterServerConfig, TransferRequest, serve_master
from mooncake.errors import ObjectNotFoundError

SLOT = 256 << 10  # the largest value GET serves from one pooled buffer


class Service:
    """Request handlers; the store and engines are opened by :func:`main`."""

    def __init__(self, store: mooncake.Store, decode: mooncake.Engine) -> None:
        self.store = store
        self.decode = decode
        # Values are read into a registered pool (zero-copy get_into); one slot per request in
        # flight, so the pool bounds memory however many clients connect.
        self.pool = np.zeros(8 * SLOT, dtype=np.uint8)
        self.free_slots: asyncio.Queue[int] = asyncio.Queue()
        for i in range(8):
            self.free_slots.put_nowait(i)

    async def start(self) -> None:
        await self.store.register_buffer(self.pool.ctypes.data, self.pool.nbytes)

    async def get(self, key: str) -> tuple[int, bytes]:
        slot = await self.free_slots.get()
        try:
            addr = self.pool.ctypes.data + slot * SLOT
            try:
                n = await self.store.get_into(key, addr, SLOT)
            except ObjectNotFoundError:
                return 404, b""
            return 200, self.pool[slot * SLOT : slot * SLOT + n].tobytes()
        finally:
            self.free_slots.put_nowait(slot)

    async def ship(self, kib: int) -> tuple[int, bytes]:
        """Write ``kib`` KiB from the store client's engine into the decode engine, read back."""
        engine = self.store.engine
        src = await engine.allocate(kib << 10)
        back = await engine.allocate(kib << 10)
        dst = await self.decode.allocate(kib << 10)
        try:
            src.numpy()[:] = np.frombuffer(os.urandom(kib << 10), dtype=np.uint8)
            peer = self.decode.segment_name
            results = await engine.transfer(
                peer, [TransferRequest.write(src.addr, dst.addr, kib << 10)]
            )
            results += await engine.transfer(
                peer, [TransferRequest.read(back.addr, dst.addr, kib << 10)]
            )
            ok = all(r.ok for r in results) and bytes(back.view) == bytes(src.view)
            return (200, hashlib.sha256(bytes(src.view)).hexdigest().encode()) if ok else (500, b"")
        finally:
            for b in (src, back):
                await engine.unregister(b)
            await self.decode.unregister(dst)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = dict(h.split(": ", 1) for h in header_lines if ": " in h)
            length = int(headers.get("Content-Length", "0"))
            if length > SLOT:
                status, body = 413, b""
            else:
                payload = await reader.readexactly(length) if length else b""
                status, body = await self.route(method, path, payload)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
            status, body = 400, b""
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    async def route(self, method: str, path: str, payload: bytes) -> tuple[int, bytes]:
        kind, _, arg = path.lstrip("/").partition("/")
        if kind == "kv" and method == "PUT":
            await self.store.put(arg, payload)
            return 200, b""
        if kind == "kv" and method == "GET":
            return await self.get(arg)
        if kind == "ship" and method == "POST":
            return await self.ship(int(arg))
        return 404, b""


async def http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    data = await reader.readexactly(length)
    writer.close()
    return status, data


async def main() -> int:
    async with anyio.create_task_group() as tg:
        master = await tg.start(
            serve_master, MasterServerConfig(rpc_port=0, enable_metric_reporting=False)
        )
        async with (
            mooncake.open_store(f"127.0.0.1:{master.rpc_port}", segment_size=64 << 20) as store,
            mooncake.open_engine("127.0.0.1") as decode,
        ):
            service = Service(store, decode)
            await service.start()
            server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]

            values = {f"block-{i}": os.urandom(1024 * (i + 1)) for i in range(32)}
            puts = await asyncio.gather(
                *(http(port, "PUT", f"/kv/{k}", v) for k, v in values.items())
            )
            # reads, ships and a miss all in flight at once
            gets = asyncio.gather(*(http(port, "GET", f"/kv/{k}") for k in values))
            ships = asyncio.gather(*(http(port, "POST", f"/ship/{n}") for n in (4, 64, 256)))
            miss = http(port, "GET", "/kv/never-stored")
            got, shipped, missed = await asyncio.gather(gets, ships, miss)
            server.close()
            await server.wait_closed()

            bad = [
                k for (k, v), (s, b) in zip(values.items(), got, strict=True) if s != 200 or b != v
            ]
            ok = (
                all(s == 200 for s, _ in puts)
                and not bad
                and all(s == 200 for s, _ in shipped)
                and missed[0] == 404
            )
            print(
                f"asyncio service: {len(puts)} puts, {len(got) - len(bad)}/{len(got)} gets verified, "
                f"{sum(s == 200 for s, _ in shipped)}/3 engine transfers verified, "
                f"miss -> {missed[0]}: {'OK' if ok else 'FAILED'}"
            )
        tg.cancel_scope.cancel()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
