"""The published ``mooncake.http_metadata_server``: an HTTP metadata server (etcd's stand-in).

``KVBootstrapServer(port, host="0.0.0.0")`` serves ``GET``/``PUT``/``DELETE /metadata?key=K``
(the protocol of :mod:`mooncake._engine.metadata.server`, which does the work) from a
background thread once :meth:`~KVBootstrapServer.run` is called; :meth:`~KVBootstrapServer.poll`
answers :attr:`KVPoll.Success` while it serves and :attr:`KVPoll.Failed` otherwise;
:meth:`~KVBootstrapServer.close` stops it. ``main()`` is the published command line
(``--port 8080 --host 0.0.0.0 --log-level INFO``); ``python -m mooncake.http_metadata_server``
runs it. Port 0 binds a free port, reported in :attr:`~KVBootstrapServer.port` once running.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mooncake._engine.metadata import server as _server

__all__ = ["KVBootstrapServer", "KVPoll", "main", "parse_args"]

log = logging.getLogger(__name__)


class KVPoll(Enum):
    """Status of the KV server (the published values)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class MetadataResponse:
    """What :meth:`KVBootstrapServer._handle_metadata` answers (an aiohttp-like response)."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class KVBootstrapServer:
    """HTTP metadata server on ``host:port``, served from a background thread."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        self.port = port
        self.host = host
        self.store = _server.MetadataStore()
        self.thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._trio_token: Any = None
        self._cancel: Any = None

    def run(self) -> threading.Thread:
        """Start serving in a daemon thread; returns once the port is bound (or failed)."""
        self.thread = threading.Thread(target=self._run_server, name="http-metadata", daemon=True)
        self.thread.start()
        self._ready.wait(30)
        if self._error is not None:
            log.error("HTTP metadata server failed: %s", self._error)
        else:
            log.info("HTTP Metadata Server started on %s:%s", self.host, self.port)
        return self.thread

    def _run_server(self) -> None:
        import trio

        async def serve() -> None:
            self._trio_token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._cancel = scope
                async with trio.open_nursery() as nursery:
                    _host, port = await nursery.start(
                        lambda task_status: _server.serve_http_metadata(
                            self.host, self.port, store=self.store, task_status=task_status
                        )
                    )
                    self.port = port
                    self._ready.set()

        try:
            trio.run(serve)
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    def close(self) -> None:
        """Stop serving and wait (up to 2 s) for the thread to end."""
        token, scope = self._trio_token, self._cancel
        if token is not None and scope is not None:
            try:
                token.run_sync_soon(scope.cancel)
            except RuntimeError:  # the loop has already ended
                pass
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=2)

    async def _handle_metadata(self, request: Any) -> MetadataResponse:
        """One metadata request, as the published (aiohttp) handler takes it: ``request`` has
        ``method``, ``query`` (a mapping) and ``async read()``. The key is stripped; a blank
        one is 400; GET -> 200 with the value or 404; PUT -> 200 (400 for an existing
        ``rpc_meta`` key; the value is stored as sent); DELETE -> 200 or 404; another method
        405. Every response is ``application/json``, as published."""
        key = str(request.query.get("key", "")).strip()
        if not key:
            return MetadataResponse(400, b"metadata key is required")
        method = str(request.method).upper()
        if method == "GET":
            value = self.store.get(key)
            if value is None:
                return MetadataResponse(404, b"metadata not found")
            return MetadataResponse(200, value)
        if method == "PUT":
            data = bytes(await request.read())
            try:
                self.store.put(key, data)
            except _server.DuplicateKeyError:
                return MetadataResponse(400, b"Duplicate rpc_meta key not allowed")
            except _server.StoreFullError:
                return MetadataResponse(507, b"metadata store full")
            return MetadataResponse(200, b"metadata updated")
        if method == "DELETE":
            if self.store.delete(key):
                return MetadataResponse(200, b"metadata deleted")
            return MetadataResponse(404, b"metadata not found")
        return MetadataResponse(405, b"Method not allowed")

    def poll(self) -> KVPoll:
        """``Success`` while the server thread serves, else ``Failed``."""
        if self.thread is None or not self.thread.is_alive() or self._error is not None:
            return KVPoll.Failed
        return KVPoll.Success


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published command-line flags."""
    parser = argparse.ArgumentParser(
        description="HTTP Metadata Server for Mooncake",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=8080, help="Port to listen on")
    parser.add_argument("--host", type=str, default="0.0.0.0", help="Host to bind to")
    parser.add_argument(
        "--log-level",
        type=str,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="INFO",
        help="Logging level",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (the published ``mooncake_http_metadata_server``)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s",
    )
    server = KVBootstrapServer(port=args.port, host=args.host)
    server.run()
    if server.poll() is not KVPoll.Success:
        return 1
    stop = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        log.info("Shutting down...")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(1.0):
        if server.poll() is not KVPoll.Success:
            return 1
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
