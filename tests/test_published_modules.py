"""The published wheel's other modules: console entry points, the vLLM PD proxy (with real
HTTP backends), the topology dump and the GPU-only modules' refusals."""

from __future__ import annotations

import http.client
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import tomllib

from mooncake.errors import NotSupportedError
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[1]
#: the published wheel's console scripts (its entry_points.txt)
PUBLISHED_SCRIPTS = {
    "mooncake_master": "mooncake.cli:main",
    "mooncake_client": "mooncake.cli_client:main",
    "transfer_engine_bench": "mooncake.cli_bench:main",
    "transfer_engine_topology_dump": "mooncake.transfer_engine_topology_dump:main",
    "mc_store_rest_server": "mooncake.mooncake_store_service:sync_main",
}


def test_console_scripts_resolve_as_published() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in PUBLISHED_SCRIPTS.items():
        assert scripts[name] == target, name
    for target in scripts.values():
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func)), target


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_cli_modules_run_the_commands() -> None:
    for mod, word in (
        ("mooncake.cli", "mooncake_master"),
        ("mooncake.cli_client", "mooncake_client"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", mod, "--no_such_flag=1"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=120,
        )
        assert out.returncode == 2, (mod, out.stderr)
        assert word in out.stderr and "no_such_flag" in out.stderr


def test_topology_dump_prints_discovery_and_custom_matrices(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mooncake.transfer_engine_topology_dump"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Local topology [te/discover]: ")
    json.loads(out.stdout.split(": ", 1)[1])
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"cpu:0": [["mlx5_0"], ["mlx5_1"]]}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake.transfer_engine_topology_dump",
            "--custom-topo-json",
            str(topo),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.split("]: ", 1)[1])
    assert got["cpu:0"] == [["mlx5_0"], ["mlx5_1"]]
    topo.write_text("[1, 2]")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake.transfer_engine_topology_dump",
            "--custom-topo-json",
            str(topo),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 1 and "not a JSON object" in out.stderr


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("mooncake.ep", ["Buffer", "ElasticBuffer", "EventHandle", "get_ep_buffer_size_hint"]),
        ("mooncake.pg", ["createMooncakeBackend", "set_host_ip", "get_active_ranks"]),
        ("mooncake.mooncake_ep_buffer", ["Buffer", "EventOverlap"]),
        ("mooncake.mooncake_elastic_buffer", ["ElasticBuffer", "EPHandle"]),
    ],
)
def test_gpu_only_modules_import_and_refuse_at_use(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    for name in names:
        assert name in mod.__all__
        with pytest.raises(NotSupportedError, match=rf"{module}\.{name} .*needs .*(CUDA|torch)"):
            getattr(mod, name)(None)


# -- the PD proxy --------------------------------------------------------------------------------


class _Backend:
    """A fake vLLM instance: a real HTTP server recording what it is sent."""

    def __init__(self, role: str, fail: int = 0) -> None:
        self.role, self.fail = role, fail
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(n))
                backend.requests.append((self.path, dict(self.headers), body))
                if backend.fail:
                    self.send_response(backend.fail)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                if backend.role == "prefill":
                    out = json.dumps(
                        {"kv_transfer_params": {"remote_block_ids": [1, 2], "remote_port": 7}}
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                # decode: a streamed answer in several chunks
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(3):
                    piece = f'data: {{"i": {i}, "port": {self.server.server_address[1]}}}\n\n'
                    data = piece.encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _ProxyProc:
    def __init__(self, prefill: list[_Backend], decode: list[_Backend]) -> None:
        cmd = [sys.executable, "-m", "mooncake.vllm_v1_proxy_server", "--port", "0"]
        cmd += ["--prefiller-host", *("127.0.0.1" for _ in prefill)]
        cmd += ["--prefiller-port", *(str(b.port) for b in prefill)]
        cmd += ["--decoder-host", *("127.0.0.1" for _ in decode)]
        cmd += ["--decoder-port", *(str(b.port) for b in decode)]
        env = {**_env(), "OPENAI_API_KEY": "sk-test"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert self.proc.stdout is not None
        lines = []
        for _ in range(5):
            line = self.proc.stdout.readline()
            lines.append(line)
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                break
        else:
            raise AssertionError(f"proxy did not come up: {lines}")

    def request(
        self, method: str, path: str, body: dict[str, Any] | bytes | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def pd() -> Iterator[tuple[_ProxyProc, list[_Backend], list[_Backend]]]:
    prefill = [_Backend("prefill"), _Backend("prefill")]
    decode = [_Backend("decode"), _Backend("decode")]
    proxy = _ProxyProc(prefill, decode)
    try:
        yield proxy, prefill, decode
    finally:
        proxy.stop()
        for b in prefill + decode:
            b.close()


def test_proxy_prefills_then_streams_decode_round_robin(
    pd: tuple[_ProxyProc, list[_Backend], list[_Backend]],
) -> None:
    proxy, prefill, decode = pd
    assert proxy.request("GET", "/healthcheck") == (
        200,
        json.dumps({"status": "ok", "prefill_instances": 2, "decode_instances": 2}).encode(),
    )
    req = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "max_completion_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ports = []
    for path, endpoint in (("/v1/completions", "/v1/completions"),) * 2 + (
        ("/v1/chat/completions", "/v1/chat/completions"),
    ):
        status, body = proxy.request("POST", path, req)
        assert status == 200, body
        events = [json.loads(x[6:]) for x in body.decode().split("\n\n") if x]
        assert [e["i"] for e in events] == [0, 1, 2]
        ports.append(events[0]["port"])
        del endpoint
    # round robin over both decode instances, each prefilled first
    assert ports == [decode[0].port, decode[1].port, decode[0].port]
    assert [len(b.requests) for b in prefill] == [2, 1] and [len(b.requests) for b in decode] == [
        2,
        1,
    ]
    p_path, p_headers, p_body = prefill[0].requests[0]
    d_path, d_headers, d_body = decode[0].requests[0]
    assert p_path == d_path == "/v1/completions"
    assert prefill[0].requests[1][0] == "/v1/chat/completions"
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p_body["stream"] is False and p_body["max_tokens"] == 1
    assert p_body["max_completion_tokens"] == 1 and "stream_options" not in p_body
    # the decode request is the original one plus the prefill's kv_transfer_params
    assert d_body == {**req, "kv_transfer_params": {"remote_block_ids": [1, 2], "remote_port": 7}}
    assert p_headers["Authorization"] == d_headers["Authorization"] == "Bearer sk-test"
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"]
    assert prefill[1].requests[0][1]["X-Request-Id"] != p_headers["X-Request-Id"]


def test_proxy_reports_backend_failures_and_bad_requests(
    pd: tuple[_ProxyProc, list[_Backend], list[_Backend]],
) -> None:
    proxy, prefill, decode = pd
    status, body = proxy.request("POST", "/v1/completions", b"not json")
    assert status == 400 and b"not JSON" in body
    status, body = proxy.request("POST", "/v1/completions", b"[1]")
    assert status == 400 and b"JSON object" in body
    assert proxy.request("GET", "/v1/completions")[0] == 405
    assert proxy.request("GET", "/nope")[0] == 404
    prefill[0].fail = 500
    status, body = proxy.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 502
    err = json.loads(body)["error"]
    assert f"prefill instance 127.0.0.1:{prefill[0].port} answered 500" in err
    assert not decode[0].requests and not decode[1].requests
    decode[0].fail = 503
    status, body = proxy.request("POST", "/v1/completions", {"prompt": "x"})  # prefill[1]
    assert (
        status == 502
        and f"decode instance 127.0.0.1:{decode[0].port} answered 503" in json.loads(body)["error"]
    )
    dead = prefill[0].port
    prefill[0].close()
    status, body = proxy.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 502 and f"prefill instance 127.0.0.1:{dead}" in json.loads(body)["error"]
    # the proxy still serves
    prefill[0].fail = 0
    status, body = proxy.request(
        "POST", "/v1/completions", {"prompt": "x"}
    )  # prefill[1], decode[1]
    assert status == 200 and b'"i": 2' in body


def test_proxy_flags_as_published() -> None:
    from mooncake.vllm_v1_proxy_server import parse_args

    a = parse_args([])
    assert (a.host, a.port) == ("127.0.0.1", 8000)
    assert a.prefiller_instances == [("localhost", 8100)]
    assert a.decoder_instances == [("localhost", 8200)]
    a = parse_args(["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2"])
    assert a.prefiller_instances == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match="prefiller hosts must match"):
        parse_args(["--prefiller-hosts", "a", "b"])
    with pytest.raises(ValueError, match="decoder hosts must match"):
        parse_args(["--decoder-ports", "1", "2"])


# -- shared segment ------------------------------------------------------------------------------


def test_shared_segment_layout_and_views_in_one_rank() -> None:
    torch = pytest.importorskip("torch")
    from mooncake.shared_segment import (
        SharedSegmentError,
        create_shared_segment,
        shared_segment_supported,
    )

    assert shared_segment_supported() and not shared_segment_supported(mmap=False)
    assert not shared_segment_supported(host_register=True)
    seg = create_shared_segment(
        "kv",
        {
            "v": {"count": 2, "shape": (3, 5), "dtype": torch.float32},
            "k": {"count": 3, "shape": (4,), "dtype": torch.bfloat16},
        },
        world_size=1,
        rank_id=0,
    )
    # sorted names, 4 KiB-aligned entries inside one group stride, max(count) groups
    assert seg.total_size() == 3 * (4096 + 4096)
    k, v = seg.tensors("k"), seg.tensors("v")
    assert len(k) == 3 and len(v) == 2 and v[0].shape == (3, 5) and k[0].dtype == torch.bfloat16
    assert k[0].data_ptr() == seg.base_addr() and v[0].data_ptr() == seg.base_addr() + 4096
    assert k[1].data_ptr() == seg.base_addr() + 8192
    v[1].fill_(7.0)
    assert float(seg.tensors("v")[1].sum()) == 7.0 * 15  # the same pages
    with pytest.raises(SharedSegmentError, match="Unknown shared segment block 'x'"):
        seg.tensors("x")
    with pytest.raises(SharedSegmentError, match="positive count"):
        create_shared_segment("b", {"k": {"count": 0, "shape": (1,), "dtype": torch.int8}}, 1, 0)
    with pytest.raises(SharedSegmentError, match="needs count, shape and dtype"):
        create_shared_segment("b", {"k": {"shape": (1,)}}, 1, 0)
    with pytest.raises(SharedSegmentError, match="no VMM backend"):
        create_shared_segment(
            "b", {"k": {"count": 1, "shape": (1,), "dtype": torch.int8}}, 1, 0, mmap=False
        )
    with pytest.raises(SharedSegmentError, match="comm_group is required"):
        create_shared_segment("b", {"k": {"count": 1, "shape": (1,), "dtype": torch.int8}}, 2, 0)


_RANK = """
import os, sys, torch, torch.distributed as dist
from mooncake.shared_segment import SharedSegmentError, create_shared_segment
rank, port, shape = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
blocks = {"k": {"count": 2, "shape": (shape,), "dtype": torch.int32}}
try:
    seg = create_shared_segment("kv", blocks, world_size=2, rank_id=rank, comm_group=dist.group.WORLD)
except SharedSegmentError as e:
    print("ERR", e, flush=True)
else:
    k = seg.tensors("k")
    if rank == 0:
        k[1].copy_(torch.arange(k[1].numel(), dtype=torch.int32))
    dist.barrier()
    print("SUM", int(k[1].sum()), flush=True)
    dist.barrier()
# gloo's threads must be joined before the interpreter exits: left running, their destructor
# can abort the process (std::terminate) after the output above was written
dist.destroy_process_group()
os._exit(0)
"""


def _two_ranks(shapes: tuple[int, int]) -> list[str]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), port, str(shapes[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
        outs.append(out)
    return outs


def test_shared_segment_maps_the_owners_pages_in_another_rank() -> None:
    pytest.importorskip("torch")
    outs = _two_ranks((16, 16))
    assert all("SUM 120" in o for o in outs), outs  # rank 1 reads what rank 0 wrote
    outs = _two_ranks((16, 8))  # the ranks disagree: both fail, naming the layouts
    assert all(
        "ERR Shared segment complete failed" in o and "different shared segment layout" in o
        for o in outs
    ), outs


@pytest.mark.parametrize(
    ("module", "cls"),
    [
        ("mooncake.mooncake_ssd_register", "MooncakeNoFRegister"),
        ("mooncake.mooncake_ssd_unregister", "MooncakeNoFUnregister"),
    ],
)
def test_ssd_nof_commands_take_the_published_flags_and_refuse(module: str, cls: str) -> None:
    mod = importlib.import_module(module)
    with pytest.raises(NotSupportedError, match="NVMe-oF"):
        getattr(mod, cls)({"master_server_address": "127.0.0.1:50051"}, ["ip:10.0.0.1 path:/spdk"])
    argv = ["--master_server_address=127.0.0.1:50051", "--spdk_target_info", "ip:10.0.0.1 path:/x"]
    out = subprocess.run(
        [sys.executable, "-m", module, *argv, "-Dtrsvcid=4420"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert (
        out.returncode == 1 and f"{cls} is not supported" in out.stderr and "NVMe-oF" in out.stderr
    )
    out = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert out.returncode == 2 and "--master_server_address" in out.stderr  # argparse, as published


def test_fast_copy_concatenates_into_raw_memory_as_published() -> None:
    import ctypes

    import numpy as np

    from mooncake._fast_copy import concat_arrays_into

    arrays = [
        np.arange(3, dtype=np.uint8),
        np.arange(4, dtype=np.uint8) + 10,
        np.arange(2, dtype=np.uint8) + 20,
    ]
    dst = ctypes.create_string_buffer(16)
    assert concat_arrays_into(arrays, ctypes.addressof(dst), 16, 1, 2) == 6
    assert dst.raw[:6] == bytes([10, 11, 12, 13, 20, 21]) and dst.raw[6:] == b"\0" * 10
    assert concat_arrays_into(arrays, ctypes.addressof(dst), 16, 7) == 0  # start clamped
    assert concat_arrays_into(arrays, ctypes.addressof(dst), 16, 2, -1) == 2
    small = ctypes.create_string_buffer(4)
    with pytest.raises(ValueError, match="destination buffer too small: need 9 bytes, got 4"):
        concat_arrays_into(arrays, ctypes.addressof(small), 4)
    assert small.raw == b"\0" * 4  # nothing written
    with pytest.raises(ValueError, match=r"arrays\[0\] is not C-contiguous"):
        concat_arrays_into([np.arange(8, dtype=np.uint8)[::2]], ctypes.addressof(dst), 16)
    with pytest.raises(TypeError, match=r"arrays\[1\] is not an ndarray"):
        concat_arrays_into([arrays[0], b"xy"], ctypes.addressof(dst), 16)


def test_http_metadata_server_handler_takes_aiohttp_like_requests() -> None:
    import asyncio

    from mooncake.http_metadata_server import KVBootstrapServer

    class Req:
        def __init__(self, method: str, key: str | None = None, body: bytes = b"") -> None:
            self.method, self.body = method, body
            self.query = {} if key is None else {"key": key}

        async def read(self) -> bytes:
            return self.body

    server = KVBootstrapServer(port=0)

    def call(*a: Any) -> Any:
        return asyncio.run(server._handle_metadata(Req(*a)))

    for m in ("GET", "PUT", "DELETE"):
        r = call(m, None, b"v")
        assert (r.status, r.content_type) == (400, "application/json") and "" not in server.store
    assert call("PUT", "   ", b"v").status == 400
    assert call("PUT", "  k  ", b"raw bytes").status == 200 and "k" in server.store
    r = call("GET", "k")
    assert (r.status, r.body) == (200, b"raw bytes")
    assert call("PUT", "mooncake/rpc_meta/a", b"{}").status == 200
    assert call("PUT", "mooncake/rpc_meta/a", b"{}").status == 400  # as published
    assert call("POST", "k").status == 405
    assert call("DELETE", "k").status == 200 and call("DELETE", "k").status == 404
    assert call("GET", "k").status == 404
