"""Mooncake's C ABI (``transfer_engine_c.h``) served by ``libtransfer_engine.so``.

``tests/c/tllm_replay.c`` is compiled here with the system compiler against the shipped header
and library; it replays TensorRT-LLM's call sequence between two processes (both embed
Python), against the published wheel, and with bad input. Its target and initiator wait on
notifications and batch states with generous deadlines, never on sleeps.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake._cli import c_abi
from mooncake._cli import main as cli_main
from tests.conftest import ROOT, anchor_python, clean_env

CC = shutil.which("cc") or shutil.which("gcc")
LIB = c_abi.LIBRARY
HEADER = c_abi.HEADER
PROGRAM = ROOT / "tests" / "c" / "tllm_replay.c"

pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler (cc) on this machine"),
    pytest.mark.skipif(
        not LIB.exists(), reason="libtransfer_engine.so not built (setup.py build_ext)"
    ),
]

# every function of Mooncake's transfer_engine_c.h (Mooncake @ 3b5a5941)
UPSTREAM_FUNCTIONS = {
    "createTransferEngine",
    "discoverTopology",
    "getLocalIpAndPort",
    "installTransport",
    "uninstallTransport",
    "openSegment",
    "openSegmentNoCache",
    "closeSegment",
    "warmupEfaSegment",
    "removeLocalSegment",
    "destroyTransferEngine",
    "registerLocalMemory",
    "unregisterLocalMemory",
    "registerLocalMemoryBatch",
    "unregisterLocalMemoryBatch",
    "allocateBatchID",
    "submitTransfer",
    "submitTransferWithNotify",
    "getNotifsFromEngine",
    "freeNotifsMsgBuf",
    "genNotifyInEngine",
    "getTransferStatus",
    "freeBatchID",
    "syncSegmentCache",
    "getNicLoadStats",
    "enableGracefulShutdown",
    "showLinks",
}


def _env() -> dict[str, str]:
    env = clean_env()
    env.pop("PYTHONHOME", None)
    return env


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cabi") / "tllm_replay"
    assert CC is not None
    cmd = [
        CC,
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-std=gnu11",
        "-pthread",
        *c_abi.cflags().split(),
        str(PROGRAM),
        "-o",
        str(out),
        *c_abi.libs().split(),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


class Target:
    """A target process (ours in C, or the published wheel's) that prints ``READY seg addr``."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.match(r"READY (\S+) (\d+)", line)
        if m is None:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"target did not start: {line!r} {err[-2000:]}")
        self.segment, self.addr = m.group(1), m.group(2)

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=180)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def targets() -> Iterator[list[Target]]:
    made: list[Target] = []
    yield made
    for t in made:
        t.kill()


def _initiator(program: Path, target: Target) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(program), "initiator", target.segment, target.addr],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )


def test_the_library_exports_every_function_of_the_header() -> None:
    declared = set(re.findall(r"\b(\w+)\s*\(", HEADER.read_text()))
    assert declared >= UPSTREAM_FUNCTIONS
    lib = ctypes.CDLL(str(LIB))
    missing = [f for f in sorted(UPSTREAM_FUNCTIONS) if not hasattr(lib, f)]
    assert missing == []


