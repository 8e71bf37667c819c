"""Transport registry: name -> class, and which transports an engine installs by default."""

from __future__ import annotations

import importlib
import os
from typing import Any

from mooncake._engine.transports.base import EngineHost, PeerInfo, Transport
from mooncake.errors import MooncakeError, NotSupportedError

#: name -> "module:Class"; modules are imported only when the transport is used
TRANSPORTS: dict[str, str] = {
    "tcp": "mooncake._engine.transports.tcp:TcpTransport",
    "shm": "mooncake._engine.transports.shm:ShmTransport",
    "rdma": "mooncake._engine.transports.rdma:RdmaTransport",
    "cuda": "mooncake._engine.transports.cuda:CudaTransport",
}


def make_transport(name: str, host: EngineHost, **options: Any) -> Transport:
    """Instantiate transport ``name`` for the engine ``host``, passing it ``options`` (the
    transport's own keyword arguments, e.g. ``lanes=`` for tcp) as given.

    Raises :class:`~mooncake.errors.NotSupportedError` for a name not in :data:`TRANSPORTS`.
    """
    spec = TRANSPORTS.get(name)
    if spec is None:
        raise NotSupportedError(f"unknown transport {name!r} (known: {sorted(TRANSPORTS)})")
    mod, cls = spec.split(":")
    klass = getattr(importlib.import_module(mod), cls)
    t = klass(host, **options)
    assert isinstance(t, Transport)
    return t


def default_transports() -> list[str]:
    """Transports installed when the caller names none.

    ``shm`` for same-host peers where the platform has it, ``rdma`` when RDMA devices are
    present, ``tcp`` always, ``cuda`` when a usable GPU is found (``MC_DISABLE_CUDA=1`` skips
    the check); the engine picks per peer and request by priority. ``MC_FORCE_TCP=1`` keeps
    only tcp; ``MOONCAKE_TRANSPORTS=a,b`` names the list outright.
    """
    names = os.environ.get("MOONCAKE_TRANSPORTS", "")
    if names.strip():
        return [n.strip() for n in names.split(",") if n.strip()]
    if os.environ.get("MC_FORCE_TCP", "") not in ("", "0"):
        return ["tcp"]
    from mooncake._engine.transports.shm import available

    out = ["shm"] if available() else []
    out += ["rdma", "tcp"] if _rdma_present() else ["tcp"]
    if os.environ.get("MC_DISABLE_CUDA", "") in ("", "0"):
        from mooncake._fast import cuda

        if cuda.is_available():
            out.append("cuda")
    return out


def _rdma_present() -> bool:
    """RDMA devices to use: HCAs in sysfs (``MC_FORCE_HCA``), or a verbs library named
    explicitly (``MOONCAKE_IBVERBS``, e.g. the software provider) that lists devices."""
    explicit = os.environ.get("MOONCAKE_IBVERBS", "") != ""
    forced = os.environ.get("MC_FORCE_HCA", "") not in ("", "0")
    try:
        hcas = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        hcas = False
    if not (explicit or forced or hcas):
        return False
    from mooncake._fast import verbs

    if not verbs.AVAILABLE:
        return False
    try:
        return bool(verbs.get_device_list())
    except MooncakeError:
        return False


__all__ = [
    "TRANSPORTS",
    "EngineHost",
    "PeerInfo",
    "Transport",
    "default_transports",
    "make_transport",
]
