"""The CRC32C primitives: the compiled module and its pure-Python twin agree byte for byte."""

from __future__ import annotations

import ctypes
import os
from types import ModuleType

import numpy as np
import pytest

from mooncake._fast import _crc32c_pure

try:
    from mooncake._fast import _crc32c as _compiled
except ImportError:  # not built
    _compiled = None

TWINS = [pytest.param(_crc32c_pure, id="pure")]
if _compiled is not None:
    TWINS.append(pytest.param(_compiled, id="compiled"))

# RFC 3720 (iSCSI) B.4 test vectors, and the common check value
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def buf(data: bytes) -> tuple[np.ndarray, int]:
    a = np.frombuffer(bytearray(data or b"\0"), dtype=np.uint8)
    return a, int(a.ctypes.data)


@pytest.mark.parametrize("m", TWINS)
def test_known_vectors(m: ModuleType) -> None:
    for data, want in VECTORS:
        assert m.crc32c(data) == want
        _, a = buf(data)
        assert m.crc32c_at(a, len(data)) == want


@pytest.mark.parametrize("m", TWINS)
def test_parts_chain_and_combine(m: ModuleType) -> None:
    data = os.urandom(3000)
    whole = m.crc32c(data)
    assert m.crc32c(data[1234:], m.crc32c(data[:1234])) == whole
    keep, a = buf(data)
    assert m.crc32c_parts([(a, 1000), (a + 1000, 0), (a + 1000, 2000)]) == whole
    assert m.crc32c_combine(m.crc32c(data[:7]), m.crc32c(data[7:]), len(data) - 7) == whole
    assert m.crc32c_combine(whole, m.crc32c(b""), 0) == whole
    del keep


@pytest.mark.parametrize("m", TWINS)
def test_copy_and_batch_land_the_bytes_with_their_crc(m: ModuleType) -> None:
    n = 5000 if m is _crc32c_pure else 200_003
    data = os.urandom(n)
    ks, s = buf(data)
    kd, d = buf(bytes(n + 1))
    assert m.copy_crc32c(d + 1, s, n) == m.crc32c(data)
    assert ctypes.string_at(d + 1, n) == data
    kd2, d2 = buf(bytes(n))
    half = n // 2
    got = m.copy_crc32c_batch([d2, d2 + half], [s, s + half], [half, n - half], [True, False])
    assert got == [m.crc32c(data[:half]), -1]
    assert ctypes.string_at(d2, n) == data
    del ks, kd, kd2


@pytest.mark.parametrize("m", TWINS)
def test_bad_arguments_name_what_is_wrong(m: ModuleType) -> None:
    with pytest.raises(ValueError, match="negative length"):
        m.crc32c_at(1, -1)
    with pytest.raises(ValueError, match="null address"):
        m.crc32c_at(0, 4)
    with pytest.raises(ValueError, match="different lengths"):
        m.copy_crc32c_batch([1], [], [1], [True])


@pytest.mark.skipif(_compiled is None, reason="compiled CRC32C not built")
def test_compiled_matches_twin_on_every_alignment_and_block_edge() -> None:
    assert _compiled is not None
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 24575, 24576, 24577, 50000):
        data = rng.integers(0, 256, n + 8, dtype=np.uint8).tobytes()
        for off in (0, 1, 5):
            piece = data[off : off + n]
            assert _compiled.crc32c(piece) == _crc32c_pure.crc32c(piece), (n, off)
            keep, s = buf(piece)
            kd, d = buf(bytes(n + 3))
            if n:
                assert _compiled.copy_crc32c(d + 3 - (off % 3), s, n) == _crc32c_pure.crc32c(piece)
            del keep, kd
