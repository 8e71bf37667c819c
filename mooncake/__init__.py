"""A Python-first Mooncake: KV-cache transfer engine and distributed store.

Async API (anyio; trio is the reference backend, asyncio works too)::

    async with mooncake.open_engine("127.0.0.1") as engine:
        buf = await engine.allocate(1 << 20)
        await engine.write(peer_segment, buf.addr, remote_addr, 4096)
        results = await engine.transfer(peer_segment, [TransferRequest.read(buf.addr, remote_addr, 4096)])

    async with mooncake.open_store(master="127.0.0.1:50051", segment_size=1 << 30) as store:
        await store.put("key", b"value")

The published Mooncake Python API lives where the published wheel puts it:
``mooncake.engine.TransferEngine`` and ``mooncake.store.MooncakeDistributedStore``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mooncake import errors
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, TransferStatus
from mooncake.errors import MooncakeError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mooncake._engine.engine import Engine, open_engine
    from mooncake._store.client import Store, open_store
    from mooncake.buffer_pool import BufferPool, RegisteredBufferPool


def __getattr__(name: str) -> Any:
    # The async layer is imported lazily so ``import mooncake`` stays cheap for the CLI and for
    # the sans-I/O modules' tests.
    if name in ("open_engine", "Engine"):
        from mooncake._engine import engine as _engine

        return getattr(_engine, name)
    if name in ("open_store", "Store"):
        from mooncake._store import client as _client

        return getattr(_client, name)
    if name in ("BufferPool", "RegisteredBufferPool"):  # as the published package exports
        from mooncake import buffer_pool as _pool

        return getattr(_pool, name)
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")


__all__ = [
    "BufferPool",
    "Engine",
    "MooncakeError",
    "Opcode",
    "RegisteredBufferPool",
    "Store",
    "TransferRequest",
    "TransferResult",
    "TransferStatus",
    "__version__",
    "errors",
    "open_engine",
    "open_store",
]
