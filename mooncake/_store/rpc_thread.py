"""The master's RPC connections served from threads of their own, beside the trio loop.

Why: on trio every request of a sequential caller costs a trip through the scheduler
(``wait_readable`` re-arms the socket, the run loop wakes the task) and a connection's
requests are answered only when its task's turn comes; with several callers on the 2-core
development VM the single loop thread also gets one thread's share of the CPUs. So a
non-replicated master on trio serves its RPC connections here: ``threads`` threads (2 by
default), each with its own level-triggered ``epoll`` set, every connection registered on one
of them for as long as it lives; each ready connection's requests are answered in one pass.
``recv`` and ``send`` (the kernel's loopback delivery, a large share of a small call's CPU:
docs/benchmarks.md, "Loop crossing") run outside the state's lock, so one thread's system calls overlap another's answering.

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
* a connection is answered at most ``reply_batch`` bytes per pass (the requests decoded after
  that wait, copied, in ``pending``); a batch the peer does not read is kept, counted in the
  master's :class:`~mooncake._store.serving.ReplyBudget` (over it: the connection is closed),
  and the connection is neither answered nor read again until it is sent: what a peer makes
  the master hold is one batch plus one answer, whatever it sends;
* deadlines: ``request_timeout`` to the first byte, ``progress_timeout`` inside a frame or
  while a reply waits to be sent (without a byte going out), and the frame's whole bound
  (:func:`~mooncake._store.serving.frame_deadline`), ``idle_timeout`` between frames;
  checked every :data:`_CHECK_S` (so they fire at most that late, never early);
* authentication (:meth:`MasterServer.auth_step`) runs here; a regex method (it matches in a
  worker thread of the loop) hands the connection, its decoder, the requests decoded after
  it and the answers not yet sent back to the loop path, which serves it from then on;
* descriptors: a thread serves a connection through a ``dup`` of its socket's descriptor,
  which it alone closes when it lets go; the loop's socket is closed by the accept loop. So
  whatever the order, no thread ever uses a closed (or reused) descriptor number;
* cancellation: the loop task owning a connection waits for its thread to finish with it;
  cancelled (eviction at the connection cap, shutdown) it asks the thread to let go and waits
  for that (shielded, bounded: a late thread still holds its own descriptor).

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
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from mooncake._core import rpc
from mooncake._store.heldwait import PUT_STARTS
from mooncake._store.keyscan import SCAN_METHODS
from mooncake._store.serving import frame_deadline
from mooncake.errors import ProtocolError

if TYPE_CHECKING:
    from mooncake._engine import _accept
    from mooncake._store.serving import ReplyBudget

log = logging.getLogger("mooncake.master")

__all__ = ["Handoff", "RpcHost", "RpcThread", "usable"]

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
    #: the first request is a put-start refused for held space: (its answer, when the space
    #: is back), for the loop path to wait out (:mod:`mooncake._store.heldwait`)
    held: tuple[bytes, float] | None = None


class ServingConfig(Protocol):
    """The part of the master's configuration a serving thread reads."""

    @property
    def request_timeout(self) -> float: ...
    @property
    def progress_timeout(self) -> float: ...
    @property
    def idle_timeout(self) -> float: ...
    @property
    def min_rate(self) -> float: ...
    @property
    def reply_batch(self) -> int: ...


class RpcHost(Protocol):
    """What the serving threads ask of the master (a
    :class:`~mooncake._store.master.MasterServer`); what reads or changes the state is called
    holding :attr:`RpcThread.lock`."""

    connections_dropped: int
    clock_offset: float

    @property
    def config(self) -> ServingConfig: ...
    @property
    def secret(self) -> bytes | None: ...
    @property
    def replies(self) -> ReplyBudget: ...

    def execute(
        self,
        req: rpc.Request,
        now: float,
        matched: list[str] | None = None,
        sock: socket.socket | None = None,
    ) -> tuple[bytes, int]:
        """(framed reply, log ticket) for one request (never raises for request errors)."""

    def auth_step(
        self,
        req: rpc.Request,
        authed: bool,
        nonces: tuple[bytes, bytes] | None,
        sock: socket.socket | None = None,
    ) -> tuple[bytes, bool, tuple[bytes, bytes] | None, bool]:
        """One request of a connection not yet authenticated (or an auth method)."""

    def connection_closed(self, sock: socket.socket, now: float | None = None) -> None:
        """``sock`` (the loop's socket of the connection) was closed by its peer."""

    def held_refusal(self) -> float:
        """When the space the last put-start was refused for comes back (0.0: not refused
        for held space; :mod:`mooncake._store.heldwait`)."""


def _own(msg: rpc.Message) -> rpc.Message:
    """``msg`` with its raw part copied out of the receive buffer."""
    if isinstance(msg, rpc.Request):
        return rpc.Request(msg.id, msg.method, msgspec.Raw(bytes(msg.params)), msg.rid)
    return msg


