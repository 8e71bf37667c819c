"""Transport registry: name -> class, and which transports an engine installs by default."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake.errors import NotSupportedError

if TYPE_CHECKING:
    from mooncake._engine.engine import Engine

#: name -> "module:Class"; modules are imported only when the transport is used
TRANSPORTS: dict[str, str] = {
    "tcp": "mooncake._engine.transports.tcp:TcpTransport",
    "shm": "mooncake._engine.transports.shm:ShmTransport",
}


def make_transport(name: str, engine: Engine, **kwargs: Any) -> Transport:
    """Instantiate transport ``name`` for ``engine``."""
    spec = TRANSPORTS.get(name)
    if spec is None:
        raise NotSupportedError(f"unknown transport {name!r} (known: {sorted(TRANSPORTS)})")
    mod, cls = spec.split(":")
    klass = getattr(importlib.import_module(mod), cls)
    if name == "tcp":
        kwargs.setdefault("lanes", engine._tcp_lanes)
    t = klass(engine, **kwargs)
    assert isinstance(t, Transport)
    return t


def default_transports() -> list[str]:
    """Transports installed when the caller names none.

    ``shm`` (same-host peers) where the platform has it, and ``tcp``; the engine picks per peer
    by priority (shm > tcp). ``MC_FORCE_TCP=1`` keeps only tcp; ``MOONCAKE_TRANSPORTS=a,b``
    names the list outright.
    """
    names = os.environ.get("MOONCAKE_TRANSPORTS", "")
    if names.strip():
        return [n.strip() for n in names.split(",") if n.strip()]
    if os.environ.get("MC_FORCE_TCP", "") not in ("", "0"):
        return ["tcp"]
    from mooncake._engine.transports.shm import available

    return ["shm", "tcp"] if available() else ["tcp"]


__all__ = ["TRANSPORTS", "PeerInfo", "Transport", "default_transports", "make_transport"]
