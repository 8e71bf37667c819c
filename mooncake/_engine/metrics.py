"""Prometheus metrics of a transfer engine: plain counters on the hot path, read at scrape time.

Recording costs the hot paths one tuple appended to a list per batch and transport (never per
slice or request, nothing in a compiled loop); the tuples are counted (Python ints, one
histogram bucket increment each) when the metrics are scraped, or once :data:`LOG_MAX` wait.
:class:`EngineMetrics` is also a ``prometheus_client`` ``Collector`` that turns those ints into
metric families when scraped, so an embedding server can ``registry.register(engine.metrics)``
in its own registry; ``engine.metrics_registry`` is a ``CollectorRegistry`` holding just it.
:func:`serve_metrics` is the opt-in HTTP exporter (``open_engine(metrics_port=...)`` or
``MC_METRICS_PORT``), bound to loopback unless told otherwise.

``MC_METRICS=0`` turns recording off (``engine.metrics`` is then ``None``; nothing is exported).
Series are listed in docs/metrics.md.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mooncake._core.transfer import Opcode, TransferRequest, TransferResult
from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._engine.transports.base import EngineHost

#: Latency bucket upper bounds in seconds: 10 us .. 1 s, about three per decade.
BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


#: Batches waiting to be counted before the hot path drains them itself.
LOG_MAX = 4096

#: The ``op`` label of an opcode.
OP_LABEL: dict[Opcode, str] = {Opcode.READ: "read", Opcode.WRITE: "write"}


class Histogram:
    """A fixed-bucket latency histogram of plain ints (``counts[i]`` observations in bucket
    ``i``, the last one past :data:`BUCKETS`)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs as Prometheus wants them, ``+Inf`` last."""
        out: list[tuple[str, float]] = []
        acc = 0
        for le, c in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((le, acc))
        return out


def histogram_family(
    name: str, doc: str, labels: list[str], hists: Mapping[tuple[str, str], Histogram]
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for key, h in sorted(hists.items()):
        fam.add_metric(list(key), h.buckets(), h.sum)
    return fam


def error_kind(err: BaseException) -> tuple[str, str]:
    """``(kind, code)`` labels of an error: its class name and its Mooncake code."""
    return type(err).__name__, str(int(getattr(err, "code", 0) or 0))


class _Slot:
    """The counters of one (transport, peer, op)."""

    __slots__ = ("batches", "bytes", "counts", "failed", "requests", "sum")

    def __init__(self) -> None:
        self.batches = self.requests = self.bytes = self.failed = 0
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0


class EngineMetrics(Collector):
    """The counters of one engine (a ``Collector``; see the module docstring).

    Increments are plain Python ints, not locked: batches recorded concurrently from several
    caller threads (the sync path) may, rarely, lose an increment."""

    def __init__(self, engine: EngineHost | None = None) -> None:
        self.engine = engine
        self.slots: dict[tuple[str, str, str], _Slot] = {}
        self.errors: dict[tuple[str, str, str], int] = {}  # (transport, kind, code)
        # Batches not yet counted, appended by the hot paths (one tuple each, no call):
        # loop path (transport, peer, requests, results, seconds); caller-thread path
        # (Transport, PeerInfo, opcode, requests, bytes, failed results, seconds). Drained into the
        # counters at scrape time, or here once LOG_MAX are waiting.
        self.log: list[tuple[str, str, list[TransferRequest], list[TransferResult], float]] = []
        self.sync_log: list[tuple[Any, Any, Opcode, int, int, list[TransferResult], float]] = []

    def _slot(self, key: tuple[str, str, str]) -> _Slot:
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = _Slot()
        return s

    def drain(self) -> None:
        """Count the batches waiting in :attr:`log` and :attr:`sync_log`."""
        log, self.log = self.log, []
        for transport, peer, reqs, results, dt in log:
            first = reqs[0].opcode
            op = OP_LABEL[first]
            if len(reqs) > 1 and any(r.opcode is not first for r in reqs):
                op = "mixed"
            self.batch(transport, peer, op, len(reqs), sum(r.length for r in reqs), results, dt)
        slog, self.sync_log = self.sync_log, []
        for t, p, opc, n, nbytes, failures, dt in slog:
            self.batch(t.name, p.segment, OP_LABEL[opc], n, nbytes, failures, dt)

    def batch(
        self,
        transport: str,
        peer: str,
        op: str,
        requests: int,
        nbytes: int,
        failures: Iterable[TransferResult],
        seconds: float,
    ) -> None:
        """Count one batch (or one transport's share of one) that took ``seconds``.

        ``failures`` may hold completed results too; only those with an error count."""
        s = self.slots.get((transport, peer, op)) or self._slot((transport, peer, op))
        s.batches += 1
        s.requests += requests
        s.bytes += nbytes
        s.counts[bisect_left(BUCKETS, seconds)] += 1
        s.sum += seconds
        for res in failures:
            if res.error is not None:
                s.failed += 1
                k = (transport, *error_kind(res.error))
                self.errors[k] = self.errors.get(k, 0) + 1

    def failed_batch(
        self, transport: str, peer: str, op: str, requests: int, err: BaseException
    ) -> None:
        """A batch that failed as a whole (unreachable peer, transport error) before moving;
        not a latency observation."""
        s = self._slot((transport, peer, op))
        s.batches += 1
        s.requests += requests
        s.failed += requests
        k = (transport, *error_kind(err))
        self.errors[k] = self.errors.get(k, 0) + requests

    # -- scrape ---------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        self.drain()
        labels = ["transport", "peer", "op"]
        fams = [
            CounterMetricFamily(
                "mooncake_engine_batches", "Transfer batches per transport share", labels=labels
            ),
            CounterMetricFamily(
                "mooncake_engine_transfer_requests", "Transfer requests", labels=labels
            ),
            CounterMetricFamily(
                "mooncake_engine_transfer_bytes", "Bytes requested to move", labels=labels
            ),
            CounterMetricFamily(
                "mooncake_engine_transfer_failed_requests", "Requests that failed", labels=labels
            ),
        ]
        hists: dict[tuple[str, str], Histogram] = {}
        for key, sl in sorted(self.slots.items()):
            for fam, v in zip(fams, (sl.batches, sl.requests, sl.bytes, sl.failed), strict=True):
                fam.add_metric(list(key), v)
            h = hists.get((key[0], key[2]))
            if h is None:
                h = hists[(key[0], key[2])] = Histogram()
            h.counts = [a + b for a, b in zip(h.counts, sl.counts, strict=True)]
            h.sum += sl.sum
        yield from fams
        yield histogram_family(
            "mooncake_engine_batch_latency_seconds",
            "Time from a batch's start to its last result, per transport",
            ["transport", "op"],
            {k: h for k, h in hists.items() if sum(h.counts)},
        )
        errs = CounterMetricFamily(
            "mooncake_engine_errors",
            "Failed requests by error class and Mooncake error code",
            labels=["transport", "kind", "code"],
        )
        for ek, n in sorted(self.errors.items()):
            errs.add_metric(list(ek), n)
        yield errs
        eng = self.engine
        if eng is not None:
            yield from _engine_gauges(eng)


def _engine_gauges(eng: EngineHost) -> Iterator[Metric]:
    regions = list(eng.registry)
    yield GaugeMetricFamily(
        "mooncake_engine_registered_bytes",
        "Bytes of registered memory",
        value=sum(r.length for r in regions),
    )
    yield GaugeMetricFamily(
        "mooncake_engine_pinned_bytes",
        "Bytes of registered regions pinned by a running transfer",
        value=sum(r.length for r in regions if r.users > 0),
    )
    conns = GaugeMetricFamily(
        "mooncake_engine_connections",
        "Known peers holding connection state of the transport",
        labels=["transport"],
    )
    peers = eng.peers()
    for t in eng.transports:
        conns.add_metric([t.name], sum(1 for p in peers if p.state.get(t.name) is not None))
    yield conns
    yield GaugeMetricFamily("mooncake_engine_peers", "Peers with a cached descriptor", len(peers))
    events = CounterMetricFamily(
        "mooncake_engine_transport_events",
        "Events a transport counts itself (rdma: posted, completions, retries, connects, "
        "accepts, timeouts, wc_<status>, rail_pauses)",
        labels=["transport", "event"],
    )
    for t in eng.transports:
        stats: Any = getattr(t, "stats", None)
        if isinstance(stats, dict):
            for ev, n in sorted(stats.items()):
                events.add_metric([t.name, str(ev)], n)
    yield events


def enabled() -> bool:
    """Whether engines record metrics (``MC_METRICS=0`` turns it off)."""
    return os.environ.get("MC_METRICS", "1") not in ("0", "false", "no", "off")


def env_port() -> int | None:
    """``MC_METRICS_PORT`` as a port number, or None if unset."""
    raw = os.environ.get("MC_METRICS_PORT", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) > 65535:
        raise InvalidArgumentError(f"MC_METRICS_PORT must be a port number, not {raw!r}")
    return int(raw)


def make_registry(*collectors: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    return reg


class MetricsServer:
    """A running HTTP exporter (``/metrics``); :meth:`close` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as e:
            raise InvalidArgumentError(f"cannot serve metrics on {host}:{port}: {e}") from e
        self.host = host
        self.port: int = int(self._server.server_port)
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            srv, self._closed = (None if self._closed else self._server), True
        if srv is not None:
            srv.shutdown()
            srv.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread (port 0: a free
    one, read it from ``.port``)."""
    return MetricsServer(registry, port, host)


__all__ = [
    "BUCKETS",
    "EngineMetrics",
    "Histogram",
    "MetricsServer",
    "enabled",
    "env_port",
    "make_registry",
    "serve_metrics",
]
