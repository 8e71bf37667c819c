"""Master-run drain jobs: the published master's ``CreateDrainJob`` / ``QueryDrainJob`` /
``CancelDrainJob`` (served on the admin HTTP port by :mod:`mooncake._store.drain_http`).

A job drains named segments on behalf of an operator: **create** checks the request as the
published master does (no segment twice, every segment mounted and ``OK``, every target mounted,
not draining and not one of the segments, ``max_concurrency`` > 0), marks the segments draining
and runs the first step; the master then runs a step every :data:`JOB_POLL_S` until the job
ends. A step is :func:`commands.DrainStep` through ``run_command`` (an HA master logs it, so a
standby applies the same planning): the rules of :mod:`mooncake._core.master.drain`, with move
and copy targets taken from ``target_segments`` only (empty: any segment), and at most
``max_concurrency`` objects of the job's segments under a task at once.

Progress, in the published field names: a **unit** is one object with a replica on one of the
job's segments. ``succeeded_units`` counts units that left the segment with the object still
stored and no task under way on it (moved, or released because another copy exists and
re-replicated from it), ``migrated_bytes`` their sizes; ``active_units`` the units under a task
now (a move off the segment, or the re-replication of a released one); ``blocked_units`` those that fit on no target
(no room) at the last step; ``failed_units`` those still on a segment that was unmounted
before they left. Status (``JobStatus``): ``CREATED`` -> ``RUNNING`` -> ``SUCCEEDED`` once no
job segment holds a unit and no unit is under a task (the segments then report ``DRAINED`` and stay closed to allocation
until unmounted), ``FAILED`` when a segment was unmounted with units left, ``CANCELED`` by
**cancel**, which the published master allows only while no unit is under a task
(``UNAVAILABLE_IN_CURRENT_STATUS`` otherwise, and for a finished job) and which sets the
segments back to ``OK`` (:func:`commands.Undrain`).

Jobs live in the leading master's memory (as published: not in snapshots, not replicated; a new
leader knows none, its segments' draining marks stay until they are unmounted). At most
:data:`MAX_JOBS` are kept: creating one more forgets the oldest finished job, or is refused
(``UNAVAILABLE_IN_CURRENT_STATUS``) when all are running.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from mooncake._core import commands
from mooncake._core.store_types import DrainStatus
from mooncake.errors import (
    InvalidArgumentError,
    JobNotFoundError,
    NotLeaderError,
    SegmentNotFoundError,
    UnavailableError,
)

log = logging.getLogger("mooncake.master")

#: how often a running job takes a step (the published master: 500 ms)
JOB_POLL_S = 0.25
#: jobs kept (running and finished)
MAX_JOBS = 256

CREATED, PLANNING, RUNNING, SUCCEEDED, FAILED, CANCELED = range(6)
#: the published ``JobStatus`` names
JOB_STATUS = {
    CREATED: "CREATED",
    PLANNING: "PLANNING",
    RUNNING: "RUNNING",
    SUCCEEDED: "SUCCEEDED",
    FAILED: "FAILED",
    CANCELED: "CANCELED",
}
_DONE = frozenset({SUCCEEDED, FAILED, CANCELED})


class _Server(Protocol):
    """What a job reads and drives of the master server."""

    @property
    def state(self) -> Any: ...
    @property
    def ha(self) -> Any: ...
    def now(self) -> float: ...
    def run_command(self, command: commands.Command) -> Any: ...


def _ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class DrainJob:
    """One drain job and its progress (module doc)."""

    id: str
    segments: list[str]
    targets: list[str]
    max_concurrency: int
    status: int = CREATED
    created_ms: int = field(default_factory=_ms)
    updated_ms: int = 0
    message: str = "Drain job created"
    succeeded_units: int = 0
    failed_units: int = 0
    blocked_units: int = 0
    active_units: int = 0
    migrated_bytes: int = 0
    units: dict[str, dict[str, tuple[int, bool]]] = field(default_factory=dict)
    """Per segment still draining: its units at the last look, key -> (size, busy)."""
    copying: dict[str, int] = field(default_factory=dict)
    """Units that left a segment while a task re-replicates their object: key -> size."""

    def as_dict(self) -> dict[str, Any]:
        """The published query fields (``QueryJobResponse``)."""
        return {
            "type": 0,
            "type_name": "DRAIN",
            "status": self.status,
            "status_name": JOB_STATUS[self.status],
            "created_at_ms_epoch": self.created_ms,
            "last_updated_at_ms_epoch": self.updated_ms or self.created_ms,
            "segments": list(self.segments),
            "succeeded_units": self.succeeded_units,
            "failed_units": self.failed_units,
            "blocked_units": self.blocked_units,
            "active_units": self.active_units,
            "migrated_bytes": self.migrated_bytes,
            "message": self.message,
            "error_code": 0,
            "error_message": "",
        }


class DrainJobs:
    """The master's drain jobs: create, query, cancel, and the loop that steps them."""

    def __init__(self) -> None:
        self.jobs: dict[str, DrainJob] = {}
        self._wake = anyio.Event()

    # -- the published operations ----------------------------------------------------------

    def create(
        self, server: _Server, segments: list[str], targets: list[str], max_concurrency: int
    ) -> DrainJob:
        """Check the request, mark ``segments`` draining, run the first step (module doc).

        Raises :class:`InvalidArgumentError`, :class:`SegmentNotFoundError`,
        :class:`UnavailableError` or :class:`NotLeaderError` naming what was wrong."""
        _leading(server)
        state = server.state
        if not segments:
            raise InvalidArgumentError("segments must name at least one segment")
        if max_concurrency <= 0:
            raise InvalidArgumentError(f"max_concurrency must be > 0, got {max_concurrency}")
        if len(set(segments)) != len(segments):
            raise InvalidArgumentError(f"segments name a segment twice: {segments}")
        for name in segments:
            draining = state.segment_draining(name)
            if draining is None:
                raise SegmentNotFoundError(f"segment {name!r} is not mounted")
            if draining:
                raise UnavailableError(f"segment {name!r} is already draining")
        for name in targets:
            if name in segments:
                raise InvalidArgumentError(f"target segment {name!r} is also being drained")
            draining = state.segment_draining(name)
            if draining is None:
                raise SegmentNotFoundError(f"target segment {name!r} is not mounted")
            if draining:
                raise UnavailableError(f"target segment {name!r} is draining")
        self._make_room()
        job = DrainJob(str(uuid.uuid4()), list(segments), list(targets), max_concurrency)
        for name in segments:
            job.units[name] = self._look(state, name) or {}
        self.jobs[job.id] = job
        self.step(server, job)
        self._wake.set()
        log.info("drain job %s: segments %s, targets %s", job.id, segments, targets or "any")
        return job

    def query(self, job_id: str) -> DrainJob:
        """The job of ``job_id`` (:class:`JobNotFoundError` when unknown)."""
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"drain job {job_id} is not known to this master")
        return job

    def cancel(self, server: _Server, job_id: str) -> None:
        """Cancel a running job with no unit under a task; its segments take allocations again."""
        _leading(server)
        job = self.query(job_id)
        if job.status in _DONE:
            raise UnavailableError(f"drain job {job_id} already ended ({JOB_STATUS[job.status]})")
        if job.active_units:
            raise UnavailableError(
                f"drain job {job_id} has {job.active_units} unit(s) under a task; retry later"
            )
        now = server.now()
        for name in job.segments:
            server.run_command(commands.Undrain(name, now))
        job.units.clear()
        job.copying.clear()
        self._finish(job, CANCELED, "Drain job canceled")

    # -- running ---------------------------------------------------------------------------

    async def run(self, server: _Server) -> None:
        """Step every running job every :data:`JOB_POLL_S` (only while this master leads)."""
        while True:
            if not any(j.status not in _DONE for j in self.jobs.values()):
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            await anyio.sleep(JOB_POLL_S)
            ha = server.ha
            if ha is not None and ha.refusal() is not None:
                continue
            for job in list(self.jobs.values()):
                if job.status in _DONE:
                    continue
                try:
                    self.step(server, job)
                except Exception:  # a bug here must not take the master down
                    log.exception("drain job %s: step failed", job.id)

    def step(self, server: _Server, job: DrainJob) -> None:
        """One step of ``job``: a :func:`commands.DrainStep` per segment still holding units
        (within the job's concurrency), then progress and, when done, the end status."""
        state = server.state
        now = server.now()
        for key in list(job.copying):  # re-replications of released units
            if not state.key_busy(key):
                size = job.copying.pop(key)
                if state.key_busy(key) is not None:
                    job.succeeded_units += 1
                    job.migrated_bytes += size
        busy = {name: sum(b for _, b in units.values()) for name, units in job.units.items()}
        free = job.max_concurrency - sum(busy.values()) - len(job.copying)
        blocked = 0
        for name in list(job.units):
            limit = busy[name] + max(0, free)
            status: DrainStatus | None = None
            if limit > 0:
                status = server.run_command(commands.DrainStep(name, job.targets, limit, now))
            seen = self._look(state, name)
            before = job.units[name]
            if seen is None:  # unmounted: what was still there is lost
                job.failed_units += len(before)
                del job.units[name]
                continue
            for key, (size, _) in before.items():
                if key in seen:
                    continue
                left = state.key_busy(key)
                if left is None:  # removed meanwhile: neither moved nor lost by the drain
                    continue
                if left:
                    job.copying[key] = size
                    free -= 1
                else:
                    job.succeeded_units += 1
                    job.migrated_bytes += size
            now_busy = sum(b for _, b in seen.values())
            free -= max(0, now_busy - busy[name])
            job.units[name] = seen
            if status is not None:
                blocked += status.stranded
                if not seen and status.writes == 0:
                    del job.units[name]  # drained
        job.blocked_units = blocked
        job.active_units = sum(b for u in job.units.values() for _, b in u.values())
        job.active_units += len(job.copying)
        job.updated_ms = _ms()
        if job.units or job.copying:
            job.status = RUNNING
            job.message = "Drain job running"
        elif job.failed_units:
            self._finish(job, FAILED, f"Drain job failed: {job.failed_units} unit(s) lost")
        else:
            self._finish(job, SUCCEEDED, "Drain job finished successfully")

    def segment_status(self, server: _Server, name: str) -> int:
        """The published ``SegmentStatus`` of ``name``: 1 ``OK``, 2 ``DRAINING``, 3 ``DRAINED``
        (draining with no object left on it); :class:`SegmentNotFoundError` when unmounted."""
        draining = server.state.segment_draining(name)
        if draining is None:
            raise SegmentNotFoundError(f"segment {name!r} is not mounted")
        if not draining:
            return 1
        units = server.state.drain_units(name)
        return 3 if not units else 2

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _look(state: Any, name: str) -> dict[str, tuple[int, bool]] | None:
        units = state.drain_units(name)
        return None if units is None else {k: (size, busy) for k, size, busy in units}

    def _finish(self, job: DrainJob, status: int, message: str) -> None:
        job.status = status
        job.message = message
        job.active_units = 0
        job.updated_ms = _ms()
        log.info("drain job %s: %s (%s)", job.id, JOB_STATUS[status], message)

    def _make_room(self) -> None:
        while len(self.jobs) >= MAX_JOBS:
            oldest = next((i for i, j in self.jobs.items() if j.status in _DONE), None)
            if oldest is None:
                raise UnavailableError(
                    f"{len(self.jobs)} drain jobs are running; wait for one to end"
                )
            del self.jobs[oldest]


def _leading(server: _Server) -> None:
    ha = server.ha
    if ha is not None:
        refusal = ha.refusal()
        if refusal is not None:
            raise NotLeaderError(f"drain jobs run on the leader: {refusal}")


__all__ = ["JOB_POLL_S", "JOB_STATUS", "MAX_JOBS", "DrainJob", "DrainJobs"]
