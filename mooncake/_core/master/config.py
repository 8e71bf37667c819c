"""The master's tunables, counters, and the argument checks its parts share."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mooncake._core.allocator import DEFAULT_ALIGNMENT
from mooncake._core.misses import Miss, MissReason
from mooncake._core.store_types import check_key
from mooncake.errors import (
    ClientNotFoundError,
    InvalidArgumentError,
    InvalidKeyError,
    MooncakeError,
)

ALLOCATION_STRATEGIES = ("random", "free_ratio_first")
_EVICT_RETRIES = 4


@dataclass
class MasterConfig:
    """Tunables of the master (times in seconds; names follow ``mooncake_master``'s flags)."""

    default_kv_lease_ttl: float = 10.0
    default_kv_soft_pin_ttl: float = 30 * 60.0
    max_kv_soft_pin_ttl: float = 24 * 3600.0
    allow_evict_soft_pinned_objects: bool = True
    eviction_high_watermark_ratio: float = 0.90
    eviction_ratio: float = 0.05
    eviction_policy: str = "lru"
    client_ttl: float = 10.0
    put_start_discard_timeout: float = 30.0
    put_start_release_timeout: float = 600.0
    read_fence_ttl: float = 0.5
    read_fence_s_per_mib: float = 0.01
    pending_task_timeout: float = 300.0
    processing_task_timeout: float = 300.0
    max_finished_tasks: int = 10000
    allocation_strategy: str = "random"
    alignment: int = DEFAULT_ALIGNMENT
    seed: int | None = None
    offload_on_evict: bool = True
    """Demote evicted objects to the SSD tier of the client owning their bytes, if it has one."""
    demote_timeout: float = 30.0
    """A demotion not ended within this many seconds is revoked (the object is dropped)."""
    max_disk_drops: int = 1 << 16
    """Bound of each client's queue of SSD copies to delete (oldest notices dropped beyond)."""
    eviction_round_objects: int = 512
    """Most objects one eviction round evicts: a run continues over sweeps (PutStart and
    PromoteStart over the watermark evict a round of 1/16 of it), so no call stalls the master
    for long however large the run (~25 us per victim here: ~13 ms a round)."""
    put_revoke_hold: float = 10.0
    """Space of a revoked write (PutRevoke/UpsertRevoke, PromoteRevoke, TaskRevoke) is reused
    only this many seconds later: the writer's transfer may have been cancelled mid-way, and
    the segment owner's server may still be copying bytes it had already received."""
    quarantine_grace: float = 0.1
    """A quarantined segment's holder lifts it with a heartbeat arriving at least this long
    after the report (an earlier one may have been sent before it died)."""
    quarantine_refute_hold: float = 10.0
    """A reporter whose report a heartbeat refuted is not heard on that segment for this long."""
    tenant_quotas: str = ""
    """Initial per-tenant quotas, ``name=BYTES[/OBJECTS],...`` (``--tenant_quota``; bytes with
    an optional B/KB/MB/GB/TB unit, 0 = unlimited; :mod:`mooncake._core.master.tenants`)."""

    def validate(self) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad setting."""
        for name in (
            "default_kv_lease_ttl",
            "default_kv_soft_pin_ttl",
            "max_kv_soft_pin_ttl",
            "client_ttl",
            "put_start_discard_timeout",
            "put_start_release_timeout",
            "read_fence_ttl",
            "read_fence_s_per_mib",
            "demote_timeout",
            "pending_task_timeout",
            "processing_task_timeout",
            "put_revoke_hold",
            "quarantine_grace",
            "quarantine_refute_hold",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.eviction_high_watermark_ratio <= 1.0:
            raise InvalidArgumentError(
                f"eviction_high_watermark_ratio must be in (0, 1], got {self.eviction_high_watermark_ratio}"
            )
        if not 0.0 <= self.eviction_ratio <= 1.0:
            raise InvalidArgumentError(
                f"eviction_ratio must be in [0, 1], got {self.eviction_ratio}"
            )
        if self.allocation_strategy not in ALLOCATION_STRATEGIES:
            raise InvalidArgumentError(
                f"allocation_strategy must be one of {', '.join(ALLOCATION_STRATEGIES)}, "
                f"got {self.allocation_strategy!r}"
            )
        if self.eviction_round_objects < 1:
            raise InvalidArgumentError(
                f"eviction_round_objects must be >= 1, got {self.eviction_round_objects}"
            )
        parse_tenant_quotas(self.tenant_quotas)
        if self.put_start_release_timeout < self.put_start_discard_timeout:
            raise InvalidArgumentError(
                "put_start_release_timeout must be >= put_start_discard_timeout"
            )


def parse_tenant_quotas(text: str) -> dict[str, tuple[int, int]]:
    """``name=BYTES[/OBJECTS],...`` as tenant -> (bytes, objects); ``InvalidArgumentError``
    naming the bad entry."""
    from mooncake._core.master.tenants import check_tenant, parse_quota

    out: dict[str, tuple[int, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, spec = part.partition("=")
        if not eq:
            raise InvalidArgumentError(f"tenant quota {part!r}: want NAME=BYTES[/OBJECTS]")
        tenant = check_tenant(name.strip())
        if not tenant:
            raise InvalidArgumentError("tenant quota: the default tenant is unlimited")
        b, _, o = spec.partition("/")
        objs = o.strip()
        if objs and not objs.isdigit():
            raise InvalidArgumentError(f"tenant quota {part!r}: objects must be an integer")
        out[tenant] = (parse_quota(b) if b.strip() else 0, int(objs) if objs else 0)
    return out


@dataclass
class MasterStats:
    """Monotonic counters (exported as Prometheus metrics by the server)."""

    puts_started: int = 0
    puts_ended: int = 0
    puts_revoked: int = 0
    put_failures_no_space: int = 0
    gets: int = 0
    get_misses: int = 0
    removes: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_runs: int = 0
    lease_refusals: int = 0
    zombies_discarded: int = 0
    zombies_released: int = 0
    clients_expired: int = 0
    corrupt_reports: int = 0
    """Replicas readers reported failing their CRC32C (``ReportCorruptReplica``)."""
    corrupt_replicas_dropped: int = 0
    corrupt_objects_removed: int = 0
    """Objects removed because their last replica was reported corrupt."""
    stall_seconds: float = 0.0
    """Time credited to clients because the master was unresponsive (:meth:`credit_stall`)."""


# -- internal records ------------------------------------------------------------------------


def _codes(fn: Callable[[str], object], keys: list[str]) -> list[int]:
    out = []
    for k in keys:
        try:
            fn(k)
            out.append(0)
        except MooncakeError as e:
            out.append(int(e.code))
    return out


#: the master's name for the one key rule (:func:`mooncake._core.store_types.check_key`)
_check_key = check_key


def _check_client_id(client_id: str) -> None:
    if not client_id:
        raise ClientNotFoundError("client_id must be non-empty")


def _compile(regex: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as e:
        raise InvalidKeyError(f"bad regular expression {regex!r}: {e}") from None


def format_miss(miss: Miss) -> str:
    """The attribution suffix of an ``OBJECT_NOT_FOUND`` message (parsed by :func:`parse_miss`)."""
    parts = [f"reason={miss.reason.value}"]
    for name in ("policy", "tier", "owner", "tenant"):
        value = getattr(miss, name)
        if value:
            parts.append(f"{name}={value}")
    return "[miss " + " ".join(parts) + "]"


_MISS_RE = re.compile(r"\[miss ((?:\w+=[^\s\]]*\s?)+)\]")


def parse_miss(key: str, message: str, tenant: str = "") -> Miss | None:
    """The :class:`Miss` in an ``OBJECT_NOT_FOUND`` message, or None if it carries none;
    ``tenant``: the caller's (the message's ``tenant=`` field wins)."""
    m = _MISS_RE.search(message)
    if m is None:
        return None
    fields = dict(f.split("=", 1) for f in m.group(1).split())
    try:
        reason = MissReason(fields.get("reason", ""))
    except ValueError:
        return None
    return Miss(
        key,
        reason,
        policy=fields.get("policy", ""),
        tier=fields.get("tier", ""),
        owner=fields.get("owner", ""),
        tenant=fields.get("tenant", tenant),
    )
