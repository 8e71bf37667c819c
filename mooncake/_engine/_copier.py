"""Large copies off the event loop: ``_fast.CopyQueue`` workers, completions via its eventfd.

One task per :class:`Copier` waits for the queue's eventfd and drains every completion that
arrived since (a burst costs one wake-up), setting the event each waiting ``copy`` sleeps on.
No sleep-polling, no thread hand-off per job on the Python side.

Cancellation: ``copy`` cannot recall a queued job (a worker may be writing into the ranges), so
it shields its wait: it returns, or raises the cancellation, only once the job is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.abc

from mooncake import _fast


class Copier:
    """Runs scatter-gather copies on worker threads; start ``run`` in a task group first."""

    def __init__(self, workers: int = 1) -> None:
        self._q = _fast.CopyQueue(workers)
        self._waiters: dict[int, anyio.Event] = {}
        self._next = 0
        self.completions = 0
        self.wakeups = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver completions until cancelled."""
        task_status.started()
        q = self._q
        while True:
            await anyio.wait_readable(q.fileno())
            done = q.drain()
            self.wakeups += 1
            self.completions += len(done)
            for job in done:
                ev = self._waiters.pop(job, None)
                if ev is not None:
                    ev.set()

    async def copy(self, dsts: Sequence[int], srcs: Sequence[int], lens: Sequence[int]) -> None:
        """Copy every ``(srcs[i] -> dsts[i], lens[i])`` on a worker; returns when all are done."""
        job = self._next
        self._next += 1
        ev = self._waiters[job] = anyio.Event()
        try:
            self._q.submit(job, dsts, srcs, lens)
        except BaseException:
            del self._waiters[job]
            raise
        with anyio.CancelScope(shield=True):
            await ev.wait()

    def close(self) -> None:
        """Finish queued jobs and stop the workers (after ``run`` has ended)."""
        self._q.close()
