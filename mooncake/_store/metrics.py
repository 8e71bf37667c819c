"""Prometheus metrics of a store client: calls by API family, latency, bytes, misses, SSD tier.

The public put/get methods of :class:`~mooncake._store.client.Store` and of the facades' sync
:class:`~mooncake._store.fastpath.FastPath` are wrapped once, at import (:func:`instrument`):
a wrapper times the call and appends one tuple to the client's :class:`StoreMetrics` log
(nothing per byte or per slice), counted into Python ints at scrape time. :class:`StoreMetrics` is a ``prometheus_client`` ``Collector``
that also reads the client's own counters at scrape time (``miss_stats``, ``lease_fences``,
the SSD tier's ``stats()``). The store registers it in its engine's ``metrics_registry``, so
one registry (and one exporter, ``open_store(metrics_port=...)`` / ``MC_METRICS_PORT``) covers
the client and the engine it moves bytes with (the per-transport bytes: shm, tcp, rdma, cuda,
local). Series are listed in docs/metrics.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from time import perf_counter
from typing import Any, Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake._engine.metrics import LOG_MAX, Histogram, error_kind, histogram_family
from mooncake.errors import MooncakeError

T = TypeVar("T")


class _Stats(Protocol):
    """A tier that reports counters and sizes (the SSD tier)."""

    def stats(self) -> dict[str, int]: ...


class _VerifyView(Protocol):
    """The verified-read counters (:class:`~mooncake._store.verify.ReadVerifier`)."""

    @property
    def verified(self) -> int: ...
    @property
    def unverified(self) -> int: ...
    @property
    def mismatches(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def replicas_reported(self) -> int: ...


class _StoreView(Protocol):
    """What :class:`StoreMetrics` reads of a store client at scrape time (and nothing more).

    :class:`~mooncake._store.client.Store` satisfies it; typing on this view keeps the
    collector below the client (the client imports this module, never the other way).
    """

    @property
    def ssd(self) -> _Stats | None:
        """The SSD tier, when the client has one."""

    @property
    def lease_fences(self) -> int:
        """Reads refused because they finished after their read lease."""

    @property
    def verify(self) -> _VerifyView:
        """Verified reads: the switch and the counters."""

    def miss_stats(self) -> dict[tuple[str, str, str], int]:
        """Failed reads counted by ``(reason, policy, tier)``."""


# family -> (direction, how to count (items, bytes, failed items) from args and result)
_Counter = Callable[[tuple[Any, ...], Any], tuple[int, int, int]]


def _one_value(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    v = args[1]
    return 1, (v.nbytes if isinstance(v, memoryview) else len(v)), 0


def _one_size(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    return 1, int(args[2]), 0


def _got_bytes(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    return 1, len(out), 0


def _got_int(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    return 1, int(out), 0


def _batch_values(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    vals: Sequence[Any] = args[1]
    ok = [v for v, e in zip(vals, out, strict=False) if e is None]
    n = sum(v.nbytes if isinstance(v, memoryview) else len(v) for v in ok)
    return len(out), n, len(out) - len(ok)


def _batch_sizes(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    sizes: Sequence[int] = args[2]
    ok = [s for s, e in zip(sizes, out, strict=False) if e is None]
    return len(out), sum(ok), len(out) - len(ok)


def _batch_parts(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    parts: Sequence[Sequence[tuple[int, int]]] = args[1]
    ok = [p for p, e in zip(parts, out, strict=False) if e is None]
    return len(out), sum(ln for p in ok for _, ln in p), len(out) - len(ok)


def _batch_got(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    n = bad = 0
    for r in out:
        if isinstance(r, BaseException):
            bad += 1
        else:
            n += r if isinstance(r, int) else len(r)
    return len(out), n, bad


def _fast_put_parts(args: tuple[Any, ...], out: Any) -> tuple[int, int, int]:
    # FastPath.put_parts_local(keys, ptrs, lens, sizes, config) -> (errors, handed over, ...)
    errs: Sequence[Any] = out[0]
    sizes: Sequence[int] = args[3]
    ok = [n for n, e in zip(sizes, errs, strict=False) if e is None]
    return len(errs), sum(ok), len(errs) - len(ok)


#: Store methods counted, by API family: (direction, counter).
STORE_FAMILIES: dict[str, tuple[str, _Counter]] = {
    "put": ("write", _one_value),
    "upsert": ("write", _one_value),
    "put_from": ("write", _one_size),
    "upsert_from": ("write", _one_size),
    "put_batch": ("write", _batch_values),
    "upsert_batch": ("write", _batch_values),
    "batch_put_from": ("write", _batch_sizes),
    "batch_upsert_from": ("write", _batch_sizes),
    "batch_put_parts": ("write", _batch_parts),
    "get": ("read", _got_bytes),
    "get_into": ("read", _got_int),
    "get_batch": ("read", _batch_got),
    "batch_get_into": ("read", _batch_got),
    "batch_get_parts": ("read", _batch_got),
}

#: FastPath methods (the facades' caller-thread path): family label -> (direction, counter).
FAST_FAMILIES: dict[str, tuple[str, str, _Counter]] = {
    "put": ("put", "write", lambda a, o: (1, int(a[2]), 0)),
    "get": ("get", "read", _got_bytes),
    "get_into": ("get_into", "read", _got_int),
    # the multi-buffer pair and the tensor puts (keys handed to the loop count there too)
    "put_parts_local": ("batch_put_parts", "write", _fast_put_parts),
    "batch_get_parts": ("batch_get_parts", "read", _batch_got),
}


class StoreMetrics(Collector):
    """The counters of one store client (a ``Collector``; see the module docstring)."""

    def __init__(self, store: _StoreView | None = None) -> None:
        self.store = store
        # (family, path) -> [calls, items, bytes, failed items]; path "loop" or "fast"
        self.calls: dict[tuple[str, str], list[int]] = {}
        self.latency: dict[tuple[str, str], Histogram] = {}
        self.errors: dict[tuple[str, str, str], int] = {}  # (family, kind, code)
        # calls not yet counted: (family, path, items, bytes, failed items, seconds)
        self.log: list[tuple[str, str, int, int, int, float]] = []

    def drain(self) -> None:
        """Count the calls waiting in :attr:`log`."""
        log, self.log = self.log, []
        for family, path, items, nbytes, bad, dt in log:
            self.ok(family, path, items, nbytes, bad, dt)

    def ok(self, family: str, path: str, items: int, nbytes: int, bad: int, dt: float) -> None:
        key = (family, path)
        c = self.calls.get(key)
        if c is None:
            c = self.calls[key] = [0, 0, 0, 0]
        c[0] += 1
        c[1] += items
        c[2] += nbytes
        c[3] += bad
        h = self.latency.get(key)
        if h is None:
            h = self.latency[key] = Histogram()
        h.observe(dt)

    def fail(self, family: str, path: str, err: BaseException, dt: float) -> None:
        self.ok(family, path, 1, 0, 1, dt)
        k = (family, *error_kind(err))
        self.errors[k] = self.errors.get(k, 0) + 1

    # -- scrape ---------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        self.drain()
        labels = ["family", "path"]
        fams = [
            CounterMetricFamily("mooncake_store_calls", "Store API calls", labels=labels),
            CounterMetricFamily(
                "mooncake_store_items", "Keys handled by store API calls", labels=labels
            ),
            CounterMetricFamily(
                "mooncake_store_bytes", "Value bytes written or read successfully", labels=labels
            ),
            CounterMetricFamily(
                "mooncake_store_failed_items", "Keys whose put or get failed", labels=labels
            ),
        ]
        for key, vals in sorted(self.calls.items()):
            for fam, v in zip(fams, vals, strict=True):
                fam.add_metric(list(key), v)
        yield from fams
        yield histogram_family(
            "mooncake_store_call_latency_seconds",
            "Store API call latency by family and path",
            labels,
            dict(self.latency),
        )
        errs = CounterMetricFamily(
            "mooncake_store_errors",
            "Failed store calls (non-batch) by error class and Mooncake code",
            labels=["family", "kind", "code"],
        )
        for ek, n in sorted(self.errors.items()):
            errs.add_metric(list(ek), n)
        yield errs
        s = self.store
        if s is None:
            return
        misses = CounterMetricFamily(
            "mooncake_store_misses",
            "Failed reads by reason, eviction policy and tier (the client's miss_stats)",
            labels=["reason", "policy", "tier"],
        )
        for (reason, policy, tier), n in sorted(s.miss_stats().items()):
            misses.add_metric([reason, policy, tier], n)
        yield misses
        yield CounterMetricFamily(
            "mooncake_store_lease_fences",
            "Reads refused because they finished after their read lease",
            value=s.lease_fences,
        )
        vr = s.verify
        yield CounterMetricFamily(
            "mooncake_store_verified_reads",
            "Reads whose landed bytes matched the CRC32C their writer recorded",
            value=vr.verified,
        )
        yield CounterMetricFamily(
            "mooncake_store_unverified_reads",
            "Reads not verified: the version has no CRC32C (an older or verification-off "
            "writer), verification is off here, or the read was part of a value",
            value=vr.unverified,
        )
        mm = CounterMetricFamily(
            "mooncake_store_checksum_mismatches",
            "Replicas whose bytes failed their CRC32C, by tier and holder (segment, or for "
            "ssd the client)",
            labels=["tier", "holder"],
        )
        for (tier, holder), n in sorted(vr.mismatches.items()):
            mm.add_metric([tier, holder], n)
        yield mm
        yield CounterMetricFamily(
            "mooncake_store_corrupt_replicas_reported",
            "Corrupt replicas reported to the master (which drops each)",
            value=vr.replicas_reported,
        )
        ssd = s.ssd
        if ssd is not None:
            g = GaugeMetricFamily(
                "mooncake_store_ssd", "The SSD tier's stats() (counters and sizes)", labels=["stat"]
            )
            for name, v in sorted(ssd.stats().items()):
                g.add_metric([name], v)
            yield g


def _wrap_async(fn: Callable[..., Any], family: str, count: _Counter) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        m: StoreMetrics | None = self.metrics
        if m is None:
            return await fn(self, *args, **kw)
        t0 = perf_counter()
        try:
            out = await fn(self, *args, **kw)
        except MooncakeError as e:
            m.fail(family, "loop", e, perf_counter() - t0)
            raise
        try:
            items, nbytes, bad = count(args, out)
        except (TypeError, IndexError):  # keyword-only call shapes: count the call only
            items, nbytes, bad = 1, 0, 0
        m.log.append((family, "loop", items, nbytes, bad, perf_counter() - t0))
        if len(m.log) > LOG_MAX:
            m.drain()
        return out

    return wrapper


def _wrap_sync(fn: Callable[..., Any], family: str, count: _Counter) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        m: StoreMetrics | None = self.store.metrics
        if m is None:
            return fn(self, *args, **kw)
        t0 = perf_counter()
        try:
            out = fn(self, *args, **kw)
        except MooncakeError as e:
            m.fail(family, "fast", e, perf_counter() - t0)
            raise
        try:
            items, nbytes, bad = count(args, out)
        except (TypeError, IndexError):
            items, nbytes, bad = 1, 0, 0
        m.log.append((family, "fast", items, nbytes, bad, perf_counter() - t0))
        if len(m.log) > LOG_MAX:
            m.drain()
        return out

    return wrapper


def instrument(cls: type[T]) -> type[T]:
    """Wrap the counted methods of the store client class ``cls`` (see the module docstring)."""
    for name, (_, count) in STORE_FAMILIES.items():
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, _wrap_async(fn, name, count))
    return cls


def instrument_fast(cls: type[T]) -> type[T]:
    """Wrap the put/get methods of the caller-thread fast path class ``cls``."""
    for name, (family, _, count) in FAST_FAMILIES.items():
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, _wrap_sync(fn, family, count))
    return cls


__all__ = ["FAST_FAMILIES", "STORE_FAMILIES", "StoreMetrics", "instrument", "instrument_fast"]
