"""Tenant scoping of the master's RPC handlers (sans-I/O).

A call's tenant travels in its params (``tenant``, omitted for the default tenant, so a default
client's frames are what they always were) and therefore in the replicated log's command too:
a standby applies the very same scoping. :func:`wrap` wraps the handlers of
:data:`TENANT_SCOPED` methods so that, for a named tenant, keys in the params become internal
keys (:func:`mooncake._core.master.tenants.internal_key`) before the state sees them, and keys
in results and error messages become the caller's keys again. Listing calls (``GetAllKeys``,
``GetReplicaListByRegex``, ``RemoveByRegex``, ``RemoveAll``) see only the caller's tenant; the
default tenant's see only default keys. A default-tenant key beginning with NUL is refused
(``INVALID_KEY``): it could name a tenant's object. Which methods are scoped, and how, is each
method's ``scope`` in :data:`~mooncake._core.methods.METHODS`.

Tier and task calls (``DemoteEnd``, ``PromoteStart``, ``PutLocal``, ``EvictDiskReplica``,
``TaskStart``, ...) are not scoped: they name the internal keys the master itself handed to the
segment or SSD owner (``FetchTierTasks``, ``FetchTasks``), and are checked against that owner.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import msgspec

from mooncake._core.master import MasterState
from mooncake._core.master.config import _compile
from mooncake._core.master.tenants import (
    PREFIX,
    check_default_key,
    check_tenant,
    internal_key,
    tenant_keys,
    user_key,
)
from mooncake._core.methods import METHODS, TENANT_SCOPED, Handler, ScanHandler
from mooncake._core.rpc_types import KeysPage
from mooncake.errors import MooncakeError

__all__ = ["KEYS_METHODS", "KEY_METHODS", "TENANT_SCOPED", "scan_keys", "tenant", "wrap"]

#: methods whose ``key`` is the caller's (views of :data:`~mooncake._core.methods.METHODS`:
#: each method's ``scope``)
KEY_METHODS = frozenset(n for n, s in METHODS.items() if s.scope == "key")
#: methods whose ``keys`` are the caller's
KEYS_METHODS = frozenset(n for n, s in METHODS.items() if s.scope == "keys")
#: methods that list or match keys: they see only the caller's tenant's
_LISTING = frozenset(n for n, s in METHODS.items() if s.scope == "listing")


@lru_cache(maxsize=1024)
def tenant(name: str) -> str:
    """A params' ``tenant`` checked (cached: names repeat)."""
    return check_tenant(name)


def scan_keys(state: MasterState, tenant_name: str) -> list[str]:
    """The readable keys a regex of ``tenant_name`` is matched against, as that tenant names
    them (the default tenant: every default key; all keys while no tenant holds objects)."""
    t = tenant(tenant_name)
    keys = state.readable_keys()
    if not t and not state.tenants.objects:
        return keys
    return list(tenant_keys(t, keys))


_UNSAFE = re.compile(r"[\s\]]")


def _relabel(t: str, ikeys: list[str], e: MooncakeError) -> MooncakeError:
    """``e`` with the internal keys in its message shown as ``t``'s keys."""
    text = str(e)
    for ik in ikeys:
        uk = user_key(t, ik)
        text = text.replace(repr(ik), f"{uk!r} of tenant {t!r}").replace(ik, uk)
    text = text.replace("[miss ", f"[miss tenant={_UNSAFE.sub('_', t)} ", 1)
    new = type(e)(text)
    new.__dict__.update(e.__dict__)
    return new


def _wrap_key(fn: Handler) -> Handler:
    def handler(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant:
            check_default_key(p.key)
            return fn(s, p, now)
        t = tenant(p.tenant)
        ik = internal_key(t, p.key)
        try:
            result = fn(s, msgspec.structs.replace(p, key=ik), now)
        except MooncakeError as e:
            raise _relabel(t, [ik], e) from None
        if hasattr(result, "key") and isinstance(result.key, str):  # ObjectInfo
            result = msgspec.structs.replace(result, key=user_key(t, result.key))
        return result

    return handler


def _wrap_keys(fn: Handler) -> Handler:
    def handler(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant:
            for k in p.keys:
                if k[:1] == PREFIX:
                    check_default_key(k)
            return fn(s, p, now)
        t = tenant(p.tenant)
        iks = [internal_key(t, k) for k in p.keys]
        try:
            result = fn(s, msgspec.structs.replace(p, keys=iks), now)
        except MooncakeError as e:
            raise _relabel(t, iks, e) from None
        if result and isinstance(result, list) and isinstance(result[0], str):
            result = [user_key(t, k) for k in result]  # BatchReplicaClear: keys cleared
        return result

    return handler


def _scoped(s: MasterState, p: Any, keys: list[str]) -> list[str]:
    """Matched user keys of ``p``'s tenant as internal keys (default: never a tenant's)."""
    t = tenant(p.tenant)
    if not t:
        return [k for k in keys if k[:1] != PREFIX]
    return [internal_key(t, k) for k in keys]


def _unscope_map(p: Any, result: dict[str, Any]) -> dict[str, Any]:
    t = tenant(p.tenant)
    return {user_key(t, k): v for k, v in result.items()} if t else result


def _matching(s: MasterState, p: Any) -> list[str]:
    pattern = _compile(p.regex)
    return [k for k in scan_keys(s, p.tenant) if pattern.search(k)]


def _listing(method: str, fn: Handler) -> Handler:
    def get_all_keys(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, now)
        return s.all_keys_bounded(tenant(p.tenant))

    def keys_page(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, now)
        return KeysPage(*s.all_keys_page(p.cursor, p.limit, tenant(p.tenant)))

    def by_regex(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, now)
        return _unscope_map(p, s.replica_lists_of(_scoped(s, p, _matching(s, p)), now))

    def remove_by_regex(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, now)
        return s.remove_keys(_scoped(s, p, _matching(s, p)), p.force, now)

    def remove_all(s: MasterState, p: Any, now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, now)
        return s.remove_keys(_scoped(s, p, scan_keys(s, p.tenant)), p.force, now)

    return {
        "GetAllKeys": get_all_keys,
        "GetAllKeysPage": keys_page,
        "GetReplicaListByRegex": by_regex,
        "RemoveByRegex": remove_by_regex,
        "RemoveAll": remove_all,
    }[method]


def _wrap_scan(method: str, fn: ScanHandler) -> ScanHandler:
    def handler(s: MasterState, p: Any, keys: list[str], now: float) -> Any:
        if not p.tenant and not s.tenants.objects:
            return fn(s, p, keys, now)
        result = fn(s, p, _scoped(s, p, keys), now)
        return _unscope_map(p, result) if isinstance(result, dict) else result

    return handler


def wrap(handlers: dict[str, Handler], scans: dict[str, ScanHandler]) -> None:
    """Wrap, in place, the handlers of :data:`TENANT_SCOPED` methods and the regex scan
    handlers (``ScanApply``: their keys are the caller's, matched by :func:`scan_keys`)."""
    for name, fn in list(handlers.items()):
        if name in KEY_METHODS:
            handlers[name] = _wrap_key(fn)
        elif name in KEYS_METHODS:
            handlers[name] = _wrap_keys(fn)
        elif name in _LISTING:
            handlers[name] = _listing(name, fn)
    for name, sfn in list(scans.items()):
        scans[name] = _wrap_scan(name, sfn)
