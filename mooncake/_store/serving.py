"""Bounds shared by the master's two RPC serving paths (the loop, :mod:`rpc_thread`).

* :class:`ReplyBudget`: the bytes of answers the master holds, all connections together, for
  peers that have not read them yet. A connection is answered at most ``reply_batch`` bytes at
  a time and is not read again while any of them is unsent, so what one
  connection makes the master hold is at most ``reply_batch`` plus one answer (``max_frame``),
  whatever it sends; a connection whose unsent answers would take the total past the budget is
  closed instead of kept.
* :func:`frame_deadline`: a frame (received or sent) must be done ``progress_timeout`` plus
  its size at ``min_rate`` bytes per second after its first byte, besides moving a byte every
  ``progress_timeout``: a peer trickling a byte per ``progress_timeout - e`` cannot keep a
  connection (and its slot) for longer than one frame's bound.
"""

from __future__ import annotations

import threading

__all__ = ["ReplyBudget", "frame_deadline"]


class ReplyBudget:
    """A thread-safe count of reply bytes held for unread peers, at most ``limit``."""

    __slots__ = ("_lock", "held", "limit", "refused")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"reply budget must be >= 1 byte, got {limit}")
        self.limit = limit
        self.held = 0
        #: connections closed because their unsent answers did not fit
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if they fit (True), else count a refusal (False)."""
        with self._lock:
            if self.held + n > self.limit:
                self.refused += 1
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        """``n`` held bytes were sent (or dropped with their connection)."""
        with self._lock:
            self.held -= n


def frame_deadline(start: float, length: int, progress_timeout: float, min_rate: float) -> float:
    """When a frame of ``length`` bytes begun at ``start`` must be done (same clock)."""
    return start + progress_timeout + length / min_rate