def test_struct_layouts_and_constants_are_mooncakes(program: Path) -> None:
    # the _Static_asserts in tllm_replay.c already held at compile time; the sizes, as run
    r = subprocess.run([str(program), "layout"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.split() == [
        "transfer_request",
        "40",
        "notify_msg",
        "16",
        "transfer_status",
        "16",
        "segment_desc",
        "48",
        "buffer_entry",
        "16",
        "nic_load_stat",
        "80",
    ]


def test_bad_input_returns_mooncakes_error_codes(program: Path) -> None:
    r = subprocess.run(
        [str(program), "bad"], capture_output=True, text=True, env=_env(), timeout=240
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DONE 0" in r.stdout


def test_tensorrt_llm_sequence_between_two_processes(program: Path, targets: list[Target]) -> None:
    target = Target([str(program), "target"], _env())
    targets.append(target)
    r = _initiator(program, target)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DONE 0" in r.stdout
    rc, out, err = target.finish()
    assert rc == 0, out + err
    assert "DONE 0" in out


ANCHOR = anchor_python()


@pytest.mark.anchor
@pytest.mark.skipif(ANCHOR is None, reason="published Mooncake wheel not installed")
def test_tensorrt_llm_sequence_against_the_published_wheel(
    program: Path, targets: list[Target]
) -> None:
    assert ANCHOR is not None
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["MC_LOG_LEVEL"] = "ERROR"
    target = Target([ANCHOR, str(ROOT / "tests" / "c" / "published_target.py")], env)
    targets.append(target)
    r = _initiator(program, target)
    assert r.returncode == 0, r.stdout + r.stderr
    rc, out, err = target.finish()
    assert rc == 0, out + err[-3000:]
    assert "DONE 0" in out


def test_inside_python_the_library_shares_the_interpreter() -> None:
    """Loaded with ctypes, the library runs the engine in this interpreter: the module it calls
    is this process's, and a copy into our own segment moves the bytes."""
    code = f"""
import ctypes, sys
lib = ctypes.CDLL({str(LIB)!r})
lib.createTransferEngine.restype = ctypes.c_void_p
lib.createTransferEngine.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_uint64, ctypes.c_int]
e = lib.createTransferEngine(b"P2PHANDSHAKE", b"127.0.0.1", b"", 0, 1)
assert e, "no engine"
import mooncake._engine.cabi as cabi
assert cabi._finish is not None, "the library attached to another interpreter"
buf = (ctypes.c_uint8 * 65536)()
for i in range(4096):
    buf[i] = (i * 7) & 0xFF
addr = ctypes.addressof(buf)
V = ctypes.c_void_p
lib.registerLocalMemory.argtypes = [V, V, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]
assert lib.registerLocalMemory(e, addr, 65536, b"*", 1) == 0
lib.allocateBatchID.restype = ctypes.c_uint64
lib.allocateBatchID.argtypes = [V, ctypes.c_size_t]
bid = lib.allocateBatchID(e, 4)
class Req(ctypes.Structure):
    _fields_ = [("opcode", ctypes.c_int), ("source", V), ("target_id", ctypes.c_int32),
                ("target_offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]
class St(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("transferred_bytes", ctypes.c_uint64)]
assert ctypes.sizeof(Req) == 40
lib.submitTransfer.argtypes = [V, ctypes.c_uint64, ctypes.POINTER(Req), ctypes.c_size_t]
lib.getTransferStatus.argtypes = [V, ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(St)]
lib.freeBatchID.argtypes = [V, ctypes.c_uint64]
r = Req(1, addr, 0, addr + 32768, 4096)
assert lib.submitTransfer(e, bid, ctypes.byref(r), 1) == 0
st = St(0, 0)
import time
end = time.monotonic() + 120
while time.monotonic() < end:
    assert lib.getTransferStatus(e, bid, 0, ctypes.byref(st)) == 0
    if st.status not in (0, 1):
        break
    time.sleep(0.001)
assert st.status == 4 and st.transferred_bytes == 4096, (st.status, st.transferred_bytes)
assert bytes(buf[32768:32768 + 4096]) == bytes(buf[:4096])
assert lib.freeBatchID(e, bid) == 0
lib.unregisterLocalMemory.argtypes = [V, V]
assert lib.unregisterLocalMemory(e, addr) == 0
lib.destroyTransferEngine.argtypes = [V]
lib.destroyTransferEngine(e)
print("OK")
"""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=240
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "OK"


def test_cli_prints_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["c-abi", "--cflags"]) == 0
    assert capsys.readouterr().out.strip() == f"-I{HEADER.parent}"
    assert cli_main(["c-abi", "--libs"]) == 0
    assert "-ltransfer_engine" in capsys.readouterr().out
    assert cli_main(["c-abi", "--root"]) == 0
    root = Path(capsys.readouterr().out.strip())
    # TensorRT-LLM's CMake looks for MOONCAKE_ROOT/lib and MOONCAKE_ROOT/include
    assert (root / "lib" / "libtransfer_engine.so").exists()
    assert (root / "include" / "transfer_engine_c.h").exists()


def test_device_memory_check_compiles_and_runs_where_there_is_a_gpu(tmp_path: Path) -> None:
    """tests/c/gpu_register.c (benchmarks/gpu_check_cabi.sh runs it on a GPU machine) builds
    here; it runs to the end only with a usable GPU (exit 3 without one)."""
    assert CC is not None
    exe = tmp_path / "gpu_register"
    src = ROOT / "tests" / "c" / "gpu_register.c"
    cmd = [CC, "-O1", "-Wall", "-Werror", "-std=gnu11", *c_abi.cflags().split(), str(src)]
    r = subprocess.run(
        [*cmd, "-o", str(exe), *c_abi.libs().split(), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, env=_env(), timeout=300)
    if r.returncode == 3:
        pytest.skip(f"no usable GPU: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr
