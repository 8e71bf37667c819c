"""SIGTERM drains every set-up ``MooncakeDistributedStore`` of the process, then exits 0.

``setup`` arms the drain for its store (:func:`arm`). The first armed store installs a SIGTERM
handler, provided the process has none of its own (the handler is ``SIG_DFL``), ``setup`` runs
on the main thread and ``MC_STORE_DRAIN_ON_SIGTERM`` is not ``0``. On SIGTERM it drains each
armed store (``MooncakeDistributedStore.drain``: no new replicas on its segments, replicated
objects re-replicated elsewhere, sole copies moved where there is room, reads in flight
finished; each bounded by the store's ``drain_timeout``, 5 s by default), closes it (which
unmounts) and raises ``SystemExit(0)``. A second SIGTERM during the drain kills the process
as the default action does. A process with its own SIGTERM handler calls ``store.drain()``
from it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any

log = logging.getLogger("mooncake.store")

_armed: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_installed = False


def arm(store: Any) -> None:
    """Drain ``store`` (a set-up facade with ``drain()`` and ``close()``) on SIGTERM."""
    global _installed
    with _lock:
        _armed.add(store)
        if _installed:
            return
        if os.environ.get("MC_STORE_DRAIN_ON_SIGTERM", "1").strip().lower() in ("0", "false"):
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("setup off the main thread: no SIGTERM drain handler installed")
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            log.debug("the process handles SIGTERM itself: no drain handler installed")
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True


def disarm(store: Any) -> None:
    """``store`` was closed: SIGTERM no longer drains it."""
    with _lock:
        _armed.discard(store)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    with _lock:
        _installed = False
        stores = list(_armed)
    log.info("SIGTERM: draining %d store client(s) before exiting", len(stores))
    for store in stores:
        try:
            store.drain()
        except Exception:  # one store failing must not keep the others from closing
            log.exception("drain on SIGTERM failed")
        try:
            store.close()
        except Exception:
            log.exception("close on SIGTERM failed")
    raise SystemExit(0)


__all__ = ["arm", "disarm"]
