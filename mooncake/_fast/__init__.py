"""Sync, non-blocking C primitives on raw addresses: the bottom layer.

``mooncake._fast`` re-exports the compiled module ``_io`` when it is built, else its pure-Python
twin ``_pure`` (same names, same contracts). ``MOONCAKE_NO_EXTENSIONS=1`` forces the twin; the
test suite runs against both. Nothing here imports an event loop.

Conventions: addresses and lengths are ints; I/O returns a byte count or ``-errno``.
"""

from __future__ import annotations

import os

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0"):
    from ._pure import (
        COMPILED,
        memcpy_at,
        memcpy_batch,
        prefault,
        readv_at,
        recv_at,
        send_at,
        vm_readv_at,
        vm_writev_at,
        writev_at,
    )
else:
    try:
        from ._io import (  # type: ignore[no-redef]
            COMPILED,
            memcpy_at,
            memcpy_batch,
            prefault,
            readv_at,
            recv_at,
            send_at,
            vm_readv_at,
            vm_writev_at,
            writev_at,
        )
    except ImportError:  # not built: the twin is correct, only slower
        from ._pure import (
            COMPILED,
            memcpy_at,
            memcpy_batch,
            prefault,
            readv_at,
            recv_at,
            send_at,
            vm_readv_at,
            vm_writev_at,
            writev_at,
        )

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0") or not COMPILED:
    from ._tcp_pure import COMPILED as TCP_COMPILED
    from ._tcp_pure import ClientPipe, RegionTable, ServeConn
else:
    try:
        from ._tcp import COMPILED as TCP_COMPILED  # type: ignore[no-redef]
        from ._tcp import (  # type: ignore[no-redef,assignment]
            ClientPipe,
            RegionTable,
            ServeConn,
        )
    except ImportError:
        from ._tcp_pure import COMPILED as TCP_COMPILED
        from ._tcp_pure import ClientPipe, RegionTable, ServeConn

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0") or not COMPILED:
    from ._copyq_pure import CopyQueue
else:
    try:
        from ._copyq import CopyQueue  # type: ignore[assignment]
    except ImportError:
        from ._copyq_pure import CopyQueue

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0"):
    from ._objtable_pure import COMPILED as OBJTABLE_COMPILED
    from ._objtable_pure import ObjectTable
else:
    try:
        from ._objtable import COMPILED as OBJTABLE_COMPILED  # type: ignore[no-redef]
        from ._objtable import ObjectTable  # type: ignore[assignment]
    except ImportError:  # not built: the twin is correct, only slower
        from ._objtable_pure import COMPILED as OBJTABLE_COMPILED
        from ._objtable_pure import ObjectTable

STAGE_SIZE = 65536  # the staging buffer a ClientPipe wants (both twins)
# results of ServeConn.step / ClientPipe.step (identical in both twins)
DONE, WANT_READ, WANT_WRITE, YIELD, CLOSE, PEER_CLOSED = 0, 1, 2, 3, 4, 5
STAGE = 6  # ServeConn: a request on a device range waits for the caller's staging
E_PROTO = 100000

__all__ = [
    "CLOSE",
    "COMPILED",
    "DONE",
    "E_PROTO",
    "OBJTABLE_COMPILED",
    "PEER_CLOSED",
    "STAGE",
    "STAGE_SIZE",
    "TCP_COMPILED",
    "WANT_READ",
    "WANT_WRITE",
    "YIELD",
    "ClientPipe",
    "CopyQueue",
    "ObjectTable",
    "RegionTable",
    "ServeConn",
    "memcpy_at",
    "memcpy_batch",
    "prefault",
    "readv_at",
    "recv_at",
    "send_at",
    "vm_readv_at",
    "vm_writev_at",
    "writev_at",
]
