"""Ours against the published wheel (its own venv, its own ``mooncake_master``), call by call.

* the API surface: every method, argument and module of the published ``mooncake.store`` that
  ours lacks is a failure;
* call sequences: the same sequence of tensor and byte calls (hypothesis over a small key space,
  dtypes and shapes: put/upsert/get/remove of tensors, TP shards, pub with pins and a bad
  config; put/upsert/get/exist/size of bytes,
  put_batch/get_batch/batch_is_exist/batch_remove, a remove under a read lease) runs on both;
  codes, sizes, the stored bytes and the tensors read back are compared call by call.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, anchor_python

ANCHOR = anchor_python()
REPLY_TIMEOUT = 60.0  # seconds for one sequence; a hang fails instead of blocking the run
pytestmark = [
    pytest.mark.anchor,
    pytest.mark.skipif(
        ANCHOR is None, reason="published wheel not installed (scripts/setup-anchor.sh)"
    ),
]
SURFACE = ROOT / "benchmarks" / "anchor" / "api_surface.py"


def anchor_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MC_LOG_LEVEL"] = "ERROR"
    return env


def surface(python: str, env: dict[str, str], cwd: str) -> str:
    res = subprocess.run(
        [python, str(SURFACE)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def store_methods(md: str) -> dict[str, str]:
    block = md.split("(`mooncake.store.MooncakeDistributedStore`)", 1)[1].split("\n### ", 1)[0]
    out = {}
    for m in re.finditer(r"^- `([a-z_]+)(?:\(([^`]*)\))?", block, re.M):
        out[m.group(1)] = m.group(2) or ""
    return out


def test_api_surface_has_every_published_store_method() -> None:
    published = store_methods(surface(str(ANCHOR), anchor_env(), "/"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ours_md = surface(sys.executable, env, str(ROOT))
    ours = store_methods(ours_md) if "MooncakeDistributedStore" in ours_md else {}
    missing = sorted(set(published) - set(ours))
    assert len(published) > 90
    assert not missing, f"published methods ours lacks: {missing}"


# -- tensor sequences ----------------------------------------------------------------------

_DRIVER = r"""
import json, os, socket, subprocess, sys, time
sys.path.insert(0, os.environ["MC_DIFF_HERE"]) if os.environ.get("MC_DIFF_HERE") else None
import torch
PUBLISHED = os.environ.get("MC_DIFF_PUBLISHED") == "1"
from mooncake.store import ReplicateConfig
from mooncake.store import MooncakeDistributedStore as S

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

