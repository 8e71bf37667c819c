"""The master's Prometheus collector (``/metrics``; names follow Mooncake's ``master_*``).

Read-only: it reads the server's state and counters through :class:`MetricsSource` (a
:class:`~mooncake._store.master.MasterServer`) at each scrape, on the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake._store.tenancy import tenant_metrics

if TYPE_CHECKING:
    from mooncake._core.master import MasterState
    from mooncake._store.keyscan import KeyScanner

__all__ = ["MasterCollector", "MetricsSource"]


class MetricsSource(Protocol):
    """What the collector reads of the server."""

    @property
    def state(self) -> MasterState: ...
    @property
    def scanner(self) -> KeyScanner: ...
    @property
    def deduplicated(self) -> int: ...
    @property
    def requests(self) -> dict[str, int]: ...
    @property
    def failures(self) -> dict[str, int]: ...

    def ha_status(self) -> dict[str, Any]: ...


class MasterCollector(Collector):
    """Prometheus view of a master (names follow Mooncake's ``master_*`` metrics)."""

    def __init__(self, server: MetricsSource) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server.state
        st = s.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield from tenant_metrics(s.tenants)
        yield gauge("master_key_count", "Objects with a readable version", s.object_count)
        yield gauge("master_allocated_bytes", "Bytes allocated in mounted segments", s.used_bytes)
        yield gauge(
            "master_total_capacity_bytes", "Bytes of all mounted segments", s.capacity_bytes
        )
        yield gauge("master_active_clients", "Clients alive (pinging)", s.client_count)
        yield gauge("master_mounted_segments", "Mounted segments", s.segment_count)
        yield counter("master_put_start", "PutStart/UpsertStart that allocated", st.puts_started)
        yield counter("master_put_end", "Writes made readable", st.puts_ended)
        yield counter("master_put_revoke", "Writes revoked", st.puts_revoked)
        yield counter(
            "master_put_no_space", "PutStart refused for lack of space", st.put_failures_no_space
        )
        yield counter("master_get_replica_list", "Successful replica lookups", st.gets)
        yield counter("master_get_miss", "Replica lookups of absent objects", st.get_misses)
        yield counter("master_removed_keys", "Objects removed explicitly", st.removes)
        yield counter("master_evicted_keys", "Objects evicted", st.evicted_objects)
        yield counter("master_evicted_bytes", "Object bytes evicted", st.evicted_bytes)
        yield counter("master_eviction_runs", "Eviction passes", st.eviction_runs)
        yield counter(
            "master_lease_refusals", "Removals refused because of a lease", st.lease_refusals
        )
        yield counter(
            "master_zombie_puts_discarded", "Zombie writes pre-empted", st.zombies_discarded
        )
        yield counter("master_zombie_puts_released", "Zombie writes released", st.zombies_released)
        yield counter(
            "master_clients_expired", "Clients dropped after client_ttl", st.clients_expired
        )
        yield counter(
            "master_corrupt_replicas_dropped",
            "Replicas dropped because a reader found their bytes failing the writer's CRC32C",
            st.corrupt_replicas_dropped,
        )
        yield counter(
            "master_corrupt_objects_removed",
            "Objects removed because their last replica was reported corrupt",
            st.corrupt_objects_removed,
        )
        yield counter(
            "master_stall_seconds",
            "Time the master could not serve, credited to every client's TTL",
            st.stall_seconds,
        )
        q = s.quarantine.stats
        for name, doc, value in (
            ("reports", "Transfer failures to a segment reported by clients", q.reports),
            ("started", "Segments quarantined on a client's report", q.started),
            ("ignored", "Reports ignored (reporter refuted on that segment)", q.ignored),
            ("lifted", "Quarantines lifted by the holder's heartbeat", q.lifted),
            ("ended", "Quarantines ended with the segment (owner expired)", q.ended),
        ):
            yield counter(f"master_quarantine_{name}", doc, value)
        yield GaugeMetricFamily(
            "master_quarantined_segments",
            "Segment names quarantined now",
            value=len(s.quarantine.names),
        )
        yield counter(
            "master_rpc_deduplicated",
            "Retried mutating calls answered from the dedup ledger, not applied again",
            self.server.deduplicated,
        )
        yield gauge(
            "master_dedup_ledger_bytes",
            "Bytes of recorded replies the dedup ledger holds",
            s.dedup.nbytes,
        )
        yield counter(
            "master_regex_timeouts",
            "Regex requests refused past their budget",
            self.server.scanner.timeouts,
        )
        ha = self.server.ha_status()
        yield gauge("master_ha_is_leader", "1 if this master leads", ha["role"] == "leader")
        for name, doc in (
            ("term", "HA term (create revision of the leader's master_view key; 0 standby)"),
            ("applied_seq", "Last log batch applied"),
            ("log_lag", "Leader: commands not yet durable; standby: batches not yet applied"),
            ("last_snapshot_seq", "Log seq of the newest snapshot"),
            ("lease_remaining", "Seconds of the leader's lease left (as it knows)"),
        ):
            if name in ha:
                yield gauge(f"master_ha_{name}", doc, float(ha[name]))
        for name in ("stepdowns", "elections_won", "batches", "apply_errors", "early_revokes"):
            if name in ha:
                yield counter(f"master_ha_{name}", f"HA {name.replace('_', ' ')}", ha[name])
        misses = CounterMetricFamily(
            "master_misses",
            "Replica lookups of absent objects, by why the object is absent",
            labels=["reason", "policy", "tier"],
        )
        for (reason, policy, tier), n in sorted(s.misses.counts().items()):
            misses.add_metric([reason, policy, tier], n)
        yield misses
        for what in ("hits", "misses", "evictions", "demotions", "promotions"):
            fam = CounterMetricFamily(
                f"master_tier_{what}", f"Per-tier {what} as the master sees them", labels=["tier"]
            )
            for tier, c in s.tiers.items():
                fam.add_metric([tier], getattr(c, what))
            yield fam
        by_tier = s.segment_tiers()
        for what, name, doc in (
            ("segments", "master_tier_segments", "Mounted segments by memory tier (dram, gpu)"),
            ("capacity", "master_tier_capacity_bytes", "Mounted segment bytes by memory tier"),
            ("used", "master_tier_used_bytes", "Allocated segment bytes by memory tier"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, d in by_tier.items():
                g.add_metric([tier], d[what])
            yield g
        req = CounterMetricFamily(
            "master_rpc_requests", "RPC requests by method", labels=["method"]
        )
        fail = CounterMetricFamily(
            "master_rpc_failures", "RPC error answers by method", labels=["method"]
        )
        for name, n in self.server.requests.items():
            req.add_metric([name], n)
        for name, n in self.server.failures.items():
            fail.add_metric([name], n)
        yield req
        yield fail
