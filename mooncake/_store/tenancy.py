"""Connections bound to a tenant by its derived key (the master's side of tenant binding).

Tenant keys (:func:`mooncake._core.auth.tenant_key`) are derived from the master's *tenant
secret* ``MOONCAKE_TENANT_AUTH_SECRET`` (held by the master alone), or, without one, from the
cluster secret. A client given its tenant's key (``MOONCAKE_TENANT_SECRET``) authenticates its
master connections with it: ``AuthHello`` names the tenant, both proofs use that tenant's key,
and on success the master binds the connection to the tenant. Every tenant-scoped call
(:data:`~mooncake._core.tenantscope.TENANT_SCOPED`) on a bound connection must name that
tenant, else it is refused with ``ILLEGAL_CLIENT`` and nothing is applied.

With a tenant secret the binding is *required*: a call naming a tenant on a connection not
bound to it is refused, so knowing the cluster secret (which the data plane needs) does not let
a client act as a tenant; only the holder of that tenant's key can. Without one, binding is
voluntary: a connection authenticated with the cluster secret itself may name any tenant.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
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

    __slots__ = ("_bound", "_pending", "secret")

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = (
            secret
            if secret is not None
            else auth.load_secret(os.environ.get(auth.TENANT_AUTH_SECRET_ENV, ""))
        )
        """The tenant secret (``MOONCAKE_TENANT_AUTH_SECRET``): binding required when set."""
        self._bound: dict[socket.socket, str] = {}
        self._pending: dict[socket.socket, str] = {}

    def binding_hello(self, params: Any, nonces: Any) -> bool:
        """Whether an authenticated connection's request is an ``AuthHello`` that binds it
        to a tenant (allowed once, with a tenant secret)."""
        return (
            self.secret is not None
            and nonces is None
            and type(params).__name__ == "AuthHelloParams"
            and bool(getattr(params, "tenant", ""))
        )

    def hello_key(self, secret: bytes | None, sock: socket.socket | None, tenant: str) -> bytes:
        """The key an ``AuthHello`` naming ``tenant`` (``""``: none) is answered with
        (``secret``: the cluster secret); ``InvalidArgumentError`` for a bad tenant name, no
        connection to bind, or nothing to authenticate with."""
        if not tenant:
            if secret is None:
                raise InvalidArgumentError("this master takes tenant keys only: name a tenant")
            return secret
        name = check_tenant(tenant)
        base = self.secret if self.secret is not None else secret
        if not name or sock is None or base is None:
            raise InvalidArgumentError(f"cannot bind a connection to tenant {tenant!r}")
        self._pending[sock] = name
        return auth.tenant_key(base, name)

    def prove_key(self, secret: bytes | None, sock: socket.socket | None) -> tuple[bytes, str]:
        """The key the ``AuthProve`` is checked with, and the tenant it binds (``""``)."""
        name = self._pending.pop(sock, "") if sock is not None else ""
        base = self.secret if self.secret is not None and name else secret
        if base is None:
            return b"", ""  # no proof can match: refused
        return (auth.tenant_key(base, name) if name else base), name

    def bind(self, sock: socket.socket | None, tenant: str) -> None:
        if sock is not None and tenant:
            self._bound[sock] = tenant

    def forget(self, sock: socket.socket) -> None:
        """``sock`` closed."""
        self._bound.pop(sock, None)
        self._pending.pop(sock, None)

    def check(self, sock: socket.socket | None, method: str, params: Any) -> None:
        """Refuse a call on a bound connection that names another tenant."""
        if sock is None or (not self._bound and self.secret is None):
            return
        if method not in TENANT_SCOPED:
            return
        bound = self._bound.get(sock)
        if bound is None:
            named = getattr(params, "tenant", "")
            if self.secret is not None and named:
                raise IllegalClientError(
                    f"{method}: tenant {named!r} must authenticate with its tenant key "
                    "(MOONCAKE_TENANT_SECRET) to act as that tenant"
                )
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
        if ha is not None:
            ha.mark_mutated()  # a later read waits until the change is durable
        return answer(200, {"success": True, "data": _snapshot(ledger, tenant)})
    except InvalidArgumentError as e:
        return answer(400, {"success": False, "error_code": int(e.code), "message": str(e)})


def tenant_metrics(ledger: Any) -> Iterator[Metric]:
    """The per-tenant Prometheus families (label ``tenant``; named tenants only)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
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
