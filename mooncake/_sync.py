"""Run the async API from synchronous code: one event loop on a background thread.

The published Mooncake API is synchronous (``TransferEngine.transfer_sync_write`` and friends),
so the facades own a :class:`LoopThread`: a daemon thread running trio (or asyncio) with an
anyio blocking portal. ``call`` runs a coroutine function there and blocks for its result;
``submit`` returns a :class:`concurrent.futures.Future`; ``enter`` keeps an async context manager
(an engine, a store client) open on the loop until :meth:`close`.

Calling ``call`` from the loop thread itself would deadlock, so it raises instead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import anyio.from_thread

from mooncake.errors import ClosedError, MooncakeError

T = TypeVar("T")


class LoopThread:
    """A background event loop for sync facades."""

    def __init__(self, *, backend: str = "trio", name: str = "mooncake-loop") -> None:
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(
            anyio.from_thread.start_blocking_portal(backend, name=name)
        )
        self._thread_id: int | None = self.portal.call(threading.get_ident)
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("the background loop is closed")
        if threading.get_ident() == self._thread_id:
            raise MooncakeError(
                "sync facade called from its own event loop thread (would deadlock)"
            )

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and return its result (exceptions propagate)."""
        self._check()
        return self.portal.call(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` on the loop; the future holds its outcome."""
        self._check()
        return self.portal.start_task_soon(fn, *args)

    def enter(self, acm: AbstractAsyncContextManager[T]) -> T:
        """Enter ``acm`` on the loop; it is exited (in reverse order) by :meth:`close`."""
        self._check()
        return self._stack.enter_context(self.portal.wrap_async_context_manager(acm))

    def close(self) -> None:
        """Exit every entered context, then stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stack.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
