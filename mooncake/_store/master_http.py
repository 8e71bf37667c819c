"""The master's admin HTTP port: ``/metrics``, ``/health``, ``/status``, ``/role``,
``/ha_status``, ``/kv_events/status``, ``/query_key``, the listings
(:mod:`mooncake._store.listing_http`), tenant quotas (:mod:`mooncake._store.tenancy`) and the
drain-job routes (:mod:`mooncake._store.drain_http`).

Served by :class:`~mooncake._store.master.MasterServer` (its ``http_*`` methods call these) on
the metrics port: keep-alive connections, at most :data:`HTTP_MAX_CONNECTIONS` live (the
longest-idle gives way at the cap), request heads bounded by h11 (:data:`HTTP_MAX_HEAD`), each
request, the first from accept, complete within :data:`HTTP_IDLE_S`. Only the drain routes read
a body (bounded by ``drain_http.MAX_BODY``). What the routes read of the server is
:class:`AdminHost`.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import h11
import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from mooncake._core import commands, rpc
from mooncake._core.master import MasterState
from mooncake._engine import _accept
from mooncake._store import drain_http
from mooncake._store.drain_jobs import DrainJobs
from mooncake._store.listing_http import admin_listing
from mooncake._store.tenancy import tenant_quotas_http, tenant_status
from mooncake.errors import MooncakeError

__all__ = [
    "HTTP_IDLE_S",
    "HTTP_MAX_CONNECTIONS",
    "HTTP_MAX_HEAD",
    "AdminHost",
    "ha_status",
    "http_response",
    "serve_http_connection",
    "status",
]

HTTP_MAX_HEAD = 16 << 10
HTTP_IDLE_S = 30.0
HTTP_MAX_CONNECTIONS = 64
_REASONS = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}


class _Refusing(Protocol):
    def refusal(self) -> str | None: ...


class _Reporting(Protocol):
    def status(self) -> dict[str, Any]: ...


class _Publishing(Protocol):
    def stats(self) -> dict[str, Any]: ...


class AdminHost(Protocol):
    """What the admin routes read of the master server."""

    @property
    def state(self) -> MasterState: ...
    @property
    def registry(self) -> CollectorRegistry: ...
    @property
    def ha(self) -> _Refusing | None: ...
    @property
    def ha_node(self) -> _Reporting | None: ...
    @property
    def kv_publisher(self) -> _Publishing | None: ...
    @property
    def last_snapshot_seq(self) -> int: ...
    @property
    def drain_jobs(self) -> DrainJobs: ...
    def now(self) -> float: ...
    def run_command(self, command: commands.Command) -> Any: ...


def http_response(
    server: AdminHost, method: str, target: str, body: bytes = b""
) -> tuple[int, str, bytes]:
    """(status, content type, body) for one admin HTTP request."""
    url = urlsplit(target)
    if url.path == "/api/v1/tenant_quotas":
        return tenant_quotas_http(server, method, url.query)
    if drain_http.handles(target):  # the rest of /api/v1/
        return drain_http.response(server, method, target, body)
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"method not allowed\n"
    if url.path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(server.registry)
    if url.path == "/health":
        return 200, "text/plain", b"OK\n"
    if url.path == "/status":
        return 200, "application/json", msgspec.json.encode(status(server))
    if url.path == "/role":
        role = server.ha_node.status()["role"] if server.ha_node is not None else "leader"
        return 200, "text/plain", role.encode() + b"\n"
    if url.path == "/ha_status":
        return 200, "application/json", msgspec.json.encode(ha_status(server))
    if url.path == "/kv_events/status":
        pub = server.kv_publisher
        doc = pub.stats() if pub is not None else {"enabled": False}
        return 200, "application/json", msgspec.json.encode(doc)
    if url.path in ("/query_key", "/get_all_keys", "/get_all_segments") and server.ha:
        refusal = server.ha.refusal()  # a standby's (or a deposed leader's) state may lag
        if refusal is not None:
            return 503, "text/plain", refusal.encode() + b"\n"
    if url.path == "/query_key":
        query = parse_qs(url.query)
        key = query.get("key", [""])[0]
        try:  # ?tenant=NAME: that tenant's key (default: the default tenant's)
            params = rpc.KeyParams(key=key, tenant=query.get("tenant", [""])[0])
            info = commands.apply_call(server.state, "QueryKey", 0.0, params)
        except MooncakeError as e:
            body = msgspec.json.encode({"success": False, "error_code": int(e.code)})
            return 404, "application/json", body
        body = msgspec.json.encode({"success": True, "data": info})
        return 200, "application/json", body
    if url.path in ("/get_all_keys", "/get_all_segments"):
        return admin_listing(server.state, url.path, parse_qs(url.query))
    return 404, "text/plain", b"not found\n"


def status(server: AdminHost) -> dict[str, Any]:
    """The ``/status`` document (what ``mooncake top`` shows): totals, tiers, segments,
    clients and the monotonic counters, as JSON-ready builtins (docs/metrics.md)."""
    s = server.state
    segments = []
    clients: dict[str, dict[str, int]] = {}
    for info in s.all_segments():
        loc = info.segment.location or "cpu"
        tier = "gpu" if loc.startswith("cuda:") else "dram"
        segments.append(
            {
                "id": info.segment.id,
                "name": info.segment.name,
                "client_id": info.client_id,
                "tier": tier,
                "capacity": info.capacity,
                "used": info.used,
            }
        )
        c = clients.setdefault(info.client_id, {"segments": 0, "capacity": 0, "used": 0})
        c["segments"] += 1
        c["capacity"] += info.capacity
        c["used"] += info.used
    tiers: dict[str, dict[str, int]] = {t: dict(d) for t, d in s.segment_tiers().items()}
    for t, tc in s.tiers.items():
        tiers.setdefault(t, {}).update(hits=tc.hits, misses=tc.misses, evictions=tc.evictions)
    st = s.stats
    return {
        "time": time.time(),
        "ha": ha_status(server),
        "objects": s.object_count,
        "clients": s.client_count,
        "segments": s.segment_count,
        "capacity_bytes": s.capacity_bytes,
        "used_bytes": s.used_bytes,
        "tiers": tiers,
        "segment_list": segments,
        "client_list": [{"client_id": k, **v} for k, v in sorted(clients.items())],
        "tenants": tenant_status(s.tenants),
        "counters": {
            "gets": st.gets,
            "get_misses": st.get_misses,
            "puts_started": st.puts_started,
            "puts_ended": st.puts_ended,
            "evicted_objects": st.evicted_objects,
            "evicted_bytes": st.evicted_bytes,
            "removes": st.removes,
            "lease_refusals": st.lease_refusals,
            "clients_expired": st.clients_expired,
        },
    }


def ha_status(server: AdminHost) -> dict[str, Any]:
    """Role, term/lease, applied seq, log lag, last snapshot (a master without HA leads)."""
    if server.ha_node is not None:
        return server.ha_node.status()
    return {
        "role": "leader",
        "enabled": False,
        "last_snapshot_seq": server.last_snapshot_seq,
    }


async def serve_http_connection(server: AdminHost, sock: socket.socket, slot: _accept.Slot) -> None:
    """One admin HTTP connection (keep-alive; at most ``HTTP_MAX_CONNECTIONS`` live, the
    longest-idle giving way to a new one at the cap; heads bounded by h11; each request,
    the first from accept, must be complete within ``HTTP_IDLE_S``)."""
    stream = await anyio.abc.SocketStream.from_socket(sock)
    async with stream:
        await _serve_http(server, stream, slot)


async def _serve_http(server: AdminHost, stream: anyio.abc.ByteStream, slot: _accept.Slot) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HTTP_MAX_HEAD)
    try:
        while True:
            request: h11.Request | None = None
            slot.rest()
            with anyio.move_on_after(HTTP_IDLE_S):  # whole request, body drained
                event = await _next_http_event(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                body = bytearray()  # only the drain routes take one (small JSON)
                while not isinstance(ev := await _next_http_event(conn, stream), h11.EndOfMessage):
                    if isinstance(ev, h11.Data) and len(body) <= drain_http.MAX_BODY:
                        body += ev.data
                request = event
            if request is None:
                return
            slot.busy()
            status, ctype, out = http_response(
                server,
                request.method.decode("ascii", "replace"),
                request.target.decode("ascii", "replace"),
                bytes(body),
            )
            headers = [("content-type", ctype), ("content-length", str(len(out)))]
            head = h11.Response(
                status_code=status, headers=headers, reason=_REASONS.get(status, b"")
            )
            data = conn.send(head) or b""
            if request.method != b"HEAD":
                data += conn.send(h11.Data(data=out)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
            await stream.send(data)
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (h11.RemoteProtocolError, h11.LocalProtocolError):
        return
    except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError):
        return


async def _next_http_event(conn: h11.Connection, stream: anyio.abc.ByteStream) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive(65536)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            data = b""
        conn.receive_data(data)
