"""An event loop on a background thread, called from sync code with as few wakeups as possible.

The sync facades (``mooncake.engine.TransferEngine``, ``mooncake.store.MooncakeDistributedStore``)
make one loop crossing per API call, so the crossing is on the latency path of every 4 KiB
operation. Of the crossings tried (``trio.from_thread.run``, a trio loop woken through a
socketpair, ``asyncio.run_coroutine_threadsafe``, an asyncio loop woken through a socketpair that
starts a task per job) the last is the cheapest (trio's scheduler is pure Python; the numbers,
and ``benchmarks/loop_crossing.py`` that measures them, are in docs/benchmarks.md, "Loop
crossing"). This module is that one: the async store code is written against anyio, so it runs
unchanged on this asyncio loop.

Contract: :meth:`LoopThread.call` runs ``async_fn(*args)`` as a task on the loop and blocks until
it finishes, returning its value or raising its exception. :meth:`submit` does the same without
blocking and returns a :class:`concurrent.futures.Future`. :meth:`close` cancels what is still
running, stops the loop and joins the thread; calls after that raise
:class:`~mooncake.errors.ClosedError`. Calling :meth:`call` from the loop thread itself would
deadlock and raises ``RuntimeError`` instead. :meth:`enter` keeps an async context manager (an
engine, a store client) open in a task of its own until :meth:`close`, which exits them in
reverse order before stopping the loop; :meth:`leave` exits one of them early (a store sharing
an engine's loop leaves it running).

Interpreter exit: a daemon loop thread can no longer run once the interpreter finalizes, so a
facade closed from ``__del__`` then would wait forever. Facades register with
:func:`close_at_exit`; an ``atexit`` hook closes what is still open (newest first) while the
interpreter is alive, and :func:`close_in_background` is what their ``__del__`` calls: it never
blocks (and does nothing once the interpreter is finalizing).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import itertools
import logging
import socket
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import anyio

from mooncake.errors import ClosedError

log = logging.getLogger("mooncake.sync")

T = TypeVar("T")

_at_exit: dict[int, weakref.ref[Any]] = {}
_at_exit_ids = itertools.count()
_at_exit_lock = threading.Lock()


def close_at_exit(obj: Any) -> int:
    """Have ``obj.close()`` called at interpreter exit if it is still alive then; a token for
    :func:`forget_at_exit`. Only a weak reference is kept."""
    with _at_exit_lock:
        token = next(_at_exit_ids)
        _at_exit[token] = weakref.ref(obj)
    return token


def forget_at_exit(token: int | None) -> None:
    if token is not None:
        with _at_exit_lock:
            _at_exit.pop(token, None)


@atexit.register
def _close_all_at_exit() -> None:
    with _at_exit_lock:
        refs = [r for _, r in sorted(_at_exit.items(), reverse=True)]
        _at_exit.clear()
    for ref in refs:
        obj = ref()
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as e:  # exiting anyway: report and go on
            log.warning("closing %r at exit: %s", obj, e)


def close_in_background(fn: Callable[[], Any]) -> None:
    """Run ``fn`` (a close) in a daemon thread: for ``__del__``, which must never block. Does
    nothing while the interpreter finalizes (the ``atexit`` hook has closed what was open)."""
    if sys.is_finalizing():
        return
    try:
        threading.Thread(target=fn, name="mooncake-close", daemon=True).start()
    except RuntimeError:  # interpreter shutting down: threads can no longer start
        pass


class _Job:
    __slots__ = ("args", "done", "error", "fn", "future", "result")

    def __init__(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        future: concurrent.futures.Future[Any] | None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.done: threading.Lock | None = None
        if future is None:
            self.done = threading.Lock()
            self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None

    async def run(self) -> None:
        try:
            self.result = await self.fn(*self.args)
        except asyncio.CancelledError:
            self.error = ClosedError("the background loop was closed during the call")
            self.finish()
            raise
        except BaseException as e:
            self.error = e
        self.finish()

    def finish(self) -> None:
        if self.future is not None:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.result)
        elif self.done is not None and self.done.locked():
            self.done.release()


class LoopThread:
    """An asyncio event loop running in a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "mooncake-loop") -> None:
        self._held: list[tuple[dict[str, Any], concurrent.futures.Future[None]]] = []
        self._jobs: collections.deque[_Job] = collections.deque()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.loop = asyncio.new_event_loop()
        self.loop.add_reader(self._rsock.fileno(), self._on_wakeup)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _on_wakeup(self) -> None:
        try:
            while self._rsock.recv(4096):
                pass
        except BlockingIOError:
            pass
        jobs = self._jobs
        while jobs:
            job = jobs.popleft()
            coro: Coroutine[Any, Any, None] = job.run()
            task = self.loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _push(self, job: _Job) -> None:
        if self._closed:
            raise ClosedError("the background loop is closed")
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.call from its own loop thread would deadlock")
        self._jobs.append(job)
        try:
            self._wsock.send(b"\0")
        except BlockingIOError:  # the loop has plenty of wakeups pending already
            pass

    def call(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` on the loop; block until it returns (or raises)."""
        job = _Job(async_fn, args, None)
        self._push(job)
        assert job.done is not None
        job.done.acquire()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def submit(
        self, async_fn: Callable[..., Awaitable[T]], *args: Any
    ) -> concurrent.futures.Future[T]:
        """Start ``async_fn(*args)`` on the loop; its outcome arrives in the returned future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._push(_Job(async_fn, args, fut))
        return fut

    def enter(self, acm: AbstractAsyncContextManager[T]) -> T:
        """Enter ``acm`` in a task of its own on the loop and return its value.

        The task holds the context open until :meth:`close` (entering and exiting in one task,
        as anyio's cancel scopes require). Errors while entering propagate here.
        """
        ready: concurrent.futures.Future[T] = concurrent.futures.Future()
        holder: dict[str, Any] = {}

        async def hold() -> None:
            try:
                async with acm as value:
                    holder["stop"] = stop = anyio.Event()
                    holder["value"] = value
                    ready.set_result(value)
                    await stop.wait()
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)
                    return
                raise

        life = self.submit(hold)
        value = ready.result()
        self._held.append((holder, life))
        return value

    def leave(self, value: Any) -> None:
        """Exit the context :meth:`enter` returned ``value`` for (the loop keeps running);
        nothing if it is not held (already left, or the loop closed)."""
        for n, (holder, life) in enumerate(self._held):
            if holder.get("value") is value:
                del self._held[n]
                self._release(holder, life)
                return

    def _release(self, holder: dict[str, Any], life: concurrent.futures.Future[None]) -> None:
        async def release() -> None:
            holder["stop"].set()

        try:
            self.call(release)
            life.result(timeout=60)
        except Exception as e:  # exiting failed: report, keep closing the rest
            log.warning("closing %s: %s", self._thread.name, e)

    def close(self) -> None:
        """Exit entered contexts (newest first), cancel what still runs, stop the loop and
        join its thread (idempotent)."""
        if self._closed:
            return
        while self._held:
            holder, life = self._held.pop()
            self._release(holder, life)
        self._closed = True

        def stop() -> None:
            for t in list(self._tasks):
                t.cancel()

            async def finish() -> None:
                if self._tasks:
                    await asyncio.wait(list(self._tasks))
                self.loop.stop()

            self.loop.create_task(finish())

        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(stop)
            self._thread.join()
        for job in self._jobs:  # pushed while closing: never started
            job.error = ClosedError("the background loop is closed")
            job.finish()
        self._jobs.clear()
        self.loop.remove_reader(self._rsock.fileno())
        self.loop.close()
        self._rsock.close()
        self._wsock.close()

    @property
    def closed(self) -> bool:
        return self._closed
