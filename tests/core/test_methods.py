"""The master's method table (mooncake._core.methods): one row per method, the rest views of it,
and the one apply path every caller takes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from mooncake._core import commands, methods, rpc, tenantscope
from mooncake._core.master import MasterState
from mooncake._core.methods import METHODS, Durability
from mooncake._store import keyscan
from mooncake._store.master import MasterServer, MasterServerConfig
from mooncake.errors import MooncakeError

#: The calls a client sends a request id with (the master deduplicates them by it): part of
#: the wire contract with deployed clients, so pinned here rather than read from the table.
DEDUP_CONTRACT = frozenset(
    {
        "MountSegment", "ReMountSegment", "UnmountSegment", "DrainSegment",
        "PutStart", "PutEnd", "PutRevoke", "UpsertStart", "UpsertEnd", "UpsertRevoke",
        "BatchPutStart", "BatchPutEnd", "BatchPutRevoke",
        "BatchUpsertStart", "BatchUpsertEnd", "BatchUpsertRevoke",
        "Remove", "BatchRemove", "RemoveByRegex", "RemoveAll", "BatchReplicaClear",
        "CreateCopyTask", "CreateMoveTask", "FetchTasks", "TaskStart", "TaskEnd", "TaskRevoke",
        "MountLocalDisk", "FetchTierTasks", "DemoteEnd", "DemoteRevoke",
        "PromoteStart", "PromoteEnd", "PromoteRevoke", "EvictDiskReplica", "PutLocal",
        "ReportCorruptReplica",
    }
)  # fmt: skip


def test_each_row_is_keyed_by_its_name_with_its_decoders() -> None:
    for name, spec in METHODS.items():
        assert spec.name == name
        assert spec.params_decoder.type is spec.params
        assert spec.result_decoder.type == spec.result


def test_the_durability_views_partition_the_table() -> None:
    views = [methods.MUTATING, methods.LEASE_ONLY, methods.PURE_READS, methods.AUTH_METHODS]
    assert set().union(*views) == set(METHODS)
    assert sum(map(len, views)) == len(METHODS)
    assert methods.MUTATING == DEDUP_CONTRACT
    for name, spec in METHODS.items():
        assert spec.dedup is (name in methods.MUTATING)
        assert (spec.handler is None) is spec.auth
        if not spec.auth:
            assert commands.durability(name) is spec.durability
    assert commands.durability("NoSuchMethod") is Durability.MUTATING  # internal commands


def test_the_other_modules_tables_are_the_same_views() -> None:
    assert rpc.METHODS is METHODS
    assert rpc.MUTATING is methods.MUTATING and rpc.AUTH_METHODS is methods.AUTH_METHODS
    assert commands.LEASE_ONLY is methods.LEASE_ONLY
    assert commands.PURE_READS is methods.PURE_READS
    assert keyscan.SCAN_METHODS is methods.SCAN_METHODS
    assert tenantscope.TENANT_SCOPED is methods.TENANT_SCOPED
    assert set(commands.HANDLERS) == set(METHODS) - methods.AUTH_METHODS
    assert (
        set(commands.SCAN_APPLY)
        == methods.SCAN_METHODS
        == {"GetReplicaListByRegex", "RemoveByRegex"}
    )
    assert tenantscope.KEY_METHODS | tenantscope.KEYS_METHODS <= tenantscope.TENANT_SCOPED


def test_a_scoped_method_has_the_field_its_scope_names() -> None:
    for spec in METHODS.values():
        fields = spec.params.__struct_fields__
        if spec.scope == "key":
            assert "key" in fields, spec.name
        elif spec.scope == "keys":
            assert "keys" in fields, spec.name
        if spec.scan is not None:
            assert spec.scope == "listing" and "regex" in fields


def test_a_row_without_a_handler_must_be_an_auth_method() -> None:
    with pytest.raises(AssertionError):
        methods._m("Nope", rpc.Empty, None, Durability.PURE_READ, None)
    with pytest.raises(AssertionError):
        methods._m("Nope", rpc.Empty, None, Durability.PURE_READ, lambda s, p, now: 0, auth=True)


@pytest.mark.parametrize(
    ("method", "params", "rid"),
    [
        ("ServiceReady", rpc.Empty(), None),
        ("GetReplicaList", rpc.KeyParams(key="k"), None),
        ("QueryKey", rpc.KeyParams(key="k"), None),
        ("PutRevoke", rpc.KeyClientParams(client_id="c", key="k"), rpc.make_rid(b"i" * 8, 1)),
    ],
)
def test_every_call_goes_through_apply_call_as_the_log_replay_does(
    monkeypatch: pytest.MonkeyPatch, method: str, params: Any, rid: bytes | None
) -> None:
    """Reads and unreplicated calls included: the server answers every call through
    ``commands.apply_call``, the function ``commands.apply`` applies a logged call with."""
    seen: list[tuple[str, bytes | None]] = []
    real = commands.apply_call

    def spy(state: MasterState, method: str, now: float, p: Any, *a: Any) -> Any:
        seen.append((method, a[1] if len(a) > 1 else None))
        return real(state, method, now, p, *a)

    monkeypatch.setattr(commands, "apply_call", spy)
    server = MasterServer(MasterServerConfig(), MasterState())
    dec = rpc.MessageDecoder()
    dec.feed(rpc.encode_request(5, method, params, rid=rid))
    (req,) = list(dec)
    assert isinstance(req, rpc.Request)
    server.handle_request(req, 1.0)
    assert seen[0] == (method, rid)  # (a deduplicated call then runs itself without its id)
    # a logged command of the same call takes the same function
    seen.clear()
    with contextlib.suppress(MooncakeError):  # (no such key / no such put: answered, not raised)
        commands.apply(MasterState(), commands.rpc_command(method, bytes(req.params), 1.0, rid))
    assert seen[0] == (method, rid)  # (a deduplicated call then runs itself without its id)
