"""Tenants inside the master: ``(tenant, key)`` identity in one table, and per-tenant quotas.

Identity
--------
The default tenant (``""``; ``"default"`` on the API) keeps every key as it is, so a store
without tenants is byte for byte what it was. A named tenant ``t``'s key ``k`` lives in the
master's one object table as the *internal key* ``"\\0" t "\\0" k``. No default-tenant key may
begin with NUL (the master refuses such a key with ``INVALID_KEY``), so an internal key can never
be a published key, and a tenant name holds no NUL, so ``t`` and ``k`` are recovered exactly.
Everything keyed by the internal key (leases, pins, eviction, tiers, the miss ledger, the HA
log) is therefore per tenant without knowing it; what lists keys (``GetAllKeys``, the regex
methods, ``RemoveAll``) filters by tenant (:mod:`mooncake._core.tenantscope`).

Tenant names: 1 to :data:`MAX_TENANT_LENGTH` characters, printable (no control characters, no
DEL), not beginning with ``_`` (upstream's reserved prefix); ``"default"`` and ``""`` name the
default tenant.

Quotas
------
:class:`TenantLedger` (the state's ``tenants``) counts, per named tenant, its objects and their
*logical bytes*: the size of an object's readable version plus the size of the version being
written into it, if any (an upsert in flight holds both until its End). Replicas are not
multiplied in: a quota bounds what a tenant stores, not how the cluster chooses to replicate
it. A tenant's quota is ``(bytes, objects)``, 0 meaning unlimited for that dimension; a tenant
without a quota is unlimited.

Strict admission: the check runs at the start of every write (PutStart, UpsertStart and their
batch forms), before anything is evicted or allocated, against what the tenant holds plus what
the same command has already admitted. A write that does not fit is refused with
``TENANT_QUOTA_EXCEEDED`` (-1700), so no interleaving of writers ever takes a tenant over its
quota, and eviction never runs on behalf of a write its tenant has no room for. Refunds are
exact: the ledger is recomputed from each touched object's versions at the end of every command
(the master settles between commands), so a remove, revoke, eviction, expiry, client loss or
replacement gives back exactly what the object was charged. ``check`` in the tests recomputes
the whole ledger from the objects.

Lowering a quota under a tenant's usage refuses its new writes until it is under again; nothing
is evicted for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mooncake.errors import InvalidArgumentError, InvalidKeyError, TenantQuotaExceededError

__all__ = [
    "DEFAULT",
    "MAX_TENANT_LENGTH",
    "PREFIX",
    "TenantLedger",
    "api_name",
    "check_default_key",
    "check_tenant",
    "internal_key",
    "parse_quota",
    "tenant_of",
    "user_key",
]

DEFAULT = ""
"""The default tenant, as the state names it (``"default"`` on the API)."""
PREFIX = "\x00"
"""The first character of every named tenant's internal key (never of a published key)."""
MAX_TENANT_LENGTH = 256


def check_tenant(name: str) -> str:
    """The tenant ``name`` as the master keys it (``""`` for the default tenant); raises
    :class:`~mooncake.errors.InvalidArgumentError` naming what is wrong with it."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"tenant id must be a str, got {type(name).__name__}")
    if name in ("", "default"):
        return DEFAULT
    if len(name) > MAX_TENANT_LENGTH:
        raise InvalidArgumentError(
            f"tenant id of {len(name)} characters exceeds {MAX_TENANT_LENGTH}"
        )
    if name[0] == "_":
        raise InvalidArgumentError(f"tenant id {name!r} must not begin with '_' (reserved)")
    for c in name:
        if c < " " or c == "\x7f":
            raise InvalidArgumentError(f"tenant id {name!r} holds the control character {c!r}")
    return name


def api_name(tenant: str) -> str:
    """The tenant as the API, metrics and logs name it (``"default"`` for ``""``)."""
    return tenant or "default"


def internal_key(tenant: str, key: str) -> str:
    """The table's key of ``key`` of ``tenant`` (a checked name, see :func:`check_tenant`)."""
    return f"{PREFIX}{tenant}{PREFIX}{key}" if tenant else key


def check_default_key(key: str) -> None:
    """Refuse a default-tenant key that begins with NUL (it could name a tenant's object)."""
    if key[:1] == PREFIX:
        raise InvalidKeyError(
            f"key {key!r} begins with NUL: such keys are reserved for the master's tenants"
        )


def tenant_of(ikey: str) -> str:
    """The tenant of internal key ``ikey`` (``""``: the default tenant)."""
    if ikey[:1] != PREFIX:
        return DEFAULT
    end = ikey.find(PREFIX, 1)
    return ikey[1:end] if end > 0 else DEFAULT


def user_key(tenant: str, ikey: str) -> str:
    """``ikey`` without the internal prefix of ``tenant``."""
    return ikey[len(tenant) + 2 :] if tenant else ikey


def tenant_keys(tenant: str, ikeys: Iterable[str]) -> Iterator[str]:
    """The user keys of ``tenant`` among ``ikeys``, in order."""
    if not tenant:
        return (k for k in ikeys if k[:1] != PREFIX)
    head = f"{PREFIX}{tenant}{PREFIX}"
    n = len(head)
    return (k[n:] for k in ikeys if k.startswith(head))


