"""Conformance checks for transports: what any transport must do, through a real engine.

::

    from mooncake.testing.transport import check_transport, process_pair

    await check_transport(process_pair(["shm", "tcp"], transport="shm", memory="alloc"))

A *pair* is an engine in this process and a :class:`Peer` it transfers with; ``make_pair()``
returns an async context manager yielding a fresh :class:`TransportPair` (each check gets its
own, since some kill or unregister the peer). :func:`process_pair` puts the peer in a child
process (``mooncake.testing._transport_peer``); :func:`local_pair` makes the engine its own peer
(the engine's local copy path). The checks (:data:`CHECKS`, one function each):

* ``registration``: bytes written arrive and read back; a local buffer registered late is
  usable at once; the peer re-registering its memory (new keys) is followed; a transfer from a
  local range no longer registered raises :class:`~mooncake.errors.NotRegisteredError`.
* ``bounds``: a request reaching past either end of the peer's registered memory fails with
  :class:`~mooncake.errors.RemoteAccessError` and touches no byte outside it, also when handed
  to the transport itself (so a hostile or stale caller is refused where the bytes are), and
  when the peer unregistered the range after we cached its descriptor.
* ``cancellation``: a transfer cancelled after any number of checkpoints returns with nothing
  left in flight: no byte of a cancelled read lands afterwards, the local buffer unregisters,
  and the pair keeps working.
* ``unregister_during_transfer``: a local ``unregister`` waits for the transfers using the
  region; a peer's ``unregister`` returns only when no byte of ours lands in it any more.
* ``peer_death``: a killed peer fails the transfers to it (running and new ones) with
  :class:`~mooncake.errors.PeerDiedError` or :class:`~mooncake.errors.PeerUnreachableError`,
  without hanging, and the engine closes cleanly after.

A check raises ``AssertionError`` naming the violation, or :class:`Unsupported` when the pair
cannot offer what it tests (a peer that cannot die); :func:`check_transport` runs them in order
and returns the names of the unsupported ones. ``anyio.fail_after`` guards turn a hang into a
failure (generous bounds, never a speed assertion).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import numpy as np

from mooncake._core.transfer import TransferRequest, TransferResult, TransferStatus
from mooncake._engine.engine import Engine, open_engine
from mooncake.errors import (
    InvalidArgumentError,
    NotRegisteredError,
    PeerDiedError,
    PeerUnreachableError,
    RegistrationError,
    RemoteAccessError,
)
from mooncake.testing._transport_peer import ProcessPeer, digest, pattern

R = TransferRequest
#: a guard against hangs (a check that takes this long is stuck, not slow)
HANG_S = 120.0
#: checkpoints after which the cancellation and unregister checks interrupt a transfer
INTERRUPT_AT = (0, 1, 2, 3, 5, 8, 13, 21, 50, 200)
#: requests per big batch (the peer's region, less the sync tail, is split into this many)
PIECES = 32
#: the region's last bytes, left out of the big batches: the sync point's own range
SYNC_BYTES = 4096


class Unsupported(Exception):
    """The pair cannot offer what the check tests (the reason is the message)."""


class Peer(Protocol):
    """The far side of a pair: one registered region of ``length`` bytes at ``addr``, with
    ``guard`` bytes of watched, unregistered memory on each side (0: none)."""

    segment: str
    addr: int
    length: int
    guard: int
    #: whether :meth:`kill` is supported
    can_die: bool

    async def fill(self, seed: int) -> None:
        """Fill the region and its guards with ``pattern(seed)`` (starting at the guard)."""

    async def digest(self, offset: int, length: int) -> str:
        """The digest of ``length`` bytes at ``addr + offset`` (``offset`` may be negative)."""

    async def unregister(self) -> str:
        """Unregister the region; return its digest taken as the unregister returned."""

    async def register(self) -> None:
        """Register the region again (``addr`` may change)."""

    async def kill(self) -> None:
        """Kill the peer's process and wait for it to be gone."""


@dataclass
class TransportPair:
    """An engine, the peer it transfers with, and the transport every transfer is forced to
    (``None``: the engine's own choice, as for the local path)."""

    engine: Engine
    peer: Peer
    transport: str | None


MakePair = Callable[[], AbstractAsyncContextManager[TransportPair]]