rpc = port()
if PUBLISHED:
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    master = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                               "--metrics_host=127.0.0.1", f"--metrics_port={port()}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
else:
    master = subprocess.Popen([sys.executable, "-m", "mooncake", "master",
                               "--rpc-port", str(rpc), "--no-metrics"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
try:
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", rpc), 0.2).close(); break
        except OSError:
            time.sleep(0.1)
    s = S()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", f"127.0.0.1:{rpc}") == 0
    out = []
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        ops = json.loads(line)
        res = []
        for op, key, dtype, shape in ops:
          try:
            if op in ("put", "upsert"):
                t = torch.arange(max(1, len(shape) and int(torch.tensor(shape).prod())), dtype=torch.float32)
                t = t[: int(torch.tensor(shape).prod()) if shape else 1].reshape(shape).to(getattr(torch, dtype))
                fn = s.put_tensor if op == "put" else s.upsert_tensor
                res.append([fn(key, t)])
            elif op == "get":
                t = s.get_tensor(key)
                raw = s.get(key)
                res.append(None if t is None else [str(t.dtype), list(t.shape),
                                                   t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex(),
                                                   raw.hex(), s.get_size(key)])
            elif op == "remove":
                res.append([s.remove(key, True)])
            elif op == "tp":
                t = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(getattr(torch, dtype))
                n = 1 + len(shape)
                rc = s.put_tensor_with_tp(key, t, 0, n, 1 if n in (2, 3) else 0)
                shards = [s.get_tensor_with_tp(key, r, n) for r in range(n)]
                res.append([rc, [None if x is None else [list(x.shape),
                                 x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()]
                                 for x in shards],
                            [s.get(f"{key}_tp_{r}").hex() for r in range(n)]])
                for r in range(n):
                    s.remove(f"{key}_tp_{r}", True)
            elif op == "pub":
                cfg = ReplicateConfig()
                cfg.with_hard_pin = bool(len(shape) % 2)
                if len(shape) == 3:
                    cfg.preferred_segments = ["a", "b"]  # does not match replica_num: -600
                t = torch.ones(shape, dtype=getattr(torch, dtype))
                res.append([s.pub_tensor(key, t, cfg), s.get(key).hex()])
            elif op == "remove_leased":
                res.append([s.remove(key)])
            elif op in ("bput", "bupsert"):
                value = (key * 7 + dtype).encode() * (1 + len(shape))
                res.append([(s.put if op == "bput" else s.upsert)(key, value)])
            elif op == "bget":
                res.append([s.get(key).hex(), s.get_size(key), s.is_exist(key)])
            elif op == "batch":
                ks = [key, key + "b"]
                res.append([s.put_batch(ks, [b"x" * len(shape), b"yy"]), [v.hex() for v in s.get_batch(ks)],
                            s.batch_is_exist(ks), s.batch_remove(ks, True)])
          except Exception as e:
            res.append(["driver error", type(e).__name__])
        print(json.dumps(res), flush=True)
    s.close()
finally:
    master.terminate(); master.wait(10)
"""


def read_line(pipe: Any, timeout: float) -> list[str]:
    """One line from ``pipe`` (an empty list if none came within ``timeout`` seconds)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(pipe.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return box


class Pair:
    """The published and our store, each in a child process with its own master."""

    def __init__(self) -> None:
        self.procs = {
            "published": subprocess.Popen(
                [str(ANCHOR), "-c", _DRIVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(anchor_env(), MC_DIFF_PUBLISHED="1"),
                cwd="/",
            ),
            "ours": subprocess.Popen(
                [sys.executable, "-c", _DRIVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=str(ROOT), MC_DIFF_HERE=str(ROOT)),
                cwd=str(ROOT),
            ),
        }

    def run(self, ops: list[Any]) -> dict[str, Any]:
        line = json.dumps(ops) + "\n"
        out = {}
        for name, p in self.procs.items():
            assert p.stdin and p.stdout
            p.stdin.write(line)
            p.stdin.flush()
            box = read_line(p.stdout, REPLY_TIMEOUT)
            assert box and box[0], f"{name} store gave no answer to {ops} (rc={p.poll()})"
            out[name] = json.loads(box[0])
        return out

    def close(self) -> None:
        for p in self.procs.values():
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


@pytest.fixture(scope="module")
def pair() -> Any:
    pytest.importorskip("torch")
    probe = subprocess.run(
        [str(ANCHOR), "-c", "import torch"], env=anchor_env(), cwd="/", capture_output=True
    )
    if probe.returncode:
        pytest.skip("torch missing in the published venv (scripts/setup-anchor.sh)")
    p = Pair()
    yield p
    p.close()


KEYS = st.sampled_from(["k0", "k1", "k2"])
DTYPES = st.sampled_from(["float32", "float16", "bfloat16", "int8", "int64", "bool", "uint8"])
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=3)
OPS = st.lists(
    st.tuples(st.sampled_from(["put", "upsert", "get", "get", "remove"]), KEYS, DTYPES, SHAPES),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(OPS)
def test_tensor_sequences_match_the_published_store(pair: Pair, ops: list[Any]) -> None:
    ops = [[o, k, d, list(s)] for o, k, d, s in ops] + [
        ["remove", k, "uint8", []] for k in ("k0", "k1", "k2")
    ]
    res = pair.run(ops)
    for op, pub, ours in zip(ops, res["published"], res["ours"], strict=True):
        assert ours == pub, op
