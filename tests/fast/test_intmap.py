"""IntMap (int64 -> int64 in C arrays) against a dict: both twins, hypothesis stateful."""

from __future__ import annotations

import pickle
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake._fast import _intmap_pure

_intmap_c: ModuleType | None
try:
    from mooncake._fast import _intmap as _intmap_c
except ImportError:  # not built: the compiled twin's cases skip
    _intmap_c = None

TWINS = [
    pytest.param(_intmap_pure, id="pure"),
    pytest.param(
        _intmap_c,
        id="compiled",
        marks=pytest.mark.skipif(
            _intmap_c is None, reason="mooncake._fast._intmap not built (setup.py build_ext)"
        ),
    ),
]

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
M64 = (1 << 64) - 1


def _mix(k: int) -> int:
    """The compiled map's splitmix64 finalizer (to build keys that share a probe chain)."""
    x = k & M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def _colliding(n: int, bits: int = 12) -> list[int]:
    """``n`` nonzero keys whose hashes agree in the low ``bits`` bits: one probe chain in every
    table of up to ``2**bits`` slots."""
    target = _mix(1) & ((1 << bits) - 1)
    out, k = [], 1
    while len(out) < n:
        if _mix(k) & ((1 << bits) - 1) == target:
            out.append(k)
        k += 1
    return out


COLLIDING = _colliding(48)
KEYS = st.one_of(
    st.sampled_from(COLLIDING),
    st.sampled_from([0, 1, -1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1]),
    st.integers(-40, 40),
    st.integers(I64_MIN, I64_MAX),
)
# the compiled map keeps values in int32 slots, wider ones in a side table: cover both and the edge
VALUES = st.one_of(
    st.integers(-(1 << 40), 1 << 40),
    st.sampled_from([-(1 << 31), -(1 << 31) + 1, (1 << 31) - 1, 1 << 31, I64_MIN, I64_MAX, 0]),
    st.integers(I64_MIN, I64_MAX),
)


def _twin_machine(mod: ModuleType) -> type[RuleBasedStateMachine]:
    class IntMapMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m: Any = mod.IntMap()
            self.d: dict[int, int] = {}
            self.known: list[int] = []

        def _key(self, k: int, i: int) -> int:
            # half the time an existing key, so deletes and overwrites hit
            if self.d and i % 2:
                return sorted(self.d)[i % len(self.d)]
            return k

        @rule(k=KEYS, v=VALUES, i=st.integers(0, 1000))
        def set(self, k: int, v: int, i: int) -> None:
            k = self._key(k, i)
            self.m[k] = v
            self.d[k] = v

        @rule(ks=st.lists(st.sampled_from(COLLIDING), min_size=1, max_size=48))
        def set_chain(self, ks: list[int]) -> None:
            for j, k in enumerate(ks):
                self.m[k] = j
                self.d[k] = j

        @rule(k=KEYS, i=st.integers(0, 1000))
        def pop(self, k: int, i: int) -> None:
            k = self._key(k, i)
            assert self.m.pop(k, "absent") == self.d.pop(k, "absent")
            assert k not in self.m

        @rule(k=KEYS, i=st.integers(0, 1000))
        def pop_no_default(self, k: int, i: int) -> None:
            k = self._key(k, i)
            if k in self.d:
                assert self.m.pop(k) == self.d.pop(k)
            else:
                with pytest.raises(KeyError):
                    self.m.pop(k)

        @rule(k=KEYS, i=st.integers(0, 1000))
        def delete(self, k: int, i: int) -> None:
            k = self._key(k, i)
            if k in self.d:
                del self.m[k]
                del self.d[k]
            else:
                with pytest.raises(KeyError):
                    del self.m[k]

        @rule(k=KEYS, i=st.integers(0, 1000))
        def lookup(self, k: int, i: int) -> None:
            k = self._key(k, i)
            assert (k in self.m) == (k in self.d)
            assert self.m.get(k) == self.d.get(k)
            assert self.m.get(k, -7) == self.d.get(k, -7)
            if k in self.d:
                assert self.m[k] == self.d[k]
            else:
                with pytest.raises(KeyError):
                    self.m[k]

        @rule(
            bad=st.one_of(
                st.integers(max_value=I64_MIN - 1),
                st.integers(min_value=I64_MAX + 1),
            )
        )
        def out_of_range(self, bad: int) -> None:
            for op in (
                lambda: self.m.__setitem__(bad, 1),
                lambda: self.m.__setitem__(1, bad),
                lambda: bad in self.m,
                lambda: self.m[bad],
                lambda: self.m.get(bad),
                lambda: self.m.pop(bad, None),
            ):
                with pytest.raises(OverflowError):
                    op()

        @rule(bad=st.one_of(st.floats(), st.text(max_size=3), st.none(), st.just(b"1")))
        def not_an_int(self, bad: object) -> None:
            for op in (
                lambda: self.m.__setitem__(bad, 1),
                lambda: self.m.__setitem__(1, bad),
                lambda: bad in self.m,
                lambda: self.m[bad],
                lambda: self.m.get(bad),
                lambda: self.m.pop(bad, None),
            ):
                with pytest.raises(TypeError):
                    op()

        @precondition(lambda self: len(self.d) > 20)
        @rule()
        def clear(self) -> None:
            self.m.clear()
            self.d.clear()

        @invariant()
        def same(self) -> None:
            assert len(self.m) == len(self.d)
            assert self.m.total() == sum(self.d.values())
            ks, vs = self.m.items_sorted()
            assert ks.typecode == vs.typecode == "q"
            assert list(ks) == sorted(self.d)
            assert list(vs) == [self.d[k] for k in sorted(self.d)]

    return IntMapMachine