def process_pair(
    transports: Sequence[str],
    *,
    transport: str,
    memory: str = "array",
    size: int = 8 << 20,
    env: dict[str, str] | None = None,
) -> MakePair:
    """Pairs of an engine here and one in a child process, both with ``transports`` installed,
    every transfer forced onto ``transport``. ``memory`` is the peer's region: ``array``
    (plain memory, guarded) or ``alloc`` (an engine buffer, memfd-backed where possible).
    ``env`` goes to the child only: set what this process needs (verbs provider) yourself."""
    if transport not in transports:
        raise InvalidArgumentError(f"transport {transport!r} is not in {list(transports)}")

    @asynccontextmanager
    async def make() -> AsyncIterator[TransportPair]:
        peer = await anyio.to_thread.run_sync(
            lambda: ProcessPeer(list(transports), memory=memory, size=size, env=env)
        )
        try:
            async with open_engine("127.0.0.1", transports=list(transports)) as engine:
                yield TransportPair(engine, peer, transport)
        finally:
            await anyio.to_thread.run_sync(peer.close)

    return make


class _LocalPeer:
    """The engine as its own peer: a guarded numpy region registered in the same engine."""

    can_die = False

    def __init__(self, engine: Engine, size: int, guard: int) -> None:
        self.engine = engine
        self.segment = engine.segment_name
        self.backing = np.zeros(size + 2 * guard, dtype=np.uint8)
        self.addr = int(self.backing.ctypes.data) + guard
        self.length = size
        self.guard = guard

    async def fill(self, seed: int) -> None:
        self.backing[:] = pattern(seed, len(self.backing))

    async def digest(self, offset: int, length: int) -> str:
        o = self.guard + offset
        return digest(self.backing[o : o + length])

    async def unregister(self) -> str:
        await self.engine.unregister(self.addr)
        return digest(self.backing[self.guard : self.guard + self.length])

    async def register(self) -> None:
        await self.engine.register((self.addr, self.length))

    async def kill(self) -> None:
        raise Unsupported("the local path has no peer process to kill")


def local_pair(*, size: int = 8 << 20, transports: Sequence[str] = ("tcp",)) -> MakePair:
    """Pairs of one engine with itself: transfers to its own segment (the local copy path)."""

    @asynccontextmanager
    async def make() -> AsyncIterator[TransportPair]:
        async with open_engine("127.0.0.1", transports=list(transports)) as engine:
            peer = _LocalPeer(engine, size, 64 << 10)
            await peer.register()
            yield TransportPair(engine, peer, None)

    return make


# -- helpers ---------------------------------------------------------------------------------


async def _run(p: TransportPair, reqs: Sequence[TransferRequest]) -> list[TransferResult]:
    with anyio.fail_after(HANG_S):
        return await p.engine.transfer(p.peer.segment, reqs, transport=p.transport)


async def _ok(p: TransportPair, reqs: Sequence[TransferRequest], what: str) -> None:
    res = await _run(p, reqs)
    bad = [(i, r.error) for i, r in enumerate(res) if r.status is not TransferStatus.COMPLETED]
    assert not bad, f"{what}: requests failed: {bad[:3]}"


def _span(n: int) -> int:
    """How many leading bytes of an ``n``-byte region :func:`_pieces` covers."""
    return (n - SYNC_BYTES) // PIECES * PIECES


def _pieces(local: int, remote: int, n: int, write: bool) -> list[TransferRequest]:
    """The first :func:`_span` bytes of ``n`` (never the sync point's tail) as :data:`PIECES`
    requests."""
    step = _span(n) // PIECES
    mk = R.write if write else R.read
    return [mk(local + i * step, remote + i * step, step) for i in range(PIECES)]


