"""Tenants: (tenant, key) identity, strict per-tenant quotas, binding under the cluster secret.

State-level rules and a hypothesis property (the ledger always equals what the objects hold,
never over a quota); then real processes: a master and one client process per tenant writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from mooncake._core import auth, commands, rpc
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import Segment
from mooncake.errors import (
    IllegalClientError,
    InvalidKeyError,
    MooncakeError,
    ObjectNotFoundError,
    TenantQuotaExceededError,
)
from tests.conftest import ROOT
from tests.services import free_port

_enc = msgspec.msgpack.Encoder()


def call(s: MasterState, method: str, params: msgspec.Struct, now: float = 1.0) -> Any:
    return commands.apply(s, commands.rpc_command(method, _enc.encode(params), now))


def state(quotas: str = "", size: int = 1 << 20, **kw: Any) -> MasterState:
    s = MasterState(MasterConfig(tenant_quotas=quotas, seed=7, **kw))
    seg = Segment(id="s0", name="h:1", base=1 << 30, size=size)
    call(s, "MountSegment", rpc.MountSegmentParams(client_id="c", segment=seg))
    return s


def put(s: MasterState, tenant: str, key: str, size: int, now: float = 1.0) -> None:
    call(s, "PutStart", rpc.PutStartParams(client_id="c", key=key, size=size, tenant=tenant), now)
    call(s, "PutEnd", rpc.KeyClientParams(client_id="c", key=key, tenant=tenant), now)


def test_same_key_is_two_objects_and_listing_stays_in_the_tenant() -> None:
    s = state()
    put(s, "", "k", 100)
    put(s, "a", "k", 200)
    put(s, "b", "k", 300)
    sizes = {t: call(s, "QueryKey", rpc.KeyParams(key="k", tenant=t)).size for t in "ab"}
    assert sizes == {"a": 200, "b": 300}
    assert call(s, "QueryKey", rpc.KeyParams(key="k")).size == 100
    for t in ("", "a", "b"):
        assert call(s, "GetAllKeys", rpc.Empty(tenant=t)) == ["k"]
        got = call(s, "GetReplicaListByRegex", rpc.RegexParams(regex=".*", tenant=t))
        assert list(got) == ["k"]
    # b removes everything it may: a's and the default's objects stay
    assert call(s, "RemoveAll", rpc.ForceParams(force=True, tenant="b")) == 1
    assert call(s, "RemoveByRegex", rpc.RegexParams(regex="k", tenant="b")) == 0
    with pytest.raises(ObjectNotFoundError, match="of tenant 'b'"):
        call(s, "Remove", rpc.RemoveParams(key="k", tenant="b"))
    assert call(s, "GetAllKeys", rpc.Empty(tenant="a")) == ["k"]
    assert call(s, "BatchExistKey", rpc.KeysParams(keys=["k"], tenant="a")) == [1]
    assert call(s, "RemoveAll", rpc.ForceParams(force=True)) == 1  # the default's one
    assert call(s, "GetAllKeys", rpc.Empty(tenant="a")) == ["k"]
    s.check_invariants()


def test_default_keys_beginning_with_nul_are_refused() -> None:
    s = state()
    put(s, "a", "k", 10)
    with pytest.raises(InvalidKeyError, match="reserved"):
        call(s, "GetReplicaList", rpc.KeyParams(key="\x00a\x00k"))
    with pytest.raises(InvalidKeyError):
        call(s, "BatchRemove", rpc.BatchRemoveParams(keys=["x", "\x00a\x00k"]))
    assert call(s, "GetAllKeys", rpc.Empty()) == []


def test_miss_names_the_tenant() -> None:
    s = state()
    with pytest.raises(ObjectNotFoundError) as e:
        call(s, "GetReplicaList", rpc.KeyParams(key="nope", tenant="t1"))
    assert "'nope' of tenant 't1'" in str(e.value) and "tenant=t1" in str(e.value)
    assert "\x00" not in str(e.value)


def test_quota_refuses_before_evicting_and_refunds_exactly() -> None:
    s = state("a=1000/3", size=4096)
    put(s, "", "d0", 3000)  # the default tenant fills most of the segment
    put(s, "a", "x", 600)
    with pytest.raises(TenantQuotaExceededError, match="1000 bytes"):
        put(s, "a", "y", 500)  # over the watermark if admitted: d0 would have been evicted
    assert call(s, "GetAllKeys", rpc.Empty()) == ["d0"]  # nothing evicted for the refused write
    put(s, "a", "y", 400)
    with pytest.raises(TenantQuotaExceededError):
        put(s, "a", "z", 1)  # bytes full
    call(s, "Remove", rpc.RemoveParams(key="x", tenant="a"))
    assert s.tenants.usage("a")["bytes"] == 400
    put(s, "a", "z", 1)
    put(s, "a", "w", 1)
    with pytest.raises(TenantQuotaExceededError, match="objects"):
        put(s, "a", "v", 1)  # 3 objects
    s.check_invariants()
    assert s.tenants.usage("a") == {
        "bytes": 402,
        "objects": 3,
        "quota_bytes": 1000,
        "quota_objects": 3,
        "refused": 3,
    }


def test_quota_change_is_a_replicated_command_and_survives_a_snapshot() -> None:
    s = state()
    commands.apply(s, commands.SetTenantQuota("a", 10, 0, 1.0))
    with pytest.raises(TenantQuotaExceededError):
        put(s, "a", "k", 11)
    put(s, "a", "k", 10)
    r = MasterState.restore(s.snapshot())
    r.check_invariants()
    assert r.tenants.usage("a")["bytes"] == 10 and r.tenants.quotas == {"a": (10, 0)}
    assert commands.digest(r) == commands.digest(s)


# -- the property: the ledger is what the objects hold, and never over a quota -----------

_OPS = hst.lists(
    hst.tuples(
        hst.sampled_from(["put", "upsert", "revoke", "remove", "batch", "expire", "sweep"]),
        hst.sampled_from(["", "a", "b"]),
        hst.integers(0, 5),  # key
        hst.integers(1, 700),  # size
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OPS)
def test_ledger_matches_objects_and_quota_holds(ops: list[tuple[str, str, int, int]]) -> None:
    s = state(
        "a=2000/4,b=900",
        size=8192,
        client_ttl=5.0,
        put_start_discard_timeout=1.0,
        put_start_release_timeout=2.0,
        eviction_high_watermark_ratio=0.7,
    )
    now = 1.0
    clients = ["c"]
    for i, (op, t, k, size) in enumerate(ops):
        now += 0.5
        key = f"k{k}"
        try:
            if op in ("put", "upsert"):
                m = "PutStart" if op == "put" else "UpsertStart"
                call(s, m, rpc.PutStartParams(client_id="c", key=key, size=size, tenant=t), now)
                if size % 3:  # else left in flight (a zombie later)
                    end = "PutEnd" if op == "put" else "UpsertEnd"
                    call(s, end, rpc.KeyClientParams(client_id="c", key=key, tenant=t), now)
            elif op == "revoke":
                call(s, "PutRevoke", rpc.KeyClientParams(client_id="c", key=key, tenant=t), now)
            elif op == "remove":
                call(s, "Remove", rpc.RemoveParams(key=key, force=True, tenant=t), now)
            elif op == "batch":
                keys = [f"b{i}-{j}" for j in range(3)]
                call(
                    s,
                    "BatchPutStart",
                    rpc.BatchPutStartParams(client_id="c", keys=keys, sizes=[size] * 3, tenant=t),
                    now,
                )
                call(
                    s,
                    "BatchPutEnd",
                    rpc.BatchKeyClientParams(client_id="c", keys=keys, tenant=t),
                    now,
                )
            elif op == "expire":  # a second client's segment comes and goes with its objects
                cid = f"e{i}"
                seg = Segment(id=f"s{cid}", name=f"h:{cid}", base=(i + 2) << 32, size=4096)
                call(s, "MountSegment", rpc.MountSegmentParams(client_id=cid, segment=seg), now)
                clients.append(cid)
                call(
                    s,
                    "PutStart",
                    rpc.PutStartParams(client_id=cid, key=key, size=size, tenant=t),
                    now,
                )
                call(s, "PutEnd", rpc.KeyClientParams(client_id=cid, key=key, tenant=t), now)
            else:
                commands.apply(s, commands.Sweep(now))
        except TenantQuotaExceededError:
            pass
        except MooncakeError:
            pass  # every other refusal of a rule (not found, not ready, no space, ...)
        call(s, "Ping", rpc.ClientParams(client_id="c"), now)
        s.check_invariants()
        for name, (qb, qo) in s.tenants.quotas.items():
            u = s.tenants.usage(name)
            assert (not qb or u["bytes"] <= qb) and (not qo or u["objects"] <= qo)
    # everything goes at the end: every charge is refunded
    commands.apply(s, commands.Sweep(now + 1000))
    for t in ("", "a", "b"):
        call(s, "RemoveAll", rpc.ForceParams(force=True, tenant=t), now + 1000)
    commands.apply(s, commands.Sweep(now + 2000))
    s.check_invariants()
    assert s.tenants.bytes == {} and s.tenants.objects == {}


# -- real processes --------------------------------------------------------------------


@pytest.fixture
def master_proc(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    extra: list[str] = getattr(request, "param", [])
    rpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MOONCAKE_CLUSTER_SECRET", None)
    env.pop("MOONCAKE_TENANT_AUTH_SECRET", None)
    if "--tenant-secret" in extra:  # the master's alone: clients get tenant keys
        extra = [a for a in extra if a != "--tenant-secret"]
        env["MOONCAKE_TENANT_AUTH_SECRET"] = "tsec"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake._cli.master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={http_port}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert f"rpc=127.0.0.1:{rpc_port}" in line, line + proc.stderr.read().decode()
        henv = {k: v for k, v in env.items() if k != "MOONCAKE_TENANT_AUTH_SECRET"}
        holder = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.tenant_client",
                f"127.0.0.1:{rpc_port}",
                "default",
                "hold",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**henv, "TENANT_CLIENT_SEGMENT": str(64 << 20), "MC_LOG_LEVEL": "ERROR"},
            cwd=ROOT,
        )
        try:
            assert holder.stdout is not None and b"ready" in holder.stdout.readline()
            yield f"127.0.0.1:{rpc_port}", f"http://127.0.0.1:{http_port}"
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=60)
            if holder.stdout:
                holder.stdout.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def client(master: str, tenant: str, *args: str, env: dict[str, str] | None = None) -> Any:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR", **(env or {})}
    e["TENANT_CLIENT_SEGMENT"] = "0"  # what it stores lives in the holder's segment
    for k in ("MOONCAKE_CLUSTER_SECRET", "MOONCAKE_TENANT_AUTH_SECRET"):
        if not env or k not in env:
            e.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.tenant_client", master, tenant, *args],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=300,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("master_proc", [["--tenant_quota=qa=20000/1000"]], indirect=True)
def test_eight_writer_processes_never_exceed_the_quota(master_proc: tuple[str, str]) -> None:
    master, http = master_proc
    size = 1000
    with ThreadPoolExecutor(8) as pool:
        futs = [
            pool.submit(client, master, "qa", "write", f"w{i}-", "10", str(size)) for i in range(8)
        ]
        peak = 0
        while not all(f.done() for f in futs):
            doc = httpx.get(f"{http}/api/v1/tenant_quotas?tenant_id=qa", timeout=10).json()
            peak = max(peak, doc["data"]["charged_bytes"])
        results = [f.result() for f in futs]
    stored = [k for r in results for k in r["stored"]]
    refused = [c for r in results for c in r["codes"] if c != 0]
    assert len(stored) == 20 and all(c == -1700 for c in refused) and len(refused) >= 1
    doc = httpx.get(f"{http}/api/v1/tenant_quotas?tenant_id=qa", timeout=10).json()["data"]
    assert doc["charged_bytes"] == 20 * size == doc["quota_bytes"] and peak <= 20000
    assert doc["objects"] == 20 and not doc["over_quota"]
    keys = httpx.get(f"{http}/get_all_keys?tenant=qa", timeout=10).json()
    assert sorted(keys) == sorted(stored)
    assert httpx.get(f"{http}/get_all_keys", timeout=10).json() == []  # not the default's
    # exact refund on remove, seen by another writer process
    assert client(master, "qa", "remove", *stored[:5])["codes"] == [0] * 5
    doc = httpx.get(f"{http}/api/v1/tenant_quotas?tenant_id=qa", timeout=10).json()["data"]
    assert doc["charged_bytes"] == 15 * size and doc["objects"] == 15
    # the runtime admin call raises the quota; a writer gets the room at once
    r = httpx.put(
        f"{http}/api/v1/tenant_quotas?tenant_id=qa&quota_bytes=30000&quota_objects=30", timeout=10
    )
    assert r.status_code == 200 and r.json()["data"]["quota_bytes"] == 30000
    assert len(client(master, "qa", "write", "more-", "20", str(size))["stored"]) == 15


def test_tenants_cannot_see_each_others_objects_across_processes(
    master_proc: tuple[str, str],
) -> None:
    master, http = master_proc
    assert client(master, "ta", "write", "k", "2", "8")["stored"] == ["k0", "k1"]
    assert client(master, "tb", "write", "k", "1", "8")["stored"] == ["k0"]
    a = client(master, "ta", "read", "k0", "k1")
    b = client(master, "tb", "read", "k0", "k1")
    d = client(master, "default", "read", "k0")
    assert a["values"] == {"k0": "tatatata", "k1": "tatatata"}
    assert b["values"] == {"k0": "tbtbtbtb", "k1": None} and b["exist"] == [1, 0]
    assert d["values"] == {"k0": None}
    assert client(master, "tb", "remove", "k1")["codes"] == [-704]
    assert client(master, "tb", "remove_all") == {"removed": 1, "by_regex": 0}
    assert client(master, "ta", "read", "k0")["values"] == {"k0": "tatatata"}
    q = httpx.get(f"{http}/query_key?key=k0&tenant=ta", timeout=10).json()
    assert q["success"] and q["data"]["key"] == "k0" and q["data"]["size"] == 8
    assert httpx.get(f"{http}/query_key?key=k0", timeout=10).status_code == 404
    metrics = httpx.get(f"{http}/metrics", timeout=10).text
    assert 'master_tenant_objects{tenant="ta"} 2.0' in metrics
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    top = [sys.executable, "-m", "mooncake", "top", http, "--once", "--interval", "0"]
    doc = json.loads(
        subprocess.run(
            [*top, "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
            check=True,
        ).stdout
    )
    assert [(t["tenant_id"], t["objects"]) for t in doc["tenants"]] == [("ta", 2)]
    shown = subprocess.run(
        top, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=True
    ).stdout
    assert "tenants" in shown and "ta" in shown


@pytest.mark.parametrize("master_proc", [["--tenant-secret"]], indirect=True)
def test_a_tenant_key_binds_the_client_to_its_tenant(master_proc: tuple[str, str]) -> None:
    master, _ = master_proc
    key = auth.tenant_key(b"tsec", "ta").decode()
    env = {"MOONCAKE_TENANT_SECRET": key}
    assert client(master, "ta", "write", "k", "1", "4", env=env)["stored"] == ["k0"]
    assert client(master, "ta", "read", "k0", env=env)["values"] == {"k0": "tata"}
    # ta's key does not authenticate tb: setup fails
    assert "setup" in client(master, "tb", "write", "k", "1", "4", env=env)
    # no key: naming a tenant is refused (-601), nothing is stored; the default tenant works
    got = client(master, "tb", "write", "k", "1", "4", env={})
    assert got.get("stored", []) == [] and got.get("codes", [-601]) == [-601], got
    assert client(master, "default", "write", "k", "1", "4", env={})["stored"] == ["k0"]
    assert client(master, "ta", "read", "k0", env=env)["values"] == {"k0": "tata"}


def test_bound_connection_refuses_another_tenants_call() -> None:
    from mooncake._store.tenancy import TenantBindings

    b = TenantBindings(b"")
    b.secret = None  # tenant keys from the cluster secret: binding voluntary
    sock: Any = object()
    k = b.hello_key(b"sec", sock, "ta")
    assert k == auth.tenant_key(b"sec", "ta") != auth.tenant_key(b"sec", "tb")
    key, t = b.prove_key(b"sec", sock)
    assert (key, t) == (k, "ta")
    b.bind(sock, t)
    b.check(sock, "Ping", rpc.ClientParams(client_id="c"))  # not scoped: allowed
    b.check(sock, "GetReplicaList", rpc.KeyParams(key="x", tenant="ta"))
    with pytest.raises(IllegalClientError, match="bound to tenant 'ta'"):
        b.check(sock, "GetReplicaList", rpc.KeyParams(key="x", tenant="tb"))
    with pytest.raises(IllegalClientError):
        b.check(sock, "GetAllKeys", rpc.Empty())
    b.forget(sock)
    b.check(sock, "GetAllKeys", rpc.Empty(tenant="tb"))  # unbound, voluntary: allowed
    strict = TenantBindings(b"tsec")
    with pytest.raises(IllegalClientError, match="tenant key"):
        strict.check(sock, "GetAllKeys", rpc.Empty(tenant="tb"))
    strict.check(sock, "GetAllKeys", rpc.Empty())  # the default tenant needs no key


@pytest.mark.anyio
async def test_a_tenants_objects_demoted_to_ssd_are_read_and_promoted(tmp_path: Any) -> None:
    from mooncake._store.client import open_store
    from tests.test_store_tiers import (
        MiB,
        eventually,
        fill_and_demote,
        running_master,
        ssd_keys,
        value,
    )

    async with (
        running_master() as addr,
        open_store(
            addr,
            segment_size=MiB,
            ssd_path=str(tmp_path),
            ssd_capacity=64 * MiB,
            promotion="always",
            tenant="ta",
        ) as s,
    ):
        keys = await fill_and_demote(s, 40)  # 2.5 MiB into a 1 MiB segment
        on_ssd = await ssd_keys(s, keys)
        assert len(on_ssd) >= 20
        for i, k in enumerate(keys):
            assert await s.get(k) == value(i), k

        async def promoted() -> bool:
            return len(await ssd_keys(s, on_ssd)) < len(on_ssd)

        await eventually(promoted, "a promotion of a tenant's object")
        assert sorted(await s.master.call("GetAllKeys", rpc.Empty())) == sorted(keys)


def test_a_standby_replaying_the_log_applies_the_same_tenants() -> None:
    """The tenant is in each command's params (and the quota change is a command), so a
    replica applying the leader's log reaches the very same state."""
    leader, log = state(), []

    def run(cmd: commands.Command) -> None:
        log.append(cmd)
        try:
            commands.apply(leader, cmd)
        except MooncakeError:
            pass

    seg = Segment(id="s0", name="h:1", base=1 << 30, size=1 << 20)
    log.append(
        commands.rpc_command(
            "MountSegment", _enc.encode(rpc.MountSegmentParams(client_id="c", segment=seg)), 1.0
        )
    )
    run(commands.SetTenantQuota("a", 300, 0, 1.0))
    for t, k, n in (("a", "k", 200), ("b", "k", 50), ("", "k", 10), ("a", "j", 200)):
        p = rpc.PutStartParams(client_id="c", key=k, size=n, tenant=t)
        run(commands.rpc_command("PutStart", _enc.encode(p), 2.0))
        e = rpc.KeyClientParams(client_id="c", key=k, tenant=t)
        run(commands.rpc_command("PutEnd", _enc.encode(e), 2.0))
    regex = rpc.RegexParams(regex="k", force=True, tenant="b")
    run(commands.ScanApply("RemoveByRegex", _enc.encode(regex), ["k"], 3.0))
    standby = MasterState(MasterConfig(seed=7))
    for cmd in commands.decode_commands(commands.encode_commands(log)):
        try:
            commands.apply(standby, cmd)
        except MooncakeError:
            pass
    assert commands.digest(standby) == commands.digest(leader)
    assert standby.tenants.usage("a")["bytes"] == 200  # "j" was refused there too
    assert call(standby, "GetAllKeys", rpc.Empty(tenant="b")) == []
    assert call(standby, "GetAllKeys", rpc.Empty(tenant="a")) == ["k"]


