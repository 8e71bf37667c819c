"""The published ``mooncake.store`` API: a synchronous ``MooncakeDistributedStore``.

Same names, arguments, return shapes and int codes as the published wheel (0.3.13): ``0`` ok,
a negative Mooncake ``ErrorCode`` on failure, byte counts where the published call returns
them, lists sized by ``len(keys)``, ``(id, code)`` tuples for tasks, dicts for segment mounts.
Underneath, the async client (:func:`mooncake.open_store`) runs on an event loop in a
background thread; every call makes one crossing to it. Exceptions never escape a call that
the published API gives an int code: :func:`mooncake.errors.to_code` maps them.

The class is composed of one module per family, all on the async client's request paths:

========================  ==============================================================
``_base``                 ``setup`` (both forms, every protocol string, ``engine=``, SSD
                          offload), ``init_all``, ``close``, ``health_check``,
                          ``get_hostname``, ``get_engine``, ``_get_pyclient_capsule``
``_bytes``                ``put``/``get``/``put_from``/``get_into``, batches, removal
``_upsert``               the ``upsert*`` forms of the put calls
``_multi``                ``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``
``_ranges``               ``get_into_ranges`` and the get/put session calls
``_segments``             ``mount_segment`` & co., ``alloc_from_mem_pool``
``_admin``                replica descriptors, ``batch_replica_clear``, copy/move tasks
``_dummy``                ``setup_dummy`` (a client of a ``mooncake_client`` process)
``_standalone``           the ``mooncake_client`` side and the wire between the two
``_engram``               ``EngramStore`` / ``EngramStoreConfig`` (head tables over the calls above)
``_types``                task and parallelism types, ``MooncakeHostMemAllocator``, helpers
========================  ==============================================================

The tensor calls come from :mod:`mooncake._store.facade_tensors` (built on the byte-level calls
above; torch is needed only when one is made). Names the published binding does not have raise
``AttributeError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from mooncake._core.store_types import ObjectDataType, ReplicaStatus, SoftPinAction, TaskType
from mooncake._store.config import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicateConfig,
)
from mooncake._store.facade_tensors import TensorMethods
from mooncake._store.tensor_support import (
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
from mooncake.store._admin import AdminMethods
from mooncake.store._bytes import BufferHandle
from mooncake.store._dummy import DummyMethods
from mooncake.store._engram import EngramStore, EngramStoreConfig
from mooncake.store._multi import MultiBufferMethods
from mooncake.store._ranges import RangeMethods
from mooncake.store._segments import SegmentMethods
from mooncake.store._types import (
    FAILED,
    PENDING,
    PROCESSING,
    REPLICA_COPY,
    REPLICA_MOVE,
    SUCCESS,
    MooncakeHostMemAllocator,
    QueryTaskResponse,
    TaskStatus,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)
from mooncake.store._upsert import UpsertMethods

# enum members at module level, as the published module has them
(
    UNKNOWN,
    KVCACHE,
    TENSOR,
    WEIGHT,
    SAMPLE,
    ACTIVATION,
    GRADIENT,
    OPTIMIZER_STATE,
    METADATA,
    GENERAL,
) = ObjectDataType
# (PROCESSING and FAILED are the task states, as in the published module: see _types)
UNDEFINED, INITIALIZED, _PROCESSING, COMPLETE, REMOVED, _FAILED = ReplicaStatus


class MooncakeDistributedStore(
    UpsertMethods,
    MultiBufferMethods,
    RangeMethods,
    SegmentMethods,
    AdminMethods,
    DummyMethods,
    TensorMethods,
):
    """The published sync store client. Call :meth:`setup` (or :meth:`setup_dummy`) first,
    :meth:`close` at the end (or let the interpreter exit: open clients are closed then)."""


def __getattr__(name: str) -> Any:
    # the published wheel's Python modules exported here, when they are installed
    if name == "MooncakeDistributedNoFRegister":
        from mooncake.store._nof import MooncakeDistributedNoFRegister

        return MooncakeDistributedNoFRegister
    if name in (
        "BufferPool",
        "RegisteredBufferPool",
        "BufferLease",
        "RegisteredBufferLease",
        "BufferLeaseView",
        "RegisteredBufferLeaseView",
    ):
        try:
            mod = importlib.import_module("mooncake.buffer_pool")
        except ImportError:
            pass
        else:
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module 'mooncake.store' has no attribute {name!r}")


__all__ = [
    "ACTIVATION",
    "COMPLETE",
    "FAILED",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "KVCACHE",
    "METADATA",
    "OPTIMIZER_STATE",
    "PENDING",
    "PROCESSING",
    "REMOVED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "SAMPLE",
    "SUCCESS",
    "TENSOR",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "EngramStore",
    "EngramStoreConfig",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "_deserialize_tensor",
    "_serialize_tensor",
    "_tensor_metadata_size",
    "bind_to_numa_node",
    "get_alloc_func_addr",
    "get_free_func_addr",
]
