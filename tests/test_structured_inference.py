"""Codec inference and nested-row expansion under the published names
(``mooncake.structured_object_store``: ``MISSING``, ``infer_structure``, ``_choose_leaf_codec``,
``_escape_key``), checked against properties and, side by side, against the published wheel."""

from __future__ import annotations

import copy
import os
import pickle
import random
import subprocess
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake.errors import InvalidArgumentError
from mooncake.structured_object_store import (
    MISSING,
    _choose_leaf_codec,
    _CodecDecision,
    _escape_key,
    _InferredLeaf,
    _InferredNode,
    _Missing,
    _structured_path_tokens,
    infer_structure,
)

torch = pytest.importorskip("torch")

ANCHOR_PYTHON = os.path.expanduser("~/.cache/mooncake-anchor-venv/bin/python")

# -- codec decisions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "accepted", "codec"),
    [
        ([[1, 2, 3], [4, 5]], True, "typed_ragged"),
        ([np.arange(3), None, np.arange(2.0)], True, "typed_ragged"),
        ([np.array(["a"], dtype=object)], False, "msgpack_ragged"),
        ([b"a", bytearray(b"b"), memoryview(b"c")], True, "bytes_ragged"),
        ([["x", 1]], True, "msgpack_ragged"),
        ([[b"png", b"jpg"], []], True, "media_list_ragged"),
        (["a", None, MISSING, "b"], True, "utf8_ragged"),
        ([True, 2, 3.5], True, "ndarray"),
        ([1, "a"], False, "msgpack_ragged"),
        ([None, MISSING], False, "msgpack_ragged"),
    ],
)
def test_choose_leaf_codec_decisions(values: list[Any], accepted: bool, codec: str) -> None:
    d = _choose_leaf_codec(values)
    assert isinstance(d, _CodecDecision)
    assert (d.accepted, d.codec) == (accepted, codec), d
    assert d.reason


def test_decision_metadata_names_the_dtype() -> None:
    assert _choose_leaf_codec([1, 2.5]).metadata == {"dtype": "float64"}
    assert _choose_leaf_codec([[1, 2], [3]]).metadata == {"dtype": "int64"}
    assert _choose_leaf_codec([torch.ones(2, dtype=torch.bfloat16)]).metadata == {
        "dtype": "torch.bfloat16"
    }
    assert _choose_leaf_codec([np.ones(2, dtype=np.int8)]).metadata == {
        "recursive_source": "ndarray"
    }
    d = _choose_leaf_codec([torch.ones(1), torch.ones(1, dtype=torch.int32)])
    assert not d.accepted and "mixed tensor dtype" in d.reason


def test_scalars_beyond_int64_are_refused_with_the_dtype() -> None:
    d = _choose_leaf_codec([1, 2**70])
    assert (d.accepted, d.codec) == (False, "ndarray")
    assert "range" in d.reason
    assert not _choose_leaf_codec([2**70]).accepted
    assert _choose_leaf_codec([2**63]).metadata == {"dtype": "uint64"}


def test_column_writer_keeps_the_decision_codec() -> None:
    from mooncake._structured import codecs

    cols: dict[str, list[Any]] = {
        "t": [torch.arange(2), None, torch.arange(3)],
        "s": ["a", None],
        "n": [1, 2.5],
        "b": [b"x", b"yz"],
        "q": [[1, 2], [3]],
    }
    for name, values in cols.items():
        column = np.empty(len(values), dtype=object)
        column[:] = values
        encoded = codecs.encode_column(name, column)
        assert encoded.codec == _choose_leaf_codec(values).codec, name
        decoded = codecs.decode_column(
            {"codec": encoded.codec, "metadata": encoded.metadata},
            _payload(encoded.payload),
            len(values),
        )
        for got, want in zip(decoded, values, strict=True):
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want), name
            else:
                assert (got.tolist() if isinstance(got, np.ndarray) else got) == want, name


