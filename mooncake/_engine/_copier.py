"""Large copies off the event loop: ``_fast.CopyQueue`` workers, completions via its eventfd.

One task per :class:`Copier` waits for the queue's eventfd and drains every completion that
arrived since (a burst costs one wake-up), setting the event each waiting ``copy`` sleeps on.
No sleep-polling, no thread hand-off per job on the Python side.

Cancellation: ``copy`` cannot recall a queued job (a worker may be writing into the ranges), so
it shields its wait: it returns, or raises the cancellation, only once the job is done. ``run``
is the only task that delivers completions, so when it is cancelled (an engine closing cancels
every task at once, in no particular order) it keeps delivering, shielded, until no ``copy`` is
waiting any more, and only then ends; a ``copy`` started after that raises
:class:`~mooncake.errors.ClosedError` without submitting anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.abc

from mooncake import _fast
from mooncake.errors import ClosedError


class Copier:
    """Runs scatter-gather copies on worker threads; start ``run`` in a task group first."""

    def __init__(self, workers: int = 1) -> None:
        self._q = _fast.CopyQueue(workers)
        self._waiters: dict[int, anyio.Event] = {}
        self._next = 0
        self._running = False
        self.completions = 0
        self.wakeups = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver completions until cancelled, then until no ``copy`` waits any more."""
        self._running = True
        task_status.started()
        try:
            while True:
                await self._deliver()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    while self._waiters:  # jobs the workers are still running: finish them
                        await self._deliver()
                finally:
                    self._running = False

    async def _deliver(self) -> None:
        q = self._q
        await anyio.wait_readable(q.fileno())
        done = q.drain()
        self.wakeups += 1
        self.completions += len(done)
        for job in done:
            ev = self._waiters.pop(job, None)
            if ev is not None:
                ev.set()

    async def copy(self, dsts: Sequence[int], srcs: Sequence[int], lens: Sequence[int]) -> None:
        """Copy every ``(srcs[i] -> dsts[i], lens[i])`` on a worker; returns when all are done.

        Raises :class:`ClosedError` (nothing copied) when ``run`` is not running.
        """
        if not self._running:
            raise ClosedError("copier is not running (its engine is closing)")
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
