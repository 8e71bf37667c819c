"""The master's commands (sans-I/O): one RPC call or one internal step, applied to a state.

Everything that changes a :class:`~mooncake._core.master.MasterState` goes through
:func:`apply`: the leader applies a command when it receives it, a standby when it reads it from
the replicated log, and the tests when they replay one. An RPC call takes one path wherever it
comes from: :func:`apply_call`, which :func:`apply` hands every ``rpc``/``scan`` command and
the leader's server every call it answers (decoded already; logged first when replicated). The state being deterministic (all
randomness from ``state.rng``, all time from ``command.now``), the same command sequence gives
the same state everywhere, allocators included.

A :class:`Command` is either an RPC call (``kind == "rpc"``: ``method`` and the msgpack
``params`` bytes the client sent) or an internal one:

* :func:`Sweep` ``(now)``: time-driven work (:meth:`MasterState.sweep`);
* :func:`CreditStall` ``(seconds, now)``: the master could not run for ``seconds``;
* :func:`ConnectionLost` ``(client_id, now)``: the client's heartbeat connection closed;
* :func:`ScanApply` ``(method, params, keys, now)``: a regex method applied to the keys the
  leader matched beforehand (off its loop), so replicas never run the pattern;
* :func:`SetTenantQuota` ``(tenant, bytes, objects, now)``: a tenant's quota changed;
* :func:`DrainStep` ``(segment, targets, limit, now)`` and :func:`Undrain` ``(segment, now)``:
  a master-run drain job's step and its cancellation (:mod:`mooncake._store.drain_jobs`);
* :func:`Promote` ``(now, seed, genesis)``: a leader took over: leases and client deadlines
  extended (:meth:`MasterState.promote`) and the rng re-seeded from ``seed`` (so the state's
  randomness is fixed by the log, whatever seed each process started with); the cluster's
  first leader (``genesis``) also draws the view id from it.

Classification (:func:`durability`, each method's row of
:data:`~mooncake._core.methods.METHODS`): a **mutating** call's reply is sent only after its
log entry is durable; a **lease-only** call (read leases, pings) is logged but its reply does
not wait for its own entry; a **pure read** changes nothing and is not logged.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from mooncake._core import rpc, tenantscope
from mooncake._core.dedup import StaleRequestError
from mooncake._core.master import MasterState
from mooncake._core.methods import (
    LEASE_ONLY,
    METHODS,
    MUTATING,
    PURE_READS,
    Durability,
    Handler,
    ScanHandler,
)
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError, NotSupportedError

__all__ = [
    "HANDLERS",
    "LEASE_ONLY",
    "PURE_READS",
    "SCAN_APPLY",
    "Command",
    "ConnectionLost",
    "CreditStall",
    "DrainStep",
    "Durability",
    "Promote",
    "ScanApply",
    "SetTenantQuota",
    "Sweep",
    "Undrain",
    "apply",
    "apply_call",
    "config_fingerprint",
    "decode_commands",
    "durability",
    "encode_commands",
    "rpc_command",
]


class Command(msgspec.Struct, array_like=True, frozen=True):
    """One entry of the replicated log (see the module docstring)."""

    kind: str
    """``"rpc"``, ``"sweep"``, ``"stall"``, ``"lost"``, ``"scan"``, ``"quota"``, ``"drain"``,
    ``"undrain"`` or ``"promote"``."""
    now: float
    method: str = ""
    params: bytes = b""
    rid: bytes | None = None
    """The client's request id (``None`` if it sent none): what a dedup ledger records."""
    keys: list[str] | None = None
    seconds: float = 0.0
    seed: int = 0
    genesis: bool = False
    """Promote only: the first leader of a cluster (the view id is drawn from ``seed`` too)."""
    config: str = ""
    """Promote only: :func:`config_fingerprint` of the leader's settings (replicas with other
    settings would diverge; a standby compares it with its own)."""


def rpc_command(method: str, params: bytes, now: float, rid: bytes | None = None) -> Command:
    return Command("rpc", now, method, bytes(params), rid)


def Sweep(now: float) -> Command:
    return Command("sweep", now)


def CreditStall(seconds: float, now: float) -> Command:
    return Command("stall", now, seconds=seconds)


def ConnectionLost(client_id: str, now: float) -> Command:
    """The last connection on which ``client_id`` sent heartbeats closed
    (:meth:`MasterState.connection_lost`)."""
    return Command("lost", now, method=client_id)


def ScanApply(
    method: str, params: bytes, keys: list[str], now: float, rid: bytes | None = None
) -> Command:
    return Command("scan", now, method, bytes(params), rid, keys=list(keys))


def SetTenantQuota(tenant: str, quota_bytes: int, quota_objects: int, now: float) -> Command:
    """Set ``tenant``'s quota (both 0: none), as ``PUT /api/v1/tenant_quotas`` asks."""
    return Command("quota", now, method=tenant, params=_enc.encode([quota_bytes, quota_objects]))