TestIntMapPure = _twin_machine(_intmap_pure).TestCase
TestIntMapPure.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
if _intmap_c is not None:
    TestIntMapCompiled = _twin_machine(_intmap_c).TestCase
    TestIntMapCompiled.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
else:

    @pytest.mark.skip(reason="mooncake._fast._intmap not built (setup.py build_ext)")
    def test_intmap_compiled_machine() -> None:
        pass


@pytest.mark.parametrize("mod", TWINS)
def test_growth_then_delete_everything(mod: ModuleType) -> None:
    m = mod.IntMap()
    keys = [*COLLIDING, *range(-5000, 5000, 7), I64_MIN, I64_MAX]
    for j, k in enumerate(keys):
        m[k] = j
    assert len(m) == len(keys)
    assert m.total() == sum(range(len(keys)))
    # delete a third, spread over every chain (backward shift must keep the rest findable)
    gone = set(keys[::3])
    for k in keys[::3]:
        assert m.pop(k) == keys.index(k)
    assert all((k in m) == (k not in gone) for k in keys)
    assert all(m[k] == j for j, k in enumerate(keys) if k not in gone)
    for k in keys[1::3] + keys[2::3]:
        del m[k]
    assert len(m) == 0 and m.total() == 0
    assert list(m.items_sorted()[0]) == []


@pytest.mark.parametrize("mod", TWINS)
def test_not_iterable_in_hash_order(mod: ModuleType) -> None:
    m = mod.IntMap()
    m[1] = 2
    with pytest.raises(TypeError, match="items_sorted"):
        iter(m)


@pytest.mark.parametrize("mod", TWINS)
@given(st.dictionaries(st.integers(I64_MIN, I64_MAX), st.integers(I64_MIN, I64_MAX)))
@settings(max_examples=50)
def test_pickle_and_canon_independent_of_history(mod: ModuleType, d: dict[int, int]) -> None:
    a, b = mod.IntMap(), mod.IntMap()
    a.update(d.items())
    for k in reversed(list(d)):
        b[k] = 0
        b[k] = d[k]
    b[123456789] = 1
    b.pop(123456789) if 123456789 not in d else None
    b.update([(123456789, d[123456789])] if 123456789 in d else [])
    assert a.__canon__() == b.__canon__() == (sorted(d), [d[k] for k in sorted(d)])
    c = pickle.loads(pickle.dumps(a))
    assert type(c) is type(a)
    assert c.__canon__() == a.__canon__() and c.total() == a.total()


def test_digest_of_twins_agrees() -> None:
    """A state holding an IntMap fingerprints by content, the same for either twin."""
    if _intmap_c is None:
        pytest.skip("mooncake._fast._intmap not built (setup.py build_ext)")
    from mooncake._core.commands import digest

    class Holder:
        def __init__(self, m: Any) -> None:
            self.m = m

    maps = []
    for mod, order in ((_intmap_pure, [5, -3, 9]), (_intmap_c, [9, 5, -3])):
        m = mod.IntMap()
        for k in order:
            m[k] = k * 10
        maps.append(m)
    assert digest(Holder(maps[0])) == digest(Holder(maps[1]))
    maps[1][5] = 51
    assert digest(Holder(maps[0])) != digest(Holder(maps[1]))


def test_compiled_memory_per_entry() -> None:
    """12-byte slots at load 3/8..3/4: at most 32 bytes an entry, no Python objects (values
    that fit in int32); wide values cost a side-table entry each until they go."""
    if _intmap_c is None:
        pytest.skip("mooncake._fast._intmap not built (setup.py build_ext)")
    m = _intmap_c.IntMap()
    n = 100_000
    for k in range(1, n + 1):
        m[k * 4096] = 4096
    assert 12 * n <= m.memory_bytes() <= 12 * (2 * n * 4 // 3) + 256
    small = m.memory_bytes()
    for k in range(1, 1001):
        m[k * 4096] = 1 << 40
    assert m.memory_bytes() > small and m.total() == 1000 * (1 << 40) + (n - 1000) * 4096
    for k in range(1, 1001):
        m[k * 4096] = 4096
    assert m.memory_bytes() == small and m.total() == n * 4096
    m.clear()
    assert m.memory_bytes() < 1024 and len(m) == 0


@pytest.mark.parametrize("mod", TWINS)
def test_update_columns_sets_each_pair_and_checks_the_columns(mod: ModuleType) -> None:
    from array import array

    m = mod.IntMap()
    m[5] = 1
    m.update_columns(array("q", [5, -(2**63), 0, 7, 7]), array("q", [9, 2, 3, 4, 2**40]))
    assert sorted((k, m[k]) for k in (5, -(2**63), 0, 7)) == sorted(
        [(5, 9), (-(2**63), 2), (0, 3), (7, 2**40)]
    )
    assert len(m) == 4 and m.total() == 9 + 2 + 3 + 2**40  # later pairs win, as in update
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        m.update_columns(array("q", [1, 2]), array("q", [1]))
    with pytest.raises(TypeError, match="array"):
        m.update_columns([1], [2])
    with pytest.raises(TypeError, match="array"):
        m.update_columns(array("i", [1]), array("q", [2]))
