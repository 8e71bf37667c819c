"""``mooncake top``: a live view of a store master and its clients.

Reads the master's ``/status`` (segments, capacity and usage per tier, objects, counters) and,
for each ``--client`` given, that client's metrics exporter (``/metrics`` of
``open_store(metrics_port=...)`` / ``MC_METRICS_PORT``). Two samples ``--interval`` seconds
apart give the rates: evictions/s, hit rate over the interval (cumulative until there were
reads), per-client read/write throughput. ``--once`` prints one view and exits; ``--json``
prints it as one JSON document (for scripts) instead of a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mooncake._store.metrics import STORE_FAMILIES

_TIMEOUT_S = 5.0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "top", help="live view of a store master and its clients", description=__doc__
    )
    p.add_argument("master", help="the master's metrics/HTTP address HOST:PORT (serves /status)")
    p.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a client's metrics exporter (repeatable)",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _url(addr: str, path: str) -> str:
    base = addr if addr.startswith(("http://", "https://")) else f"http://{addr}"
    return base.rstrip("/") + path


def _get(addr: str, path: str) -> bytes:
    with urllib.request.urlopen(_url(addr, path), timeout=_TIMEOUT_S) as r:
        body: bytes = r.read()
        return body


def client_sample(addr: str) -> dict[str, Any]:
    """Totals of one client's exporter: bytes read/written, calls, failed reads, engine bytes,
    and its engine's slowest recent batches (``slowest``: label dicts with ``seconds``)."""
    out: dict[str, Any] = {"read_bytes": 0.0, "write_bytes": 0.0, "reads": 0.0, "writes": 0.0}
    out.update(failed_reads=0.0, engine_bytes=0.0)
    slowest: list[dict[str, Any]] = []
    out["slowest"] = slowest
    text = _get(addr, "/metrics").decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "mooncake_engine_slowest_transfer_seconds":
                slowest.append({**smp.labels, "seconds": smp.value, "exporter": addr})
                continue
            if smp.name == "mooncake_engine_transfer_bytes_total":
                out["engine_bytes"] += smp.value
                continue
            fam_label = smp.labels.get("family", "")
            direction = STORE_FAMILIES.get(fam_label, ("", None))[0]
            if not direction:
                continue
            kind = "read" if direction == "read" else "write"
            if smp.name == "mooncake_store_bytes_total":
                out[f"{kind}_bytes"] += smp.value
            elif smp.name == "mooncake_store_items_total":
                out[f"{kind}s"] += smp.value
            elif smp.name == "mooncake_store_failed_items_total" and kind == "read":
                out["failed_reads"] += smp.value
    return out


def sample(master: str, clients: list[str]) -> dict[str, Any]:
    """One reading of the master's ``/status`` and every client's totals."""
    status: dict[str, Any] = json.loads(_get(master, "/status"))
    cs: dict[str, dict[str, Any] | str] = {}
    for c in clients:
        try:
            cs[c] = client_sample(c)
        except (OSError, urllib.error.URLError, ValueError) as e:
            cs[c] = f"unreachable: {e}"
    return {"t": time.monotonic(), "status": status, "clients": cs}


