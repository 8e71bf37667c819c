"""Opt-in OpenTelemetry spans (``MOONCAKE_OTEL=1``; ``pip install mooncake-py[otel]``).

With it on, a store ``get``/``put`` is a span (``mooncake.store.get`` / ``.put``) whose
children are its master RPCs (``mooncake.master.<Method>``) and its engine batches
(``mooncake.transfer``, with the peer, bytes, requests and the verdict), nested through the
context of the running task (contextvars: trio and asyncio tasks inherit it). Spans go to
whatever tracer provider the application configured (``opentelemetry.trace``); this package
never configures one. Off (the default), :func:`traced` returns the function unchanged and
:func:`span` a shared no-op, and ``opentelemetry`` is never imported.

Not done: propagating the context to the peer through the handshake (the peer's serving side
makes no spans).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

__all__ = ["enabled", "span", "traced"]

log = logging.getLogger("mooncake")

_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])
_tracer: Any = None
_checked = False


def _load() -> Any:
    global _tracer, _checked
    if not _checked:
        _checked = True
        if os.environ.get("MOONCAKE_OTEL", "") not in ("", "0"):
            try:
                from opentelemetry import trace
            except ImportError:
                log.warning("MOONCAKE_OTEL is set but opentelemetry-api is not installed: no spans")
            else:
                _tracer = trace.get_tracer("mooncake")
    return _tracer


def enabled() -> bool:
    """Whether spans are made (read once, at the first call)."""
    return _load() is not None


def reset() -> None:
    """Read ``MOONCAKE_OTEL`` again at the next call (tests)."""
    global _tracer, _checked
    _tracer, _checked = None, False


@contextlib.contextmanager
def _span(name: str, attrs: dict[str, Any]) -> Iterator[Any]:
    with _load().start_as_current_span(name, attributes=attrs) as s:
        yield s


_NULL = contextlib.nullcontext()


def span(name: str, **attrs: Any) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` as a context manager (exceptions are recorded on it), or a no-op."""
    if _load() is None:
        return _NULL
    return _span(name, attrs)


def traced(name: str, attr: Callable[..., dict[str, Any]] | None = None) -> Callable[[_F], _F]:
    """Decorate a coroutine method: each call is a span ``name`` (``attr(*args)`` gives its
    attributes); with spans off, the method itself, untouched."""

    def wrap(fn: _F) -> _F:
        if _load() is None:
            return fn

        @functools.wraps(fn)
        async def inner(*args: Any, **kwargs: Any) -> Any:
            attrs = attr(*args, **kwargs) if attr is not None else {}
            with _span(name, attrs):
                return await fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
