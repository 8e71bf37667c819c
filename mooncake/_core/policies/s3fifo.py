"""S3-FIFO eviction (Yang et al., SOSP'23): a small probation FIFO, a main FIFO, a ghost FIFO."""

from __future__ import annotations

from collections import OrderedDict

from mooncake._core.policies.base import (
    CanEvict,
    Key,
    Pin,
    SizedPolicy,
    check_size,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3
_GHOST_FLOOR = 16


class S3FIFOPolicy(SizedPolicy):
    """S3-FIFO: quick demotion of one-hit wonders through a small FIFO.

    New objects enter the small queue S, or the main queue M if their key is in the ghost
    queue G (recently evicted from S). A hit raises a 2-bit counter (max 3). Eviction takes
    from S while S holds at least ``small_ratio`` of the tracked bytes, else from M: the
    oldest object of S moves to M if it was hit since it entered (counter reset), else it is
    the victim and its key enters G; the oldest object of M is reinserted at M's head with its
    counter decremented if non-zero, else it is the victim. G keeps at most as many keys as
    the policy tracks (the paper sizes G like M; the policy does not know the capacity, and
    is evicting when full).

    Objects that may not be evicted now (pinned, busy) keep their place at the tail of their
    queue; soft-pinned ones are proposed, in the order met, after everything else.

    ``OrderedDict`` queues: every event is O(1); ``victims`` is O(v + s + promotions).
    """

    __slots__ = (
        "_evicting_small",
        "_freq",
        "_ghost",
        "_main",
        "_size",
        "_small",
        "_small_bytes",
        "small_ratio",
    )
    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise InvalidArgumentError(f"small_ratio must be in (0, 1), got {small_ratio!r}")
        self.small_ratio = small_ratio
        self._size: dict[Key, int] = {}
        super().__init__(self._size)
        self._freq: dict[Key, int] = {}
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._evicting_small: set[Key] = set()  # last victims() proposals taken from S
        self._small_bytes = 0

    def on_insert(
        self, key: Key, size: int, *, parent: Key | None = None, now: float = 0.0
    ) -> None:
        if type(size) is not int or size < 0:
            size = check_size(key, size)
        if key in self._size:
            self.on_remove(key)
        self._size[key] = size
        self._freq[key] = 0
        self._bytes += size
        ghost = self._ghost
        if key in ghost:
            del ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def on_access(self, key: Key, now: float = 0.0) -> None:
        freq = self._freq
        f = freq[key]
        if f < _MAX_FREQ:
            freq[key] = f + 1

    def on_remove(self, key: Key) -> None:
        size = self._size.pop(key)
        del self._freq[key]
        self._pins.pop(key, None)
        self._bytes -= size
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
            if key in self._evicting_small:
                # Evicted from S as proposed: remember the key, so a quick return goes to M.
                self._evicting_small.discard(key)
                ghost = self._ghost
                ghost[key] = None
                limit = max(len(self._size), _GHOST_FLOOR)
                while len(ghost) > limit:
                    ghost.popitem(last=False)
        else:
            del self._main[key]
            self._evicting_small.discard(key)

    def victims(self, nbytes: int, can_evict: CanEvict) -> list[Key]:
        if nbytes <= 0 or not self._size:
            return []
        small, main, freq, size, pins = self._small, self._main, self._freq, self._size, self._pins
        ratio = self.small_ratio
        # Fast path, the common case: the first object examined is enough on its own.
        from_s = bool(small) and (not main or self._small_bytes >= ratio * self._bytes)
        first = next(iter(small if from_s else main))
        if freq[first] == 0 and first not in pins and size[first] >= nbytes and can_evict(first):
            self._evicting_small = {first} if from_s else set()
            return [first]
        back_small: list[Key] = []
        back_main: list[Key] = []
        out: list[Key] = []
        from_small: set[Key] = set()
        deferred: list[tuple[Key, bool]] = []
        freed = 0
        s_bytes = self._small_bytes  # bytes still in play in S / in all
        all_bytes = self._bytes
        try:
            while freed < nbytes and (small or main):
                if small and (not main or s_bytes >= ratio * all_bytes):
                    key = small.popitem(last=False)[0]
                    sz = size[key]
                    s_bytes -= sz
                    if freq[key] > 0:
                        # Hit while on probation: promote to M (a real move).
                        freq[key] = 0
                        main[key] = None
                        self._small_bytes -= sz
                        continue
                    back_small.append(key)
                    in_small = True
                else:
                    key = main.popitem(last=False)[0]
                    f = freq[key]
                    if f > 0:
                        freq[key] = f - 1
                        main[key] = None
                        continue
                    sz = size[key]
                    back_main.append(key)
                    in_small = False
                all_bytes -= sz
                pin = pins.get(key)
                if pin is Pin.HARD or not can_evict(key):
                    continue
                if pin is Pin.SOFT:
                    deferred.append((key, in_small))
                    continue
                out.append(key)
                freed += sz
                if in_small:
                    from_small.add(key)
            for key, in_small in deferred:
                if freed >= nbytes:
                    break
                out.append(key)
                freed += size[key]
                if in_small:
                    from_small.add(key)
        finally:
            # Popped keys that stay in their queue go back to its tail, in their order.
            for queue, back in ((small, back_small), (main, back_main)):
                for key in reversed(back):
                    queue[key] = None
                    queue.move_to_end(key, last=False)
        self._evicting_small = from_small
        return out

    def self_check(self) -> None:
        small, main = self._small, self._main
        assert not (small.keys() & main.keys()), "a key in both S and M"
        assert small.keys() | main.keys() == self._size.keys(), "queues differ from tracked keys"
        assert self._size.keys() == self._freq.keys(), "size and counter maps differ"
        assert all(0 <= f <= _MAX_FREQ for f in self._freq.values()), "counter out of range"
        assert not (self._ghost.keys() & self._size.keys()), "a tracked key in the ghost queue"
        self._check_sized(sum(self._size.values()))
        assert self._small_bytes == sum(self._size[k] for k in small), "S byte total drifted"
