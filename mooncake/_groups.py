"""Exceptions out of a library context manager that owns a task group, as themselves.

A context manager such as ``open_engine`` runs its servers in a task group and yields to the
caller's block from inside it. Left alone, anything the block raises (a ``KeyError`` of the
caller's own, a :class:`~mooncake.errors.MooncakeError` of a call in it) and every setup error
would leave wrapped in an ``ExceptionGroup``, so ``except KeyError`` around the block never
fires. trio's and anyio's guidance for libraries is to unwrap what is not genuinely concurrent.

Contract of :func:`unwrapped`: wrap the ``async with create_task_group()`` in it. When the group
exits with a :class:`BaseExceptionGroup` whose leaves (nested groups flattened) hold exactly one
exception that is not a cancellation, that exception is raised as itself (its traceback kept,
the group hidden from the chain). When every leaf is a cancellation, the first one is raised
(the enclosing cancel scope catches it as it would the group). Two or more real failures at once
are genuinely concurrent: the group is re-raised unchanged. Anything that is not a group passes
through untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def _leaves(eg: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def single(eg: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception ``eg`` stands for, or ``None`` if it holds concurrent failures."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = list(_leaves(eg))
    real = [e for e in leaves if not isinstance(e, cancelled)]
    if len(real) == 1:
        return real[0]
    if not real and leaves:
        return leaves[0]
    return None


@contextmanager
def unwrapped() -> Iterator[None]:
    """Re-raise a task group's lone failure as itself (see the module docstring)."""
    exc: BaseException | None = None
    try:
        yield
    except BaseExceptionGroup as eg:
        exc = single(eg)
        if exc is None:
            raise
        del eg
    if exc is not None:
        # ``__exit__`` runs while the group is being handled: keep it out of the chain
        context = exc.__context__
        try:
            raise exc
        except BaseException as e:
            e.__context__ = context
            raise
        finally:
            exc = context = None  # no reference cycle through this frame
