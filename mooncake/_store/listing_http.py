"""The master's admin HTTP listings, ``/get_all_keys`` and ``/get_all_segments``.

Without a query they answer as the published master does: a JSON array of every readable key
(of every segment). With ``?limit=N`` (and ``&cursor=C`` from the previous page; 0 first)
they answer one page, ``{"keys": [...], "next": C}`` (``"segments"`` for segments; ``next`` -1
after the last page), by the rules of :mod:`mooncake._core.paging`. A bad ``limit`` or
``cursor`` is ``400`` naming it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mooncake._core.master import MasterState
from mooncake._core.master.tenants import check_tenant, tenant_keys
from mooncake.errors import MooncakeError

Answer = tuple[int, str, bytes]


def _int(query: dict[str, list[str]], name: str, default: int) -> int:
    raw = query.get(name, [str(default)])[0]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def admin_listing(state: MasterState, path: str, query: dict[str, list[str]]) -> Answer:
    """The answer to ``path`` (one of the two listings) with the parsed ``query``."""
    keys = path == "/get_all_keys"
    try:
        # ?tenant=NAME: that tenant's keys as it names them; none: the default tenant's
        tenant = check_tenant(query.get("tenant", [""])[0]) if keys else None
    except MooncakeError as e:
        return 400, "text/plain", f"{path}: {e}\n".encode()
    if tenant is not None and not tenant and not state.tenants.objects:
        tenant = None  # no named tenant holds objects: every key is the default tenant's
    if "limit" not in query and "cursor" not in query:
        body: Any
        if keys:
            body = (
                state.all_keys() if tenant is None else list(tenant_keys(tenant, state.all_keys()))
            )
        else:
            body = state.all_segments()
        return 200, "application/json", msgspec.json.encode(body)
    try:
        limit = _int(query, "limit", 10_000)
        cursor = _int(query, "cursor", 0)
        if keys:
            items: Any
            items, nxt = state.all_keys_page(cursor, limit, tenant)
            body = {"keys": items, "next": nxt}
        else:
            items, nxt = state.all_segments_page(cursor, limit)
            body = {"segments": items, "next": nxt}
    except (ValueError, MooncakeError) as e:
        return 400, "text/plain", f"{path}: {e}\n".encode()
    return 200, "application/json", msgspec.json.encode(body)


__all__ = ["admin_listing"]