class _Conn:
    __slots__ = (
        "authed",
        "busy_start",
        "close_after",
        "deadline",
        "decoder",
        "done",
        "events",
        "fd",
        "first",
        "frame_start",
        "handoff",
        "held",
        "nonces",
        "origin",
        "pending",
        "reply_end",
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
        #: the caller's socket (``sock`` may be a dup of it): the master's key for the
        #: connection (its heartbeat record)
        self.origin = sock
        self.fd = sock.fileno()
        self.slot = slot
        self.decoder = decoder
        self.authed = False
        self.nonces: tuple[bytes, bytes] | None = None
        self.first = True
        self.wbuf: memoryview | None = None
        #: requests decoded and not answered yet (owned copies), answered before any recv
        self.pending: list[rpc.Message] = []
        #: bytes of ``wbuf`` counted in the master's reply budget
        self.held = 0
        self.close_after = False
        self.deadline = 0.0
        #: (monotonic) when the partial frame in the decoder began
        self.frame_start = 0.0
        #: (monotonic) when the unsent reply must be all sent
        self.reply_end = 0.0
        #: (monotonic) when it last began a request or finished some (meaningful while not idle)
        self.busy_start = 0.0
        self.events = 0
        self.what = "no request"
        self.done = trio.Event()
        self.handoff: Handoff | None = None

    @property
    def idle(self) -> bool:
        return not self.decoder.buffered and self.wbuf is None and not self.pending

    def busy_for(self) -> float:
        """Seconds since it last began a request or finished some while it is inside one
        (0: idle): what the accept loop closes first at the cap, with none idle."""
        return 0.0 if self.idle else time.monotonic() - self.busy_start


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

    def __init__(self, server: RpcHost, threads: int = 2) -> None:
        import trio

        self.server = server
        self.lock = threading.Lock()
        self.clock = trio.lowlevel.current_clock()
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

        class _HoldWhileRunning(trio.abc.Instrument):
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

        The thread works on a descriptor of its own (a ``dup`` of ``sock``'s), which only it
        closes, once it has let go of the connection (:meth:`finish`); ``sock`` stays the
        caller's. Cancelled, this asks the thread to let go and waits (shielded, a bounded
        time) until it has; if the thread is late, ``sock`` may be closed meanwhile, and the
        thread's descriptor still names the same connection, never a reused number."""
        import anyio

        own = sock.dup()
        own.setblocking(False)
        c = _Conn(own, slot, decoder)
        c.origin = sock
        c.authed = self.server.secret is None
        c.deadline = time.monotonic() + self.server.config.request_timeout
        w = self._workers[self._next % len(self._workers)]
        self._next += 1
        slot.idle_cb = lambda: c.idle
        slot.busy_for_cb = c.busy_for
        w.queue.append((True, c))
        w.wake()
        try:
            await c.done.wait()
        finally:
            slot.idle_cb = None
            slot.busy_for_cb = None
            if not c.done.is_set():
                w.queue.append((False, c))
                w.wake()
                with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                    await c.done.wait()
        return c.handoff

    def finish(self, c: _Conn, handoff: Handoff | None = None) -> None:
        """(A thread) done with ``c``: its descriptor (the thread's own, out of its ``epoll``
        set by now) is closed and its handler woken; nothing touches ``c`` after."""
        c.handoff = handoff
        with contextlib.suppress(OSError):
            c.sock.close()
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
        if c.held:
            self.server.replies.give(c.held)
            c.held = 0
        c.wbuf = None
        c.pending = []
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
                c.events = _IN
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
            idle = c.idle
            try:
                self._step(c)
                if idle and not c.idle:  # a request began
                    c.busy_start = time.monotonic()
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
            log.info("master: closing a connection: %s", c.what)
            self._finish(c)

    def _timeout(self, c: _Conn) -> tuple[float, str]:
        cfg = self.server.config
        if c.wbuf is not None:
            return cfg.progress_timeout, "reply not read"
        if c.pending:
            return cfg.progress_timeout, "requests not answered"
        if c.decoder.buffered:
            return cfg.progress_timeout, "no progress inside a frame"
        if c.first:
            return cfg.request_timeout, "no request"
        return cfg.idle_timeout, "idle"

    def _want(self, c: _Conn, events: int) -> None:
        if c.events != events:
            self.ep.modify(c.fd, events)
            c.events = events

    def _step(self, c: _Conn) -> None:
        """One pass over ``c``: send what waits, else answer what is pending, else read.

        A connection is read only when it has nothing unsent and nothing pending, and it is
        answered at most ``reply_batch`` bytes per pass: what a peer that never reads makes
        the master hold is one batch, whatever it sent."""
        if c.wbuf is not None:
            if not self._send(c):
                return
            if c.close_after:
                self._finish(c)
                return
            if not c.pending:
                self._want(c, _IN)
                self._rearm(c)
                return
        if c.pending:
            msgs, c.pending = c.pending, []
            self._answer(c, msgs, owned=True)
            return
        try:
            n = c.sock.recv_into(self.scratch)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            c.decoder.check_eof()
            # a client's heartbeat connection closed: tell the state now, before this thread
            # (or another) answers anyone else, not when the loop gets round to the handler
            with self.owner.lock:
                server = self.server
                server.connection_closed(
                    c.origin, self.owner.clock.current_time() + server.clock_offset
                )
            self._finish(c)
            return
        fresh = not c.decoder.buffered
        # the messages' raw params point into the scratch buffer: used (or copied) before
        # the next recv
        msgs = c.decoder.feed_messages(self.scratch[:n])
        if c.decoder.buffered and (fresh or msgs):  # a new frame began in this recv
            c.frame_start = time.monotonic()
        self._answer(c, msgs, owned=False)

    def _send(self, c: _Conn) -> bool:
        """Send what ``c`` has waiting: True once all of it is sent."""
        assert c.wbuf is not None
        c.slot.since = self.owner.clock.current_time()  # as in _answer: before the peer sees it
        try:
            n = c.sock.send(c.wbuf)
        except (BlockingIOError, InterruptedError):
            return False
        n = min(n, c.held)
        self.server.replies.give(n)
        c.held -= n
        c.wbuf = c.wbuf[n:] if n < len(c.wbuf) else None
        if c.wbuf is not None:  # progress: the deadline is for no byte at all
            timeout = self.server.config.progress_timeout
            c.deadline = min(time.monotonic() + timeout, c.reply_end)
            return False
        return True

    def _answer(self, c: _Conn, msgs: list[rpc.Message], owned: bool) -> None:
        server = self.server
        batch = server.config.reply_batch
        out: list[bytes] = []
        size = 0
        handoff = None
        rest: list[rpc.Message] = []
        with self.owner.lock:  # the state, only while answering (not around the I/O)
            now = self.owner.clock.current_time() + server.clock_offset
            for i, msg in enumerate(msgs):
                if size >= batch:  # the rest waits until this batch is sent
                    rest = msgs[i:] if owned else [_own(m) for m in msgs[i:]]
                    break
                c.first = False
                if not isinstance(msg, rpc.Request):
                    raise ProtocolError("a client sent a response frame")
                if not c.authed or msg.method in rpc.AUTH_METHODS:
                    reply, c.authed, c.nonces, close = server.auth_step(
                        msg, c.authed, c.nonces, c.origin
                    )
                    out.append(reply)
                    size += len(reply)
                    if close:
                        c.close_after = True
                        break
                    continue
                if msg.method in SCAN_METHODS:
                    requests = msgs[i:] if owned else [_own(m) for m in msgs[i:]]
                    handoff = Handoff(c.decoder, c.authed, c.nonces, requests, out)
                    break
                reply = server.execute(msg, now, sock=c.origin)[0]
                if msg.method in PUT_STARTS and (until := server.held_refusal()) > 0:
                    requests = msgs[i:] if owned else [_own(m) for m in msgs[i:]]
                    handoff = Handoff(c.decoder, c.authed, c.nonces, requests, out, (reply, until))
                    break
                out.append(reply)
                size += len(reply)
        if handoff is not None:
            self._finish(c, handoff)
            return
        c.pending = rest
        if out:  # requests done: the clock of "inside a request" restarts
            c.busy_start = time.monotonic()
            data = b"".join(out) if len(out) > 1 else out[0]
            # idle from this reply on, stamped before the peer can see it: stamped after
            # the send, a thread descheduled in between left the loop seeing an older
            # stamp than that of connections active since, and it evicted one of those
            c.slot.since = self.owner.clock.current_time()
            try:
                sent = c.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(data):
                left = len(data) - sent
                if not server.replies.take(left):
                    with self.owner.lock:
                        server.connections_dropped += 1
                    log.warning(
                        "master: closing a connection: %d bytes of answers not read, over "
                        "the reply budget (%d bytes held for all connections)",
                        left,
                        server.replies.held,
                    )
                    self._finish(c)
                    return
                c.held = left
                c.wbuf = memoryview(data)[sent:]
                mono = time.monotonic()
                cfg = server.config
                c.reply_end = frame_deadline(mono, left, cfg.progress_timeout, cfg.min_rate)
                self._want(c, _OUT)
                self._rearm(c)
                return
            if c.close_after:
                self._finish(c)
                return
        # the rest is answered in the next round (the socket is writable); else read again
        self._want(c, _OUT if c.pending else _IN)
        self._rearm(c)

    def _rearm(self, c: _Conn) -> None:
        """Move ``c``'s deadline for what it waits for now."""
        timeout, c.what = self._timeout(c)
        mono = time.monotonic()
        c.deadline = mono + timeout
        if c.wbuf is not None:
            if c.reply_end < c.deadline:
                c.deadline, c.what = c.reply_end, "reply not read within its bound"
        elif not c.pending and c.decoder.buffered:
            cfg = self.server.config
            end = frame_deadline(
                c.frame_start, c.decoder.pending_length + 4, cfg.progress_timeout, cfg.min_rate
            )
            if end < c.deadline:
                c.deadline, c.what = end, "frame not done within its bound"
