"""Per-transfer telemetry: one record per batch, a bounded ring of recent ones, JSON lines.

Every batch the engine runs (:meth:`Engine.transfer`, :meth:`Engine.submit`, the sync
facade's calling-thread path) gets a :class:`TransferTelemetry`: its bytes and request count,
one :class:`SliceGroup` per transport share (transport, NIC/rails, requests, bytes, wire time,
failures), the stage times and the verdict. Names follow NIXL's ``getXferTelemetry``
(``start_time``, ``post_duration``, ``xfer_duration``, ``total_bytes``, ``desc_count``) plus
this engine's stages:

* ``queued_s``: from :meth:`Engine.submit` to the batch starting on the loop (0 when awaited);
* ``posted_s``: from the start to the first transport taking requests (validation, the peer
  lookup, routing, pinning): NIXL's ``post_duration`` is ``queued_s + posted_s``;
* ``wire_s``: from the first transport taking requests to the last one returning;
* ``completed_s``: from the submit (or start) to the results: NIXL's ``xfer_duration``.

``retries`` counts the descriptor refetches of the batch (a range outside the cached
descriptor) and, on the sync path, the calling-thread attempt that fell back to the loop.

The ring (``MOONCAKE_TRANSFER_TELEMETRY_RING`` records, 4096 by default; 0 turns telemetry
off) keeps the newest records and finds them by batch id while they are in it.
``MOONCAKE_TRANSFER_TELEMETRY_LOG=PATH`` appends each record to ``PATH`` as one JSON line.
Thread-safe: the sync path records from callers' threads.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import IO, Any

__all__ = ["CURRENT", "SliceGroup", "TelemetryRing", "TransferTelemetry", "from_env"]

#: the record of the batch the current task runs (set by Engine.transfer; the transports'
#: shares read it, and after ``await engine.transfer(...)`` it is that batch's record)
CURRENT: contextvars.ContextVar[TransferTelemetry | None] = contextvars.ContextVar(
    "mooncake_transfer_telemetry", default=None
)


@dataclass(slots=True)
class SliceGroup:
    """One transport's share of a batch."""

    transport: str
    nic: str
    """The NIC(s) the share could use: rdma its rails, tcp/shm the local host."""
    requests: int
    bytes: int
    wire_s: float
    failed: int = 0


