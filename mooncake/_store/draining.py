"""Graceful drain of a store client's segments before it leaves (SIGTERM, rolling restarts).

:func:`drain` asks the master to drain every segment the client mounted (``DrainSegment``,
rules in :mod:`mooncake._core.master.drain`): nothing new is allocated on them, objects with
another replica are re-replicated from it, sole copies are moved to a segment with room (this
client runs those moves: it still serves its segment), and the call is repeated until nothing
is in flight there (writes into the segment, moves, read leases granted on it) or the bound
runs out. The caller then closes the store, which unmounts the segments: what could not be
moved (no room anywhere) is dropped then.

:func:`drain_on_signal` is the async client's SIGTERM drain: ``await
store.drain_on_signal()`` in a task of the block that opened the store returns once SIGTERM
came and the drain ended; leaving the block then unmounts. (The sync facade installs its
SIGTERM handler itself: :mod:`mooncake.store._drain`.)

The bound defaults to :data:`DEFAULT_DRAIN_TIMEOUT_S` (5 s; ``MC_STORE_DRAIN_TIMEOUT`` in the
environment, the sync facade's ``drain_timeout`` setup option and the ``mooncake_client``
``--drain_timeout`` flag override it).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake.errors import InvalidArgumentError, MooncakeError

if TYPE_CHECKING:
    from mooncake._store.moves import _Mover

log = logging.getLogger("mooncake.store")

DEFAULT_DRAIN_TIMEOUT_S = 5.0
#: how often the drain asks the master again while something is in flight
DRAIN_POLL_S = 0.05


def drain_timeout(value: float | str | None = None) -> float:
    """The drain bound in seconds: ``value``, else ``MC_STORE_DRAIN_TIMEOUT``, else 5 s.

    Raises :class:`InvalidArgumentError` naming a value that is not a number >= 0."""
    raw: float | str | None = value
    if raw is None:
        raw = os.environ.get("MC_STORE_DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT_S)
    try:
        out = float(raw)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"drain timeout {raw!r} is not a number of seconds") from None
    if not out >= 0 or out == float("inf"):
        raise InvalidArgumentError(f"drain timeout {raw!r} must be a finite number >= 0")
    return out


@dataclass(slots=True)
class DrainReport:
    """What a drain did, summed over its calls and segments."""

    released: int = 0
    """Replicas that left the replica lists because another copy exists."""
    copies: int = 0
    """Re-replication tasks queued (from the remaining copy onto another segment)."""
    moves: int = 0
    """Sole copies queued to move to another segment."""
    stranded: int = 0
    """Sole copies that fit nowhere else at the last call (dropped at the unmount)."""
    settled: bool = False
    """Nothing was in flight on the segments at the end (False: the bound ran out first)."""
    seconds: float = 0.0


async def drain(store: _Mover, timeout_s: float | None = None) -> DrainReport:
    """Drain every segment ``store`` mounted (module doc); at most ``timeout_s`` seconds.

    Never raises for a master that cannot be reached or refuses (the drain then ends unsettled,
    logged); the segments stay mounted until the store closes."""
    bound = drain_timeout(timeout_s)
    report = DrainReport()
    start = anyio.current_time()
    segments = store.mounted_segments()
    with anyio.move_on_after(bound):
        while segments:
            pending = False
            wait = DRAIN_POLL_S
            for seg in segments:
                try:
                    status: st.DrainStatus = await store.master.call(
                        "DrainSegment",
                        rpc.UnmountSegmentParams(client_id=store.client_id, segment_id=seg.id),
                    )
                except MooncakeError as e:
                    log.warning("draining segment %s failed: %s", seg.id, e)
                    report.seconds = anyio.current_time() - start
                    return report
                report.released += status.released
                report.copies += status.copies
                report.moves += status.moves
                report.stranded = status.stranded
                if not status.settled:
                    pending = True
                    if status.writes == 0 and status.tasks == 0:
                        wait = max(wait, min(status.read_wait_s, 0.5))
            if not pending:
                report.settled = True
                break
            store._task_kick.set()  # run this client's moves now, not at the next poll
            await anyio.sleep(wait)
    report.seconds = anyio.current_time() - start
    log.info(
        "drained %d segment(s) in %.2fs: %d replicas released, %d re-replications, %d moves,"
        " %d stranded%s",
        len(segments),
        report.seconds,
        report.released,
        report.copies,
        report.moves,
        report.stranded,
        "" if report.settled or not segments else " (bound reached before it settled)",
    )
    if not segments:
        report.settled = True
    return report


async def drain_on_signal(
    store: _Mover,
    signals: Sequence[signal.Signals] = (signal.SIGTERM,),
    timeout_s: float | None = None,
) -> DrainReport:
    """Wait for one of ``signals`` (SIGTERM by default), then :func:`drain` and return its
    report; the caller then leaves its ``open_store`` block (which unmounts) and exits. The
    handlers are installed for the wait only; the main thread only (anyio's signal receiver)."""
    bound = drain_timeout(timeout_s)  # a bad bound is refused now, not at the signal
    with anyio.open_signal_receiver(*signals) as received:
        async for signum in received:
            log.info("signal %d: draining before exit", signum)
            break
    return await drain(store, bound)


__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "DrainReport", "drain", "drain_on_signal", "drain_timeout"]
