"""OffsetAllocator: no overlap, no leak, coalescing, alignment (hypothesis stateful + examples)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake._core.allocator import OffsetAllocator
from mooncake.errors import InvalidArgumentError


def test_fill_exactly_then_refuse() -> None:
    a = OffsetAllocator(4096, 1024, alignment=64)
    addrs = [a.allocate(64) for _ in range(16)]
    assert addrs == [4096 + 64 * i for i in range(16)]
    assert a.allocate(1) is None
    assert a.used == 1024 and a.largest_free == 0


def test_rounding_and_alignment() -> None:
    a = OffsetAllocator(0, 1 << 20, alignment=256)
    x = a.allocate(1)
    y = a.allocate(257)
    assert x == 0 and y == 256
    assert a.extent(y) == 512
    assert a.used == 768


def test_best_fit_prefers_smallest_hole() -> None:
    a = OffsetAllocator(0, 64 * 10, alignment=64)
    maybe = [a.allocate(64) for _ in range(10)]
    blocks = [b for b in maybe if b is not None]
    assert len(blocks) == 10
    a.free(blocks[1])  # hole of 64
    a.free(blocks[4])
    a.free(blocks[5])  # hole of 128
    assert a.allocate(64) == blocks[1]
    assert a.allocate(128) == blocks[4]


def test_coalesces_both_sides() -> None:
    a = OffsetAllocator(0, 64 * 3, alignment=64)
    x, y, z = (a.allocate(64) for _ in range(3))
    assert x is not None and y is not None and z is not None
    a.free(x)
    a.free(z)
    assert len(a.free_blocks()) == 2
    a.free(y)
    assert a.free_blocks() == [(0, 192)]
    assert a.allocate(192) == 0


def test_double_free_and_foreign_address_refused() -> None:
    a = OffsetAllocator(0, 4096)
    x = a.allocate(100)
    assert x is not None
    a.free(x)
    with pytest.raises(InvalidArgumentError, match="not an allocated extent"):
        a.free(x)
    with pytest.raises(InvalidArgumentError):
        a.free(12345)


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        OffsetAllocator(0, 0)
    with pytest.raises(InvalidArgumentError):
        OffsetAllocator(0, 100, alignment=3)
    with pytest.raises(InvalidArgumentError):
        OffsetAllocator(0, 100).allocate(0)


def test_tail_smaller_than_alignment_is_never_handed_out() -> None:
    a = OffsetAllocator(0, 100, alignment=64)
    assert a.allocate(64) == 0
    assert a.allocate(1) is None


@given(st.lists(st.integers(1, 5000), max_size=60), st.randoms(use_true_random=False))
@settings(max_examples=100)
def test_free_everything_gives_one_block(sizes: list[int], rnd: object) -> None:
    a = OffsetAllocator(1 << 20, 64 * 1024, alignment=64)
    got = [x for x in (a.allocate(n) for n in sizes) if x is not None]
    rnd.shuffle(got)  # type: ignore[attr-defined]
    for x in got:
        a.free(x)
        a.self_check()
    assert a.used == 0
    assert a.free_blocks() == [(1 << 20, 64 * 1024)]


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a model of live extents."""

    def __init__(self) -> None:
        super().__init__()
        self.base = 4096 * 7
        self.size = 64 * 200 + 17
        self.a = OffsetAllocator(self.base, self.size, alignment=64)
        self.live: dict[int, int] = {}

    @rule(n=st.integers(1, 64 * 40))
    def allocate(self, n: int) -> None:
        addr = self.a.allocate(n)
        need = -(-n // 64) * 64
        if addr is None:
            # refused only when no free block is big enough
            assert all(length < need for _, length in self.a.free_blocks())
            return
        assert addr not in self.live
        assert (addr - self.base) % 64 == 0
        assert self.base <= addr and addr + need <= self.base + self.size
        for s, ln in self.live.items():
            assert addr + need <= s or s + ln <= addr, "overlap"
        self.live[addr] = need

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i: int) -> None:
        addr = sorted(self.live)[i % len(self.live)]
        self.a.free(addr)
        del self.live[addr]

    @invariant()
    def consistent(self) -> None:
        self.a.self_check()
        assert self.a.used == sum(self.live.values())
        assert self.a.allocations == len(self.live)
        free_total = sum(n for _, n in self.a.free_blocks())
        assert free_total + self.a.used == self.size - self.size % 64


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


@given(st.lists(st.integers(1, 3000), max_size=40), st.randoms(use_true_random=False))
@settings(max_examples=60)
def test_extents_state_restore_round_trip(sizes: list[int], rnd: object) -> None:
    a = OffsetAllocator(1 << 30, 64 * 1024, alignment=64)
    got = [x for x in (a.allocate(n) for n in sizes) if x is not None]
    rnd.shuffle(got)  # type: ignore[attr-defined]
    for x in got[: len(got) // 2]:
        a.free(x)
    addrs, lengths = a.extents()
    assert list(addrs) == sorted(got[len(got) // 2 :])
    assert list(lengths) == [a.extent(x) for x in addrs]
    allocated, free, used = a.state()
    assert allocated == list(zip(addrs, lengths, strict=True))
    # restore takes extents in any order
    b = OffsetAllocator.restore(
        a.base, a.size, a.alignment, allocated=reversed(allocated), free=free, used=used
    )
    b.self_check()
    assert b.state() == a.state() and b.allocations == a.allocations
    assert b.memory_bytes() > 0


def test_addresses_outside_int64_are_just_not_extents() -> None:
    a = OffsetAllocator(0, 4096)
    with pytest.raises(KeyError):
        a.extent(1 << 70)
    with pytest.raises(InvalidArgumentError, match="not an allocated extent"):
        a.free(1 << 70)
