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

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0") or not COMPILED:
    from ._intmap_pure import COMPILED as INTMAP_COMPILED
    from ._intmap_pure import IntMap
else:
    try:
        from ._intmap import COMPILED as INTMAP_COMPILED  # type: ignore[no-redef]
        from ._intmap import IntMap  # type: ignore[assignment]
    except ImportError:
        from ._intmap_pure import COMPILED as INTMAP_COMPILED
        from ._intmap_pure import IntMap

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

if os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0"):
    from ._crc32c_pure import COMPILED as CRC_COMPILED
    from ._crc32c_pure import HARDWARE as CRC_HARDWARE
    from ._crc32c_pure import (
        copy_crc32c,
        copy_crc32c_batch,
        crc32c,
        crc32c_at,
        crc32c_combine,
        crc32c_parts,
    )
else:
    try:
        from ._crc32c import COMPILED as CRC_COMPILED  # type: ignore[no-redef]
        from ._crc32c import HARDWARE as CRC_HARDWARE  # type: ignore[no-redef]
        from ._crc32c import (  # type: ignore[no-redef]
            copy_crc32c,
            copy_crc32c_batch,
            crc32c,
            crc32c_at,
            crc32c_combine,
            crc32c_parts,
        )
    except ImportError:  # not built: the twin gives the same checksums, slowly
        from ._crc32c_pure import COMPILED as CRC_COMPILED
        from ._crc32c_pure import HARDWARE as CRC_HARDWARE
        from ._crc32c_pure import (
            copy_crc32c,
            copy_crc32c_batch,
            crc32c,
            crc32c_at,
            crc32c_combine,
            crc32c_parts,
        )

STAGE_SIZE = 65536  # the staging buffer a ClientPipe wants (both twins)
# results of ServeConn.step / ClientPipe.step (identical in both twins)
DONE, WANT_READ, WANT_WRITE, YIELD, CLOSE, PEER_CLOSED = 0, 1, 2, 3, 4, 5
STAGE = 6  # ServeConn: a request on a device range waits for the caller's staging
E_PROTO = 100000

__all__ = [
    "CLOSE",
    "COMPILED",
    "CRC_COMPILED",
    "CRC_HARDWARE",
    "DONE",
    "E_PROTO",
    "INTMAP_COMPILED",
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
    "IntMap",
    "ObjectTable",
    "RegionTable",
    "ServeConn",
    "copy_crc32c",
    "copy_crc32c_batch",
    "crc32c",
    "crc32c_at",
    "crc32c_combine",
    "crc32c_parts",
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