def view(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The view from two samples ``a`` then ``b`` (rates over the time between them)."""
    dt = max(b["t"] - a["t"], 1e-9)
    s, c0, c1 = b["status"], a["status"]["counters"], b["status"]["counters"]
    gets, misses = c1["gets"] - c0["gets"], c1["get_misses"] - c0["get_misses"]
    if gets + misses == 0:  # no reads in the interval: the cumulative rate
        gets, misses = c1["gets"], c1["get_misses"]
    clients = []
    for addr, cur in b["clients"].items():
        prev = a["clients"].get(addr)
        if isinstance(cur, str) or not isinstance(prev, dict):
            clients.append({"address": addr, "error": cur if isinstance(cur, str) else "no data"})
            continue
        row: dict[str, Any] = {"address": addr, **cur}
        for k in ("read_bytes", "write_bytes", "engine_bytes"):
            row[f"{k}_per_s"] = (cur[k] - prev[k]) / dt
        clients.append(row)
    return {
        "master": {
            "objects": s["objects"],
            "clients": s["clients"],
            "segments": s["segments"],
            "capacity_bytes": s["capacity_bytes"],
            "used_bytes": s["used_bytes"],
            "tiers": s["tiers"],
            "hit_rate": gets / (gets + misses) if gets + misses else None,
            "evictions_per_s": (c1["evicted_objects"] - c0["evicted_objects"]) / dt,
            "counters": c1,
        },
        "segments": s["segment_list"],
        "master_clients": s["client_list"],
        "tenants": s.get("tenants", []),
        "clients": clients,
        "interval_s": dt,
    }


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def render(v: dict[str, Any]) -> Any:
    """A rich renderable of a view."""
    from rich.console import Group
    from rich.table import Table

    m = v["master"]
    hr = "-" if m["hit_rate"] is None else f"{m['hit_rate'] * 100:.1f} %"
    head = Table(title="mooncake master", show_header=False)
    head.add_row("objects", str(m["objects"]), "clients", str(m["clients"]))
    head.add_row("used", _mib(m["used_bytes"]), "capacity", _mib(m["capacity_bytes"]))
    head.add_row("hit rate", hr, "evictions/s", f"{m['evictions_per_s']:.1f}")
    tiers = Table(title="tiers")
    for col in ("tier", "segments", "used", "capacity", "hits", "misses", "evictions"):
        tiers.add_column(col)
    for name, t in sorted(m["tiers"].items()):
        tiers.add_row(
            name,
            str(t.get("segments", "-")),
            _mib(t["used"]) if "used" in t else "-",
            _mib(t["capacity"]) if "capacity" in t else "-",
            str(t.get("hits", 0)),
            str(t.get("misses", 0)),
            str(t.get("evictions", 0)),
        )
    segs = Table(title="segments")
    for col in ("name", "tier", "used", "capacity", "client"):
        segs.add_column(col)
    for sg in v["segments"]:
        segs.add_row(
            sg["name"], sg["tier"], _mib(sg["used"]), _mib(sg["capacity"]), sg["client_id"][:8]
        )
    parts: list[Any] = [head, tiers, segs]
    if v.get("tenants"):
        tn = Table(title="tenants")
        for col in ("tenant", "objects", "bytes", "quota bytes", "quota objects", "refused"):
            tn.add_column(col)
        for t in v["tenants"]:
            tn.add_row(
                t["tenant_id"],
                str(t["objects"]),
                _mib(t["charged_bytes"]),
                _mib(t["quota_bytes"]) if t["quota_bytes"] else "-",
                str(t["quota_objects"] or "-"),
                str(t["refused"]),
            )
        parts.append(tn)
    if v["clients"]:
        cl = Table(title="clients")
        for col in ("exporter", "read/s", "write/s", "engine/s", "reads", "failed reads"):
            cl.add_column(col)
        for c in v["clients"]:
            if "error" in c:
                cl.add_row(c["address"], c["error"], "", "", "", "")
                continue
            cl.add_row(
                c["address"],
                _mib(c["read_bytes_per_s"]),
                _mib(c["write_bytes_per_s"]),
                _mib(c["engine_bytes_per_s"]),
                f"{c['reads']:.0f}",
                f"{c['failed_reads']:.0f}",
            )
        parts.append(cl)
    slow = sorted(
        (s for c in v["clients"] for s in c.get("slowest", ())),
        key=lambda s: s["seconds"],
        reverse=True,
    )[:10]
    if slow:
        st = Table(title="slowest transfers")
        for col in (
            "exporter",
            "batch",
            "peer",
            "op",
            "transport",
            "nic",
            "bytes",
            "ms",
            "verdict",
        ):
            st.add_column(col)
        for s in slow:
            st.add_row(
                s["exporter"],
                s["batch_id"],
                s["segment"],
                s["op"],
                s["transport"],
                s["nic"],
                s["bytes"],
                f"{s['seconds'] * 1000:.2f}",
                s["verdict"],
            )
        parts.append(st)
    return Group(*parts)


def run(args: argparse.Namespace) -> int:
    try:
        prev = sample(args.master, args.client)
    except (OSError, urllib.error.URLError, ValueError) as e:
        print(f"mooncake top: cannot read {_url(args.master, '/status')}: {e}", file=sys.stderr)
        print(
            "mooncake top: it reads the master's HTTP metrics port (default 9003, the "
            "'metrics=' of `mooncake master`'s first line), not its RPC port",
            file=sys.stderr,
        )
        return 1
    if args.once:
        time.sleep(max(args.interval, 0.0))
        v = view(prev, sample(args.master, args.client))
        if args.json:
            print(json.dumps(v, sort_keys=True))
        else:
            from rich.console import Console

            Console().print(render(v))
        return 0
    from contextlib import nullcontext

    from rich.live import Live

    with nullcontext() if args.json else Live(refresh_per_second=4) as live:
        while True:
            time.sleep(max(args.interval, 0.05))
            try:
                cur = sample(args.master, args.client)
            except (OSError, urllib.error.URLError, ValueError) as e:
                print(f"mooncake top: {e}", file=sys.stderr)
                return 1
            if live is None:  # --json: one document per line
                print(json.dumps(view(prev, cur), sort_keys=True), flush=True)
            else:
                live.update(render(view(prev, cur)))
            prev = cur
