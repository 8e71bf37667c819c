"""The master's RPC connections served from threads of their own, beside the trio loop.

Why: on trio every request of a sequential caller costs a trip through the scheduler
(``wait_readable`` re-arms the socket, the run loop wakes the task) and a connection's
requests are answered only when its task's turn comes; with several callers on the 2-core
development VM the single loop thread also gets one thread's share of the CPUs. So a
non-replicated master on trio serves its RPC connections here: ``threads`` threads (2 by
default), each with its own level-triggered ``epoll`` set, every connection registered on one
of them for as long as it lives; each ready connection's requests are answered in one pass.
``recv`` and ``send`` (the kernel's loopback delivery, ~40 % of a small call's CPU) run
outside the state's lock, so one thread's system calls overlap another's answering.

Mutual exclusion with the loop: one :class:`threading.Lock` guards the master's state. The loop
thread holds it whenever it runs (a trio instrument takes it after every I/O wait and gives it
back before the next one), so everything on the loop (sweeper, snapshots, ``/metrics``,
``/status``, regex matching's apply step) sees the state exactly as before, without a lock at
each access; a serving thread takes it while it answers one connection's batch of requests
(never across I/O). The loop never waits for a serving thread while it holds the lock.

Contracts kept from the loop path (:meth:`MasterServer._serve_socket`):

* answers on a connection in request order (one thread owns a connection); one ``recv`` (at
  most 256 KiB) per connection per round, so a flood on one connection cannot starve the
  others (level-triggered: what is left is read next round);
* a reply the peer does not read is kept (one batch at most) and the connection is not read
  again until it is sent: nothing a peer sends grows without bound;
* deadlines: ``request_timeout`` to the first byte, ``progress_timeout`` inside a frame or
  while a reply waits to be sent (without a byte going out), ``idle_timeout`` between
  frames; checked every :data:`_CHECK_S` (so they fire at most that late, never early);
* authentication (:meth:`MasterServer._auth_step`) runs here; a regex method (it matches in a
  worker thread of the loop) hands the connection, its decoder, the requests decoded after
  it and the answers not yet sent back to the loop path, which serves it from then on;
* cancellation: the loop task owning a connection waits for its thread to finish with it;
  cancelled (eviction at the connection cap, shutdown) it asks the thread to let go and waits
  for that (shielded, bounded) before the socket is closed, so no thread ever uses a closed
  (or reused) descriptor.

Only on trio with its real clock: under ``MockClock`` (tests) time must move with the loop,
and a replicated master (:mod:`mooncake._store.ha`) orders answers behind its log on the loop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from mooncake._core import rpc
from mooncake._store.keyscan import SCAN_METHODS
from mooncake.errors import ProtocolError

if TYPE_CHECKING:
    from mooncake._engine import _accept
    from mooncake._store.master import MasterServer

log = logging.getLogger("mooncake.master")

__all__ = ["Handoff", "RpcThread", "usable"]

_RECV = 256 << 10
#: seconds between deadline checks (a deadline fires at most this late)
_CHECK_S = 0.25
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT


@dataclass
class Handoff:
    """A connection given back to the loop path: its decoder (bytes not yet parsed), the
    requests decoded and not answered (the first is the one it stopped at), and the answers
    before them not yet sent."""

    decoder: rpc.MessageDecoder
    authed: bool
    nonces: tuple[bytes, bytes] | None
    requests: list[rpc.Message]
    out: list[bytes] = field(default_factory=list)


def _own(msg: rpc.Message) -> rpc.Message:
    """``msg`` with its raw part copied out of the receive buffer."""
    if isinstance(msg, rpc.Request):
        return rpc.Request(msg.id, msg.method, msgspec.Raw(bytes(msg.params)), msg.rid)
    return msg


class _Conn:
    __slots__ = (
        "authed",
        "close_after",
        "deadline",
        "decoder",
        "done",
        "fd",
        "first",
        "handoff",
        "nonces",
        "slot",
        "sock",
        "wbuf",
        "what",
    )

    def __init__(
        self, sock: socket.socket, slot: _accept.Slot, decoder: rpc.MessageDecoder
    ) -> None:
        import trio

        self.sock = sock
        self.fd = sock.fileno()
        self.slot = slot
        self.decoder = decoder
        self.authed = False
        self.nonces: tuple[bytes, bytes] | None = None
        self.first = True
        self.wbuf: memoryview | None = None
        self.close_after = False
        self.deadline = 0.0
        self.what = "no request"
        self.done = trio.Event()
        self.handoff: Handoff | None = None

    @property
    def idle(self) -> bool:
        return not self.decoder.buffered and self.wbuf is None


def usable() -> bool:
    """Whether the running loop can host an :class:`RpcThread` (trio, its real clock)."""
    try:
        import sniffio

        if sniffio.current_async_library() != "trio":
            return False
        import trio
        import trio.testing

        return not isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    except Exception:
        return False


class RpcThread:
    """The threads serving one master's RPC connections (see the module docstring).

    :meth:`start` and :meth:`stop` run on the loop; :meth:`serve` is a connection's handler.
    """

    def __init__(self, server: MasterServer, threads: int = 2) -> None:
        import trio

        self.server = server
        self.lock = threading.Lock()
        self._clock = trio.lowlevel.current_clock()
        self._token = trio.lowlevel.current_trio_token()
        self._instrument: Any = None
        self._workers = [_Worker(self, i) for i in range(max(1, threads))]
        self._next = 0

    @property
    def rounds(self) -> int:
        """Rounds of ready connections served so far, all threads."""
        return sum(w.rounds for w in self._workers)

    # -- the loop's side -----------------------------------------------------------------------

    def start(self) -> None:
        """Take the lock for the loop (it runs now) and start the threads."""
        import trio

        lock = self.lock

        class _HoldWhileRunning(trio.abc.Instrument):  # type: ignore[misc]
            def before_io_wait(self, timeout: float) -> None:
                lock.release()

            def after_io_wait(self, timeout: float) -> None:
                lock.acquire()

        lock.acquire()
        self._instrument = _HoldWhileRunning()
        trio.lowlevel.add_instrument(self._instrument)
        for w in self._workers:
            w.thread.start()

    def stop(self) -> None:
        """Stop the threads (call on the loop, after every connection's handler returned)."""
        import trio

        if self._instrument is None:
            return
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self._instrument)
        self._instrument = None
        for w in self._workers:
            w.stopping = True
        self.lock.release()  # the loop now runs without it: the threads may take it and leave
        for w in self._workers:
            w.wake()
            w.thread.join(5.0)
            w.close()

    async def serve(
        self, sock: socket.socket, slot: _accept.Slot, decoder: rpc.MessageDecoder
    ) -> Handoff | None:
        """Serve ``sock`` on a thread until it is done: None (closed, dropped), or a
        :class:`Handoff` for the loop path to go on with.

        Cancelled, it asks the thread to let go of the connection and waits (shielded, a
        bounded time) until it has: the socket is never closed under a thread using it."""
        import anyio

        c = _Conn(sock, slot, decoder)
        c.authed = self.server.secret is None
        c.deadline = time.monotonic() + self.server.config.request_timeout
        w = self._workers[self._next % len(self._workers)]
        self._next += 1
        slot.idle_cb = lambda: c.idle
        w.queue.append((True, c))
        w.wake()
        try:
            await c.done.wait()
        finally:
            slot.idle_cb = None
            if not c.done.is_set():
                w.queue.append((False, c))
                w.wake()
                with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                    await c.done.wait()
        return c.handoff

    def finish(self, c: _Conn, handoff: Handoff | None = None) -> None:
        """(A thread) done with ``c``: its handler is woken; nothing touches ``c`` after."""
        c.handoff = handoff
        try:
            self._token.run_sync_soon(c.done.set)
        except Exception:  # the loop has finished: nobody waits any more
            pass


