"""Regex scans of the master's keys: in a worker thread, within a time budget, never on the loop.

``GetReplicaListByRegex`` and ``RemoveByRegex`` run a client's pattern over every key. With the
standard library's ``re`` a pattern such as ``(a+)+$`` backtracks exponentially on a long key,
and ``re`` holds the GIL while it does: one request would stop the master (and every client's
pings with it). So the server matches with the ``regex`` package instead, whose matcher

* releases the GIL (``concurrent=True``): the loop keeps serving while a scan runs, and
* stops at a deadline (``timeout=``): a scan that has not finished within
  :attr:`KeyScanner.budget` seconds fails with ``INVALID_PARAMS`` (``-600``) naming the
  pattern, and changes nothing. The budget is wall-clock time checked between keys; inside one
  key the ``regex`` package measures it as the process's CPU time, so on a loaded host one
  pathological key can take longer in wall time (the loop is still never blocked).

Contract of :meth:`KeyScanner.matching`: the keys of a snapshot taken on the loop that match
(``search`` semantics, Python ``re`` syntax); at most ``concurrency`` scans run at once (others
wait their turn); cancelling the caller abandons the thread, which stops by itself at its
deadline and touches nothing but the snapshot. The caller then applies the rules to the matched
keys on the loop, each re-checked there (a key removed meanwhile is skipped).
"""

from __future__ import annotations

import time

import anyio
import regex

from mooncake._core.methods import SCAN_METHODS
from mooncake.errors import InvalidArgumentError, InvalidKeyError

__all__ = ["DEFAULT_BUDGET_S", "SCAN_METHODS", "KeyScanner"]

DEFAULT_BUDGET_S = 5.0
MAX_PATTERN = 4096


def compile_pattern(pattern: str) -> regex.Pattern[str]:
    """``pattern`` compiled, or ``InvalidKeyError`` (as for a bad key) saying why not."""
    if len(pattern) > MAX_PATTERN:
        raise InvalidKeyError(
            f"regular expression of {len(pattern)} characters (max {MAX_PATTERN})"
        )
    try:
        return regex.compile(pattern)
    except (regex.error, ValueError, OverflowError) as e:
        raise InvalidKeyError(f"bad regular expression {pattern!r}: {e}") from None


class KeyScanner:
    """Matches patterns against key snapshots in worker threads (see the module docstring)."""

    def __init__(self, budget: float = DEFAULT_BUDGET_S, concurrency: int = 2) -> None:
        if budget <= 0 or concurrency < 1:
            raise InvalidArgumentError("scan budget must be > 0 and concurrency >= 1")
        self.budget = budget
        self._limit = anyio.CapacityLimiter(concurrency)
        self.timeouts = 0
        """Scans refused for running past the budget."""

    async def matching(self, keys: list[str], pattern: str) -> list[str]:
        """The ``keys`` that ``pattern`` matches (``search``), computed off the event loop."""
        compiled = compile_pattern(pattern)
        budget = self.budget

        def scan() -> list[str] | None:
            deadline = time.monotonic() + budget
            out: list[str] = []
            for key in keys:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    if compiled.search(key, timeout=left, concurrent=True) is not None:
                        out.append(key)
                except TimeoutError:
                    return None
            return out

        async with self._limit:
            found = await anyio.to_thread.run_sync(scan, abandon_on_cancel=True)
        if found is None:
            self.timeouts += 1
            raise InvalidArgumentError(
                f"regular expression {pattern!r} did not finish matching {len(keys)} keys "
                f"within {budget:g} s"
            )
        return found
