"""Every compiled CRC32C kernel (tables, crc32 instruction, PCLMULQDQ and VPCLMULQDQ folding)
against the pure-Python twin: random lengths and alignments, chained parts, combine."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake._fast import _crc32c_pure as pure

compiled: ModuleType | None
try:
    from mooncake._fast import _crc32c as compiled
except ImportError:  # not built
    compiled = None

pytestmark = pytest.mark.skipif(compiled is None, reason="compiled CRC32C not built")

ROOT = Path(__file__).resolve().parents[1]
KERNELS = compiled.AVAILABLE if compiled is not None else ()


@pytest.fixture
def restore_kernel() -> Iterator[None]:
    assert compiled is not None
    was = compiled.KERNEL
    try:
        yield
    finally:
        compiled.set_kernel(was)


def _block(n: int, seed: int, pad: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n + pad, dtype=np.uint8)


def test_every_kernel_gives_the_check_value(restore_kernel: None) -> None:
    assert compiled is not None
    assert compiled.KERNEL in compiled.AVAILABLE
    for k in KERNELS:
        assert compiled.set_kernel(k) == k == compiled.KERNEL
        assert compiled.crc32c(b"123456789") == 0xE3069283, k
        assert (k != "table") == compiled.HARDWARE


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.one_of(st.integers(0, 1100), st.integers(0, 65536)),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    init=st.integers(0, 0xFFFFFFFF),
    cut=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_kernel_equals_the_pure_twin(
    restore_kernel: None, n: int, src_off: int, dst_off: int, init: int, cut: float, seed: int
) -> None:
    assert compiled is not None
    src = _block(n, seed)
    data = src[src_off : src_off + n].tobytes()
    want = pure.crc32c(data, init)
    split = int(n * cut)
    head, tail = pure.crc32c(data[:split]), pure.crc32c(data[split:])
    assert pure.crc32c_combine(head, tail, n - split) == pure.crc32c(data)
    a = int(src.ctypes.data) + src_off
    for k in KERNELS:
        compiled.set_kernel(k)
        assert compiled.crc32c_at(a, n, init) == want, (k, n, src_off)
        assert compiled.crc32c_at(a + split, n - split, compiled.crc32c_at(a, split, init)) == want
        assert compiled.crc32c_combine(head, tail, n - split) == pure.crc32c(data)
        dst = np.zeros(n + 128, dtype=np.uint8)
        d = int(dst.ctypes.data) + dst_off
        stream = bool(seed & 1)  # non-temporal stores (4 KiB and more) or not
        assert compiled.copy_crc32c(d, a, n, init, stream) == want, (k, n, src_off, dst_off)
        assert ctypes.string_at(d, n) == data
        # nothing written outside [dst_off, dst_off + n)
        assert not dst[:dst_off].any() and not dst[dst_off + n :].any()
        assert compiled.bytes_crc32c(a, n, init) == (data, want)
        got = compiled.copy_crc32c_batch([d], [a + split], [n - split], [True], not stream)
        assert got == [pure.crc32c(data[split:])]


def test_kernels_on_the_block_edges(restore_kernel: None) -> None:
    """Lengths around every loop boundary of the kernels (16/64/256-byte steps, the alignment
    prefixes, the three-stream 256 B / 8 KiB blocks), at every source alignment in a line."""
    assert compiled is not None
    edges = sorted({e + d for e in (16, 64, 79, 256, 319, 768, 24576) for d in (-1, 0, 1, 15)})
    src = _block(max(edges), 7)
    for n in edges:
        for off in range(0, 64, 3):
            data = src[off : off + n].tobytes()
            want = pure.crc32c(data)
            a = int(src.ctypes.data) + off
            for k in KERNELS:
                compiled.set_kernel(k)
                assert compiled.crc32c_at(a, n) == want, (k, n, off)


def _in_child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from mooncake._fast import _crc32c as c; print(c.KERNEL, hex(c.crc32c(b'123456789')))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_env_selects_the_kernel(kernel: str) -> None:
    r = _in_child({"MOONCAKE_CRC_KERNEL": kernel})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [kernel, "0xe3069283"]


def test_env_with_an_unknown_kernel_names_the_variable() -> None:
    r = _in_child({"MOONCAKE_CRC_KERNEL": "sse9"})
    assert r.returncode != 0
    assert "MOONCAKE_CRC_KERNEL='sse9'" in r.stderr


def test_bad_kernel_name_is_refused(restore_kernel: None) -> None:
    assert compiled is not None
    with pytest.raises(ValueError, match="'fast'"):
        compiled.set_kernel("fast")
    with pytest.raises(ValueError, match="'fast'"):
        pure.set_kernel("fast")
    assert pure.set_kernel("avx512") == "pure"


def test_bytes_crc32c_twins_agree_and_refuse_bad_input() -> None:
    assert compiled is not None
    src = _block(5000, 11)
    a = int(src.ctypes.data)
    data = src[3:4003].tobytes()
    for m in (compiled, pure):
        assert m.bytes_crc32c(a + 3, 4000, 5) == (data, pure.crc32c(data, 5))
        assert m.bytes_crc32c(a, 0, 7) == (b"", 7)
        with pytest.raises(ValueError, match="bytes_crc32c: negative length"):
            m.bytes_crc32c(a, -1)
        with pytest.raises(ValueError, match="bytes_crc32c: null address"):
            m.bytes_crc32c(0, 4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_verification_default_follows_the_kernel(kernel: str) -> None:
    """Verified reads are on by default only with a kernel measured fast enough
    (``verify.FAST_KERNELS``); MOONCAKE_STORE_CHECKSUM=0 turns them off, =1 on."""
    from mooncake._store import verify

    fast = kernel in verify.FAST_KERNELS
    code = (
        "from mooncake._store import verify as v; from mooncake._fast import _crc32c as c; "
        "print(c.KERNEL, v.DEFAULT, v.ReadVerifier().enabled)"
    )
    for env, want in (("", fast), ("0", False), ("1", True)):
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "MOONCAKE_CRC_KERNEL": kernel,
                "MOONCAKE_STORE_CHECKSUM": env,
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [kernel, str(fast), str(want)], env
