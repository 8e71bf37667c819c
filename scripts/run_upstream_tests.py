#!/usr/bin/env python3
"""Run upstream Mooncake's own Python tests against this package, the way upstream CI does.

Upstream's CI (``.github/workflows/ci.yml`` and ``scripts/run_tests.sh``) starts an HTTP
metadata server and ``mooncake_master`` (``--default_kv_lease_ttl=500``, special flags for the
SSD / promotion tests), a ``mooncake_client`` for the dummy-client tests, then runs
``mooncake-wheel/tests/*.py`` and ``scripts/test_*.py`` one file at a time. This script does the
same with *this* project's console scripts, on free ports (the tests read their addresses from
``MC_METADATA_SERVER`` / ``MASTER_SERVER`` / ``MOONCAKE_MASTER`` / ``MOONCAKE_TE_META_DATA_SERVER``),
and prints one line per test plus pass/fail counts::

    python scripts/run_upstream_tests.py                       # all files
    python scripts/run_upstream_tests.py -k dummy -k tensor    # files whose name contains a word
    python scripts/run_upstream_tests.py --json out.json       # per-test results as JSON
    python scripts/run_upstream_tests.py --published           # the baseline: the published wheel

The tests come from a git directory of kvcache-ai/Mooncake (``--mirror``, a bare clone is fine;
``--rev`` picks the commit). Each file runs under pytest (unittest classes included) with a
junit report, so every test case is counted; the files that are scripts with a ``main()``
(``scripts/test_tensor_api.py``, ``scripts/test_drain_http_api.py``, ...) run as upstream runs
them and count as one test each. Every process it starts is stopped by PID.

``--published`` runs the same against the published wheel instead (the anchor venv,
``scripts/setup-anchor.sh``; its interpreter and console scripts, nothing of this package), so
the two result sets can be compared test by test; a published venv without pytest is lent
this interpreter's (``pytest_overlay``: links to pytest and its pure-Python dependencies only). Upstream CI runs ``scripts/test_engram_store.py``
from a build tree (``build/mooncake-integration/store.so``): a one-line ``store`` module there
re-exports ``mooncake.store`` of whichever package is under test.

Exit status: 0 when every test passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MIRROR = "/work/.mirror/kvcache-ai+Mooncake/repo"
#: how long one server may take to listen (a loaded machine starts Python slowly)
START_S = 120.0

ANCHOR_PYTHON = os.path.expanduser("~/.cache/mooncake-anchor-venv/bin/python")
#: the published wheel's console scripts (its entry_points.txt)
PUBLISHED_SHIMS = {
    "mooncake_master": "mooncake.cli:main",
    "mooncake_client": "mooncake.cli_client:main",
    "mooncake_http_metadata_server": "mooncake.http_metadata_server:main",
    "transfer_engine_bench": "mooncake.cli_bench:main",
    "transfer_engine_topology_dump": "mooncake.transfer_engine_topology_dump:main",
    "mc_store_rest_server": "mooncake.mooncake_store_service:sync_main",
}
#: console scripts the tests call by name (``test_cli.py``, ``run_tests.sh``): name -> callable
SHIMS = {
    "mooncake_master": "mooncake._cli.master:gflags_main",
    "mooncake_client": "mooncake._cli.real_client:main",
    "mooncake_http_metadata_server": "mooncake.http_metadata_server:main",
    "transfer_engine_bench": "mooncake.cli_bench:main",
    "transfer_engine_topology_dump": "mooncake.transfer_engine_topology_dump:main",
    "mc_store_rest_server": "mooncake.mooncake_store_service:sync_main",
}


@dataclass
class Suite:
    """One upstream test file and how upstream CI runs it."""

    path: str  # inside the upstream tree
    master_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # script mode: the arguments CI passes
    script: bool = False  # run as ``python FILE ARGS`` and count as one test
    real_client: bool = False  # needs ``mooncake_client`` serving dummy clients
    parallel: int = 1  # script mode: that many copies at once (argv gets ``{i}``)
    background: str = ""  # a helper script started before this one (and stopped after)
    timeout: float = 600.0


W = "mooncake-wheel/tests/"
SUITES: list[Suite] = [
    Suite(W + "test_import_structure.py"),
    Suite(W + "test_mooncake_config.py"),
    Suite(W + "test_http_metadata_server.py"),
    Suite(W + "test_fast_copy.py"),
    Suite(W + "test_buffer_pool_native.py"),
    Suite(W + "test_cli.py", script=True),
    Suite(
        W + "transfer_engine_initiator_test.py",
        env={"MC_FORCE_TCP": "true"},
        background=W + "transfer_engine_target.py",
    ),
    Suite(W + "test_distributed_object_store.py"),
    Suite(W + "test_replicated_distributed_object_store.py"),
    Suite(W + "test_batch_replica_clear.py"),
    Suite(W + "test_put_get_tensor.py"),
    Suite(W + "test_safetensor_functions.py"),
    Suite(W + "test_dummy_client.py", real_client=True),
    Suite(
        W + "test_multi_dummy_clients.py",
        script=True,
        real_client=True,
        argv=["--client-id", "client{i}"],
        parallel=2,
    ),
    Suite(W + "test_ssd_offload_in_evict.py", master_flags=["--root_fs_dir={tmp}/ssd"]),
    Suite(
        W + "test_offload_on_eviction.py",
        master_flags=[
            "--root_fs_dir={tmp}/evict",
            "--enable_offload=true",
            "--offload_on_evict=true",
        ],
        env={"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "{tmp}/evict"},
    ),
    Suite(
        W + "test_promotion_on_hit.py",
        master_flags=[
            "--root_fs_dir={tmp}/promo",
            "--enable_offload=true",
            "--offload_on_evict=true",
            "--promotion_on_hit=true",
            "--promotion_admission_threshold=1",
        ],
        env={
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "{tmp}/promo",
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "10",
            "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": "10485760",
        },
    ),
    Suite(W + "test_dataproto_catalog.py"),
    Suite(W + "test_structured_object_store.py", timeout=1800.0),
    Suite(W + "test_mooncake_store_service_api.py"),
    Suite("scripts/test_tensor_api.py", script=True, argv=["-n", "1"]),
    Suite("scripts/test_async_store.py"),
    Suite("scripts/test_copy_move_api.py"),
    Suite("scripts/test_upsert_api.py"),
    Suite("scripts/test_engram_store.py"),
    Suite("scripts/test_drain_http_api.py", script=True, argv=["--timeout-sec", "90"]),
]
#: upstream CI's master RPC, HTTP metadata and admin ports (``--ci-ports``)
CI_PORTS = (50051, 8080, 9003)
#: in the tree but not run: hardware or builds this package does not have
NOT_RUN = {
    W + "test_mooncake_ep.py": "needs CUDA GPUs (Mooncake EP)",
    W + "test_transfer_on_cuda.py": "needs CUDA GPUs",
    W + "test_transfer_on_hip.py": "needs ROCm GPUs",
    W + "test_regmr_overhead.py": "needs GPUs and torch.distributed",
    W + "test_distributed_object_store_cxl.py": "needs a CXL device (TEST_CXL in CI)",
    W + "test_spdk_tgt_create.py": "needs SPDK",
    W + "test_release_wheel_tags.py": "checks upstream's wheel build tags",
    W + "test_meta_server.py": "manual script (a second host's master)",
    "scripts/test_hicache_hugepage_requirements.py": "needs SGLang HiCache and hugepages",
}


@dataclass
class Result:
    suite: str
    name: str
    outcome: str  # passed / failed / error / skipped
    reason: str = ""


#: pytest and what it imports, lent to an interpreter that lacks it (pure Python)
PYTEST_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


def pytest_overlay(python: str, folder: Path) -> str:
    """A folder for ``PYTHONPATH`` holding links to this interpreter's pytest, when
    ``python`` (the published wheel's venv) has none; "" when it has its own. Only those
    modules are lent, so the package under test and its dependencies stay the venv's."""
    probe = subprocess.run([python, "-c", "import pytest"], capture_output=True)
    if probe.returncode == 0:
        return ""
    import pytest as _pytest_pkg

    site = Path(_pytest_pkg.__file__).resolve().parents[1]
    folder.mkdir(parents=True, exist_ok=True)
    for name in PYTEST_MODULES:
        if (site / name).exists():
            (folder / name).symlink_to(site / name)
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {START_S:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group we created, then SIGKILL (by PID only)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def export_tree(mirror: str, rev: str, dest: Path) -> None:
    paths = sorted({s.path for s in SUITES} | {s.background for s in SUITES if s.background})
    extra = [W + "conftest.py"]
    archive = dest / "tests.tar"
    with archive.open("wb") as f:
        subprocess.run(
            ["git", "--git-dir", mirror, "archive", rev, "--", *extra, *paths],
            stdout=f,
            check=True,
        )
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "upstream", filter="data")
    archive.unlink()
    build = dest / "upstream" / "build" / "mooncake-integration"
    build.mkdir(parents=True)
    (build / "store.py").write_text("from mooncake.store import *  # noqa: F403\n")


def write_shims(bindir: Path, python: str, shims: dict[str, str]) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    for name, target in shims.items():
        mod, func = target.split(":")
        shim = bindir / name
        shim.write_text(f"#!{python}\nimport sys\nfrom {mod} import {func}\nsys.exit({func}())\n")
        shim.chmod(0o755)


class Services:
    """The master (with its embedded HTTP metadata server) and, on demand, ``mooncake_client``."""

    def __init__(
        self, tmp: Path, env: dict[str, str], flags: Sequence[str], ci_ports: bool = False
    ) -> None:
        if ci_ports:  # upstream's defaults, which some tests hard-code (127.0.0.1:50051)
            self.rpc, self.meta, self.metrics = CI_PORTS
        else:
            self.rpc, self.meta, self.metrics = free_port(), free_port(), free_port()
        self.env = env
        self.log = open(tmp / "master.log", "ab")  # noqa: SIM115 (closed in close())
        cmd = [
            str(Path(env["PATH"].split(os.pathsep)[0]) / "mooncake_master"),
            f"--port={self.rpc}",
            f"--metrics_port={self.metrics}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.meta}",
            "--http_metadata_server_host=127.0.0.1",
            "--default_kv_lease_ttl=500",
            "--eviction_high_watermark_ratio=0.95",
            "--cluster_id=ci_test_cluster",
            *flags,
        ]
        self.master = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.client: subprocess.Popen[bytes] | None = None
        try:
            wait_listening(self.rpc, self.master, "mooncake_master")
            wait_listening(self.meta, self.master, "the HTTP metadata server")
        except BaseException:
            self.close()
            raise

    def test_env(self) -> dict[str, str]:
        meta = f"http://127.0.0.1:{self.meta}/metadata"
        master = f"127.0.0.1:{self.rpc}"
        return {
            **self.env,
            "MC_METADATA_SERVER": meta,
            "MOONCAKE_TE_META_DATA_SERVER": meta,
            "METADATA_ADDR": meta,
            "MASTER_SERVER": master,
            "MOONCAKE_MASTER": master,
            "MOONCAKE_MASTER_CONTROL_BASE": f"http://127.0.0.1:{self.metrics}",
            "DEFAULT_KV_LEASE_TTL": "500",
            "MOONCAKE_PROTOCOL": "tcp",
        }

    def start_client(self, tmp: Path) -> None:
        bindir = Path(self.env["PATH"].split(os.pathsep)[0])
        cmd = [
            str(bindir / "mooncake_client"),
            "--host=127.0.0.1",
            "--port=50052",  # the dummy-client tests hard-code 127.0.0.1:50052
            f"--metadata_server=http://127.0.0.1:{self.meta}/metadata",
            f"--master_server_address=127.0.0.1:{self.rpc}",
            "--global_segment_size=4 GB",
        ]
        self.client = subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        # ready once it serves: ours on the abstract socket @mooncake_client_50052.sock, the
        # published one on TCP 127.0.0.1:50052 (its RPC port)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.client.poll() is not None:
                raise RuntimeError(f"mooncake_client exited with {self.client.returncode}")
            for family, addr in (
                (socket.AF_UNIX, "\0mooncake_client_50052.sock"),
                (socket.AF_INET, ("127.0.0.1", 50052)),
            ):
                s = socket.socket(family)
                try:
                    s.connect(addr)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.2)
        raise RuntimeError("mooncake_client did not serve within the start-up bound")

    def close(self) -> None:
        if self.client is not None:
            stop(self.client)
        stop(self.master)
        self.log.close()


@contextmanager
def services(
    tmp: Path, env: dict[str, str], suite: Suite, ci_ports: bool = False
) -> Iterator[Services]:
    flags = [f.replace("{tmp}", str(tmp)) for f in suite.master_flags]
    for f in flags:
        if f.startswith("--root_fs_dir="):
            Path(f.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)
    svc = Services(tmp, env, flags, ci_ports)
    try:
        if suite.real_client:
            svc.start_client(tmp)
        yield svc
    finally:
        svc.close()


def _junit(path: Path, suite: str) -> list[Result]:
    out: list[Result] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = (el.get("message") or (el.text or "")).strip().splitlines()
                reason = reason[0][:300] if reason else ""  # type: ignore[assignment]
                break
        out.append(Result(suite, name, outcome, str(reason)))
    return out


def _tail(text: str, n: int = 300) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:n]


def run_suite(
    suite: Suite, tree: Path, tmp: Path, env: dict[str, str], python: str, ci_ports: bool = False
) -> list[Result]:
    test = tree / suite.path
    cwd = test.parent
    extra_env = {k: v.replace("{tmp}", str(tmp)) for k, v in suite.env.items()}
    ctx = services(tmp, env, suite, ci_ports)
    try:
        svc = ctx.__enter__()
    except RuntimeError as e:
        return [Result(suite.path, "(services)", "error", str(e))]
    bg: subprocess.Popen[bytes] | None = None
    try:
        run_env = {**svc.test_env(), **extra_env}
        if suite.background:
            bg = subprocess.Popen(
                [python, str(tree / suite.background)],
                cwd=cwd,
                env=run_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            time.sleep(3.0)  # as run_tests.sh: the target registers itself, then the initiator runs
        if suite.script:
            procs = [
                subprocess.Popen(
                    [python, str(test), *(a.replace("{i}", str(i + 1)) for a in suite.argv)],
                    cwd=cwd,
                    env=run_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                for i in range(suite.parallel)
            ]
            results = []
            for i, p in enumerate(procs):
                try:
                    out, _ = p.communicate(timeout=suite.timeout)
                except subprocess.TimeoutExpired:
                    stop(p)
                    out, _ = p.communicate()
                    results.append(Result(suite.path, f"main[{i}]", "error", "timed out"))
                    continue
                text = out.decode("utf-8", "replace")
                (tmp / f"{test.stem}.{i}.log").write_text(text)
                ok = p.returncode == 0
                results.append(
                    Result(
                        suite.path,
                        f"main[{i}]",
                        "passed" if ok else "failed",
                        "" if ok else _tail(text),
                    )
                )
            return results
        xml = tmp / f"{test.stem}.xml"
        cmd = [
            python, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", str(cwd), f"--junitxml={xml}",
        ]  # fmt: skip
        p = subprocess.Popen(
            cmd, cwd=cwd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = p.communicate(timeout=suite.timeout)
        except subprocess.TimeoutExpired:
            stop(p)
            out, _ = p.communicate()
        text = out.decode("utf-8", "replace")
        (tmp / f"{test.stem}.log").write_text(text)
        if not xml.exists():
            return [Result(suite.path, "(file)", "error", _tail(text) or f"rc={p.returncode}")]
        results = _junit(xml, suite.path)
        if not results:
            return [Result(suite.path, "(file)", "error", _tail(text) or "no tests collected")]
        return results
    finally:
        if bg is not None:
            stop(bg)
        ctx.__exit__(None, None, None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", default=DEFAULT_MIRROR, help="git dir of kvcache-ai/Mooncake")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("-k", action="append", default=[], help="only files whose path has WORD")
    ap.add_argument("--python", default=None, help="interpreter (default: this one)")
    ap.add_argument("--published", action="store_true", help="test the published wheel instead")
    ap.add_argument("--json", help="write the per-test results here")
    ap.add_argument(
        "--ci-ports",
        action="store_true",
        help="serve on upstream CI's fixed ports 50051/8080/9003 (some tests hard-code "
        "127.0.0.1:50051); refused when one is taken",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args(argv)

    suites = [s for s in SUITES if not args.k or any(k in s.path for k in args.k)]
    if args.ci_ports:
        for port in CI_PORTS:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ap.error(f"--ci-ports: port {port} is taken on this host")
    tmp = Path(tempfile.mkdtemp(prefix="mc-upstream-"))
    try:
        export_tree(args.mirror, args.rev, tmp)
        python = args.python or (ANCHOR_PYTHON if args.published else sys.executable)
        write_shims(tmp / "bin", python, PUBLISHED_SHIMS if args.published else SHIMS)
        env = dict(os.environ)
        env["PATH"] = f"{tmp / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        if args.published:
            env.pop("PYTHONPATH", None)
            runner = pytest_overlay(python, tmp / "pytest-overlay")
            if runner:
                env["PYTHONPATH"] = runner
        else:
            env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
        env["MC_FORCE_TCP"] = "true"
        env.pop("MOONCAKE_CONFIG_PATH", None)
        results: list[Result] = []
        for suite in suites:
            t0 = time.monotonic()
            got = run_suite(suite, tmp / "upstream", tmp, env, python, args.ci_ports)
            results += got
            n_ok = sum(r.outcome == "passed" for r in got)
            print(
                f"# {suite.path}: {n_ok}/{len(got)} passed ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            for r in got:
                if r.outcome not in ("passed", "skipped"):
                    print(f"  {r.outcome.upper():7} {r.name}: {r.reason}", flush=True)
        counts = {
            o: sum(r.outcome == o for r in results)
            for o in ("passed", "failed", "error", "skipped")
        }
        print("total:", len(results), " ".join(f"{k}={v}" for k, v in counts.items()))
        for path, why in NOT_RUN.items():
            print(f"not run: {path}: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
        if args.keep:
            print("work directory:", tmp)
        return 0 if counts["failed"] == counts["error"] == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
