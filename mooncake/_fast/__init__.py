"""Sync, non-blocking C primitives on raw addresses: the bottom layer.

``mooncake._fast`` re-exports each compiled module (``_io``, ``_tcp``, ``_copyq``, ``_intmap``,
``_objtable``, ``_crc32c``, ``_kvenc``) when it is built, else its pure-Python twin (``_pure``, ``_tcp_pure``, ...: same
names, same contracts), each chosen on its own by :func:`_select` over :data:`PUBLIC_API`; the
package's ``COMPILED``, ``TCP_COMPILED``, ... say which was. ``MOONCAKE_NO_EXTENSIONS=1`` forces
every twin; the test suite runs against both. Nothing here imports an event loop.

Conventions: addresses and lengths are ints; I/O returns a byte count or ``-errno``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

#: compiled module -> (its pure-Python twin, the module's flags under the package's names
#: (``COMPILED`` always), the names the package re-exports as they are). The one backend
#: switch: every twin is chosen here.
PUBLIC_API: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {
    "_io": (
        "_pure",
        {"COMPILED": "COMPILED"},
        (
            "memcpy_at",
            "memcpy_batch",
            "prefault",
            "readv_at",
            "recv_at",
            "send_at",
            "vm_readv_at",
            "vm_writev_at",
            "writev_at",
        ),
    ),
    "_tcp": (
        "_tcp_pure",
        {"COMPILED": "TCP_COMPILED"},
        ("ClientPipe", "RegionTable", "ServeConn"),
    ),
    "_copyq": ("_copyq_pure", {"COMPILED": "COPYQ_COMPILED"}, ("CopyQueue",)),
    "_intmap": ("_intmap_pure", {"COMPILED": "INTMAP_COMPILED"}, ("IntMap",)),
    "_kvenc": (
        "_kvenc_pure",
        {"COMPILED": "KVENC_COMPILED"},
        ("encode_events", "parse_seq_hash"),
    ),
    "_objtable": ("_objtable_pure", {"COMPILED": "OBJTABLE_COMPILED"}, ("ObjectTable",)),
    "_crc32c": (
        "_crc32c_pure",
        {"COMPILED": "CRC_COMPILED", "HARDWARE": "CRC_HARDWARE", "KERNEL": "CRC_KERNEL"},
        (
            "bytes_crc32c",
            "copy_crc32c",
            "copy_crc32c_batch",
            "crc32c",
            "crc32c_at",
            "crc32c_combine",
            "crc32c_parts",
        ),
    ),
}

#: ``MOONCAKE_NO_EXTENSIONS=1``: every twin, compiled modules or not
FORCED_PURE = os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0")


def _select(compiled: str, twin: str) -> ModuleType:
    """The compiled module unless the twins are forced or it is not built (the twin is correct,
    only slower)."""
    if not FORCED_PURE:
        try:
            return importlib.import_module(f"{__name__}.{compiled}")
        except ImportError:
            pass
    return importlib.import_module(f"{__name__}.{twin}")


if TYPE_CHECKING:  # what the checker sees: the compiled modules' stubs (the twins match them)
    from ._copyq import COMPILED as COPYQ_COMPILED
    from ._copyq import CopyQueue
    from ._crc32c import COMPILED as CRC_COMPILED
    from ._crc32c import HARDWARE as CRC_HARDWARE
    from ._crc32c import KERNEL as CRC_KERNEL
    from ._crc32c import (
        bytes_crc32c,
        copy_crc32c,
        copy_crc32c_batch,
        crc32c,
        crc32c_at,
        crc32c_combine,
        crc32c_parts,
    )
    from ._intmap import COMPILED as INTMAP_COMPILED
    from ._intmap import IntMap
    from ._io import (
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
    from ._kvenc import COMPILED as KVENC_COMPILED
    from ._kvenc import encode_events, parse_seq_hash
    from ._objtable import COMPILED as OBJTABLE_COMPILED
    from ._objtable import ObjectTable
    from ._tcp import COMPILED as TCP_COMPILED
    from ._tcp import ClientPipe, RegionTable, ServeConn
else:
    for _compiled, (_twin, _flags, _names) in PUBLIC_API.items():
        _mod = _select(_compiled, _twin)
        for _flag, _as in _flags.items():
            globals()[_as] = getattr(_mod, _flag)
        for _name in _names:
            globals()[_name] = getattr(_mod, _name)
    del _compiled, _twin, _flags, _flag, _as, _names, _mod

STAGE_SIZE = 65536  # the staging buffer a ClientPipe wants (both twins)
# results of ServeConn.step / ClientPipe.step (identical in both twins)
DONE, WANT_READ, WANT_WRITE, YIELD, CLOSE, PEER_CLOSED = 0, 1, 2, 3, 4, 5
STAGE = 6  # ServeConn: a request on a device range waits for the caller's staging
E_PROTO = 100000

__all__ = [
    "CLOSE",
    "COMPILED",
    "COPYQ_COMPILED",
    "CRC_COMPILED",
    "CRC_HARDWARE",
    "CRC_KERNEL",
    "DONE",
    "E_PROTO",
    "INTMAP_COMPILED",
    "KVENC_COMPILED",
    "OBJTABLE_COMPILED",
    "PEER_CLOSED",
    "PUBLIC_API",
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
    "bytes_crc32c",
    "copy_crc32c",
    "copy_crc32c_batch",
    "crc32c",
    "crc32c_at",
    "crc32c_combine",
    "crc32c_parts",
    "encode_events",
    "memcpy_at",
    "memcpy_batch",
    "parse_seq_hash",
    "prefault",
    "readv_at",
    "recv_at",
    "send_at",
    "vm_readv_at",
    "vm_writev_at",
    "writev_at",
]