def DrainStep(segment: str, targets: list[str], limit: int, now: float) -> Command:
    """One step of a drain job on ``segment`` (:meth:`MasterState.drain_job_step`)."""
    return Command("drain", now, method=segment, params=_enc.encode([list(targets), limit]))


def Undrain(segment: str, now: float) -> Command:
    """A cancelled drain job: ``segment`` takes allocations again
    (:meth:`MasterState.undrain_segment`)."""
    return Command("undrain", now, method=segment)


def Promote(now: float, seed: int, *, genesis: bool = False, config: str = "") -> Command:
    return Command("promote", now, seed=seed, genesis=genesis, config=config)


def config_fingerprint(config: Any) -> str:
    """A digest of a master's state settings (a dataclass), ``seed`` left out (the log fixes
    the randomness): masters of one cluster must agree on it."""
    import dataclasses
    import hashlib

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields.pop("seed", None)
    return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def durability(method: str) -> Durability:
    """How a call of ``method`` is replicated (:data:`~mooncake._core.methods.METHODS`; a name
    not in the table counts as mutating)."""
    spec = METHODS.get(method)
    return spec.durability if spec is not None else Durability.MUTATING


#: RPC method -> handler(state, decoded params, now), tenant scoping applied: a view of
#: :data:`~mooncake._core.methods.METHODS` (every method but the auth ones)
HANDLERS: dict[str, Handler] = {n: s.handler for n, s in METHODS.items() if s.handler is not None}
#: regex methods applied to keys matched beforehand (off the loop): a view of the table's
#: ``scan`` handlers, tenant scoping applied
SCAN_APPLY: dict[str, ScanHandler] = {n: s.scan for n, s in METHODS.items() if s.scan is not None}
tenantscope.wrap(HANDLERS, SCAN_APPLY)  # keys scoped by the caller's tenant


def decode(method: str, params: bytes | msgspec.Raw) -> Any:
    """``params`` as ``method``'s params Struct (errors as :func:`rpc.decode_params`)."""
    spec = METHODS.get(method)
    if spec is None or spec.handler is None:
        raise NotSupportedError(f"unknown method {method!r}")
    try:
        return spec.params_decoder.decode(params)
    except msgspec.DecodeError as e:
        raise InvalidArgumentError(f"bad params for {method}: {e}") from None


def _apply_once(
    state: MasterState,
    method: str,
    now: float,
    params: Any,
    raw: bytes | msgspec.Raw,
    keys: list[str] | None,
    rid: bytes,
    unrecorded: bool,
) -> Any:
    """A mutating call with a request id: applied unless ``state.dedup`` has it (then nothing
    happens: the leader answered the retry from the ledger), its reply recorded -- the framed
    answer with id 0, so every replica's ledger holds the same bytes."""
    if not unrecorded:
        try:
            if state.dedup.lookup(rid) is not None:
                return None
        except StaleRequestError:
            return None
    try:
        result = apply_call(state, method, now, params, raw, None, keys)
    except MooncakeError as e:
        state.dedup.record(rid, rpc.encode_error(0, e))
        raise
    except Exception as e:
        state.dedup.record(
            rid, rpc.encode_error(0, ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
        )
        raise
    try:
        state.dedup.record(rid, rpc.encode_result(0, result))
    except InvalidArgumentError as e:  # too large for one frame: the leader answered that
        state.dedup.record(rid, rpc.encode_error(0, e))
    return result


def apply_call(
    state: MasterState,
    method: str,
    now: float,
    params: Any,
    raw: bytes | msgspec.Raw = b"",
    rid: bytes | None = None,
    keys: list[str] | None = None,
    unrecorded: bool = False,
) -> Any:
    """Apply one RPC call: what :func:`apply` does with an ``rpc`` or ``scan`` command, and
    what the leader calls with the call it is answering (building a :class:`Command` only
    when it logs one). Returns the RPC result or raises the RPC's error.

    ``params``: the decoded params (None: ``raw``, the msgpack params, is decoded); ``keys``:
    for a regex method, the keys its pattern matched (its scan handler runs on them). A
    mutating call with a request id ``rid`` is applied at most once per id and its reply
    recorded in ``state.dedup`` (:mod:`mooncake._core.dedup`); a repeated one returns
    ``None`` and changes nothing. ``unrecorded``: the caller has just looked the id up and
    found it new, so the ledger is not asked twice. The state settles after the call.
    """
    if rid is not None and method in MUTATING:
        return _apply_once(state, method, now, params, raw, keys, rid, unrecorded)
    try:
        if keys is None:
            if params is None:  # (decoded first: an unknown method is NOT_SUPPORTED)
                params = decode(method, raw)
            return HANDLERS[method](state, params, now)
        scan = SCAN_APPLY.get(method)
        if scan is None:
            raise NotSupportedError(f"{method!r} is not a key-scan method")
        if params is None:
            params = decode(method, raw)
        return scan(state, params, keys, now)
    finally:
        state.settle()


def apply(
    state: MasterState, command: Command, params: Any = None, *, unrecorded: bool = False
) -> Any:
    """Apply one command; returns the RPC result or raises the RPC's
    :class:`~mooncake.errors.MooncakeError` (internal commands return ``None``).

    ``params``: the already decoded params of an RPC/scan command (the leader decoded them to
    answer); ``None`` decodes ``command.params``. A mutating RPC/scan command with a request id
    is applied at most once per id and its reply recorded in ``state.dedup``
    (:mod:`mooncake._core.dedup`); a repeated one returns ``None`` and changes nothing.
    A :func:`DrainStep` returns its :class:`~mooncake._core.store_types.DrainStatus` (None:
    no such segment).
    ``unrecorded``: the caller has just looked the id up and found it new (the leader does
    before logging), so the ledger is not asked twice.
    """
    kind = command.kind
    if kind == "rpc" or kind == "scan":
        keys = None if kind == "rpc" else list(command.keys or ())
        return apply_call(
            state,
            command.method,
            command.now,
            params,
            command.params,
            command.rid,
            keys,
            unrecorded,
        )
    if kind == "sweep":
        state.sweep(command.now)
        return None
    if kind == "stall":
        state.credit_stall(command.seconds)
        return None
    if kind == "lost":
        state.connection_lost(command.method, command.now)
        return None
    if kind == "quota":
        qb, qo = msgspec.msgpack.decode(command.params, type=tuple[int, int])
        state.tenants.set_quota(command.method, qb, qo)
        return None
    if kind == "drain":
        targets, limit = msgspec.msgpack.decode(command.params, type=tuple[list[str], int])
        try:
            return state.drain_job_step(command.method, targets, limit, command.now)
        finally:
            state.settle()
    if kind == "undrain":
        state.undrain_segment(command.method)
        return None
    if kind == "promote":
        state.rng.seed(command.seed)
        if command.genesis:
            state.view_version_id = state.rng.getrandbits(63)
        state.promote(command.now)
        return None
    raise InvalidArgumentError(f"unknown command kind {kind!r}")


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[Command])