class _Worker:
    """One serving thread: its ``epoll`` set and connections (only it touches them; the loop
    hands connections in and asks for them back through ``queue``)."""

    def __init__(self, owner: RpcThread, index: int) -> None:
        self.owner = owner
        self.server = owner.server
        self.ep = select.epoll()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.ep.register(self.wake_r, _IN)
        self.conns: dict[int, _Conn] = {}
        #: (attach?, connection) from the loop, in order
        self.queue: collections.deque[tuple[bool, _Conn]] = collections.deque()
        self.scratch = memoryview(bytearray(_RECV))
        self.stopping = False
        self.rounds = 0
        self.thread = threading.Thread(
            target=self._run, name=f"mooncake-master-rpc-{index}", daemon=True
        )

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")

    def close(self) -> None:
        for c in list(self.conns.values()):
            self._finish(c)
        while self.queue:
            self.owner.finish(self.queue.popleft()[1])
        self.ep.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _finish(self, c: _Conn, handoff: Handoff | None = None) -> None:
        if self.conns.get(c.fd) is c:
            del self.conns[c.fd]
            with contextlib.suppress(OSError, ValueError):
                self.ep.unregister(c.fd)
        self.owner.finish(c, handoff)

    def _take_queue(self) -> None:
        while self.queue:
            attach, c = self.queue.popleft()
            if attach:
                self.conns[c.fd] = c
                self.ep.register(c.fd, _IN)
            elif self.conns.get(c.fd) is c:
                self._finish(c)

    def _run(self) -> None:
        next_check = time.monotonic() + _CHECK_S
        while not self.stopping:
            try:
                events = self.ep.poll(_CHECK_S)
            except InterruptedError:
                continue
            except (OSError, ValueError):  # closed under us: stopping
                return
            try:
                self._round(events)
            except Exception:  # never lose the thread: its connections hang on it
                log.exception("master: RPC thread round failed")
            mono = time.monotonic()
            if mono >= next_check:
                next_check = mono + _CHECK_S
                self._expire(mono)

    def _round(self, events: list[tuple[int, int]]) -> None:
        self.rounds += 1
        for fd, _ in events:
            if fd == self.wake_r:
                with contextlib.suppress(OSError):
                    os.read(self.wake_r, 4096)
                self._take_queue()
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            try:
                self._step(c)
            except (ProtocolError, OSError) as e:
                with self.owner.lock:
                    self.server.connections_dropped += 1
                if isinstance(e, ProtocolError):
                    log.warning("master: dropping connection: %s", e)
                else:  # reset, broken pipe
                    log.info("master: connection lost: %s", e)
                self._finish(c)
            except Exception:  # a bug here must cost its connection only
                with self.owner.lock:
                    self.server.connections_dropped += 1
                log.exception("master: RPC connection failed")
                self._finish(c)

    def _expire(self, mono: float) -> None:
        for c in [c for c in self.conns.values() if mono >= c.deadline]:
            with self.owner.lock:
                self.server.connections_dropped += 1
            timeout = self._timeout(c)[0]
            log.info("master: closing a connection: %s for %g s", c.what, timeout)
            self._finish(c)

    def _timeout(self, c: _Conn) -> tuple[float, str]:
        cfg = self.server.config
        if c.wbuf is not None:
            return cfg.progress_timeout, "reply not read"
        if c.decoder.buffered:
            return cfg.progress_timeout, "no progress inside a frame"
        if c.first:
            return cfg.request_timeout, "no request"
        return cfg.idle_timeout, "idle"

    def _step(self, c: _Conn) -> None:
        sock = c.sock
        if c.wbuf is not None:
            try:
                n = sock.send(c.wbuf)
            except (BlockingIOError, InterruptedError):
                return
            c.wbuf = c.wbuf[n:] if n < len(c.wbuf) else None
            if c.wbuf is not None:  # progress: the deadline is for no byte at all
                c.deadline = time.monotonic() + self.server.config.progress_timeout
                return
            if c.close_after:
                self._finish(c)
                return
            self.ep.modify(c.fd, _IN)
            self._rearm(c)
            return
        try:
            n = sock.recv_into(self.scratch)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            c.decoder.check_eof()
            # a client's heartbeat connection closed: tell the state now, before this thread
            # (or another) answers anyone else, not when the loop gets round to the handler
            with self.owner.lock:
                server = self.server
                server._connection_closed(
                    sock, self.owner._clock.current_time() + server.clock_offset
                )
            self._finish(c)
            return
        # the messages' raw params point into the scratch buffer: used before the next recv
        msgs = c.decoder.feed_messages(self.scratch[:n])
        server = self.server
        out: list[bytes] = []
        handoff = None
        with self.owner.lock:  # the state, only while answering (not around the I/O)
            now = self.owner._clock.current_time() + server.clock_offset
            for i, msg in enumerate(msgs):
                c.first = False
                if not isinstance(msg, rpc.Request):
                    raise ProtocolError("a client sent a response frame")
                if not c.authed or msg.method in rpc.AUTH_METHODS:
                    reply, c.authed, c.nonces, close = server._auth_step(msg, c.authed, c.nonces)
                    out.append(reply)
                    if close:
                        c.close_after = True
                        break
                    continue
                if msg.method in SCAN_METHODS:
                    handoff = Handoff(
                        c.decoder, c.authed, c.nonces, [_own(m) for m in msgs[i:]], out
                    )
                    break
                out.append(server.execute(msg, now, sock=sock)[0])
        if handoff is not None:
            self._finish(c, handoff)
            return
        if out:
            data = b"".join(out) if len(out) > 1 else out[0]
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(data):
                c.wbuf = memoryview(data)[sent:]
                self.ep.modify(c.fd, _OUT)
            elif c.close_after:
                self._finish(c)
                return
        self._rearm(c)

    def _rearm(self, c: _Conn) -> None:
        """Move ``c``'s deadline for what it waits for now."""
        timeout, c.what = self._timeout(c)
        c.deadline = time.monotonic() + timeout
        if c.idle:
            c.slot.since = self.owner._clock.current_time()
