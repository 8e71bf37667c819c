"""Sans-I/O RDMA pieces: slicing, handshake and descriptor codecs, NIC choice, rail health,
and topology discovery from a fake sysfs tree."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._core.descriptor import BufferDesc, SegmentDescriptor, decode_descriptor
from mooncake._core.rdma import (
    ConnectionInfo,
    PriorityMatrix,
    RailHealth,
    decode_connection,
    decode_rdma_segment,
    format_gid,
    nic_path,
    parse_gid,
    split_lengths,
    split_nic_path,
)
from mooncake._engine.transports.rdma_topology import discover, pci_distance
from mooncake.errors import InvalidArgumentError, ProtocolError


@given(
    length=st.integers(1, 1 << 22),
    slice_size=st.sampled_from([4096, 65536, 1 << 20]),
    ratio=st.sampled_from([1, 4, 16]),
    cuts=st.lists(st.integers(0, 1 << 22), max_size=4),
)
def test_slices_tile_the_range_and_respect_cuts(
    length: int, slice_size: int, ratio: int, cuts: list[int]
) -> None:
    frag = slice_size // ratio
    out = split_lengths(length, slice_size, frag, cuts)
    assert out[0][0] == 0
    pos = 0
    for off, n in out:
        assert off == pos and n > 0
        assert n <= slice_size + frag
        assert not any(off < c < off + n for c in cuts)  # never crosses a region boundary
        pos += n
    assert pos == length
    pieces = sorted({c for c in cuts if 0 < c < length} | {0, length})
    # exactly Mooncake's count per piece: full slices, the tail merged when small enough
    for lo, hi in itertools.pairwise(pieces):
        n = hi - lo
        inside = [s for s in out if lo <= s[0] < hi]
        expect = 1 if n <= slice_size + frag else -(-(n - slice_size - frag) // slice_size) + 1
        assert len(inside) == expect
        assert all(ln == slice_size for _, ln in inside[:-1])
        assert len(inside) == 1 or inside[-1][1] > frag  # a small tail would have merged


def test_tail_merge_examples() -> None:
    assert split_lengths(65536 + 16384) == [(0, 65536 + 16384)]
    assert split_lengths(65536 + 16385) == [(0, 65536), (65536, 16385)]
    assert split_lengths(3 * 65536 + 5) == [(0, 65536), (65536, 65536), (131072, 65541)]
    assert split_lengths(100, cuts=[40]) == [(0, 40), (40, 60)]


@given(st.binary(min_size=16, max_size=16))
def test_gid_text_round_trips(raw: bytes) -> None:
    text = format_gid(raw)
    assert len(text.split(":")) == 16 and text == text.lower()
    assert parse_gid(text) == raw


@pytest.mark.parametrize("bad", ["", "fe80::1", "zz:" * 15 + "00", "00:" * 16, 5])
def test_bad_gid_is_protocol_error(bad: object) -> None:
    with pytest.raises(ProtocolError):
        parse_gid(bad)  # type: ignore[arg-type]


def test_nic_paths_split_at_the_last_at() -> None:
    assert split_nic_path(nic_path("10.0.0.1:15002", "mlx5_0")) == ("10.0.0.1:15002", "mlx5_0")
    assert split_nic_path("user@host:1@mlx5_1") == ("user@host:1", "mlx5_1")
    for bad in ("mlx5_0", "@mlx5_0", "host:1@"):
        with pytest.raises(ProtocolError):
            split_nic_path(bad)


@given(
    qps=st.lists(st.integers(1, (1 << 24) - 1), min_size=1, max_size=64),
    lid=st.none() | st.integers(0, 65535),
    gid=st.none() | st.binary(min_size=16, max_size=16),
)
def test_connection_round_trips(qps: list[int], lid: int | None, gid: bytes | None) -> None:
    c = ConnectionInfo("a:1@soft0", "b:2@soft1", tuple(qps), lid, gid)
    wire = json.loads(json.dumps(c.to_json()))
    assert set(wire) >= {"local_nic_path", "peer_nic_path", "qp_num", "reply_msg"}
    assert decode_connection(wire) == c


def test_connection_from_older_engines_and_rejections() -> None:
    # the published engine's encoder: no lid/gid fields
    c = decode_connection(
        {
            "local_nic_path": "h:1@mlx5_0",
            "peer_nic_path": "g:2@mlx5_1",
            "qp_num": [7, 8],
            "reply_msg": "",
        }
    )
    assert c.lid is None and c.gid is None and c.qp_num == (7, 8)
    r = decode_connection(
        {"local_nic_path": "", "peer_nic_path": "", "qp_num": [], "reply_msg": "no such device"}
    )
    assert r.reply_msg == "no such device"
    bad: object
    for bad in (
        [],
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": []},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": [0]},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": [1 << 24]},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": [True]},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": list(range(1, 70))},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": [1], "local_lid": -1},
        {"local_nic_path": "h:1@d", "peer_nic_path": "g:2@e", "qp_num": [1], "local_gid": "x"},
        {"local_nic_path": 3, "peer_nic_path": "g:2@e", "qp_num": [1]},
    ):
        with pytest.raises(ProtocolError):
            decode_connection(bad)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: (
            st.lists(c, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "local_nic_path",
                        "peer_nic_path",
                        "qp_num",
                        "reply_msg",
                        "local_lid",
                        "local_gid",
                        "x",
                    ]
                ),
                c,
                max_size=6,
            )
        ),
        max_leaves=12,
    )
)
def test_connection_decoder_parses_or_raises_protocol_error(obj: object) -> None:
    try:
        decode_connection(obj)
    except ProtocolError:
        pass


def _desc(
    devices: object, matrix: object = None, rkeys: tuple[int, ...] = (1, 2)
) -> SegmentDescriptor:
    obj = {
        "name": "h:1",
        "protocol": "rdma",
        "devices": devices,
        "buffers": [
            {
                "name": "cpu:0",
                "addr": 4096,
                "length": 4096,
                "rkey": list(rkeys),
                "lkey": list(rkeys),
            }
        ],
    }
    if matrix is not None:
        obj["priority_matrix"] = matrix
    return decode_descriptor(obj)


def test_descriptor_rdma_fields() -> None:
    devs = [
        {"name": "mlx5_0", "lid": 3, "gid": format_gid(bytes(range(16)))},
        {"name": "mlx5_1", "lid": 4, "gid": format_gid(bytes(16))},
    ]
    d = _desc(devs, {"cpu:0": [["mlx5_1"], ["mlx5_0"]]})
    seg = decode_rdma_segment(d)
    assert seg is not None
    assert [x.name for x in seg.devices] == ["mlx5_0", "mlx5_1"] and seg.devices[0].lid == 3
    assert seg.matrix.candidates("cpu:0") == ((1,), (0,))
    buf = d.buffers[0]
    assert seg.rkey(buf, 1) == 2
    assert decode_rdma_segment(decode_descriptor({"name": "t", "protocol": "tcp"})) is None
    for bad in (
        _desc([]),
        _desc([{"lid": 1}]),
        _desc([{"name": "a", "lid": 70000}]),
        _desc([*devs, devs[0]]),
        _desc(devs, {"cpu:0": [["nope"], []]}),
        _desc(devs, {"cpu:0": "x"}),
    ):
        with pytest.raises(ProtocolError):
            decode_rdma_segment(bad)
    seg = decode_rdma_segment(_desc(devs, rkeys=(1,)))
    assert seg is not None
    with pytest.raises(ProtocolError, match="one key per device"):
        seg.rkey(_desc(devs, rkeys=(1,)).buffers[0], 0)
    assert isinstance(BufferDesc, type)


def test_select_device_like_mooncake() -> None:
    m = PriorityMatrix({"cpu:0": ((0, 1), (2, 3)), "*": ((0, 1, 2, 3), ())}, 4)
    rng = random.Random(1)
    assert {m.select("cpu:0", 0, rng) for _ in range(200)} == {0, 1}  # random among preferred
    assert [m.select("cpu:0", k, rng) for k in range(1, 6)] == [0, 1, 2, 3, 0]  # rotation
    assert m.select("cpu:0", 0, rng, usable=[3]) == 3  # preferred all paused: fall back
    assert m.select("cpu:0", 0, rng, usable=[]) is None
    assert m.select("cpu:7", 0, rng) in (0, 1)  # unknown numa node: another cpu entry
    assert m.select("cuda:0", 0, rng) in range(4)  # "*"
    assert PriorityMatrix({}, 2).select("cpu:0", 3, rng) in (0, 1)


def test_rail_health_pauses_after_threshold_in_window() -> None:
    h = RailHealth(threshold=5, window=5.0, pause=30.0)
    rail = (0, "h:1@mlx5_0")
    for t in (0.0, 1.0, 2.0, 3.0):
        assert not h.record_error(rail, t)
    assert not h.paused(rail, 3.0)
    assert h.record_error(rail, 4.0)
    assert h.paused(rail, 4.0) and h.paused(rail, 33.9)
    assert not h.paused(rail, 34.0)
    # errors spread wider than the window never pause
    for i in range(20):
        assert not h.record_error(rail, 100.0 + 2.0 * i)
    h.record_error(rail, 200.0)
    h.record_success(rail)
    for t in (201.0, 202.0, 203.0, 204.0):
        assert not h.record_error(rail, t)
    assert h.paused_rails(204.0) == []


def _fake_sysfs(root: Path) -> None:
    def w(p: str, text: str) -> None:
        f = root / p
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    pci0 = root / "devices/pci0000:00/0000:00:01.0"
    pci1 = root / "devices/pci0000:80/0000:80:01.0"
    for i, (pci, numa) in enumerate(((pci0, 0), (pci1, 1))):
        nic = pci / f"0000:0{i}:00.0"
        nic.mkdir(parents=True)
        (nic / "numa_node").write_text(f"{numa}\n")
        link = root / f"class/infiniband/mlx5_{i}"
        link.mkdir(parents=True)
        (link / "device").symlink_to(nic)
        gpu = pci / f"0000:0{i}:01.0"
        gpu.mkdir(parents=True)
        (gpu / "vendor").write_text("0x10de\n")
        (gpu / "class").write_text("0x030200\n")
        bus = root / "bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / gpu.name).symlink_to(gpu)
    for n in (0, 1):
        (root / f"devices/system/node/node{n}").mkdir(parents=True)
    w("devices/system/node/possible", "0-1\n")


def test_topology_from_sysfs(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    m = discover(["mlx5_0", "mlx5_1", "soft9"], str(tmp_path))
    assert m.entries["cpu:0"] == ((0, 2), (1,))  # soft9: unknown NUMA, preferred everywhere
    assert m.entries["cpu:1"] == ((1, 2), (0,))
    assert m.entries["cuda:0"][0] == (0,) and m.entries["cuda:1"][0] == (1,)
    assert m.entries["*"] == ((0, 1, 2), ())
    assert json.loads(json.dumps(m.to_json(["mlx5_0", "mlx5_1", "soft9"])))["cpu:1"] == [
        ["mlx5_1", "soft9"],
        ["mlx5_0"],
    ]


def test_custom_topology_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"cpu:0": [["b"], ["a"]]}))
    monkeypatch.setenv("MC_CUSTOM_TOPO_JSON", str(f))
    assert discover(["a", "b"]).entries == {"cpu:0": ((1,), (0,))}
    f.write_text(json.dumps({"cpu:0": [["zz"], []]}))
    with pytest.raises(InvalidArgumentError, match="unknown device 'zz'"):
        discover(["a", "b"])


def test_pci_distance() -> None:
    a = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
    assert pci_distance(a, a) == 0
    assert pci_distance(a, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1") == 2
    assert pci_distance(a, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0") == 6
