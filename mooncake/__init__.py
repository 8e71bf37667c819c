"""A Python-first Mooncake: KV-cache transfer engine and distributed store.

Async API (anyio; trio is the reference backend, asyncio works too)::

    async with mooncake.open_engine("127.0.0.1") as a, mooncake.open_engine("127.0.0.1") as b:
        src, dst = await a.allocate(1 << 20), await b.allocate(1 << 20)
        await a.write(b.segment_name, src.addr, dst.addr, 4096)
        await a.transfer(b.segment_name, [TransferRequest.read(src.addr, dst.addr, 4096)])

    async with mooncake.open_store(master="127.0.0.1:50051") as store:  # mooncake master
        await store.put("key", b"value")

Exceptions raised in those blocks, and setup errors, leave them as themselves (never wrapped in
an ``ExceptionGroup``). :func:`serve_master` runs a store master in this process
(:func:`mooncake.testing.local_master` wraps it for a block).

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
    from mooncake._store.master import MasterServerConfig, serve_master
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
    if name in ("serve_master", "MasterServerConfig"):
        from mooncake._store import master as _master

        return getattr(_master, name)
    if name in ("BufferPool", "RegisteredBufferPool"):  # as the published package exports
        from mooncake import buffer_pool as _pool

        return getattr(_pool, name)
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazily imported names are part of the module's surface too
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BufferPool",
    "Engine",
    "MasterServerConfig",
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
    "serve_master",
]
