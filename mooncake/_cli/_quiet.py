"""Ordinary endings of a CLI server as an exit status and at most one line, never a traceback.

A server's ``trio.run`` ends in a few ordinary ways: Ctrl-C (``KeyboardInterrupt``, which trio
delivers inside an ``ExceptionGroup`` when a nursery is open), a port already in use or another
``OSError`` of setting up, a :class:`~mooncake.errors.MooncakeError` naming a bad setting.
:func:`run_server` turns each into an exit status and one line on stderr (none for Ctrl-C);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator

from mooncake.errors import MooncakeError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

#: exit status of a server stopped by Ctrl-C (or SIGINT): a deliberate, clean stop
INTERRUPTED = 0


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            yield from _leaves(sub)
    else:
        yield e


def _is_cancel(e: BaseException) -> bool:
    return isinstance(e, asyncio.CancelledError) or type(e).__name__ == "Cancelled"


def ordinary(e: BaseException) -> BaseException | None:
    """The one ordinary ending ``e`` stands for (unwrapping groups), or None."""
    leaves = [x for x in _leaves(e) if not _is_cancel(x)]
    for x in leaves:
        if isinstance(x, KeyboardInterrupt):
            return x  # Ctrl-C wins over whatever it interrupted
    if len(leaves) == 1 and isinstance(leaves[0], MooncakeError | OSError):
        return leaves[0]
    return None


def port_arg(text: str) -> int:
    """An argparse ``type`` for a TCP port: 0-65535 (0: a free one), else a usage error."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"port {value} is out of range (0-65535; 0 picks a free port)"
        )
    return value


def run_server(prog: str, main: Callable[[], object], *, what: str = "") -> int:
    """Call ``main`` (a ``trio.run(...)``); 0 when it returns.

    Ctrl-C exits :data:`INTERRUPTED` quietly; a ``MooncakeError`` or ``OSError`` prints
    ``PROG: [WHAT: ]MESSAGE`` on stderr and exits 1 (``what`` says what was being done, such as
    ``cannot listen on 127.0.0.1:8080``; an ``OSError`` shows its ``strerror``).
    """
    try:
        main()
    except BaseException as e:
        exc = ordinary(e)
        if exc is None:
            raise
        if isinstance(exc, KeyboardInterrupt):
            return INTERRUPTED
        msg = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
        if isinstance(exc, OSError) and what:
            msg = f"{what}: {msg}"
        print(f"{prog}: {msg}", file=sys.stderr)
        return 1
    return 0