def encode_commands(commands: list[Command]) -> bytes:
    """A batch of commands as one log entry's bytes."""
    return _enc.encode(commands)


def decode_commands(data: bytes) -> list[Command]:
    try:
        return _dec.decode(data)
    except msgspec.DecodeError as e:
        raise InvalidArgumentError(f"bad log entry: {e}") from None


def digest(state: MasterState) -> str:
    """A canonical fingerprint of everything in ``state`` (tests: replicas must agree).

    Walks the whole object graph: dicts and sequences in their order (order is state: it
    decides later iteration), sets sorted, objects with a ``__canon__()`` method by what it
    returns (a container of plain values, e.g. ``IntMap`` by its sorted items), other objects
    by their fields, shared objects by first visit. Slow; for tests and checks, not the hot path.
    """
    import hashlib
    import random as _random

    memo: dict[int, int] = {}
    alive: list[Any] = []

    def canon(o: Any) -> Any:
        if o is None or isinstance(o, bool | int | float | str | bytes):
            return o
        if isinstance(o, enum.Enum):
            return (type(o).__name__, o.value)
        oid = id(o)
        if oid in memo:
            return ("ref", memo[oid])
        memo[oid] = len(memo)
        alive.append(o)  # ids are only unique among live objects (views are made on the fly)
        if isinstance(o, _random.Random):
            return ("rng", o.getstate())
        hook = getattr(type(o), "__canon__", None)
        if hook is not None:  # a compact structure: its logical content, not its layout
            return (type(o).__name__, canon(hook(o)))
        if isinstance(o, dict):
            return ("dict", [(canon(k), canon(v)) for k, v in o.items()])
        if isinstance(o, set | frozenset):
            return ("set", sorted(repr(canon(x)) for x in o))
        if isinstance(o, list | tuple) or type(o).__name__ == "deque":
            return ("seq", [canon(x) for x in o])
        if isinstance(o, msgspec.Struct):
            return (type(o).__name__, [canon(getattr(o, f)) for f in o.__struct_fields__])
        fields: dict[str, Any] = {}
        for cls in type(o).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(o, name):
                    fields[name] = getattr(o, name)
        fields.update(getattr(o, "__dict__", {}))
        if not fields and callable(o):
            return ("fn", getattr(o, "__qualname__", type(o).__name__))
        return (type(o).__name__, [(k, canon(v)) for k, v in sorted(fields.items())])

    fields = {k: v for k, v in state.__dict__.items() if k != "config"}  # settings, not state
    return hashlib.sha256(repr(canon(fields)).encode()).hexdigest()
