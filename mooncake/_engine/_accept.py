"""Bounded accept loops: a cap on live connections, eviction of idle ones, deadlines.

Every server of ours (TCP data, P2P handshake, HTTP metadata, store master RPC) accepts through
:func:`accept_loop` with a :class:`Slots` table:

* at most ``cap`` connections are live; at the cap the loop stops calling ``accept`` (further
  connections wait in the kernel's listen backlog, and past it are refused by the kernel);
* before waiting, it asks the longest-idle live connection to close (``evict``): a connection
  is *idle* when it is between requests (or has sent nothing since it was accepted) and can be
  closed without losing a request;
* with none idle, it closes (``kill``) the connection that has been inside its current request
  longest, once that is over :data:`EVICT_BUSY_S`: peers that trickle their requests cannot
  hold every slot against a new one (each server also bounds a request's whole time);
* each connection's handler runs in its own task inside a cancel scope, so evicting a connection
  served on the event loop is a plain cancellation.

Servers mark their connections busy/idle with :meth:`Slot.busy` / :meth:`Slot.rest`; a slot
starts idle at accept (so an accepted socket that never sends is the first to go). The deadlines
themselves (idle, handshake, progress) are the handlers': this module only starts their clocks.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable

import anyio

log = logging.getLogger("mooncake.accept")

#: how long the accept loop waits for an evicted connection to go before choosing again
EVICT_WAIT_S = 0.05
#: at the cap with no idle connection, one inside a request this long (seconds) may be closed
EVICT_BUSY_S = 1.0
#: how long (seconds) an asked idle connection may take to go before another is asked too
EVICT_GONE_S = 2.0


class Slot:
    """One live connection in a :class:`Slots` table."""

    __slots__ = (
        "busy_for_cb",
        "busy_since",
        "evict_cb",
        "idle",
        "idle_cb",
        "scope",
        "since",
        "sock",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle = True
        self.since = anyio.current_time()
        self.busy_since = self.since
        #: seconds inside its current request, where another thread knows better
        self.busy_for_cb: Callable[[], float] | None = None
        self.scope: anyio.CancelScope | None = None
        #: how to evict this connection when idle (default: cancel its handler's scope)
        self.evict_cb: Callable[[], None] | None = None
        #: whether it is idle, where another thread knows better than ``idle``
        self.idle_cb: Callable[[], bool] | None = None

    def is_idle(self) -> bool:
        return self.idle_cb() if self.idle_cb is not None else self.idle

    def busy_for(self) -> float:
        """Seconds the connection has been inside a request without finishing one (0 when
        idle; see :meth:`progress`)."""
        if self.busy_for_cb is not None:
            return self.busy_for_cb()
        return 0.0 if self.idle else anyio.current_time() - self.busy_since

    def busy(self) -> None:
        """The connection is inside a request: evicted only after the idle ones, and only
        once it has been inside this request for :data:`EVICT_BUSY_S`."""
        if self.idle:
            self.idle = False
            self.busy_since = anyio.current_time()

    def progress(self) -> None:
        """The connection finished a request but is still inside others (pipelined): its
        :meth:`busy_for` clock restarts."""
        self.busy_since = anyio.current_time()

    def rest(self) -> None:
        """The connection is between requests: evictable, longest-idle first."""
        if not self.idle:
            self.idle = True
            self.since = anyio.current_time()

    def evict(self) -> None:
        if self.evict_cb is not None:
            self.evict_cb()
        elif self.scope is not None:
            self.scope.cancel()

    def kill(self) -> None:
        """Close the connection whatever it is doing (cancel its handler)."""
        if self.scope is not None:
            self.scope.cancel()


class Slots:
    """Live connections of one server, at most ``cap`` (see the module docstring)."""

    def __init__(self, cap: int, what: str) -> None:
        if cap < 1:
            raise ValueError(f"{what}: connection cap must be >= 1, got {cap}")
        self.cap = cap
        self.what = what
        self.live: set[Slot] = set()
        self.evicted = 0
        #: connections closed inside a request at the cap (counted in ``evicted`` too)
        self.killed = 0
        self.waited = 0
        self._freed = anyio.Event()

    def __len__(self) -> int:
        return len(self.live)

    async def wait_room(self) -> None:
        """Return once fewer than ``cap`` connections are live, evicting idle ones meanwhile."""
        if len(self.live) < self.cap:
            return
        self.waited += 1
        asked: set[Slot] = set()
        killing: set[Slot] = set()  # closed whatever they do: going, idle or not
        asked_at = 0.0
        while len(self.live) >= self.cap:
            # one asked and still idle is on its way out (its thread may be slow to let go on
            # a loaded host): wait for it, not close another idle one as well
            going = any(s in killing or s.is_idle() for s in asked)
            if going and anyio.current_time() - asked_at < EVICT_GONE_S:
                self._freed = anyio.Event()
                with anyio.move_on_after(EVICT_WAIT_S):
                    await self._freed.wait()
                asked &= self.live
                continue
            idle = [s for s in self.live if s not in asked and s.is_idle()]
            asked_at = anyio.current_time()
            if idle:
                victim = min(idle, key=lambda s: s.since)
                asked.add(victim)
                self.evicted += 1
                log.debug("%s: %d connections (cap); evicting an idle one", self.what, self.cap)
                victim.evict()
            else:
                slow = self._slowest(asked)
                if slow is not None:
                    asked.add(slow)
                    self.evicted += 1
                    self.killed += 1
                    log.info(
                        "%s: %d connections (cap), none idle; closing the one longest inside "
                        "a request",
                        self.what,
                        self.cap,
                    )
                    slow.kill()
                    killing.add(slow)
                    idle = [slow]
            self._freed = anyio.Event()
            with anyio.move_on_after(EVICT_WAIT_S if idle else 1.0):
                await self._freed.wait()
            asked &= self.live  # forget those that went
            killing &= self.live
            if not idle:
                asked.clear()  # one that refused (it was busy) may be idle by now

    def _slowest(self, asked: set[Slot]) -> Slot | None:
        """The live connection longest inside its request, if that is over EVICT_BUSY_S."""
        best, age = None, EVICT_BUSY_S
        for s in self.live:
            if s not in asked:
                t = s.busy_for()
                if t >= age:
                    best, age = s, t
        return best

    def open(self, sock: socket.socket) -> Slot:
        slot = Slot(sock)
        self.live.add(slot)
        return slot

    def close(self, slot: Slot) -> None:
        self.live.discard(slot)
        self._freed.set()


_RETRY_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


async def accept_loop(
    lsock: socket.socket,
    slots: Slots,
    handler: Callable[[socket.socket, Slot], Awaitable[None]],
    *,
    prepare: Callable[[socket.socket], None] | None = None,
) -> None:
    """Accept on the non-blocking ``lsock`` forever, one task per connection, within ``slots``.

    ``prepare`` tunes each accepted socket (default: non-blocking). The handler owns nothing
    of the socket's lifetime: it is closed here once the handler returns or is cancelled.
    Out of descriptors (``EMFILE``...), the loop backs off and retries.
    """
    async with anyio.create_task_group() as tg:
        try:
            while True:
                await slots.wait_room()
                try:
                    conn, _ = lsock.accept()
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_readable(lsock)
                    continue
                except OSError as e:
                    if e.errno in _RETRY_ERRNOS:
                        log.warning("%s accept: %s; backing off", slots.what, e)
                        await anyio.sleep(0.05)
                        continue
                    raise
                try:
                    if prepare is not None:
                        prepare(conn)
                    else:
                        conn.setblocking(False)
                except OSError:
                    conn.close()
                    continue
                slot = slots.open(conn)
                tg.start_soon(_run, slots, slot, handler)
        finally:
            tg.cancel_scope.cancel()


async def _run(
    slots: Slots, slot: Slot, handler: Callable[[socket.socket, Slot], Awaitable[None]]
) -> None:
    try:
        with anyio.CancelScope() as scope:
            slot.scope = scope
            await handler(slot.sock, slot)
    except Exception:
        # a handler bug must cost its connection only, never the server's task group
        log.exception("%s: connection handler failed", slots.what)
    finally:
        slots.close(slot)
        sock = slot.sock
        if sock.fileno() >= 0:
            try:
                anyio.notify_closing(sock)
            except Exception:
                pass
            sock.close()


def listen_tcp(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A bound, listening, non-blocking TCP socket on ``host:port`` (``OSError`` on failure).

    ``host`` must be a literal address or a name that resolves synchronously (loopback, a local
    name); servers bind exactly what they are given.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, stype, proto, _, addr = infos[0]
    lsock = socket.socket(family, stype, proto)
    try:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(addr)
        lsock.listen(backlog)
        lsock.setblocking(False)
    except BaseException:
        lsock.close()
        raise
    return lsock
