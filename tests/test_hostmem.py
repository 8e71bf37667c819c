"""Segments and buffers larger than the machine can back are refused up front, by name."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import mooncake
from mooncake._core import hostmem
from mooncake.errors import InvalidArgumentError
from mooncake.store import MooncakeDistributedStore
from tests.helpers.store_procs import Master

TIB = 1 << 40


def _files(tmp: Path, avail_kb: int, cgroup: str, limit: str, used: str, v2: bool) -> Path:
    (tmp / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kb} kB\n")
    (tmp / "cgroup").write_text(cgroup)
    root = tmp / "fs"
    if v2:
        d = root / "grp"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(limit)
        (d / "memory.current").write_text(used)
    else:
        d = root / "memory" / "grp"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(limit)
        (d / "memory.usage_in_bytes").write_text(used)
    return root


@pytest.mark.parametrize("v2", [True, False], ids=["cgroup-v2", "cgroup-v1"])
def test_available_is_the_smaller_of_memavailable_and_the_cgroup_room(
    tmp_path: Path, v2: bool
) -> None:
    line = "0::/grp\n" if v2 else "4:memory:/grp\n"
    root = _files(tmp_path, 1 << 20, line, str(300 << 20), str(100 << 20), v2)
    got = hostmem.available_bytes(tmp_path / "meminfo", root, tmp_path / "cgroup")
    assert got == 200 << 20  # the cgroup leaves 200 MiB of the 1 GiB available
    unlimited = "max" if v2 else "9223372036854771712"
    (tmp_path / "u").mkdir()
    root = _files(tmp_path / "u", 1 << 20, line, unlimited, "5", v2)
    got = hostmem.available_bytes(tmp_path / "u" / "meminfo", root, tmp_path / "u" / "cgroup")
    assert got == 1 << 30
    assert hostmem.available_bytes(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None


def test_check_names_the_size_and_what_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hostmem.CHECK_ENV, raising=False)
    hostmem.check_backable(100, "a segment", available=100)
    with pytest.raises(InvalidArgumentError, match=r"a segment of 101 bytes .* only 100 bytes"):
        hostmem.check_backable(101, "a segment", available=100)
    monkeypatch.setenv(hostmem.CHECK_ENV, "0")
    hostmem.check_backable(101, "a segment", available=100)


def test_setup_refuses_a_segment_or_buffer_the_machine_cannot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(hostmem.CHECK_ENV, raising=False)
    avail = hostmem.available_bytes()
    if avail is None or avail >= TIB:
        pytest.skip("this machine could back 1 TiB")
    m = Master()
    try:
        for seg, buf in ((TIB, 16 << 20), (16 << 20, TIB)):
            s = MooncakeDistributedStore()
            # old code pre-faulted the whole TiB (minutes, then the OOM killer)
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", seg, buf, "tcp", "", m.address) != 0
            s.close()
        s = MooncakeDistributedStore()  # the same client with sizes that fit still works
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", m.address) == 0
        assert s.put("k", b"fits") == 0 and s.get("k") == b"fits"
        s.close()

        async def main() -> None:
            with pytest.raises(InvalidArgumentError, match="cannot be backed"):
                async with mooncake.open_store(m.address, segment_size=TIB):
                    pass
            async with mooncake.open_engine(transports=["tcp"]) as eng:
                with pytest.raises(InvalidArgumentError, match=r"a buffer of \d+ bytes"):
                    await eng.allocate(TIB)

        anyio.run(main, backend="trio")
    finally:
        m.stop()