class TransferTelemetry:
    """One batch (see the module docstring for the stages). A plain class: made on every
    batch, it sets six attributes and leaves the rest to class defaults; transport shares are
    kept as tuples until :attr:`groups` is read."""

    path = "loop"
    """``"loop"`` (the engine's event loop) or ``"sync"`` (the caller's thread)."""
    queued_s = 0.0
    posted_s = 0.0
    wire_s = 0.0
    completed_s = 0.0
    retries = 0
    verdict = "pending"
    """``"completed"``, ``"failed"`` (a request failed), ``"canceled"``, ``"timed_out"`` or
    ``"error"`` (the batch raised)."""
    error = ""
    first_post = 0.0
    last_done = 0.0
    _groups: list[tuple[str, str, int, int, float, int]] | None = None
    _wall_offset = 0.0

    def __init__(
        self, batch_id: int, segment: str, opcode: str, desc_count: int, total_bytes: int, t0: float
    ) -> None:
        self.batch_id = batch_id
        self.segment = segment
        self.opcode = opcode
        self.desc_count = desc_count
        self.total_bytes = total_bytes
        self.t0 = t0
        """perf_counter at submit/start."""

    @property
    def start_time(self) -> float:
        """Wall clock (seconds since the epoch) when the batch was submitted or started."""
        return self.t0 + self._wall_offset

    @property
    def groups(self) -> list[SliceGroup]:
        return [SliceGroup(*g) for g in self._groups or ()]

    @property
    def post_duration(self) -> float:
        """NIXL's ``postDuration`` (seconds)."""
        return self.queued_s + self.posted_s

    @property
    def xfer_duration(self) -> float:
        """NIXL's ``xferDuration`` (seconds)."""
        return self.completed_s

    @property
    def rate_bps(self) -> float:
        """Bytes per second over the batch's whole duration."""
        return self.total_bytes / self.completed_s if self.completed_s > 0 else 0.0

    def add_group(
        self,
        transport: str,
        nic: str,
        requests: int,
        nbytes: int,
        t0: float,
        t1: float,
        failed: int,
    ) -> None:
        """A transport share that ran from perf_counter ``t0`` to ``t1``."""
        g = (transport, nic, requests, nbytes, t1 - t0, failed)
        if self._groups is None:
            self._groups = [g]
        else:
            self._groups.append(g)
        if not self.first_post or t0 < self.first_post:
            self.first_post = t0
        if t1 > self.last_done:
            self.last_done = t1

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready builtins (what the facade's ``get_transfer_telemetry`` returns)."""
        return {
            "batch_id": self.batch_id,
            "segment": self.segment,
            "opcode": self.opcode,
            "desc_count": self.desc_count,
            "total_bytes": self.total_bytes,
            "start_time": self.start_time,
            "path": self.path,
            "queued_s": self.queued_s,
            "posted_s": self.posted_s,
            "wire_s": self.wire_s,
            "completed_s": self.completed_s,
            "groups": [asdict(g) for g in self.groups],
            "retries": self.retries,
            "verdict": self.verdict,
            "error": self.error,
            "post_duration": self.post_duration,
            "xfer_duration": self.xfer_duration,
            "rate_bps": self.rate_bps,
        }

    def __repr__(self) -> str:
        return (
            f"TransferTelemetry(batch_id={self.batch_id}, segment={self.segment!r}, "
            f"{self.opcode} {self.total_bytes} B x{self.desc_count}, {self.verdict}, "
            f"{self.completed_s * 1e6:.0f} us)"
        )


class TelemetryRing:
    """The newest ``capacity`` records, by batch id (see the module docstring)."""

    def __init__(self, capacity: int = 4096, log_path: str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"telemetry ring capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ring: deque[TransferTelemetry] = deque()
        self._by_id: dict[int, TransferTelemetry] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.recorded = 0
        # wall clock = perf_counter + this (one reading, so a record costs no wall-clock call)
        self._wall_offset = time.time() - time.perf_counter()
        # sync-path batches as raw tuples (a record is built only when someone reads)
        self._raw: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self.local = threading.local()
        """``local.last``: the calling thread's last sync-path batch (a raw tuple or record)."""
        self._log: IO[str] | None = (
            open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            if log_path
            else None
        )

    def begin(self, segment: str, opcode: str, n: int, nbytes: int) -> TransferTelemetry:
        rec = TransferTelemetry(next(self._ids), segment, opcode, n, nbytes, time.perf_counter())
        rec._wall_offset = self._wall_offset
        return rec

    def finish(self, rec: TransferTelemetry, verdict: str, error: str = "") -> None:
        """Stamp the end of ``rec`` now and keep it."""
        now = time.perf_counter()
        rec.completed_s = now - rec.t0
        if rec.first_post:
            rec.posted_s = max(0.0, rec.first_post - rec.t0 - rec.queued_s)
            rec.wire_s = rec.last_done - rec.first_post
        else:
            rec.posted_s = max(0.0, rec.completed_s - rec.queued_s)
        rec.verdict = verdict
        rec.error = error
        self.add(rec)

    def add(self, rec: TransferTelemetry) -> None:
        with self._lock:
            ring = self._ring
            if len(ring) >= self.capacity:
                old = ring.popleft()
                self._by_id.pop(old.batch_id, None)
            ring.append(rec)
            self._by_id[rec.batch_id] = rec
            self.recorded += 1
            log = self._log
            if log is not None:
                log.write(json.dumps(rec.as_dict(), separators=(",", ":")) + "\n")

    def add_sync(
        self,
        segment: str,
        opcode: str,
        n: int,
        nbytes: int,
        transport: str,
        nic: str,
        t0: float,
        t1: float,
        nfailed: int,
        fallback: bool = False,
    ) -> None:
        """A batch the sync path ran on the caller's thread (``fallback``: it went on to the
        loop path). Kept raw: one tuple append, the record is built when read."""
        raw = (segment, opcode, n, nbytes, transport, nic, t0, t1, nfailed, fallback)
        if self._log is not None:
            self.local.last = self._build(raw)
            self.add(self.local.last)
            return
        self._raw.append(raw)
        self.local.last = raw

    def _build(self, raw: tuple[Any, ...]) -> TransferTelemetry:
        segment, opcode, n, nbytes, transport, nic, t0, t1, nfailed, fallback = raw
        rec = TransferTelemetry(next(self._ids), segment, opcode, n, nbytes, t0)
        rec._wall_offset = self._wall_offset
        rec.path = "sync"
        rec.wire_s = rec.completed_s = t1 - t0
        rec._groups = [(transport, nic, n, nbytes, t1 - t0, nfailed)]
        rec.first_post, rec.last_done = t0, t1
        rec.retries = 1 if fallback else 0
        rec.verdict = "fallback" if fallback else ("failed" if nfailed else "completed")
        return rec

    def _fold(self) -> None:
        while self._raw:
            try:
                raw = self._raw.popleft()
            except IndexError:
                return
            rec = self._build(raw)
            if getattr(self.local, "last", None) is raw:
                self.local.last = rec
            self.add(rec)

    def last_sync(self) -> TransferTelemetry | None:
        """The calling thread's last sync-path batch."""
        last = getattr(self.local, "last", None)
        if isinstance(last, tuple):
            self._fold()
            last = getattr(self.local, "last", None)
            if isinstance(last, tuple):  # folded by another thread meanwhile
                last = self._build(last)
        return last

    def get(self, batch_id: int) -> TransferTelemetry | None:
        """The record of ``batch_id`` while the ring holds it."""
        return self._by_id.get(batch_id)

    def recent(self, n: int | None = None) -> list[TransferTelemetry]:
        """The newest ``n`` records (all when ``None``), oldest first."""
        self._fold()
        with self._lock:
            items = list(self._ring)
        return items if n is None else items[-n:]

    def slowest(self, n: int = 10) -> list[TransferTelemetry]:
        """The ``n`` records with the longest ``completed_s``, slowest first."""
        return sorted(self.recent(), key=lambda r: r.completed_s, reverse=True)[:n]

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def from_env() -> TelemetryRing | None:
    """The ring the environment asks for (``None`` when ``..._RING=0``)."""
    raw = os.environ.get("MOONCAKE_TRANSFER_TELEMETRY_RING", "4096")
    try:
        cap = int(raw)
    except ValueError:
        raise ValueError(
            f"MOONCAKE_TRANSFER_TELEMETRY_RING must be an integer, got {raw!r}"
        ) from None
    if cap <= 0:
        return None
    return TelemetryRing(cap, os.environ.get("MOONCAKE_TRANSFER_TELEMETRY_LOG") or None)


class TelemetryCollector:
    """Prometheus view of a ring (what ``mooncake top`` shows): the ``n`` slowest batches as
    ``mooncake_engine_slowest_transfer_seconds`` (labels: batch id, peer, op, transports,
    NIC, verdict, bytes) and the records kept so far."""

    def __init__(self, ring: TelemetryRing, n: int = 10) -> None:
        self.ring = ring
        self.n = n

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = GaugeMetricFamily(
            "mooncake_engine_slowest_transfer_seconds",
            "The slowest batches in the telemetry ring (completed_s)",
            labels=["batch_id", "segment", "op", "transport", "nic", "verdict", "bytes"],
        )
        for r in self.ring.slowest(self.n):
            gs = r._groups or ()
            transports = "+".join(sorted({g[0] for g in gs})) or "-"
            nics = "+".join(sorted({g[1] for g in gs})) or "-"
            labels = [str(r.batch_id), r.segment, r.opcode, transports, nics, r.verdict]
            g.add_metric([*labels, str(r.total_bytes)], r.completed_s)
        yield g
        c = CounterMetricFamily(
            "mooncake_engine_transfer_telemetry_records", "Batches recorded in the telemetry ring"
        )
        c.add_metric([], self.ring.recorded)
        yield c
