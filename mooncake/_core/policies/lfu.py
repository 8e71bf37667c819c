"""Least-frequently-used eviction, ties broken by least recent use."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator

from mooncake._core.policies.base import (
    CanEvict,
    Key,
    SizedPolicy,
    check_size,
    select_victims,
)

__all__ = ["LFUPolicy"]


class LFUPolicy(SizedPolicy):
    """Least frequently used: evict the object with the fewest hits since its insert.

    An insert counts as the first use (frequency 1); each access adds one. Among equal
    frequencies the least recently used goes first. Counts never decay (classic LFU: a
    once-hot object that turned cold stays until colder ones are gone); re-inserting a key
    resets its count.

    Buckets: frequency -> ``OrderedDict`` of keys (oldest use first), plus a sorted list of
    the non-empty frequencies. ``on_insert``/``on_remove``/``on_access`` are O(1) plus an
    O(log F) bisect when a bucket appears or empties (F distinct frequencies, F <= sqrt(2 *
    accesses)); ``victims`` is O(v + s + buckets walked).
    """

    __slots__ = ("_buckets", "_freq", "_freqs", "_size")
    name = "lfu"

    def __init__(self) -> None:
        self._size: dict[Key, int] = {}
        super().__init__(self._size)
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._freqs: list[int] = []  # sorted non-empty bucket frequencies

    def _unlink(self, key: Key, freq: int) -> None:
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]
            freqs = self._freqs
            del freqs[bisect.bisect_left(freqs, freq)]

    def _link(self, key: Key, freq: int) -> None:
        bucket = self._buckets.get(freq)
        if bucket is None:
            bucket = self._buckets[freq] = OrderedDict()
            bisect.insort(self._freqs, freq)
        bucket[key] = None

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        if key in self._size:
            self.on_remove(key)
        self._size[key] = size
        self._freq[key] = 1
        self._link(key, 1)
        self._bytes += size

    def on_access(self, key: Key, now: float = 0.0) -> None:
        # _unlink + _link inlined: this is the hottest call under a skewed workload.
        freq = self._freq[key]
        buckets = self._buckets
        bucket = buckets[freq]
        del bucket[key]
        freqs = self._freqs
        if not bucket:
            del buckets[freq]
            del freqs[bisect.bisect_left(freqs, freq)]
        freq += 1
        self._freq[key] = freq
        target = buckets.get(freq)
        if target is None:
            target = buckets[freq] = OrderedDict()
            bisect.insort(freqs, freq)
        target[key] = None

    def on_remove(self, key: Key) -> None:
        self._bytes -= self._size.pop(key)
        self._unlink(key, self._freq.pop(key))
        self._pins.pop(key, None)

    def _order(self) -> Iterator[Key]:
        buckets = self._buckets
        for freq in self._freqs:
            yield from buckets[freq]

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0:
            return []
        return select_victims(self._order(), self._size, self._pins, nbytes, can_evict)

    def frequency(self, key: Key) -> int:
        """Current use count of ``key`` (``KeyError`` if untracked)."""
        return self._freq[key]

    def self_check(self) -> None:
        self._check_sized(sum(self._size.values()))
        assert self._size.keys() == self._freq.keys(), "size and frequency maps differ"
        assert self._freqs == sorted(self._buckets), "frequency index out of order"
        assert all(self._buckets.values()), "empty bucket kept"
        seen = 0
        for freq, bucket in self._buckets.items():
            for key in bucket:
                assert self._freq[key] == freq, f"{key!r} in bucket {freq}"
                seen += 1
        assert seen == len(self._size), "bucket membership differs from tracked keys"