@pytest.mark.anyio
async def test_a_tenant_clients_miss_names_its_tenant() -> None:
    from mooncake._store.client import open_store
    from tests.test_store_tiers import running_master

    async with running_master() as addr, open_store(addr, segment_size=1 << 20, tenant="ta") as s:
        await s.put("k", b"x" * 64)
        async with open_store(addr, segment_size=0, tenant="tb") as other:
            with pytest.raises(ObjectNotFoundError) as e:
                await other.get("k")
        assert e.value.miss is not None and e.value.miss.tenant == "tb"
        assert e.value.miss.reason.value == "never_stored"
        assert await s.get("k") == b"x" * 64


_WRITERS = hst.lists(
    hst.tuples(
        hst.integers(0, 7),  # writer
        hst.sampled_from(["start", "upsert", "end", "revoke", "remove", "batch"]),
        hst.integers(0, 3),  # key
        hst.integers(1, 400),  # size
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_WRITERS)
def test_eight_interleaved_writers_never_exceed_the_quota(
    steps: list[tuple[int, str, int, int]],
) -> None:
    """8 writers (clients) of one tenant, their PutStart/UpsertStart/End/Revoke/Remove calls
    interleaved in any order: after every call the tenant holds at most its quota, counting
    writes in flight, and exactly what its objects hold."""
    s = state("q=1000/6", size=1 << 16)
    for w in range(8):
        seg = Segment(id=f"w{w}", name=f"h:w{w}", base=(w + 2) << 32, size=1 << 16)
        call(s, "MountSegment", rpc.MountSegmentParams(client_id=f"w{w}", segment=seg))
    for w, op, k, size in steps:
        cid, key = f"w{w}", f"k{k}"
        try:
            if op in ("start", "upsert"):
                m = "PutStart" if op == "start" else "UpsertStart"
                call(s, m, rpc.PutStartParams(client_id=cid, key=key, size=size, tenant="q"))
            elif op in ("end", "revoke"):
                m = "PutEnd" if op == "end" else "PutRevoke"
                call(s, m, rpc.KeyClientParams(client_id=cid, key=key, tenant="q"))
            elif op == "remove":
                call(s, "Remove", rpc.RemoveParams(key=key, force=True, tenant="q"))
            else:
                keys = [f"b{w}-{j}" for j in range(3)]
                call(
                    s,
                    "BatchPutStart",
                    rpc.BatchPutStartParams(client_id=cid, keys=keys, sizes=[size] * 3, tenant="q"),
                )
        except MooncakeError:
            pass
        s.check_invariants()
        u = s.tenants.usage("q")
        assert u["bytes"] <= 1000 and u["objects"] <= 6, u
