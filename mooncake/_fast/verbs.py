"""The verbs layer: Cython over libibverbs, opened with dlopen at first use.

One module per object family (``_verbs_device``: device list and :class:`Context`; ``_verbs_pd``:
:class:`PD`; ``_verbs_mr``: :class:`MR`; ``_verbs_cq``: :class:`CompChannel`, :class:`CQ`,
:class:`WcBatch`; ``_verbs_qp``: :class:`QP`; ``_rdma_batch``: the transport's batch engine,
:class:`SliceBatch`, :class:`Rail`, :class:`NicPump`, :class:`BatchEngine`), re-exported here. Importing this module never
opens libibverbs; :func:`load` (or the first :class:`Context`) does, honouring
``MOONCAKE_IBVERBS`` (a path, or ``soft`` for the project's software provider).

Ownership (pyverbs' rules, uvloop's checks): a child holds its parent; ``close()`` is idempotent
and closes children first; ``__dealloc__`` never raises; an unclosed object warns
(``ResourceWarning``) when collected; :func:`live_objects` counts what is open. An MR keeps its
buffer exported; every posted WR keeps its MR alive until its completion is reaped.

There is no pure-Python twin: without the compiled modules (or with
``MOONCAKE_NO_EXTENSIONS=1``) :data:`AVAILABLE` is False and :data:`UNAVAILABLE_REASON` says
why; the RDMA transport then refuses to start.
"""

from __future__ import annotations

import os as _os
from typing import Any

AVAILABLE: bool
UNAVAILABLE_REASON: str = ""

try:
    if _os.environ.get("MOONCAKE_NO_EXTENSIONS", "") not in ("", "0"):
        raise ImportError("MOONCAKE_NO_EXTENSIONS is set")
    from mooncake._fast._rdma_batch import (
        ERR_BAD_RKEY,
        ERR_NO_RAIL,
        ERR_REFUSED,
        ERR_UNQUEUED,
        ERR_WC,
        ERR_WC_STALE,
        BatchEngine,
        NicPump,
        Rail,
        SliceBatch,
    )
    from mooncake._fast._verbs_cq import CQ, WC_STATUS_NAMES, CompChannel, WcBatch
    from mooncake._fast._verbs_device import Context, get_device_list
    from mooncake._fast._verbs_lib import (
        DEFAULT_LIBRARY,
        configured_path,
        is_soft_provider,
        live_objects,
        load,
        loaded_path,
        provider_live_objects,
        soft_inject_fault,
        soft_provider_path,
        soft_set_port_state,
        soft_set_stall,
        soft_wr_count,
    )
    from mooncake._fast._verbs_mr import (
        ACCESS_DEFAULT,
        ACCESS_LOCAL_WRITE,
        ACCESS_REMOTE_READ,
        ACCESS_REMOTE_WRITE,
        MR,
    )
    from mooncake._fast._verbs_pd import PD
    from mooncake._fast._verbs_qp import (
        MTU_BYTES,
        OP_READ,
        OP_WRITE,
        QP,
        QPS_ERR,
        QPS_INIT,
        QPS_RESET,
        QPS_RTR,
        QPS_RTS,
    )

    AVAILABLE = True
except ImportError as e:  # extensions not built
    AVAILABLE = False
    UNAVAILABLE_REASON = f"the verbs extensions are not available ({e})"

# ibv_wc_status values the transport classifies
WC_SUCCESS = 0
WC_LOC_LEN_ERR = 1
WC_LOC_PROT_ERR = 4
WC_WR_FLUSH_ERR = 5
WC_REM_ACCESS_ERR = 10
WC_REM_OP_ERR = 11
WC_RETRY_EXC_ERR = 12
WC_RNR_RETRY_EXC_ERR = 13
WC_FATAL_ERR = 19
WC_GENERAL_ERR = 21


def wc_status_name(status: int) -> str:
    """``IBV_WC_<NAME>`` of a completion status."""
    names: dict[int, str] = WC_STATUS_NAMES if AVAILABLE else {}
    return "IBV_WC_" + names.get(status, f"STATUS_{status}")


__all__ = [
    "ACCESS_DEFAULT",
    "ACCESS_LOCAL_WRITE",
    "ACCESS_REMOTE_READ",
    "ACCESS_REMOTE_WRITE",
    "AVAILABLE",
    "CQ",
    "DEFAULT_LIBRARY",
    "ERR_BAD_RKEY",
    "ERR_NO_RAIL",
    "ERR_REFUSED",
    "ERR_UNQUEUED",
    "ERR_WC",
    "ERR_WC_STALE",
    "MR",
    "MTU_BYTES",
    "OP_READ",
    "OP_WRITE",
    "PD",
    "QP",
    "QPS_ERR",
    "QPS_INIT",
    "QPS_RESET",
    "QPS_RTR",
    "QPS_RTS",
    "UNAVAILABLE_REASON",
    "WC_STATUS_NAMES",
    "BatchEngine",
    "CompChannel",
    "Context",
    "NicPump",
    "Rail",
    "SliceBatch",
    "WcBatch",
    "configured_path",
    "get_device_list",
    "is_soft_provider",
    "live_objects",
    "load",
    "loaded_path",
    "provider_live_objects",
    "soft_inject_fault",
    "soft_provider_path",
    "soft_set_port_state",
    "soft_set_stall",
    "soft_wr_count",
    "wc_status_name",
]


def __getattr__(name: str) -> Any:
    raise AttributeError(f"mooncake._fast.verbs has no attribute {name!r} ({UNAVAILABLE_REASON})")
