"""``mooncake.dataproto_catalog``: rows and fields resolved to DataProto fragments, and the
lifetimes of catalog-managed fragments (references, pinned readers, retirement)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake.dataproto_catalog import DataProtoCatalog, DataProtoCatalogTransfer
from mooncake.errors import NotSupportedError


def handle(name: str, fields: list[str], batch_size: int = 2) -> dict[str, Any]:
    return {
        "type": "mooncake_dataproto_ref",
        "version": 1,
        "kind": "bundle_stages",
        "batch_size": batch_size,
        "stage_refs": {"rollout": {"manifest_key": f"manifest/{name}"}},
        "field_index": {
            f: {"stage": "rollout", "member": f"batch.{f}", "section": "batch"} for f in fields
        },
    }


def _retired(result: dict[str, Any]) -> list[str]:
    return sorted(
        next(iter(h["stage_refs"].values()))["manifest_key"] for h in result["retired_handles"]
    )


def test_resolve_groups_fields_by_location_in_key_order() -> None:
    c = DataProtoCatalog()
    c.update("p", ["a", "b"], tags=[{"s": 1}, {"s": 1}], handle=handle("base", ["x", "y"]))
    c.update("p", ["b", "a"], handle=handle("extra", ["z"]))
    plan = c.resolve("p", ["a", "b"])
    assert plan["fields"] == ["x", "y", "z"]
    assert plan["field_groups"] == [
        {"fields": ["x", "y"], "locations": [("manifest/base", 0), ("manifest/base", 1)]},
        {"fields": ["z"], "locations": [("manifest/extra", 1), ("manifest/extra", 0)]},
    ]
    assert set(plan["handles"]) == {"manifest/base", "manifest/extra"}
    assert plan["tags"] == [{"s": 1}, {"s": 1}] and "read_token" not in plan
    with pytest.raises(ValueError, match="collision"):
        c.update("p", ["a", "b"], handle={**handle("base", ["w"])})
    with pytest.raises(ValueError, match="batch size 2 does not match 1"):
        c.update("p", ["a"], handle=handle("one", ["x"]))
    with pytest.raises(ValueError, match="unique"):
        c.update("p", ["a", "a"], tags=[{}, {}])
    with pytest.raises(ValueError, match="requires tags or a DataProto handle"):
        c.update("p", ["a"])
    assert c.list() == {"p": {"a": {"s": 1}, "b": {"s": 1}}}  # nothing changed by the refusals


def test_managed_fragments_retire_after_their_last_reference_and_reader() -> None:
    c = DataProtoCatalog()
    first = c.publish("op1", "p", ["a", "b"], handle=handle("f1", ["x"]))
    assert c.publish("op1", "p", ["a", "b"], handle=handle("other", ["x"])) == first  # idempotent
    c.ack_publication("op1")
    pinned = c.resolve("p", ["a", "b"], ["x"], pin=True)
    token = pinned["read_token"]
    # both rows now point at f2: f1 has no reference left but a pinned reader
    c.publish("op2", "p", ["a", "b"], handle=handle("f2", ["x"]))
    assert _retired(c.ack_retired([])) == []  # f1 waits for its reader
    assert _retired(c.release_read(token)) == ["manifest/f1"]
    assert _retired(c.release_read(token)) == ["manifest/f1"]  # idempotent
    out = c.ack_retired([handle("f1", ["x"])])
    assert out["retired_handles"] == []
    # an unmanaged fragment is forgotten without retiring
    c.update("q", ["k"], handle=handle("plain", ["v"], batch_size=1))
    assert c.remove("q", ["k"])["retired_handles"] == [] and c.list("q") == {}
    assert _retired(c.drain()) == ["manifest/f2"]
    with pytest.raises(RuntimeError, match="drained"):
        c.update("p", ["a"], tags=[{}])


def test_publish_append_adds_fields_or_says_why_not() -> None:
    c = DataProtoCatalog()
    base = handle("frag", ["x"])
    c.publish("op1", "default", ["a", "b"], handle=base)
    grown = handle("frag", ["x", "y"])
    out = c.publish_append(
        "op2", "manifest/frag", "default", ["a", "b"], previous_handle=base, handle=grown
    )
    assert out["fields"] == ["x", "y"]
    assert c.resolve("default", ["b"], ["y"])["field_groups"] == [
        {"fields": ["y"], "locations": [("manifest/frag", 1)]}
    ]
    stale = c.publish_append(
        "op3", "manifest/frag", "default", ["a", "b"], previous_handle=base, handle=grown
    )
    assert "stale DataProto append handle" in stale["append_rejected"]
    changed = handle("frag", ["x", "y"])
    changed["field_index"]["x"]["member"] = "batch.other"
    out = c.publish_append(
        "op4", "manifest/frag", "default", ["a", "b"], previous_handle=grown, handle=changed
    )
    assert out == {"append_rejected": "appended DataProto handle changed existing fields"}
    other = c.publish_append(
        "op5", "manifest/frag", "q", ["a", "b"], previous_handle=grown, handle=grown
    )
    assert other == {"append_rejected": "appended DataProto handle changed fragment identity"}
    with pytest.raises(ValueError, match="not found"):
        c.resolve("default", ["zz"])


def test_transfer_wrapper_says_it_is_not_here() -> None:
    with pytest.raises(NotSupportedError, match="DataProtoCatalogTransfer is not supported"):
        DataProtoCatalogTransfer(object(), lambda *a: None)
