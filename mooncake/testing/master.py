"""A store master in this process, for examples, notebooks and tests.

:func:`local_master` starts :func:`mooncake.serve_master` in a task group of its own on free
ports of loopback and yields its RPC address (``"127.0.0.1:PORT"``), ready for
``mooncake.open_store(master=...)``; the master stops when the block exits (objects it tracked
are gone). It is the master ``mooncake master`` runs, with its defaults except that the ports
are free ones and the metrics endpoint is off unless ``metrics=True`` (then read it from
``server.metrics_port`` via :func:`local_master_server`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio

from mooncake._groups import unwrapped
from mooncake._store.master import MasterServer, MasterServerConfig, serve_master


@asynccontextmanager
async def local_master_server(
    host: str = "127.0.0.1", *, metrics: bool = False, **config: Any
) -> AsyncIterator[MasterServer]:
    """Run a master on ``host`` (free ports) for the block; yield the running server.

    ``config`` are further :class:`~mooncake._store.master.MasterServerConfig` fields (for
    example ``cluster_secret=""``). A port that cannot be bound raises as itself.
    """
    cfg = replace(
        MasterServerConfig(),
        rpc_address=host,
        rpc_port=0,
        metrics_host=host,
        metrics_port=0,
        enable_metric_reporting=metrics,
        **config,
    )
    with unwrapped():
        async with anyio.create_task_group() as tg:
            server: MasterServer = await tg.start(serve_master, cfg)
            try:
                yield server
            finally:
                tg.cancel_scope.cancel()


@asynccontextmanager
async def local_master(
    host: str = "127.0.0.1", *, metrics: bool = False, **config: Any
) -> AsyncIterator[str]:
    """Run a master on ``host`` for the block; yield its ``"host:port"`` RPC address."""
    async with local_master_server(host, metrics=metrics, **config) as server:
        yield f"{host}:{server.rpc_port}"


__all__ = ["local_master", "local_master_server"]
