"""Queries, removal, replica tasks and segments mounted after setup, for the store client.

Existence and size queries, replica descriptors and removal; ``BatchReplicaClear``;
copy/move tasks (the client owning the source fetches and runs them: ``TaskStart`` -> writes ->
``TaskEnd`` or ``TaskRevoke``); and segments mounted after setup (``mount_memory``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import anyio

from mooncake._core import paging, rpc
from mooncake._core import store_types as st
from mooncake._store.moves import TASK_POLL_S, _check_key, _close_owner, _Op
from mooncake._store.ranges import _Ranges
from mooncake.errors import MooncakeError, SegmentNotFoundError, TransferError

log = logging.getLogger("mooncake.store")


class _Admin(_Ranges):
    """Queries, removal, replica tasks and segments mounted after setup, for the store client (part of :class:`~mooncake._store.client.Store`)."""

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is readable (grants a lease when it is, as in Mooncake)."""
        self._check_open()
        return bool(await self.master.call("ExistKey", rpc.KeyParams(key=_check_key(key))))

    async def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / negative code per key."""
        self._check_open()
        if not keys:
            return []
        for k in keys:
            _check_key(k)
        codes: list[int] = await self.master.call("BatchExistKey", rpc.KeysParams(keys=list(keys)))
        return codes

    async def all_keys(self, page: int = paging.PAGE_ITEMS) -> list[str]:
        """Every readable key, listed ``page`` keys per call (``GetAllKeysPage``; a key
        present during the whole listing is in it once, see :mod:`mooncake._core.paging`)."""
        self._check_open()
        out: list[str] = []
        cursor = 0
        while cursor >= 0:
            got: rpc.KeysPage = await self.master.call(
                "GetAllKeysPage", rpc.PageParams(cursor=cursor, limit=page)
            )
            out += got.keys
            cursor = got.cursor
        return out

    async def all_segments(self, page: int = 1000) -> list[st.SegmentInfo]:
        """Every mounted segment and its usage, ``page`` per call (``GetAllSegmentsPage``)."""
        self._check_open()
        out: list[st.SegmentInfo] = []
        cursor = 0
        while cursor >= 0:
            got: rpc.SegmentsPage = await self.master.call(
                "GetAllSegmentsPage", rpc.PageParams(cursor=cursor, limit=page)
            )
            out += got.segments
            cursor = got.cursor
        return out

    async def get_size(self, key: str) -> int:
        """Size in bytes of ``key``'s value."""
        self._check_open()
        resp, _ = await self._query(key, for_read=False)
        return self._size_of(resp)

    async def replica_descriptors(self, key: str) -> list[st.ReplicaDescriptor]:
        """The object's replicas (grants a read lease)."""
        self._check_open()
        resp, _ = await self._query(key, for_read=False)
        return list(resp.replicas)

    async def batch_replica_descriptors(
        self, keys: Sequence[str]
    ) -> dict[str, list[st.ReplicaDescriptor]]:
        """Replicas of each readable key (keys that fail are left out)."""
        self._check_open()
        if not keys:
            return {}
        resps, _ = await self._batch_query(keys, for_read=False)
        return {
            k: list(r.replicas)
            for k, r in zip(keys, resps, strict=True)
            if not isinstance(r, MooncakeError)
        }

    async def replica_listing(self, key: str) -> st.GetReplicaListResponse:
        """The master's whole answer for ``key``: its memory replicas, the clients holding an
        SSD copy (``disk_clients``) and its size (grants a read lease)."""
        self._check_open()
        resp, _ = await self._query(key, for_read=False)
        return resp

    async def batch_replica_listing(
        self, keys: Sequence[str]
    ) -> dict[str, st.GetReplicaListResponse]:
        """:meth:`replica_listing` of each readable key (keys that fail are left out)."""
        self._check_open()
        if not keys:
            return {}
        resps, _ = await self._batch_query(keys, for_read=False)
        return {k: r for k, r in zip(keys, resps, strict=True) if not isinstance(r, MooncakeError)}

    async def remove(self, key: str, *, force: bool = False) -> None:
        self._check_open()
        await self.master.call("Remove", rpc.RemoveParams(key=_check_key(key), force=force))

    async def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        self._check_open()
        if not keys:
            return []
        codes: list[int] = await self.master.call(
            "BatchRemove", rpc.BatchRemoveParams(keys=list(keys), force=force)
        )
        return codes

    async def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        self._check_open()
        n: int = await self.master.call(
            "RemoveByRegex", rpc.RegexParams(regex=pattern, force=force)
        )
        return n

    async def remove_all(self, *, force: bool = False) -> int:
        self._check_open()
        n: int = await self.master.call("RemoveAll", rpc.ForceParams(force=force))
        return n

    async def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Drop this client's objects among ``keys`` whose lease has ended (only their
        replicas on ``segment_name`` when given); the keys cleared."""
        self._check_open()
        if not keys:
            return []
        cleared: list[str] = await self.master.call(
            "BatchReplicaClear",
            rpc.ReplicaClearParams(
                client_id=self.client_id, keys=list(keys), segment_name=segment_name
            ),
        )
        return cleared

    async def create_copy_task(self, key: str, targets: Sequence[str]) -> str:
        """Queue a copy of ``key`` onto segments ``targets``; its task id."""
        self._check_open()
        tid: str = await self.master.call(
            "CreateCopyTask", rpc.CopyTaskParams(key=_check_key(key), targets=list(targets))
        )
        self._task_kick.set()
        return tid

    async def create_move_task(self, key: str, source: str, target: str) -> str:
        """Queue a move of ``key``'s replica on ``source`` to ``target``; its task id."""
        self._check_open()
        tid: str = await self.master.call(
            "CreateMoveTask",
            rpc.MoveTaskParams(key=_check_key(key), source=source, target=target),
        )
        self._task_kick.set()
        return tid

    async def query_task(self, task_id: str) -> st.ReplicaTask:
        self._check_open()
        task: st.ReplicaTask = await self.master.call(
            "QueryTask", rpc.TaskIdParams(task_id=task_id)
        )
        return task

    async def _task_loop(self) -> None:
        """Run the copy/move tasks the master assigns to this client (it owns their source):
        every ``TASK_POLL_S``, or at once after this client created one."""
        while True:
            with anyio.move_on_after(TASK_POLL_S):
                await self._task_kick.wait()
            self._task_kick = anyio.Event()
            try:
                tasks: list[st.ReplicaTask] = await self.master.call(
                    "FetchTasks", rpc.ClientParams(client_id=self.client_id)
                )
            except MooncakeError as e:
                log.debug("fetching replica tasks failed: %s", e)
                continue
            for t in tasks:
                await self._run_task(t.id)

    async def _run_task(self, task_id: str) -> None:
        """TaskStart -> write the source replica into every target -> TaskEnd (or Revoke)."""
        params = rpc.TaskParams(client_id=self.client_id, task_id=task_id)
        try:
            plan: st.TaskStartResponse = await self.master.call("TaskStart", params)
        except MooncakeError as e:
            log.warning("replica task %s did not start: %s", task_id, e)
            return
        src = plan.source
        err: MooncakeError | None = None
        if src.segment_name != self.segment_name or not self._owns(src.addr, plan.size):
            err = TransferError(f"task source {src.segment_name!r} is not this client's segment")
        else:
            ops = [_Op(True, src.addr, r, plan.size) for r in plan.targets]
            await self._move(ops)
            err = next((op.error for op in ops if op.error is not None), None)
        try:
            if err is None:
                await self.master.call("TaskEnd", params)
            else:
                await self.master.call(
                    "TaskRevoke",
                    rpc.TaskRevokeParams(
                        client_id=self.client_id, task_id=task_id, message=str(err)
                    ),
                )
        except MooncakeError as e:
            log.warning("finishing replica task %s failed: %s", task_id, e)

    async def mount_memory(self, addr: int, size: int, owner: Any, location: str = "") -> str:
        """Register ``[addr, +size)`` (kept alive by ``owner``, closed at unmount) with the
        engine and mount it at the master as one more segment of this client; its id."""
        self._check_open()
        region = await self.engine.register((addr, size))
        region.owner = owner
        seg = st.Segment(
            id=str(uuid.uuid4()),
            name=self.segment_name,
            base=addr,
            size=size,
            te_endpoint=self.segment_name,
            protocol="tcp",
            location=location or "cpu:0",
        )
        try:
            await self.master.call(
                "MountSegment", rpc.MountSegmentParams(client_id=self.client_id, segment=seg)
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.engine.unregister(addr)
            raise
        self.extra_segments[seg.id] = seg
        self._extra_owners[seg.id] = owner
        return seg.id

    async def unmount_memory(self, segment_id: str, grace_s: float = 0.0) -> None:
        """Unmount a segment :meth:`mount_memory` mounted; its memory is released after
        ``grace_s`` seconds (readers already granted a lease may still be copying)."""
        self._check_open()
        seg = self.extra_segments.get(segment_id)
        if seg is None:
            raise SegmentNotFoundError(f"no segment {segment_id!r} mounted by this client")
        await self.master.call(
            "UnmountSegment",
            rpc.UnmountSegmentParams(client_id=self.client_id, segment_id=segment_id),
        )
        del self.extra_segments[segment_id]
        owner = self._extra_owners.pop(segment_id)

        async def release() -> None:
            await anyio.sleep(grace_s)
            with anyio.CancelScope(shield=True):
                await self.engine.unregister(seg.base)
                _close_owner(owner)

        if grace_s > 0 and self._tg is not None:
            self._tg.start_soon(release)
        else:
            await self.engine.unregister(seg.base)
            _close_owner(owner)
