"""The replica-admin family: replica descriptors, ``batch_replica_clear`` and copy/move tasks.

* ``batch_replica_clear(keys, segment_name="")``: this client's objects among ``keys`` whose
  lease has ended are removed (or, with ``segment_name``, only their replicas there); the keys
  cleared. Others' objects, leased ones and ones being written stay.
* ``create_copy_task(key, targets)`` / ``create_move_task(key, source, target)`` answer
  ``((high, low), 0)``, or ``((0, 0), code)``: ``OBJECT_NOT_FOUND`` (-704) for a missing key,
  ``INVALID_PARAMS`` (-600) for an unknown target or one that already holds a replica, as
  published. The client owning the source replica runs the task (``TaskStart`` -> writes ->
  ``TaskEnd``): a copy adds replicas on the targets, a move leaves one on the target only.
* ``query_task((high, low))`` answers ``(QueryTaskResponse, 0)`` or ``(None, code)``.
"""

from __future__ import annotations

from typing import Any

from mooncake._core import store_types as st
from mooncake._store.config import ReplicaDescriptor
from mooncake.errors import ErrorCode, ReplicaNotFoundError, SegmentNotFoundError, to_code
from mooncake.store._base import StoreBase
from mooncake.store._types import (
    TASK_NOT_FOUND,
    QueryTaskResponse,
    TaskStatus,
    task_id_str,
    task_id_tuple,
)


def _descriptors(resp: st.GetReplicaListResponse) -> list[ReplicaDescriptor]:
    size = resp.size or (resp.replicas[0].length if resp.replicas else 0)
    out = [ReplicaDescriptor(r) for r in resp.replicas]
    out += [ReplicaDescriptor.local_disk(c, size) for c in resp.disk_clients]
    return out


def _task_code(e: BaseException) -> int:
    # the published master answers INVALID_PARAMS for a segment it cannot use (an unknown
    # target, a move source holding no replica)
    if isinstance(e, (SegmentNotFoundError, ReplicaNotFoundError)):
        return int(ErrorCode.INVALID_PARAMS)
    return to_code(e)


class AdminMethods(StoreBase):
    """Replica descriptors, replica clearing and copy/move tasks."""

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of ``key``: memory replicas, then one ``LOCAL_DISK`` replica per client
        holding an SSD copy (empty if it is missing)."""
        try:
            resp = self._call(self._s.replica_listing, key)
        except Exception:
            return []
        return _descriptors(resp)

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """:meth:`get_replica_desc` of each readable key (missing keys are left out)."""
        try:
            got = self._call(self._s.batch_replica_listing, keys)
        except Exception:
            return {}
        return {k: _descriptors(v) for k, v in got.items()}

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        try:
            return list(self._call(self._s.batch_replica_clear, keys, segment_name))
        except Exception:
            return []

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[tuple[int, int], int]:
        try:
            tid: str = self._call(self._s.create_copy_task, key, targets)
        except Exception as e:
            return (0, 0), _task_code(e)
        return task_id_tuple(tid), 0

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        if source == target:
            return (0, 0), int(ErrorCode.INVALID_PARAMS)
        try:
            tid: str = self._call(self._s.create_move_task, key, source, target)
        except Exception as e:
            return (0, 0), _task_code(e)
        return task_id_tuple(tid), 0

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        tid = task_id_str(task_id)  # TypeError for a malformed id, as pybind11 raises
        try:
            task: st.ReplicaTask = self._call(self._s.query_task, tid)
        except Exception as e:
            code = to_code(e)
            return None, TASK_NOT_FOUND if code == int(ErrorCode.INVALID_PARAMS) else code
        out = QueryTaskResponse()
        out.id = task_id
        out.type = st.TaskType(task.type)
        out.status = TaskStatus.of(task.status)
        out.message = task.message
        out.assigned_client = task.executor
        return out, 0

    def get_offload_rpc_read_count(self) -> int:
        """Reads this client served from its SSD (offload) tier since setup."""
        store: Any = self._store
        return int(store.offload_reads) if store is not None else 0
