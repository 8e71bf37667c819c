"""The master's RPC connections served from a thread of their own, beside the trio loop.

Why: on trio every request of a sequential caller costs a trip through the scheduler
(``wait_readable`` registers the socket, the run loop wakes the task, the task re-arms):
measured with a 40-byte echo on the 2-core development VM, 22 us of user CPU and 15 us of
system CPU per request, against 1 us and 10 us for a plain level-triggered ``epoll`` loop. The
request path itself (decode, :meth:`MasterServer.execute`, encode) is ~3.5 us for ``ExistKey``.
So a non-replicated master on trio serves its RPC connections here: one thread, one ``epoll``
set, every connection registered for as long as it lives, each ready connection's buffered
requests answered in one pass.

Mutual exclusion with the loop: one :class:`threading.Lock` guards the master's state. The loop
thread holds it whenever it runs (a trio instrument takes it after every I/O wait and gives it
back before the next one), so everything on the loop (sweeper, snapshots, ``/metrics``,
``/status``, regex matching's apply step) sees the state exactly as before, without a
lock at each access; this thread takes it for each batch of ready connections (never across
its own ``epoll`` wait). The loop never waits for this thread while holding it.

Contracts kept from the loop path (:meth:`MasterServer._serve_socket`):

* answers on a connection in request order; one ``recv`` (at most 256 KiB) per connection per
  round, so a flood on one connection cannot starve the others (level-triggered: what is left
  is read next round);
* a reply the peer does not read is kept (one batch at most) and the connection is not read
  again until it is sent: nothing a peer sends grows without bound;
* deadlines: ``request_timeout`` to the first byte, ``progress_timeout`` inside a frame or
  while a reply waits to be sent, ``idle_timeout`` between frames; checked every
  :data:`_CHECK_S` (so they fire at most that late, never early);
* authentication (:meth:`MasterServer._auth_step`) runs here; a regex method (it matches in a
  worker thread of the loop) hands the connection, its decoder and the answers not yet sent,
  back to the loop path, which serves it from then on;
* cancellation: the loop task owning a connection waits for this thread to finish with it;
  cancelled (eviction at the connection cap, shutdown) it takes the connection out of the
  ``epoll`` set itself (it holds the lock, so this thread is not inside it) before the socket
  is closed.

Only on trio with its real clock: under ``MockClock`` (tests) time must move with the loop,
and a replicated master (:mod:`mooncake._store.ha`) orders answers behind its log on the loop.
"""

from __future__ import annotations

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
    """The thread serving one master's RPC connections (see the module docstring).

    :meth:`start` and :meth:`stop` run on the loop; :meth:`serve` is a connection's handler.
    """

    def __init__(self, server: MasterServer) -> None:
        import trio

        self.server = server
        self.lock = threading.Lock()
        self._clock = trio.lowlevel.current_clock()
        self._token = trio.lowlevel.current_trio_token()
        self._instrument: Any = None
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ep.register(self._wake_r, _IN)
        self._conns: dict[int, _Conn] = {}
        self._scratch = memoryview(bytearray(_RECV))
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mooncake-master-rpc", daemon=True)
        self.rounds = 0
        """Rounds of ready connections served (one lock hold each)."""

    # -- the loop's side -----------------------------------------------------------------------

    def start(self) -> None:
        """Take the lock for the loop (it runs now) and start the thread."""
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
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (call on the loop, after every connection's handler returned)."""
        import trio

        if self._instrument is None:
            return
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self._instrument)
        self._instrument = None
        self._stopping = True
        self.lock.release()  # the loop now runs without it: the thread may take it and leave
        self._wake()
        self._thread.join(5.0)
        for c in list(self._conns.values()):
            self._detach(c)
        self._ep.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    async def serve(
        self, sock: socket.socket, slot: _accept.Slot, decoder: rpc.MessageDecoder
    ) -> Handoff | None:
        """Serve ``sock`` on the thread until it is done: None (closed, dropped), or a
        :class:`Handoff` for the loop path to go on with. Runs on the loop (lock held)."""
        c = _Conn(sock, slot, decoder)
        c.authed = self.server.secret is None
        c.deadline = time.monotonic() + self.server.config.request_timeout
        slot.idle_cb = lambda: c.idle
        self._conns[c.fd] = c
        self._ep.register(c.fd, _IN)
        try:
            await c.done.wait()
        finally:
            if self._conns.get(c.fd) is c:  # cancelled: the thread is not inside it (lock)
                self._detach(c)
            slot.idle_cb = None
        return c.handoff

    # -- the thread ----------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _detach(self, c: _Conn) -> None:
        if self._conns.get(c.fd) is c:
            del self._conns[c.fd]
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(c.fd)

    def _finish(self, c: _Conn, handoff: Handoff | None = None) -> None:
        """Done with ``c`` (thread side): out of the set, its handler woken."""
        self._detach(c)
        c.handoff = handoff
        try:
            self._token.run_sync_soon(c.done.set)
        except Exception:  # the loop has finished: nobody waits any more
            pass

    def _run(self) -> None:
        ep = self._ep
        lock = self.lock
        next_check = time.monotonic() + _CHECK_S
        while True:
            try:
                events = ep.poll(_CHECK_S)
            except InterruptedError:
                continue
            except (OSError, ValueError):  # closed under us: stopping
                return
            with lock:
                if self._stopping:
                    return
                try:
                    self._round(events)
                except Exception:  # never lose the thread: every connection hangs on it
                    log.exception("master: RPC thread round failed")
                mono = time.monotonic()
                if mono >= next_check:
                    next_check = mono + _CHECK_S
                    self._expire(mono)

    def _round(self, events: list[tuple[int, int]]) -> None:
        server = self.server
        self.rounds += 1
        now = self._clock.current_time() + server.clock_offset
        for fd, ev in events:
            if fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                continue
            c = self._conns.get(fd)
            if c is None:
                continue
            try:
                self._step(c, ev, now)
            except ProtocolError as e:
                server.connections_dropped += 1
                log.warning("master: dropping connection: %s", e)
                self._finish(c)
            except OSError as e:  # reset, broken pipe
                server.connections_dropped += 1
                log.info("master: connection lost: %s", e)
                self._finish(c)
            except Exception:  # a bug here must cost its connection only
                server.connections_dropped += 1
                log.exception("master: RPC connection failed")
                self._finish(c)

    def _expire(self, mono: float) -> None:
        for c in [c for c in self._conns.values() if mono >= c.deadline]:
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

    def _step(self, c: _Conn, ev: int, now: float) -> None:
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
            self._ep.modify(c.fd, _IN)
            self._rearm(c)
            return
        try:
            n = sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            c.decoder.check_eof()
            self._finish(c)
            return
        # the messages' raw params point into the scratch buffer: used before the next recv
        msgs = c.decoder.feed_messages(self._scratch[:n])
        server = self.server
        out: list[bytes] = []
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
                rest = [_own(m) for m in msgs[i:]]
                self._finish(c, Handoff(c.decoder, c.authed, c.nonces, rest, out))
                return
            out.append(server.execute(msg, now)[0])
        if out:
            data = b"".join(out) if len(out) > 1 else out[0]
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(data):
                c.wbuf = memoryview(data)[sent:]
                self._ep.modify(c.fd, _OUT)
            elif c.close_after:
                self._finish(c)
                return
        self._rearm(c)

    def _rearm(self, c: _Conn) -> None:
        """Move ``c``'s deadline for what it waits for now."""
        timeout, c.what = self._timeout(c)
        c.deadline = time.monotonic() + timeout
        if c.idle:
            c.slot.since = self._clock.current_time()
