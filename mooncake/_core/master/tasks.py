"""Replica tasks: copies and moves of a replica onto other segments, run by a client."""

from __future__ import annotations

from mooncake._core.master.base import _StateBase
from mooncake._core.master.records import _Object, _Replica, _Seg, _Task
from mooncake._core.store_types import (
    ReplicaStatus,
    ReplicaTask,
    TaskStartResponse,
    TaskStatus,
    TaskType,
)
from mooncake.errors import (
    IllegalClientError,
    InvalidArgumentError,
    InvalidWriteError,
    NoAvailableHandleError,
    ObjectHasReplicationTaskError,
    ObjectNotFoundError,
    ReplicaNotFoundError,
    ReplicaNotReadyError,
    SegmentNotFoundError,
)


class _Tasks(_StateBase):
    """Replica copy/move tasks: creation, the executor's start/end/revoke, expiry."""

    # -- replica tasks (copy / move) -----------------------------------------------------

    def create_copy_task(self, key: str, targets: list[str], now: float) -> str:
        """Queue a copy of ``key`` onto each of ``targets`` (segment names without a replica of
        it); executed by the client owning the first replica's segment. Returns the task id."""
        obj = self._task_object(key)
        assert obj.readable is not None
        if not targets:
            raise InvalidArgumentError("a copy task needs at least one target segment")
        source = obj.readable.replicas[0]
        return self._new_task(obj, TaskType.REPLICA_COPY, source, targets, now)

    def create_move_task(self, key: str, source: str, target: str, now: float) -> str:
        """Queue a move of ``key``'s replica on segment ``source`` to segment ``target``."""
        obj = self._task_object(key)
        assert obj.readable is not None
        src = next((r for r in obj.readable.replicas if r.seg.segment.name == source), None)
        if src is None:
            raise ReplicaNotFoundError(f"object {key!r} has no replica on segment {source!r}")
        return self._new_task(obj, TaskType.REPLICA_MOVE, src, [target], now)

    def _task_object(self, key: str) -> _Object:
        obj = self._objects.get(key)
        if obj is None or obj.readable is None:
            raise ObjectNotFoundError(f"object {key!r} not found")
        if obj.pending is not None:
            raise ReplicaNotReadyError(f"object {key!r} has a write in progress")
        if obj.task is not None:
            raise ObjectHasReplicationTaskError(f"object {key!r} has task {obj.task.id} in flight")
        if obj.demoting is not None or obj.promoting is not None:
            raise ReplicaNotReadyError(f"object {key!r} is moving between memory and SSD")
        if not obj.readable.replicas:
            raise ReplicaNotFoundError(f"object {key!r} has no memory replica (it is on SSD only)")
        return obj

    def _new_task(
        self, obj: _Object, ttype: TaskType, source: _Replica, targets: list[str], now: float
    ) -> str:
        assert obj.readable is not None
        held = {id(r.seg) for r in obj.readable.replicas}
        held_names = {r.seg.segment.name for r in obj.readable.replicas}
        segs: list[_Seg] = []
        for name in targets:
            seg = next(
                (
                    s
                    for s in self._seg_list
                    if s.segment.name == name
                    and id(s) not in held
                    and not s.draining
                    and s not in segs
                ),
                None,
            )
            if seg is None:
                if ttype is TaskType.REPLICA_COPY and name in held_names:
                    continue  # a copy onto a segment that holds one already: nothing to do there
                raise SegmentNotFoundError(
                    f"no mounted segment {name!r} without a replica of {obj.key!r}"
                )
            segs.append(seg)
        self._next_task += 1
        task_id = f"{self.view_version_id:016x}{self._next_task:016x}"
        task = _Task(task_id, ttype, obj.key, source, segs, source.seg.client_id, now)
        self._tasks[task.id] = task
        if not segs:  # every target holds a replica already: done, as Mooncake answers it
            self._finish_task(task, TaskStatus.SUCCESS, "every target already holds a replica")
            return task.id
        self._active_tasks[task.id] = task
        obj.task = task
        return task.id

    def query_task(self, task_id: str) -> ReplicaTask:
        task = self._tasks.get(task_id)
        if task is None:
            raise InvalidArgumentError(f"no task {task_id!r}")
        return task.info()

    def fetch_tasks(self, client_id: str, now: float) -> list[ReplicaTask]:
        """Pending tasks this client executes; they become PROCESSING."""
        out = []
        for task in self._active_tasks.values():
            if task.executor == client_id and task.status is TaskStatus.PENDING:
                task.status = TaskStatus.PROCESSING
                task.started = now
                out.append(task.info())
        return out

    def task_start(self, client_id: str, task_id: str, now: float) -> TaskStartResponse:
        """Allocate the task's targets; the executor then writes ``source`` into each."""
        task = self._active_task(client_id, task_id)
        if task.allocated:
            raise InvalidWriteError(f"task {task_id} already started")
        size = task.source.length
        for seg in task.targets:
            addr = seg.alloc.allocate(size)
            if addr is None:
                self._fail_task(task, f"no space for {size} bytes on {seg.segment.name!r}")
                raise NoAvailableHandleError(task.message)
            self._used += seg.alloc.extent(addr)
            task.allocated.append(_Replica(seg, addr, size))
        if task.status is TaskStatus.PENDING:
            task.started = now
        task.status = TaskStatus.PROCESSING
        return TaskStartResponse(
            size=size,
            source=task.source.descriptor(ReplicaStatus.COMPLETE),
            targets=[r.descriptor(ReplicaStatus.PROCESSING) for r in task.allocated],
        )

    def task_end(self, client_id: str, task_id: str, now: float) -> None:
        """The targets hold the bytes: they become replicas (a move also drops its source)."""
        task = self._active_task(client_id, task_id)
        if not task.allocated:
            raise InvalidWriteError(f"task {task_id} was not started")
        obj = self._objects[task.key]
        assert obj.readable is not None and obj.task is task
        for r in task.allocated:
            obj.readable.replicas.append(r)
        task.allocated = []
        if task.type is TaskType.REPLICA_MOVE:
            src = task.source
            obj.readable.replicas.remove(src)
            if src.seg.draining:  # readers granted it may still copy until their lease ends
                src.seg.reads_until = max(src.seg.reads_until, obj.read_deadline)
            if obj.read_deadline > now:  # a reader may be copying from it
                self._defer(obj.read_deadline, [src])
            else:
                self._free_replicas([src])
        self._finish_task(task, TaskStatus.SUCCESS, "")

    def task_revoke(self, client_id: str, task_id: str, message: str, now: float) -> None:
        """The executor gave up: targets are freed, the task FAILED."""
        task = self._active_task(client_id, task_id)
        self._hold_written(task.allocated, now)
        task.allocated = []
        self._fail_task(task, message or "revoked by the executor")

    def _active_task(self, client_id: str, task_id: str) -> _Task:
        task = self._active_tasks.get(task_id)
        if task is None:
            if task_id in self._tasks:
                raise InvalidWriteError(f"task {task_id} is {self._tasks[task_id].status.name}")
            raise InvalidArgumentError(f"no task {task_id!r}")
        if task.executor != client_id:
            raise IllegalClientError(f"task {task_id} is executed by {task.executor}")
        return task

    def _fail_task(self, task: _Task, message: str) -> None:
        self._free_replicas(task.allocated)
        task.allocated = []
        self._finish_task(task, TaskStatus.FAILED, message)

    def _finish_task(self, task: _Task, status: TaskStatus, message: str) -> None:
        task.status = status
        task.message = message
        self._active_tasks.pop(task.id, None)
        obj = self._objects.get(task.key)
        if obj is not None and obj.task is task:
            obj.task = None
        self._finished_tasks.append(task.id)
        while len(self._finished_tasks) > self.config.max_finished_tasks:
            self._tasks.pop(self._finished_tasks.popleft(), None)

    def _expire_tasks(self, now: float) -> None:
        for task in list(self._active_tasks.values()):
            if task.status is TaskStatus.PENDING:
                if now - task.created >= self.config.pending_task_timeout:
                    self._fail_task(task, "not fetched by its executor in time")
            elif now - task.started >= self.config.processing_task_timeout:
                self._fail_task(task, "not finished by its executor in time")
