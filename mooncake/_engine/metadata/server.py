"""The HTTP metadata server: Mooncake's protocol over h11 on anyio sockets.

::

    store = MetadataStore()
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(partial(serve_http_metadata, "127.0.0.1", 8080, store=store))

Protocol (compatible with the published servers): ``GET|PUT|DELETE <path>?key=<key>``;
GET -> 200 with the stored bytes, or 404; PUT -> 200, or 400 when the key is an ``rpc_meta`` key
that already exists (as Mooncake's servers do) or the body is not JSON; DELETE -> 200, or 404.
A missing ``key`` is 400, another path 404, another method 405.

Robustness: it binds the address it is given (loopback by default). Every connection is its own
task, so a bad or slow client costs only its own connection: request heads are bounded by h11
(``MAX_HEAD``), bodies by ``max_body`` (413, checked against Content-Length before reading), a
request must arrive within ``REQUEST_S`` and an idle keep-alive connection is closed after
``IDLE_S``; at most ``max_connections`` are served at once (more get 503 and are closed), and the
store refuses writes past ``max_total_bytes`` (507). The store (:class:`MetadataStore`) is a plain
object so an embedding process (the store master) can share it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import h11

from mooncake.errors import InvalidArgumentError

log = logging.getLogger("mooncake.metadata.server")

DEFAULT_PORT = 8080
DEFAULT_PATH = "/metadata"
MAX_HEAD = 16 << 10
DEFAULT_MAX_BODY = 16 << 20
DEFAULT_MAX_TOTAL = 1 << 30
DEFAULT_MAX_CONNECTIONS = 1024
REQUEST_S = 10.0
IDLE_S = 60.0
_RECV = 65536


class StoreFullError(Exception):
    pass


class DuplicateKeyError(Exception):
    pass


class MetadataStore:
    """In-memory metadata: ``key -> bytes``, bounded in total size.

    Synchronous and loop-free: callers on one event loop need no lock.
    """

    def __init__(self, max_total_bytes: int = DEFAULT_MAX_TOTAL) -> None:
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self.max_total_bytes = max_total_bytes

    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def put(self, key: str, value: bytes) -> None:
        """Store ``value``; :class:`DuplicateKeyError` for an existing ``rpc_meta`` key,
        :class:`StoreFullError` past the size bound."""
        old = self._data.get(key)
        if old is not None and "rpc_meta" in key:
            raise DuplicateKeyError(key)
        size = self._bytes - (len(key) + len(old) if old is not None else 0) + len(key) + len(value)
        if size > self.max_total_bytes:
            raise StoreFullError(key)
        self._data[key] = value
        self._bytes = size

    def delete(self, key: str) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        self._bytes -= len(key) + len(old)
        return True

    def keys(self, prefix: str = "") -> Iterator[str]:
        return (k for k in list(self._data) if k.startswith(prefix))

    def __len__(self) -> int:
        return len(self._data)

    @property
    def total_bytes(self) -> int:
        return self._bytes


class _Reject(Exception):
    def __init__(self, status: int, text: str) -> None:
        self.status, self.text = status, text


class HttpMetadataServer:
    """Serves one :class:`MetadataStore`; counters are for tests and metrics."""

    def __init__(
        self,
        store: MetadataStore | None = None,
        *,
        path: str = DEFAULT_PATH,
        max_body: int = DEFAULT_MAX_BODY,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if not path.startswith("/"):
            raise InvalidArgumentError(f"metadata path must start with '/', got {path!r}")
        self.store = store if store is not None else MetadataStore()
        self.path = path
        self.max_body = max_body
        self.max_connections = max_connections
        self.active = 0
        self.requests = 0
        self.rejected = 0

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 = any free port); ``task_status.started((host, port))``."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        async with listener:
            bound = listener.extra(anyio.abc.SocketAttribute.local_port)
            log.info("HTTP metadata server on %s:%d%s", host, bound, self.path)
            task_status.started((host, bound))
            await listener.serve(self._connection)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            if self.active >= self.max_connections:
                self.rejected += 1
                with anyio.move_on_after(1):
                    await _send_simple(stream, 503, "too many connections")
                return
            self.active += 1
            try:
                await self._serve_conn(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                log.debug("metadata connection dropped: %s", e)
            finally:
                self.active -= 1

    async def _serve_conn(self, stream: anyio.abc.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        while True:
            # wait (bounded) for the next request head, then (bounded) for its body
            event: Any = None
            with anyio.move_on_after(IDLE_S):
                event = await _next_event(conn, stream, first=True)
            if event is None:  # idle (or a head trickling in for too long)
                return
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, _Reject):
                self.rejected += 1
                await _respond_conn(conn, stream, event.status, event.text.encode())
                return
            assert isinstance(event, h11.Request)
            with anyio.move_on_after(REQUEST_S) as scope:
                status, body = await self._handle(conn, stream, event)
            if scope.cancelled_caught:
                self.rejected += 1
                status, body = 408, b"request not received in time"
                await _respond_conn(conn, stream, status, body, close=True)
                return
            self.requests += 1
            close = status in (408, 413) or conn.their_state is not h11.DONE
            await _respond_conn(conn, stream, status, body, close=close)
            if close or conn.our_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.ProtocolError:
                return

    async def _handle(
        self, conn: h11.Connection, stream: anyio.abc.SocketStream, req: h11.Request
    ) -> tuple[int, bytes]:
        method = req.method.decode("ascii", "replace")
        target = req.target.decode("latin-1")
        parts = urlsplit(target)
        if parts.path.rstrip("/") != self.path.rstrip("/"):
            return 404, f"no such path {parts.path!r} (metadata lives at {self.path})".encode()
        if method not in ("GET", "PUT", "DELETE"):
            return 405, f"method {method} not allowed (GET, PUT, DELETE)".encode()
        keys = parse_qs(parts.query).get("key", [])
        key = keys[0].strip() if keys else ""
        if not key:
            return 400, b"metadata key is required"
        if method == "PUT":
            length = _content_length(req)
            if length is not None and length > self.max_body:
                return 413, f"body of {length} bytes exceeds {self.max_body}".encode()
            body = await _read_body(conn, stream, self.max_body)
            if body is None:
                return 413, f"body exceeds {self.max_body} bytes".encode()
            try:
                json.loads(body)
            except (UnicodeDecodeError, ValueError) as e:
                return 400, f"body is not valid JSON: {e}".encode()
            try:
                self.store.put(key, body)
            except DuplicateKeyError:
                return 400, b"Duplicate rpc_meta key not allowed"
            except StoreFullError:
                return 507, f"store full ({self.store.max_total_bytes} bytes)".encode()
            return 200, b"metadata updated"
        # GET/DELETE: drain any (bounded) body so the connection can be reused
        if await _read_body(conn, stream, self.max_body) is None:
            return 413, b"body too large"
        if method == "GET":
            value = self.store.get(key)
            if value is None:
                return 404, b"metadata not found"
            return 200, value
        if self.store.delete(key):
            return 200, b"metadata deleted"
        return 404, b"metadata not found"


def _content_length(req: h11.Request) -> int | None:
    for name, value in req.headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _next_event(
    conn: h11.Connection, stream: anyio.abc.SocketStream, *, first: bool = False
) -> Any:
    """The next h11 event (reading as needed); a :class:`_Reject` for a protocol error."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            return _Reject(e.error_status_hint, f"bad request: {e}")
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive(_RECV)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            data = b""
        conn.receive_data(data)
        if not data and first and conn.their_state is h11.IDLE:
            return h11.ConnectionClosed()


