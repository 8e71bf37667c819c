"""Master snapshots from a hostile or broken store: nothing in them is ever executed, and
anything but an intact ``MCKSNAP3`` snapshot is refused with ``InvalidArgumentError``."""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake._core.master import MasterConfig, MasterState, safecodec
from mooncake._core.master import snapshot as snapmod
from mooncake._core.store_types import ReplicateConfig, Segment
from mooncake.errors import InvalidArgumentError

KiB = 1024


def populated() -> MasterState:
    m = MasterState(MasterConfig(seed=3))
    m.mount_segment("c0", Segment(id="s0", name="h:1", base=1 << 20, size=256 * KiB), now=0.0)
    for i in range(20):
        m.put_start("c0", f"key-{i}", 1000 + i, ReplicateConfig(), now=0.0)
        if i % 3:
            m.put_end("c0", f"key-{i}", now=0.0)
    return m


def framed(payload: bytes, schema: int = snapmod.SCHEMA) -> bytes:
    """``payload`` under a correct MCKSNAP3 header (so it reaches the decoder)."""
    return snapmod.MAGIC + struct.pack("<IIQ", schema, zlib.crc32(payload), len(payload)) + payload


def payload_of(data: bytes) -> bytes:
    return data[len(snapmod.MAGIC) + 16 :]


class _Exec:
    """A pickle that, when loaded, creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_pickled_snapshot_of_the_old_format_is_refused_by_name_and_never_runs(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "pwned"
    hostile = pickle.dumps({"x": _Exec(marker)})
    for magic in (b"MCKSNAP2", b"MCKSNAP1"):
        with pytest.raises(InvalidArgumentError, match=f"older format \\({magic.decode()}\\)"):
            MasterState.restore(magic + hostile + hostile)
    with pytest.raises(InvalidArgumentError, match="bad magic"):
        MasterState.restore(hostile)
    assert not marker.exists()


@pytest.mark.parametrize(
    "node",
    [
        ["X", 0, "os:system", [], None],
        ["X", 0, "builtins:eval", [], None],
        ["X", 0, "mooncake._store.master:MasterServer", [], None],  # outside the data types
        ["X", 0, "mooncake._core.master.records:_Object.__init__", [], None],
        ["C", 0, "os.system", ["T", ["touch x"]]],
        ["E", "subprocess:Popen", "ls"],
        ["M", 0, "mooncake._core.store_types:Segment", ["D", 1, ["id", ["r", 7]]]],
    ],
)
def test_a_graph_naming_anything_but_the_known_types_is_refused(node: list[Any]) -> None:
    with pytest.raises(ValueError):
        safecodec.decode_tree(node)
    payload = msgspec.msgpack.encode({"head": node, "body": node})
    with pytest.raises(InvalidArgumentError, match="malformed master snapshot"):
        MasterState.restore(framed(payload))


def test_truncated_wrong_checksum_wrong_schema_and_wrong_length_are_refused() -> None:
    data = populated().snapshot()
    assert data.startswith(b"MCKSNAP3")
    assert MasterState.restore(data).object_count == populated().object_count
    for cut in sorted({0, 4, 8, 12, 20, 23, 24, 25, len(data) // 2, len(data) - 1}):
        with pytest.raises(InvalidArgumentError):
            MasterState.restore(data[:cut])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    with pytest.raises(InvalidArgumentError, match="checksum"):
        MasterState.restore(bytes(flipped))
    with pytest.raises(InvalidArgumentError, match="schema 2"):
        MasterState.restore(framed(payload_of(data), schema=2))
    with pytest.raises(InvalidArgumentError, match="header says"):
        MasterState.restore(data + b"\0")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_payloads_with_a_good_checksum_restore_or_are_refused(data: st.DataObject) -> None:
    """Bytes of a real snapshot changed anywhere, the checksum made right again: the restore
    gives a state or InvalidArgumentError, nothing else (and runs nothing)."""
    payload = bytearray(payload_of(_SNAPSHOT))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload)))]
    try:
        MasterState.restore(framed(bytes(payload)))
    except InvalidArgumentError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_fuzzed_bytes_are_refused(blob: bytes) -> None:
    with pytest.raises(InvalidArgumentError):
        MasterState.restore(framed(blob))
    with pytest.raises(InvalidArgumentError):
        MasterState.restore(b"MCKSNAP3" + blob)


_tags = st.sampled_from(["r", "I", "T", "F", "E", "L", "D", "O", "N", "Q", "S", "A", "B", "G"])
_leaf = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=8), st.binary(max_size=8))
_trees = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.tuples(_tags, st.integers(0, 3), st.lists(inner, max_size=4)).map(list),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_trees)
def test_fuzzed_graphs_decode_or_raise_value_error(tree: Any) -> None:
    try:
        safecodec.decode_tree(tree)
    except ValueError:
        pass


def test_deeply_nested_payloads_are_refused() -> None:
    deep = b"\x91" * 200_000 + b"\xc0"  # msgpack: 200 000 nested one-element arrays
    with pytest.raises(InvalidArgumentError, match="malformed"):
        MasterState.restore(framed(b"\x82\xa4head" + deep + b"\xa4body\xc0"))
    tree: list[Any] = ["L", 0, []]
    node = tree
    for i in range(1, 3000):  # deeper than the decoder's recursion allows
        child: list[Any] = ["L", i, []]
        node[2].append(child)
        node = child
    with pytest.raises(ValueError, match="nested too deeply"):
        safecodec.decode_tree(tree)


def test_the_codec_keeps_shared_references_and_cycles() -> None:
    shared: list[Any] = [1, 2]
    d: dict[str, Any] = {"a": shared, "b": shared}
    d["self"] = d
    out = safecodec.decode(safecodec.encode(d))
    assert out["a"] is out["b"] and out["a"] == [1, 2] and out["self"] is out
    with pytest.raises(TypeError, match="cannot hold"):
        safecodec.encode({"f": os.system})


_SNAPSHOT = populated().snapshot()