def _payload(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload members as a reader gets them back from the store."""
    from mooncake._structured.codecs import BytesParts

    out: dict[str, Any] = {}
    for k, v in payload.items():
        if isinstance(v, BytesParts):
            raw = bytearray(b"".join(bytes(memoryview(p)) for p in v.parts))
            out[k] = np.frombuffer(raw, dtype=v.dtype) if v.dtype else bytes(raw)
        else:
            out[k] = v
    return out


# -- MISSING, escaping, paths --------------------------------------------------------------


def test_missing_is_one_instance() -> None:
    assert isinstance(MISSING, _Missing)
    assert repr(MISSING) == "<MISSING>"
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING
    assert copy.deepcopy([MISSING])[0] is MISSING
    with pytest.raises(AttributeError):
        MISSING.x = 1  # type: ignore[attr-defined]


def test_empty_keys_are_tokens() -> None:
    assert _structured_path_tokens("r.") == ["r", ""]
    assert _structured_path_tokens("r..x[0]") == ["r", "", "x", 0]
    assert _structured_path_tokens("[1][2]") == [1, 2]


def test_bad_path_index_names_the_path() -> None:
    with pytest.raises(InvalidArgumentError, match=r"a\[x\]"):
        _structured_path_tokens("a[x]")
    with pytest.raises(ValueError, match="bad index"):
        _structured_path_tokens("a[1")


@given(st.text(min_size=1))
def test_escaped_key_is_one_token(key: str) -> None:
    assert _structured_path_tokens(_escape_key(key)) == [key]


@given(st.lists(st.one_of(st.text(), st.integers(0, 99)), min_size=1, max_size=6))
def test_escaped_path_round_trip(tokens: list[str | int]) -> None:
    path = "root"
    for t in tokens:
        path += f"[{t}]" if isinstance(t, int) else f".{_escape_key(t)}"
    assert _structured_path_tokens(path) == ["root", *tokens]


# -- expansion ------------------------------------------------------------------------------


def test_expansion_of_rows_with_absent_keys_and_null_rows() -> None:
    leaves: list[_InferredLeaf] = []
    nodes: list[_InferredNode] = []
    rows = [{"a": [{"k": 1}], "b.c": "x"}, None, {"a": [{"k": 2}, None]}]
    infer_structure("r", rows, leaves, nodes)
    assert [(n.path, n.node_type, n.children, n.lengths, n.row_mask) for n in nodes] == [
        ("r", "dict", ["a", "b.c"], None, [True, False, True]),
        ("r.a", "list", [0, 1], [1, 0, 2], [True, False, True]),
        ("r.a[0]", "dict", ["k"], None, [True, False, True]),
    ]
    by_path = {leaf.path: leaf for leaf in leaves}
    assert sorted(by_path) == ["r.a[0].k", "r.a[1]", "r.b\\.c"]
    assert by_path["r.a[0].k"].values == [1, None, 2]
    assert by_path["r.a[1]"].values == [MISSING, None, None]
    assert by_path["r.b\\.c"].values == ["x", None, MISSING]
    assert by_path["r.b\\.c"].decision.codec == "utf8_ragged"


def test_wide_and_long_containers_stay_leaves() -> None:
    leaves: list[_InferredLeaf] = []
    nodes: list[_InferredNode] = []
    infer_structure("r", [{f"k{i}": i for i in range(65)}], leaves, nodes)
    assert nodes == [] and leaves[0].decision.codec == "msgpack_ragged"
    leaves.clear()
    infer_structure("r", [[{}] * 9], leaves, nodes)
    assert nodes == [] and len(leaves) == 1
    leaves.clear()
    infer_structure("r", [{1: "int key"}], leaves, nodes)
    assert nodes == [] and len(leaves) == 1


def test_depth_limit_names_the_path() -> None:
    deep: Any = 1
    for _ in range(33):
        deep = [deep]
    infer_structure("r", [{"a": 1}], [], [])
    deep = {"a": 1}
    for _ in range(40):
        deep = {"a": deep}
    with pytest.raises(InvalidArgumentError, match="max depth 32"):
        infer_structure("r", [deep], [], [])


def _lookup(row: Any, tokens: list[str | int]) -> Any:
    """The child value infer_structure assigns a row at ``tokens``: None under a non-container,
    MISSING for an absent key or index."""
    cur = row
    for t in tokens:
        if isinstance(t, str):
            cur = cur.get(t, MISSING) if isinstance(cur, dict) else None
        else:
            cur = (cur[t] if t < len(cur) else MISSING) if isinstance(cur, list) else None
    return cur


def _rebuild(rows: list[Any], leaves: list[_InferredLeaf], nodes: list[_InferredNode]) -> Any:
    """The rows from the expansion (plus, per node, which rows lack it: what the published
    writer stores beside the node), deepest node first."""
    values = {leaf.path: leaf.values for leaf in leaves}
    for node in sorted(nodes, key=lambda n: len(_structured_path_tokens(n.path)), reverse=True):
        tokens = _structured_path_tokens(node.path)[1:]
        assert node.row_mask is not None
        out: list[Any] = []
        for i, row in enumerate(rows):
            if _lookup(row, tokens) is MISSING:
                out.append(MISSING)
            elif not node.row_mask[i]:
                out.append(None)
            elif node.node_type == "dict":
                kids = ((c, values[f"{node.path}.{_escape_key(c)}"][i]) for c in node.children)
                out.append({c: v for c, v in kids if v is not MISSING})
            else:
                assert node.lengths is not None
                out.append([values[f"{node.path}[{c}]"][i] for c in range(node.lengths[i])])
        values[node.path] = out
    return values["root"]


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
)
_keys = st.sampled_from(["a", "b", "a.b", "x[0]", "\\", "k\\.", ""])
_nested = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=12,
)
_rows = st.lists(
    st.one_of(
        st.none(),
        st.dictionaries(_keys, _nested, max_size=5),
        st.lists(st.one_of(st.none(), st.dictionaries(_keys, _nested, max_size=3)), max_size=4),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_rows)
def test_expansion_describes_every_row(rows: list[Any]) -> None:
    leaves: list[_InferredLeaf] = []
    nodes: list[_InferredNode] = []
    infer_structure("root", rows, leaves, nodes)
    paths = [n.path for n in nodes] + [leaf.path for leaf in leaves]
    assert len(paths) == len(set(paths))
    for leaf in leaves:
        assert len(leaf.values) == len(rows)
        tokens = _structured_path_tokens(leaf.path)[1:]
        for row, v in zip(rows, leaf.values, strict=True):
            assert v is _lookup(row, tokens) or v == _lookup(row, tokens)
        assert leaf.decision == _choose_leaf_codec(leaf.values)
    for node in nodes:
        tokens = _structured_path_tokens(node.path)[1:]
        kind = dict if node.node_type == "dict" else list
        assert node.row_mask == [isinstance(_lookup(r, tokens), kind) for r in rows]
    assert _rebuild(rows, leaves, nodes) == rows


# -- side by side with the published wheel ---------------------------------------------------

_PUBLISHED = textwrap.dedent(
    """
    import pickle, sys
    from mooncake.structured_object_store import infer_structure, _choose_leaf_codec
    cases = pickle.load(sys.stdin.buffer)
    out = []
    for rows in cases:
        leaves, nodes = [], []
        try:
            infer_structure("r", rows, leaves, nodes)
        except ValueError as e:
            out.append(("ValueError", str(e)))
            continue
        out.append((
            [(n.path, n.node_type, list(n.children), n.lengths, n.row_mask) for n in nodes],
            [(l.path, [repr(v) for v in l.values], l.decision.accepted, l.decision.codec,
              l.decision.reason, l.decision.normalized_type, l.decision.metadata)
             for l in leaves],
        ))
    pickle.dump(out, sys.stdout.buffer)
    """
)


def _ours(rows: list[Any]) -> Any:
    leaves: list[_InferredLeaf] = []
    nodes: list[_InferredNode] = []
    try:
        infer_structure("r", rows, leaves, nodes)
    except ValueError as e:
        return ("ValueError", str(e))
    return (
        [(n.path, n.node_type, list(n.children), n.lengths, n.row_mask) for n in nodes],
        [
            (
                leaf.path,
                [repr(v) for v in leaf.values],
                leaf.decision.accepted,
                leaf.decision.codec,
                leaf.decision.reason,
                leaf.decision.normalized_type,
                leaf.decision.metadata,
            )
            for leaf in leaves
        ],
    )


def _random_value(rng: random.Random, depth: int) -> Any:
    # the top level is mostly containers, so most cases expand into nodes
    pick = (
        rng.randrange(9, 14)
        if depth == 0 and rng.random() < 0.7
        else rng.randrange(14 if depth < 4 else 9)
    )
    if pick == 0:
        return None
    if pick == 1:
        return rng.randrange(-5, 5)
    if pick == 2:
        return rng.random()
    if pick == 3:
        return rng.choice(["", "x", "héllo"])
    if pick == 4:
        return rng.choice([b"", b"\x00b"])
    if pick == 5:
        return torch.arange(rng.randrange(3), dtype=rng.choice([torch.int64, torch.float32]))
    if pick == 6:
        return np.arange(rng.randrange(3), dtype=rng.choice([np.int32, np.float64]))
    if pick == 7:
        return [rng.randrange(9) for _ in range(rng.randrange(4))]
    if pick == 8:
        return rng.choice([True, False])
    if pick < 11:
        return {
            rng.choice(["a", "b", "c.d", "e[1]"]): _random_value(rng, depth + 1)
            for _ in range(rng.randrange(4))
        }
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(10))]


def _random_cases(n: int) -> list[list[Any]]:
    rng = random.Random(20260427)
    cases: list[list[Any]] = []
    for _ in range(n):
        template = _random_value(rng, 0)
        rows = []
        for _ in range(rng.randrange(1, 5)):
            # rows share a shape most of the time, so nodes (not just leaves) come out
            rows.append(copy.deepcopy(template) if rng.random() < 0.6 else _random_value(rng, 0))
        cases.append(rows)
    deep: Any = 1
    for _ in range(40):
        deep = {"a": deep}
    cases.append([deep])
    cases.append([{"x": None}, {"y": 2}, None])
    cases.append([[{"k": 1}, None], [{"k": 2}, None]])
    return cases


@pytest.mark.skipif(not os.path.exists(ANCHOR_PYTHON), reason="published wheel venv not set up")
def test_same_expansion_as_the_published_wheel() -> None:
    cases = _random_cases(400)
    proc = subprocess.run(
        [ANCHOR_PYTHON, "-c", _PUBLISHED],
        input=pickle.dumps(cases),
        capture_output=True,
        cwd="/",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    published = pickle.loads(proc.stdout)
    assert len(published) == len(cases)
    with_nodes = 0
    for rows, theirs in zip(cases, published, strict=True):
        assert _ours(rows) == theirs, rows
        with_nodes += bool(theirs[0]) and theirs[0] != "ValueError"
    assert with_nodes > len(cases) // 6  # the cases exercised expansion, not only leaves


# -- the structured_recursive column layout ----------------------------------------------------


def _plain(v: Any) -> Any:
    """A value with tensors and arrays spelled out, for comparing decoded rows."""
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.tolist())
    if isinstance(v, np.ndarray):
        return ("ndarray", v.tolist())
    if isinstance(v, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(v))
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _nested_row(rng: random.Random) -> Any:
    if rng.random() < 0.15:
        return None
    row: dict[str, Any] = {}
    if rng.random() < 0.8:
        row["tok"] = None if rng.random() < 0.2 else torch.arange(rng.randrange(4))
    meta: dict[str, Any] = {"s": rng.choice(["x", "yé", None])}
    if rng.random() < 0.6:
        meta["b"] = rng.choice([b"", b"\x00z", None])
    row["meta"] = meta
    if rng.random() < 0.7:
        row["l"] = [rng.choice([None, {"k": rng.randrange(9)}]) for _ in range(rng.randrange(4))]
    if rng.random() < 0.5:
        row["a.b"] = rng.random()
    if rng.random() < 0.3:
        row[""] = np.arange(rng.randrange(3), dtype=np.int32)
    if rng.random() < 0.5:
        row["media"] = [rng.choice([b"a", b"", b"\xffpng"]) for _ in range(rng.randrange(3))]
    return row


@pytest.mark.parametrize("seed", range(30))
def test_recursive_columns_round_trip(seed: int) -> None:
    from mooncake._structured import codecs

    rng = random.Random(seed)
    rows = [_nested_row(rng) for _ in range(rng.randrange(1, 7))]
    rows.append({"tok": torch.arange(2), "meta": {"s": "x", "b": b"q"}})  # a tensor leaf
    column = np.empty(len(rows), dtype=object)
    column[:] = rows
    enc = codecs.encode_column("non_tensor_batch.f", column)
    assert enc.codec == "structured_recursive"
    assert enc.metadata["root_path"] == "non_tensor_batch.f"
    got = codecs.decode_column(
        {"codec": enc.codec, "metadata": enc.metadata}, _payload(enc.payload), len(rows)
    )
    assert _plain(got) == _plain(rows)


def test_flat_nested_columns_keep_flat_codecs() -> None:
    from mooncake._structured import codecs

    column = np.empty(2, dtype=object)
    column[:] = [{"a": 1, "s": "x", "l": [1, 2]}, {"a": 2, "s": None}]
    assert codecs.encode_column("f", column).codec in ("json_ragged", "msgpack_ragged")


def test_a_malformed_recursive_layout_names_what_is_missing() -> None:
    from mooncake._structured import codecs

    column = np.empty(2, dtype=object)
    column[:] = [{"t": torch.arange(2)}, {"t": torch.arange(1)}]
    enc = codecs.encode_column("f", column)
    payload = _payload(enc.payload)
    del payload["node.0.missing"]
    with pytest.raises(InvalidArgumentError, match=r"node\.0\.missing"):
        codecs.decode_column({"codec": enc.codec, "metadata": enc.metadata}, payload, 2)


_PUBLISHED_RECURSIVE = textwrap.dedent(
    """
    import pickle, sys
    import numpy as np
    import mooncake.structured_object_store as sos
    mode, blob = sys.argv[1], sys.stdin.buffer.read()
    if mode == "encode":
        cases = pickle.loads(blob)
        out = []
        for rows in cases:
            column = np.empty(len(rows), dtype=object)
            column[:] = rows
            enc = sos._encode_with_fallback("non_tensor_batch.f", column)
            def conv(v):
                # a multi-buffer member (data) reads back from the store as its bytes
                parts = getattr(v, "buffers", getattr(v, "arrays", None))
                if parts is not None:
                    raw = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in parts))
                    return np.frombuffer(raw, dtype=v.dtype) if v.dtype is not None else bytes(raw)
                return bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else np.asarray(v)
            out.append((enc.codec, enc.metadata, {k: conv(v) for k, v in enc.payload.items()}))
        pickle.dump(out, sys.stdout.buffer)
    else:
        out = []
        for codec, metadata, payload, rows in pickle.loads(blob):
            out.append(sos._decode_structured_non_tensor_encoded(
                {"codec": codec, "metadata": metadata}, payload, rows))
        pickle.dump(out, sys.stdout.buffer)
    """
)


def _published(mode: str, data: Any) -> Any:
    assert ANCHOR_PYTHON
    proc = subprocess.run(
        [ANCHOR_PYTHON, "-c", _PUBLISHED_RECURSIVE, mode],
        input=pickle.dumps(data),
        capture_output=True,
        cwd="/",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return pickle.loads(proc.stdout)


@pytest.mark.skipif(not os.path.exists(ANCHOR_PYTHON), reason="published wheel venv not set up")
def test_recursive_columns_read_across_implementations() -> None:
    from mooncake._structured import codecs

    cases = []
    for seed in range(12):
        rng = random.Random(1000 + seed)
        rows = [_nested_row(rng) for _ in range(rng.randrange(1, 6))]
        rows.append({"tok": torch.arange(3), "meta": {"s": "y", "b": b"w"}})
        # a null in each array leaf: the published writer passes a leaf to its codec as
        # np.asarray(values, dtype=object), which splits equal-shape tensors into elements
        # and then refuses them ("ragged tensor codec requires numeric ndarray values")
        rows.append({"tok": None, "meta": {"s": None, "b": None}, "": None})
        cases.append(rows)
    # theirs -> ours
    for rows, (codec, metadata, payload) in zip(cases, _published("encode", cases), strict=True):
        assert codec == "structured_recursive"
        got = codecs.decode_column({"codec": codec, "metadata": metadata}, payload, len(rows))
        assert _plain(got) == _plain(rows)
    # ours -> theirs
    mine = []
    for rows in cases:
        column = np.empty(len(rows), dtype=object)
        column[:] = rows
        enc = codecs.encode_column("non_tensor_batch.f", column)
        mine.append((enc.codec, enc.metadata, _payload(enc.payload), len(rows)))
    for rows, got in zip(cases, _published("decode", mine), strict=True):
        assert _plain(got) == _plain(rows)
