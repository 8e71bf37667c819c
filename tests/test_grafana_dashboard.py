"""docs/grafana-dashboard.json queries only series that exist.

The exported series come from a real master, a store client with an SSD tier and its engine
after some traffic; every ``mooncake_*`` / ``master_*`` name in a panel expression must be one
of them (histograms by their ``_bucket``/``_sum``/``_count`` samples, counters by ``_total``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from mooncake._core.master import MasterConfig
from mooncake._store.client import open_store
from mooncake._store.master import MasterServerConfig, serve_master

pytestmark = pytest.mark.anyio

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana-dashboard.json"
NAME = re.compile(r"\b((?:mooncake|master)_[a-z0-9_]+)")


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def exported(*sources: Collector | CollectorRegistry) -> set[str]:
    """Every sample name the sources emit (from their families' names and types)."""
    out: set[str] = set()
    for fam in (f for src in sources for f in src.collect()):
        if fam.type == "counter":
            out.add(fam.name + "_total")
        elif fam.type == "histogram":
            out.update(fam.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            out.add(fam.name)
    return out


def referenced() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    return {m for e in exprs for m in NAME.findall(e)}


async def test_dashboard_series_exist(tmp_path: Path) -> None:
    cfg = MasterServerConfig(rpc_port=0, metrics_port=0, state=MasterConfig())
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_master, cfg)
        addr = f"127.0.0.1:{server.rpc_port}"
        async with open_store(
            addr, segment_size=4 << 20, ssd_path=str(tmp_path / "ssd"), ssd_capacity=8 << 20
        ) as store:
            await store.put("k", b"v" * 1000)
            assert await store.get("k") == b"v" * 1000
            assert store.metrics is not None and store.engine.metrics is not None
            names = exported(store.metrics_registry, server.registry)
        tg.cancel_scope.cancel()
    missing = referenced() - names
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"] and all(p["targets"] and p["datasource"] for p in dash["panels"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
