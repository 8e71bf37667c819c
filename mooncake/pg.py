"""The published ``mooncake.pg`` (a ``torch.distributed`` backend over the transfer engine).

The published module loads ``mooncake.pg_<torch version>``, a C++ extension built against
one torch release. This package has none: the module imports, and each of its functions and
classes raises :class:`~mooncake.errors.NotSupportedError` at use, naming what is missing.
"""

from __future__ import annotations

from mooncake import _unsupported

MISSING = "the C++ extension mooncake.pg_<torch version> (Mooncake PG, built against torch)"

_FUNCTIONS = (
    "createMooncakeBackend",
    "createMooncakeCpuBackend",
    "set_host_ip",
    "set_collective_timeout_us",
    "set_fault_reconciliation_window_us",
    "set_device_filter",
    "set_transfer_engine",
    "get_active_ranks",
    "get_num_synced_ranks",
    "extend_group_size_to",
    "get_peer_state",
    "recover_ranks",
    "activate_ranks",
    "deactivate_ranks",
    "join_group",
    "get_failed_ranks_hint",
    "get_local_success",
    "get_current_epoch",
    "sync_after_failure",
)
_CLASSES = (
    "MooncakeBackendOptions",
    "SyncAfterFailureResponse",
    "ProposeViewUpdateResponse",
)

createMooncakeBackend = _unsupported.function(__name__, "createMooncakeBackend", MISSING)
createMooncakeCpuBackend = _unsupported.function(__name__, "createMooncakeCpuBackend", MISSING)
set_host_ip = _unsupported.function(__name__, "set_host_ip", MISSING)
set_collective_timeout_us = _unsupported.function(__name__, "set_collective_timeout_us", MISSING)
set_fault_reconciliation_window_us = _unsupported.function(
    __name__, "set_fault_reconciliation_window_us", MISSING
)
set_device_filter = _unsupported.function(__name__, "set_device_filter", MISSING)
set_transfer_engine = _unsupported.function(__name__, "set_transfer_engine", MISSING)
get_active_ranks = _unsupported.function(__name__, "get_active_ranks", MISSING)
get_num_synced_ranks = _unsupported.function(__name__, "get_num_synced_ranks", MISSING)
extend_group_size_to = _unsupported.function(__name__, "extend_group_size_to", MISSING)
get_peer_state = _unsupported.function(__name__, "get_peer_state", MISSING)
recover_ranks = _unsupported.function(__name__, "recover_ranks", MISSING)
activate_ranks = _unsupported.function(__name__, "activate_ranks", MISSING)
deactivate_ranks = _unsupported.function(__name__, "deactivate_ranks", MISSING)
join_group = _unsupported.function(__name__, "join_group", MISSING)
get_failed_ranks_hint = _unsupported.function(__name__, "get_failed_ranks_hint", MISSING)
get_local_success = _unsupported.function(__name__, "get_local_success", MISSING)
get_current_epoch = _unsupported.function(__name__, "get_current_epoch", MISSING)
sync_after_failure = _unsupported.function(__name__, "sync_after_failure", MISSING)
MooncakeBackendOptions = _unsupported.cls(__name__, "MooncakeBackendOptions", MISSING)
SyncAfterFailureResponse = _unsupported.cls(__name__, "SyncAfterFailureResponse", MISSING)
ProposeViewUpdateResponse = _unsupported.cls(__name__, "ProposeViewUpdateResponse", MISSING)

__all__ = [*_FUNCTIONS, *_CLASSES]