async def _local(engine: Engine, n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    arr = pattern(seed, n).copy()
    await engine.register(arr)
    return arr


async def _sync_point(p: TransportPair, scratch: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """A complete write and read back of the 4 KiB past the big batches' span (:func:`_pieces`
    leaves it out): what the peer had in flight before has landed or never will.

    Not at the start of the region: a cancelled *write*'s bytes may still land at the peer
    after a later write to the same range (the tcp server may serve a closed connection's
    buffered request after a new connection's); the contract is about local memory."""
    a = int(scratch.ctypes.data)
    tail = p.peer.addr + p.peer.length - SYNC_BYTES
    scratch[:SYNC_BYTES] = 0x5A
    await _ok(p, [R.write(a, tail, SYNC_BYTES)], "sync write")
    scratch[:SYNC_BYTES] = 0
    await _ok(p, [R.read(a, tail, SYNC_BYTES)], "sync read")
    assert (scratch[:SYNC_BYTES] == 0x5A).all(), (
        "sync point: read back differs from what was written"
    )


def _failed_with(res: TransferResult, kinds: tuple[type[BaseException], ...], what: str) -> None:
    assert res.status is TransferStatus.FAILED, f"{what}: succeeded, must fail"
    assert isinstance(res.error, kinds), f"{what}: failed with {res.error!r}, want {kinds}"


# -- the checks ------------------------------------------------------------------------------


async def check_registration(make_pair: MakePair) -> None:
    """Round trip, late local registration, peer re-registration, unregistered local range."""
    async with make_pair() as p:
        n = p.peer.length
        src = await _local(p.engine, n, 3)
        await _ok(p, _pieces(int(src.ctypes.data), p.peer.addr, n, True), "write")
        m = _span(n)
        assert await p.peer.digest(0, m) == digest(src[:m]), "written bytes differ at the peer"
        late = np.zeros(n, dtype=np.uint8)
        await p.engine.register(late)
        await _ok(p, _pieces(int(late.ctypes.data), p.peer.addr, n, False), "read (late buffer)")
        assert digest(late[:m]) == digest(src[:m]), "read-back bytes differ from what was written"
        await p.peer.unregister()
        await p.peer.register()  # new keys (rdma), maybe a new address (alloc): followed
        await p.peer.fill(5)
        await _ok(p, [R.read(int(late.ctypes.data), p.peer.addr, n)], "read after re-register")
        assert digest(late) == await p.peer.digest(0, n), "read after re-register differs"
        await p.engine.unregister(late)
        try:
            await p.engine.transfer(
                p.peer.segment,
                [R.read(int(late.ctypes.data), p.peer.addr, 4096)],
                transport=p.transport,
            )
        except NotRegisteredError:
            pass
        else:
            raise AssertionError("a transfer from an unregistered local range must raise")


async def check_bounds(make_pair: MakePair) -> None:
    """Requests past either end of the peer's region fail and touch nothing outside it."""
    async with make_pair() as p:
        peer, n, g = p.peer, p.peer.length, p.peer.guard
        await peer.fill(7)
        guards = (await peer.digest(-g, g), await peer.digest(n, g)) if g else None
        src = await _local(p.engine, 2 * 65536, 9)
        a = int(src.ctypes.data)
        over = [
            R.write(a, peer.addr + n - 4096, 8192),  # past the end
            R.write(a, peer.addr - 4096, 8192),  # before the start
            R.read(a, peer.addr + n - 4096, 8192),
        ]
        for i, res in enumerate(await _run(p, over)):
            _failed_with(res, (RemoteAccessError,), f"out-of-bounds request {i}")
        # handed straight to the transport (no engine-side bounds check in front of it)
        t = next((t for t in p.engine.transports if t.name == p.transport), None)
        if t is not None:
            info = await p.engine.peer(peer.segment)
            region = p.engine.acquire_region(a, 8192)
            try:
                with anyio.fail_after(HANG_S):
                    direct = await t.execute(info, over[:2])
            finally:
                p.engine.release_region(region)
            for i, r in enumerate(direct):
                assert r.status is TransferStatus.FAILED, f"transport accepted bad request {i}"
        if guards is not None:
            after = (await peer.digest(-g, g), await peer.digest(n, g))
            assert after == guards, "an out-of-bounds request wrote outside the peer's region"
        await _ok(p, [R.write(a, peer.addr, 8192)], "in-bounds write after refusals")
        # the peer's range is gone, our descriptor of it stale: refused where the bytes are
        await _ok(p, [R.read(a, peer.addr, 4096)], "read (caches the descriptor)")
        before = await peer.unregister()
        (res,) = await _run(p, [R.write(a, peer.addr, 8192)])
        _failed_with(res, (RemoteAccessError,), "write to the range the peer unregistered")
        assert await peer.digest(0, n) == before, "a write landed in an unregistered range"


async def _interrupted(
    p: TransportPair, reqs: list[TransferRequest], k: int, then: Callable[[], Awaitable[Any]]
) -> None:
    """Start ``reqs``; after ``k`` checkpoints await ``then()``; return when both are done.

    A transfer that starts only after ``then()`` began unregistering its local range is
    refused with :class:`~mooncake.errors.RegistrationError`, which is right and ignored."""

    async def transfer() -> None:
        try:
            await _run(p, reqs)
        except RegistrationError:
            pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(transfer)
        for _ in range(k):
            await anyio.lowlevel.checkpoint()
        with anyio.fail_after(HANG_S):
            await then()


async def check_cancellation(make_pair: MakePair) -> None:
    """A cancelled transfer leaves nothing in flight, whenever it is cancelled."""
    async with make_pair() as p:
        n = p.peer.length
        await p.peer.fill(11)
        scratch = await _local(p.engine, 4096, 0)
        for k in INTERRUPT_AT:
            dst = await _local(p.engine, n, 1)
            d = int(dst.ctypes.data)
            for write in (False, True):
                with anyio.CancelScope() as scope:

                    async def cancel(scope: anyio.CancelScope = scope) -> None:
                        scope.cancel()

                    await _interrupted(p, _pieces(d, p.peer.addr, n, write), k, cancel)
            dst[:] = 0xEE  # a read landing after this is one the cancel left behind
            await _sync_point(p, scratch)
            assert (dst == 0xEE).all(), f"a cancelled read wrote after it returned (k={k})"
            with anyio.fail_after(HANG_S):
                await p.engine.unregister(dst)  # no pin left behind
        await p.peer.fill(11)
        dst = await _local(p.engine, n, 1)
        await _ok(p, _pieces(int(dst.ctypes.data), p.peer.addr, n, False), "read after cancels")
        m = _span(n)
        assert digest(dst[:m]) == await p.peer.digest(0, m), "read after cancels differs"


async def check_unregister_during_transfer(make_pair: MakePair) -> None:
    """Local and peer ``unregister`` wait for the transfers on the region."""
    async with make_pair() as p:
        n = p.peer.length
        await p.peer.fill(13)
        scratch = await _local(p.engine, 4096, 0)
        for k in INTERRUPT_AT[::3]:
            dst = await _local(p.engine, n, 1)

            async def unregister(dst: np.ndarray[Any, np.dtype[np.uint8]] = dst) -> None:
                await p.engine.unregister(dst)
                dst[:] = 0xEE  # a read landing after this is one unregister did not wait for

            await _interrupted(
                p, _pieces(int(dst.ctypes.data), p.peer.addr, n, False), k, unregister
            )
            await _sync_point(p, scratch)
            assert (dst == 0xEE).all(), f"a read wrote after unregister returned (k={k})"
        # the peer unregisters while we write to it, over and over
        src = await _local(p.engine, n, 17)
        s = int(src.ctypes.data)
        done = anyio.Event()
        after: list[str] = []

        async def writer() -> None:
            while not done.is_set():
                await _run(p, _pieces(s, p.peer.addr, n, True))
                await anyio.lowlevel.checkpoint()  # a refused transfer may not yield (local)

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await _ok(p, [R.write(s, p.peer.addr, 4096)], "first write")
            after.append(await p.peer.unregister())
            done.set()
        assert await p.peer.digest(0, n) == after[0], "bytes landed after the peer's unregister"


async def check_peer_death(make_pair: MakePair) -> None:
    """A killed peer fails transfers (running and new) without a hang."""
    async with make_pair() as p:
        if not p.peer.can_die:
            raise Unsupported("the peer cannot be killed (same process)")
        n = p.peer.length
        src = await _local(p.engine, n, 19)
        s = int(src.ctypes.data)
        await _ok(p, _pieces(s, p.peer.addr, n, True), "write before the death")
        results: list[list[TransferResult]] = []

        async def writer() -> None:
            while True:
                res = await _run(p, _pieces(s, p.peer.addr, n, True))
                results.append(res)
                if any(r.status is TransferStatus.FAILED for r in res):
                    return
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await anyio.lowlevel.checkpoint()
            await p.peer.kill()
        dead = (PeerDiedError, PeerUnreachableError)
        failed = [r for r in results[-1] if r.status is TransferStatus.FAILED]
        assert all(isinstance(r.error, dead) for r in failed), [r.error for r in failed][:3]
        for i, res in enumerate(await _run(p, _pieces(s, p.peer.addr, n, False))):
            _failed_with(res, dead, f"request {i} to the dead peer")


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[MakePair], Awaitable[None]]

    async def run(self, make_pair: MakePair) -> None:
        await self.fn(make_pair)


CHECKS: tuple[Check, ...] = (
    Check("registration", check_registration),
    Check("bounds", check_bounds),
    Check("cancellation", check_cancellation),
    Check("unregister_during_transfer", check_unregister_during_transfer),
    Check("peer_death", check_peer_death),
)


async def check_transport(make_pair: MakePair, *, only: Sequence[str] | None = None) -> list[str]:
    """Run the :data:`CHECKS` (or those named in ``only``) on fresh pairs from ``make_pair``.

    Raises ``AssertionError`` at the first violation; returns the names of the checks the pair
    does not support (with ``only`` naming one, that one's :class:`Unsupported` is raised
    instead, so a test runner can skip with its reason).
    """
    names = {c.name for c in CHECKS}
    unknown = sorted(set(only or ()) - names)
    if unknown:
        raise InvalidArgumentError(f"unknown transport checks {unknown} (known: {sorted(names)})")
    skipped: list[str] = []
    for c in CHECKS:
        if only is not None and c.name not in only:
            continue
        try:
            await c.run(make_pair)
        except Unsupported:
            if only is not None and len(only) == 1:
                raise
            skipped.append(c.name)
    return skipped


__all__ = [
    "CHECKS",
    "Check",
    "MakePair",
    "Peer",
    "TransportPair",
    "Unsupported",
    "check_transport",
    "local_pair",
    "process_pair",
]