async def _read_body(
    conn: h11.Connection, stream: anyio.abc.SocketStream, limit: int
) -> bytes | None:
    """The request body, or None once it exceeds ``limit``."""
    chunks: list[bytes] = []
    n = 0
    while True:
        event = await _next_event(conn, stream)
        if isinstance(event, h11.Data):
            n += len(event.data)
            if n > limit:
                return None
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        elif isinstance(event, _Reject):
            raise anyio.BrokenResourceError(event.text)
        elif isinstance(event, h11.ConnectionClosed):
            raise anyio.BrokenResourceError("client closed mid-body")


async def _respond_conn(
    conn: h11.Connection,
    stream: anyio.abc.SocketStream,
    status: int,
    body: bytes,
    *,
    close: bool = False,
) -> None:
    headers = [
        ("Content-Type", "application/json" if status == 200 else "text/plain"),
        ("Content-Length", str(len(body))),
    ]
    if close:
        headers.append(("Connection", "close"))
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers))
        data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        # e.g. the client broke the protocol before we could answer in h11's state machine
        await _send_simple(stream, status, body.decode("utf-8", "replace"))
        return
    with anyio.move_on_after(REQUEST_S):
        await stream.send(data)


async def _send_simple(stream: anyio.abc.SocketStream, status: int, text: str) -> None:
    body = text.encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        await stream.send(head.encode() + body)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


_REASONS = {400: "Bad Request", 413: "Payload Too Large", 431: "Header Too Large", 503: "Busy"}


async def serve_http_metadata(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    store: MetadataStore | None = None,
    path: str = DEFAULT_PATH,
    max_body: int = DEFAULT_MAX_BODY,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve Mooncake's HTTP metadata protocol on ``host:port`` until cancelled.

    ``store`` may be shared with the embedding process; ``task_status.started((host, port))``
    reports the bound port (useful with ``port=0``).
    """
    server = HttpMetadataServer(
        store, path=path, max_body=max_body, max_connections=max_connections
    )
    await server.serve(host, port, task_status=task_status)
