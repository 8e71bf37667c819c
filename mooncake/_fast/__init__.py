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

__all__ = [
    "COMPILED",
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
