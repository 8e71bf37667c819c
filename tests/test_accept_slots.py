"""The connection cap's eviction (``mooncake._engine._accept.Slots``) on trio's virtual clock:
real socket pairs stand in for accepted connections, slow to go where a loaded host makes a
serving thread slow to let go of one."""

from __future__ import annotations

import socket

import trio
import trio.testing

from mooncake._engine._accept import EVICT_GONE_S, Slot, Slots


def _slots(n: int, cap: int) -> tuple[Slots, list[Slot], list[socket.socket]]:
    slots = Slots(cap, "test")
    socks: list[socket.socket] = []
    opened = []
    for _ in range(n):
        a, b = socket.socketpair()
        socks += [a, b]
        opened.append(slots.open(a))
    return slots, opened, socks


def test_an_idle_connection_slow_to_go_is_waited_for_not_joined_by_another() -> None:
    """At the cap, the longest-idle connection is asked to go; while it is on its way out (idle
    still, its thread slow to let go), the loop waits for it and asks no other one: it closed a
    second, and a third, idle connection every 50 ms a slow thread took."""

    async def main() -> None:
        slots, (old, new), socks = _slots(2, cap=2)
        old.since, new.since = 1.0, 2.0
        asked: list[Slot] = []

        async with trio.open_nursery() as nursery:

            def going(slot: Slot, after: float) -> None:
                asked.append(slot)

                async def close() -> None:
                    await trio.sleep(after)
                    slots.close(slot)

                nursery.start_soon(close)

            old.evict_cb = lambda: going(old, EVICT_GONE_S / 2)
            new.evict_cb = lambda: going(new, 0.0)
            await slots.wait_room()
        assert asked == [old]
        assert slots.evicted == 1 and len(slots) == 1
        for s in socks:
            s.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_asked_connection_that_never_goes_is_followed_by_the_next() -> None:
    """An asked connection that stays past ``EVICT_GONE_S`` (idle, yet it does not close) does
    not stall the accept loop: the next longest-idle one is asked."""

    async def main() -> None:
        slots, (stuck, other), socks = _slots(2, cap=2)
        stuck.since, other.since = 1.0, 2.0
        asked: list[Slot] = []
        stuck.evict_cb = lambda: asked.append(stuck)  # never closes

        def go() -> None:
            asked.append(other)
            slots.close(other)

        other.evict_cb = go
        start = trio.current_time()
        await slots.wait_room()
        assert asked == [stuck, other]
        assert trio.current_time() - start >= EVICT_GONE_S
        assert len(slots) == 1 and stuck in slots.live
        for s in socks:
            s.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
