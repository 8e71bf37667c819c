"""The client-local HTTP endpoints: ``setup(..., enable_client_http_server=True, client_http_port=9300)``.

As the published client serves them (``RealClient::start_http_server``):

* ``GET /health`` -> ``{"status": "healthy", "code": 0}`` with 200, or with 503
  ``not_initialized`` (1, the client is closed) / ``master_unreachable`` (2); the codes are
  ``health_check()``'s.
* ``GET /metrics`` -> the client's Prometheus series (``text/plain; version=0.0.4``; its
  engine's included), 503 ``client not initialized`` once closed.
* ``GET /metrics/summary`` -> a short plain-text digest of the same series (one
  ``name{labels} value`` line per sample of the client's own ``mooncake_*`` families).

Anything else is 404; a method other than GET/HEAD 405. Setup refuses a port outside 1..65535
with ``INVALID_PARAMS``; a port that cannot be bound is logged and setup continues without the
endpoints, as published. Deliberate difference: the server binds the host of
``local_hostname`` (the address this client publishes; ``localhost`` -> 127.0.0.1), not
0.0.0.0. Bounds: at most :data:`MAX_ACTIVE` requests are served at once (others get 503), a
request must arrive within :data:`REQUEST_S`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

log = logging.getLogger("mooncake.store")

MAX_ACTIVE = 16
REQUEST_S = 10.0
HEALTH_NAMES = {0: "healthy", 1: "not_initialized", 2: "master_unreachable"}


def summary(registry: CollectorRegistry) -> str:
    """One ``name{labels} value`` line per sample of the ``mooncake_*`` families."""
    lines = []
    for family in registry.collect():
        if not family.name.startswith("mooncake_"):
            continue
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            value = int(s.value) if float(s.value).is_integer() else s.value
            lines.append(f"{s.name}{{{labels}}} {value}" if labels else f"{s.name} {value}")
    return "\n".join(lines) + "\n"


class ClientHttpServer:
    """Serves the endpoints above from a daemon thread until :meth:`close`.

    ``health`` answers ``health_check()``'s code; ``registry`` the client's registry, or None
    once the client is closed."""

    def __init__(
        self,
        host: str,
        port: int,
        health: Callable[[], int],
        registry: Callable[[], CollectorRegistry | None],
    ) -> None:
        slots = threading.BoundedSemaphore(MAX_ACTIVE)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = REQUEST_S

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("client http: " + format, *args)

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self) -> None:
                if not slots.acquire(blocking=False):
                    self._send(503, "text/plain", b"busy\n")
                    return
                try:
                    self._route(self.path.split("?", 1)[0])
                finally:
                    slots.release()

            def _route(self, path: str) -> None:
                if path == "/health":
                    code = health()
                    body = json.dumps(
                        {"status": HEALTH_NAMES.get(code, "unknown"), "code": code},
                        separators=(",", ":"),
                    ).encode()
                    self._send(200 if code == 0 else 503, "application/json", body)
                elif path in ("/metrics", "/metrics/summary"):
                    reg = registry()
                    if reg is None:
                        self._send(503, "text/plain", b"client not initialized")
                    elif path == "/metrics":
                        self._send(200, "text/plain; version=0.0.4", generate_latest(reg))
                    else:
                        self._send(200, "text/plain", summary(reg).encode())
                else:
                    self._send(404, "text/plain", f"no such path {path!r}\n".encode())

            def do_GET(self) -> None:
                self._serve()

            def do_HEAD(self) -> None:
                self._serve()

            def _refuse(self) -> None:
                self._send(405, "text/plain", b"method not allowed (GET)\n")

            do_POST = do_PUT = do_DELETE = _refuse

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="mooncake-client-http", daemon=True
        )
        self.thread.start()
        log.info(
            "client HTTP server on %s:%d (/health, /metrics, /metrics/summary)", host, self.port
        )

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join()
        self.server.server_close()


def start(
    hostname: str,
    port: Any,
    health: Callable[[], int],
    registry: Callable[[], CollectorRegistry | None],
) -> ClientHttpServer | None:
    """The server for ``setup``'s arguments, or None when the port cannot be bound (logged).
    ``ValueError`` for a port outside 1..65535."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        raise ValueError(f"client_http_port must be in 1..65535, got {port!r}")
    host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
    host = host.strip("[]") or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        return ClientHttpServer(host, port, health, registry)
    except OSError as e:
        log.warning(
            "setup: cannot start the client HTTP server on %s:%d (%s); continuing without "
            "HTTP endpoints",
            host,
            port,
            e.strerror or e,
        )
        return None
