"""The memory registry against a simple model (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._core.memory import MemoryRegistry, Region
from mooncake.errors import AddressOverlapError, InvalidArgumentError, NotRegisteredError

ranges = st.tuples(st.integers(0, 1000), st.integers(1, 100))


@given(st.lists(st.tuples(st.booleans(), ranges), max_size=60), st.lists(ranges, max_size=30))
def test_registry_matches_model(ops: list, probes: list) -> None:
    reg = MemoryRegistry()
    model: dict[int, int] = {}
    for add, (addr, length) in ops:
        if add:
            overlaps = any(a < addr + length and addr < a + n for a, n in model.items())
            if overlaps:
                with pytest.raises(AddressOverlapError):
                    reg.add(Region(addr, length))
            else:
                reg.add(Region(addr, length))
                model[addr] = length
        elif addr in model:
            reg.remove(addr)
            del model[addr]
        else:
            with pytest.raises(NotRegisteredError):
                reg.remove(addr)
    assert [(r.addr, r.length) for r in reg.regions()] == sorted(model.items())
    for addr, length in probes:
        holder = [a for a, n in model.items() if a <= addr and addr + length <= a + n]
        found = reg.find(addr, length)
        assert (found.addr if found else None) == (holder[0] if holder else None)


def test_bad_ranges_are_refused() -> None:
    reg = MemoryRegistry()
    for addr, length in [(0, 0), (-1, 5), (2**64 - 1, 2), (1.5, 3)]:
        with pytest.raises(InvalidArgumentError):
            reg.add(Region(addr, length))  # type: ignore[arg-type]


def test_straddling_two_adjacent_regions_is_not_covered() -> None:
    reg = MemoryRegistry()
    reg.add(Region(0, 100))
    reg.add(Region(100, 100))
    assert reg.find(50, 100) is None
    assert reg.find(100, 100) is not None
    with pytest.raises(NotRegisteredError, match="not inside one registered region"):
        reg.require(50, 100)


def test_closing_region_is_not_found() -> None:
    reg = MemoryRegistry()
    r = reg.add(Region(0, 100))
    r.closing = True
    assert reg.find(0, 10) is None
