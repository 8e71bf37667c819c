"""``mc_store_rest_server`` next to the published one: the same requests to the published
service (on the published master, in the anchor venv) and to ours (on our master) get the
same answers, but for the deliberate differences listed in ``docs/store.md``, each pinned here
to our answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import anchor_python
from tests.helpers import sidemaster

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = anchor_python()
MIB = 1 << 20

pytestmark = [
    pytest.mark.anchor,
    pytest.mark.slow,
    pytest.mark.skipif(ANCHOR is None, reason="published Mooncake wheel not installed"),
]

_MISSING = "00000000-0000-0000-0000-000000000009"


def _requests(shm: Path) -> list[tuple[str, str, Any, bytes | None, int | None]]:
    """(method, path, JSON body, raw body, our status where ours deliberately differs)."""
    name = shm.name
    return [
        ("GET", "/api/exist/k1", None, None, None),
        ("GET", "/api/get/k1", None, None, None),
        ("PUT", "/api/put", {"key": "a", "value": "aaa"}, None, None),
        ("PUT", "/api/put", {"key": "a", "value": "again"}, None, None),
        ("DELETE", "/api/remove/a", None, None, None),
        ("DELETE", "/api/remove/a", None, None, 500),  # + "ret"
        ("PUT", "/api/put", {"key": "b", "value": "bbb"}, None, None),
        ("PUT", "/api/put", {"key": "c", "value": "ccc"}, None, None),
        ("DELETE", "/api/remove_all", None, None, None),
        ("PUT", "/api/put", {"key": "k1", "value": "hello"}, None, None),
        ("GET", "/api/exist/k1", None, None, None),
        ("GET", "/api/get/k1", None, None, None),
        ("DELETE", "/api/remove/k1", None, None, 500),  # leased by the reads; + "ret"
        ("PUT", "/api/put", {"value": "v"}, None, None),
        ("PUT", "/api/put", {"key": "k", "value": ""}, None, 500),  # + "ret"
        ("PUT", "/api/put", None, b"{bad", 400),
        ("PUT", "/api/put", ["x"], None, 400),
        ("PUT", "/api/put", {"key": "k", "value": 5}, None, 400),
        ("POST", "/api/put", {"key": "k", "value": "v"}, None, 405),  # JSON, not text
        ("GET", "/api/nothing", None, None, 404),  # JSON, not text
        ("POST", "/api/mount", {"size": 0}, None, None),
        ("POST", "/api/mount", {"size": 1}, None, None),
        ("POST", "/api/mount_shm", {"name": "../x", "size": 4096}, None, None),
        ("POST", "/api/mount_shm", {"name": name, "size": 16 * MIB}, None, None),
        ("POST", "/api/mount_shm", {"name": name, "size": 0}, None, 400),
        ("POST", "/api/unmount_shm", {}, None, None),
        ("POST", "/api/unmount_shm", {"segment_ids": [_MISSING]}, None, None),
        ("POST", "/api/unmount", {"segment_ids": [_MISSING]}, None, None),
        ("POST", "/api/unmount_local_disk", {}, None, None),
        ("POST", "/api/unmount_local_disk", {"grace_period_seconds": 1.5}, None, None),
        ("POST", "/api/reconfigure", {"mode": "x"}, None, None),
        ("POST", "/api/reconfigure", {"mode": "decode", "size": 4096}, None, None),
        ("POST", "/api/reconfigure", {"mode": "decode", "path": f"{shm}-no", "size": 4096}, None, None),
        ("POST", "/api/reconfigure", {"mode": "decode", "path": str(shm), "size": 16 * MIB}, None, None),
        ("POST", "/api/reconfigure", {"mode": "decode", "path": str(shm), "size": 8 * MIB}, None, None),
        ("POST", "/api/reconfigure", {"mode": "decode", "path": f"{shm}-no", "size": 4096}, None, None),
        ("POST", "/api/reconfigure", {"mode": "prefill"}, None, None),
    ]  # fmt: skip


def _side(published: bool, tmp: Path, shm: Path) -> list[Any]:
    """Every request's (status, JSON body or raw body) on one side, then its exit status
    after SIGTERM."""
    py = ANCHOR if published else sys.executable
    assert py is not None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not published:
        env["PYTHONPATH"] = str(ROOT)
    rpc = sidemaster.free_port()
    # the master command is built by the side's own interpreter (it locates its binary)
    probe = (
        f"import sys, json; sys.path.insert(0, {str(ROOT / 'tests' / 'helpers')!r}); "
        f"import sidemaster; print(json.dumps(sidemaster.master_command({published}, {rpc})))"
    )
    master_cmd = json.loads(
        subprocess.run(
            [py, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp, check=True
        ).stdout
    )
    procs: list[subprocess.Popen[bytes]] = []
    out: list[Any] = []
    try:
        procs.append(
            subprocess.Popen(
                master_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp
            )
        )
        sidemaster.wait_serving(procs[0], rpc, 120)
        cfg = tmp / f"config-{published}.json"
        cfg.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": f"127.0.0.1:{rpc}",
                    "global_segment_size": "32mb",
                    "local_buffer_size": "16mb",
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        port = sidemaster.free_port()
        with (tmp / f"service-{published}.log").open("wb") as log:
            cmd = [py, "-m", "mooncake.mooncake_store_service", "--config", str(cfg)]
            procs.append(
                subprocess.Popen(
                    [*cmd, "--port", str(port)], stdout=log, stderr=log, env=env, cwd=tmp
                )
            )
        service = procs[1]
        sidemaster.wait_serving(service, port, 120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            for method, path, doc, raw, _ in _requests(shm):
                if doc is not None:
                    r = c.request(method, path, json=doc)
                else:
                    r = c.request(method, path, content=raw)
                try:
                    body: Any = r.json()
                except ValueError:
                    body = r.content
                if isinstance(body, dict) and "segment_ids" in body:
                    body["segment_ids"] = len(body["segment_ids"])
                out.append((r.status_code, body))
        service.send_signal(signal.SIGTERM)
        out.append(("exit", service.wait(120)))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return out


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mc-svc-side-{uuid.uuid4().hex[:12]}"
    with path.open("wb") as f:
        f.truncate(16 * MIB)
    try:
        yield path
    finally:
        path.unlink()


def test_answers_match_the_published_service(tmp_path: Path, shm: Path) -> None:
    theirs = _side(True, tmp_path, shm)
    ours = _side(False, tmp_path, shm)
    reqs = _requests(shm)
    assert len(theirs) == len(ours) == len(reqs) + 1
    for (method, path, doc, raw, differs), a, b in zip(reqs, theirs, ours, strict=False):
        what = f"{method} {path} {doc if doc is not None else raw!r}"
        if differs is None:
            assert a == b, what
        else:
            assert b[0] == differs and isinstance(b[1], dict) and b[1]["error"], (what, b)
            if differs >= 500:  # the published text, and the store's code beside it
                assert b[1]["error"] == a[1]["error"] and b[1]["ret"] < 0, (what, a, b)
    assert theirs[-1] == ours[-1] == ("exit", 0)
