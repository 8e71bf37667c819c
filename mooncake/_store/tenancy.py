"""Connections bound to a tenant by its derived key (the master's side of tenant binding).

With the cluster secret set, a client may authenticate with its tenant's key instead
(:func:`mooncake._core.auth.tenant_key`): its ``AuthHello`` names the tenant, both proofs use
that tenant's key, and on success the master binds the connection to the tenant. Every
tenant-scoped call (:data:`~mooncake._core.tenantscope.TENANT_SCOPED`) on a bound connection
must name that tenant, else it is refused with ``ILLEGAL_CLIENT`` and nothing is applied. A
connection authenticated with the cluster secret itself is not bound (it may name any tenant:
operators, trusted services).
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import parse_qs

from mooncake._core import auth
from mooncake._core.master.tenants import check_tenant
from mooncake._core.tenantscope import TENANT_SCOPED
from mooncake.errors import IllegalClientError, InvalidArgumentError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["TenantBindings", "tenant_metrics", "tenant_quotas_http", "tenant_status"]


class TenantBindings:
    """Which connections are bound to which tenant (keys: the served sockets)."""

    __slots__ = ("_bound", "_pending")

    def __init__(self) -> None:
        self._bound: dict[socket.socket, str] = {}
        self._pending: dict[socket.socket, str] = {}

    def hello_key(self, secret: bytes, sock: socket.socket | None, tenant: str) -> bytes:
        """The key an ``AuthHello`` naming ``tenant`` (``""``: none) is answered with;
        ``InvalidArgumentError`` for a bad tenant name or no connection to bind."""
        if not tenant:
            return secret
        name = check_tenant(tenant)
        if not name or sock is None:
            raise InvalidArgumentError(f"cannot bind a connection to tenant {tenant!r}")
        self._pending[sock] = name
        return auth.tenant_key(secret, name)

    def prove_key(self, secret: bytes, sock: socket.socket | None) -> tuple[bytes, str]:
        """The key the ``AuthProve`` is checked with, and the tenant it binds (``""``)."""
        name = self._pending.pop(sock, "") if sock is not None else ""
        return (auth.tenant_key(secret, name) if name else secret), name

    def bind(self, sock: socket.socket | None, tenant: str) -> None:
        if sock is not None and tenant:
            self._bound[sock] = tenant

    def forget(self, sock: socket.socket) -> None:
        """``sock`` closed."""
        self._bound.pop(sock, None)
        self._pending.pop(sock, None)

    def check(self, sock: socket.socket | None, method: str, params: Any) -> None:
        """Refuse a call on a bound connection that names another tenant."""
        if sock is None or not self._bound:
            return
        bound = self._bound.get(sock)
        if bound is None or method not in TENANT_SCOPED:
            return
        if getattr(params, "tenant", "") != bound:
            raise IllegalClientError(
                f"{method}: this connection is bound to tenant {bound!r} and may not act as "
                f"tenant {getattr(params, 'tenant', '') or 'default'!r}"
            )


def _snapshot(ledger: Any, tenant: str) -> dict[str, Any]:
    u = ledger.usage(tenant)
    return {
        "tenant_id": tenant,
        "quota_bytes": u["quota_bytes"],
        "quota_objects": u["quota_objects"],
        "charged_bytes": u["bytes"],
        "objects": u["objects"],
        "refused": u["refused"],
        "has_explicit_policy": bool(u["quota_bytes"] or u["quota_objects"]),
        "over_quota": bool(
            (u["quota_bytes"] and u["bytes"] > u["quota_bytes"])
            or (u["quota_objects"] and u["objects"] > u["quota_objects"])
        ),
    }


def tenant_quotas_http(server: Any, method: str, query: str) -> tuple[int, str, bytes]:
    """``/api/v1/tenant_quotas`` of the master's admin HTTP port: ``GET`` (all, or
    ``?tenant_id=``), ``PUT ?tenant_id=NAME&quota_bytes=N[&quota_objects=M]`` (bytes take a
    B/KB/MB/GB/TB unit; 0 = unlimited) and ``DELETE ?tenant_id=NAME``. A change is a
    replicated command (:func:`~mooncake._core.commands.SetTenantQuota`); only the leader of
    an HA cluster takes it (others answer 503)."""
    import msgspec

    from mooncake._core import commands
    from mooncake._core.master.tenants import parse_quota

    def answer(status: int, doc: Any) -> tuple[int, str, bytes]:
        return status, "application/json", msgspec.json.encode(doc)

    q = parse_qs(query)
    name = q.get("tenant_id", [""])[0]
    ledger = server.state.tenants
    try:
        tenant = check_tenant(name) if name else ""
        if method in ("GET", "HEAD"):
            if name:
                return answer(200, {"success": True, "data": _snapshot(ledger, tenant)})
            data = [_snapshot(ledger, t) for t in ledger.tenants()]
            return answer(200, {"success": True, "data": data})
        if method not in ("PUT", "DELETE"):
            return 405, "text/plain", b"method not allowed\n"
        if not tenant:
            raise InvalidArgumentError("tenant_id names no tenant (the default is unlimited)")
        ha = server.ha
        if ha is not None and ha.refusal() is not None:
            return 503, "text/plain", ha.refusal().encode() + b"\n"
        qb = qo = 0
        if method == "PUT":
            qb = parse_quota(q.get("quota_bytes", ["0"])[0])
            objs = q.get("quota_objects", ["0"])[0]
            if not objs.isdigit():
                raise InvalidArgumentError(f"quota_objects must be an integer, got {objs!r}")
            qo = int(objs)
        server.run_command(commands.SetTenantQuota(tenant, qb, qo, server.now()))
        return answer(200, {"success": True, "data": _snapshot(ledger, tenant)})
    except InvalidArgumentError as e:
        return answer(400, {"success": False, "error_code": int(e.code), "message": str(e)})


def tenant_metrics(ledger: Any) -> Iterator[Metric]:
    """The per-tenant Prometheus families (label ``tenant``; named tenants only)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams = {
        "bytes": GaugeMetricFamily(
            "master_tenant_bytes", "Logical bytes a tenant holds (quota charge)", labels=["tenant"]
        ),
        "objects": GaugeMetricFamily(
            "master_tenant_objects", "Objects a tenant holds", labels=["tenant"]
        ),
        "quota_bytes": GaugeMetricFamily(
            "master_tenant_quota_bytes", "A tenant's byte quota (0: none)", labels=["tenant"]
        ),
        "quota_objects": GaugeMetricFamily(
            "master_tenant_quota_objects", "A tenant's object quota (0: none)", labels=["tenant"]
        ),
        "refused": CounterMetricFamily(
            "master_tenant_quota_refusals", "Writes refused for quota", labels=["tenant"]
        ),
    }
    for t in ledger.tenants():
        u = ledger.usage(t)
        for k, fam in fams.items():
            fam.add_metric([t], u[k])
    yield from fams.values()


def tenant_status(ledger: Any) -> list[dict[str, Any]]:
    """The ``tenants`` rows of the master's ``/status`` (``mooncake top``)."""
    return [_snapshot(ledger, t) for t in ledger.tenants()]
