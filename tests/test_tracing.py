"""Opt-in OpenTelemetry spans: off by default (no opentelemetry import); on, a store put/get is
a span with its master RPCs and engine batches as children (a child process with
``MOONCAKE_OTEL=1`` and the SDK's in-memory exporter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.store_procs import _env

pytest.importorskip("opentelemetry.sdk")

_SCRIPT = r"""
import json, trio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exp = InMemorySpanExporter()
tp = TracerProvider()
tp.add_span_processor(SimpleSpanProcessor(exp))
trace.set_tracer_provider(tp)

import mooncake
from mooncake._core.transfer import TransferRequest as R
from mooncake._store.client import open_store
from mooncake.testing import local_master

async def main():
    async with local_master() as addr:
        async with open_store(addr, segment_size=8 << 20) as store:
            await store.put("k", b"v" * 1000)
            assert await store.get("k") == b"v" * 1000
    async with mooncake.open_engine() as a, mooncake.open_engine() as b:
        src, dst = await a.allocate(4096), await b.allocate(4096)
        with trace.get_tracer("app").start_as_current_span("app.step"):
            await a.transfer(b.segment_name, [R.write(src.addr, dst.addr, 4096)])

trio.run(main)
print(json.dumps([
    {"name": s.name, "id": s.context.span_id, "parent": s.parent.span_id if s.parent else None,
     "attrs": dict(s.attributes)}
    for s in exp.get_finished_spans()
]))
"""


def _run(otel: str) -> list[dict[str, object]]:
    env = {**_env(), "MOONCAKE_OTEL": otel}
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    spans: list[dict[str, object]] = json.loads(r.stdout.strip().splitlines()[-1])
    return spans


def test_spans_nest_store_calls_over_master_rpcs_and_transfers() -> None:
    spans = _run("1")
    by_id = {s["id"]: s for s in spans}
    for op in ("mooncake.store.put", "mooncake.store.get"):
        (top,) = [s for s in spans if s["name"] == op]
        assert top["attrs"] == {"mooncake.key": "k"}
        kids = [s for s in spans if s["parent"] == top["id"]]
        assert any(s["name"] == "mooncake.master.call" for s in kids), (op, kids)
    methods = {s["attrs"]["rpc.method"] for s in spans if s["name"] == "mooncake.master.call"}
    assert {"PutStart", "PutEnd", "GetReplicaList"} <= methods  # type: ignore[operator]
    (xfer,) = [s for s in spans if s["name"] == "mooncake.transfer"]
    assert by_id[xfer["parent"]]["name"] == "app.step"
    assert xfer["attrs"]["mooncake.requests"] == 1  # type: ignore[index]


def test_off_by_default_makes_no_spans() -> None:
    assert [s["name"] for s in _run("")] == ["app.step"]