_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def parse_quota(text: str) -> int:
    """A byte count: an integer with an optional ``B``/``KB``/``MB``/``GB``/``TB`` unit
    (binary multiples, as upstream's quota policy file); ``InvalidArgumentError`` otherwise."""
    t = str(text).strip().upper().replace(" ", "")
    num = t.rstrip("KMGTB")
    unit = t[len(num) :]
    if not num.isdigit() or unit not in _UNITS:
        raise InvalidArgumentError(f"bad quota {text!r}: want an integer with B, KB, MB, GB or TB")
    return int(num) * _UNITS[unit]


class TenantLedger:
    """Per-tenant usage and quotas (see the module docstring).

    ``bytes``/``objects``: settled usage per named tenant (entries at 0 are dropped);
    ``quotas``: tenant -> ``(bytes, objects)``, 0 = unlimited. Deterministic: it is part of the
    replicated state (snapshots, digests).
    """

    __slots__ = ("_held_bytes", "_held_objects", "bytes", "objects", "quotas", "refusals")

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.objects: dict[str, int] = {}
        self.quotas: dict[str, tuple[int, int]] = {}
        self.refusals: dict[str, int] = {}
        """Writes refused for quota, per tenant."""
        # admitted by the command in progress, not yet settled into bytes/objects
        self._held_bytes: dict[str, int] = {}
        self._held_objects: dict[str, int] = {}

    def set_quota(self, tenant: str, quota_bytes: int, quota_objects: int) -> None:
        """Set (both 0: remove) ``tenant``'s quota; applies to writes from now on."""
        tenant = check_tenant(tenant)
        if not tenant:
            raise InvalidArgumentError("the default tenant has no quota (it is unlimited)")
        if quota_bytes < 0 or quota_objects < 0:
            raise InvalidArgumentError(
                f"quota of tenant {tenant!r} must be >= 0, got {quota_bytes} bytes and "
                f"{quota_objects} objects"
            )
        if quota_bytes == 0 and quota_objects == 0:
            self.quotas.pop(tenant, None)
        else:
            self.quotas[tenant] = (quota_bytes, quota_objects)

    def admit(self, tenant: str, size: int, new_object: bool) -> None:
        """A write of ``size`` bytes (``new_object``: a key the tenant does not hold yet) by
        ``tenant`` is admitted and held until the command settles, or refused with
        :class:`~mooncake.errors.TenantQuotaExceededError`."""
        quota = self.quotas.get(tenant)
        if quota is not None:
            qb, qo = quota
            used_b = self.bytes.get(tenant, 0) + self._held_bytes.get(tenant, 0)
            if qb and used_b + size > qb:
                self.refusals[tenant] = self.refusals.get(tenant, 0) + 1
                raise TenantQuotaExceededError(
                    f"tenant {tenant!r}: {size} more bytes would exceed its quota "
                    f"({used_b} of {qb} bytes used)"
                )
            used_o = self.objects.get(tenant, 0) + self._held_objects.get(tenant, 0)
            if new_object and qo and used_o + 1 > qo:
                self.refusals[tenant] = self.refusals.get(tenant, 0) + 1
                raise TenantQuotaExceededError(
                    f"tenant {tenant!r}: one more object would exceed its quota "
                    f"({used_o} of {qo} objects)"
                )
        self._held_bytes[tenant] = self._held_bytes.get(tenant, 0) + size
        if new_object:
            self._held_objects[tenant] = self._held_objects.get(tenant, 0) + 1

    def settle(self, deltas: list[tuple[str, int, int]]) -> None:
        """Apply the command's ``(tenant, bytes, objects)`` changes; drop what it held."""
        if not deltas and not self._held_bytes:
            return
        b, o = self.bytes, self.objects
        for tenant, db, do in deltas:
            nb = b.get(tenant, 0) + db
            no = o.get(tenant, 0) + do
            if nb:
                b[tenant] = nb
            else:
                b.pop(tenant, None)
            if no:
                o[tenant] = no
            else:
                o.pop(tenant, None)
        self._held_bytes.clear()
        self._held_objects.clear()

    def tenants(self) -> list[str]:
        """Every named tenant with objects or a quota, sorted."""
        return sorted(set(self.objects) | set(self.bytes) | set(self.quotas))

    def usage(self, tenant: str) -> dict[str, int]:
        """``tenant``'s usage and quota: bytes, objects, quota_bytes, quota_objects (0 =
        unlimited), refused (writes refused for quota)."""
        qb, qo = self.quotas.get(tenant, (0, 0))
        return {
            "bytes": self.bytes.get(tenant, 0),
            "objects": self.objects.get(tenant, 0),
            "quota_bytes": qb,
            "quota_objects": qo,
            "refused": self.refusals.get(tenant, 0),
        }

    def check(self, actual: dict[str, tuple[int, int]]) -> None:
        """Raise ``AssertionError`` unless the settled usage equals ``actual`` (tenant ->
        (bytes, objects), recomputed from the objects) and nothing held is left unsettled."""
        got = {t: (self.bytes.get(t, 0), self.objects.get(t, 0)) for t in self.tenants()}
        want = {t: v for t, v in actual.items() if v != (0, 0)}
        got = {t: v for t, v in got.items() if v != (0, 0)}
        assert got == want, f"tenant ledger {got} != objects {want}"
        assert not self._held_bytes and not self._held_objects, "held charges not settled"
