"""The HTTP metadata server: Mooncake's protocol over h11 on anyio sockets.

::

    store = MetadataStore()
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(partial(serve_http_metadata, "127.0.0.1", 8080, store=store))

Protocol (compatible with the published servers): ``GET|PUT|DELETE <path>?key=<key>``;
GET -> 200 with the stored bytes, or 404; PUT -> 200, or 400 when the key is an ``rpc_meta`` key
that already exists (as Mooncake's servers do) or the body is not JSON; DELETE -> 200, or 404.
A missing ``key`` is 400, another path 404, another method 405. ``GET /health`` answers 200
``OK`` (no key, no cluster-secret proof needed), as the published servers do.

Robustness: it binds the address it is given (loopback by default). Every connection is its own
task, so a bad or slow client costs only its own connection: request heads are bounded by h11
(``MAX_HEAD``), bodies by ``max_body`` (413, checked against Content-Length before reading), a
request must be complete within ``REQUEST_S`` of its first byte, a fresh connection must start
its first request within ``REQUEST_S`` of accept and an idle keep-alive connection is closed
after ``IDLE_S``. At most ``max_connections`` are live: at the cap the server stops accepting
(the rest wait in the listen backlog) and closes the longest-idle keep-alive connection in favour
of the new one (an idle HTTP connection costs its client only a reconnect). The store refuses
writes past ``max_total_bytes`` (507). The store (:class:`MetadataStore`) is a plain object so an
embedding process (the store master) can share it.

With a cluster secret (``MOONCAKE_CLUSTER_SECRET`` or ``secret=``) every request must carry an
``X-Mooncake-Auth`` proof obtained through a challenge (``GET <path>?auth_challenge=<nonce>``);
others get 401 (``docs/protocol.md``, "Cluster secret").
"""

from __future__ import annotations

import json
import logging
import socket
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import h11

from mooncake._core import auth
from mooncake._engine import _accept
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
#: header carrying the client's proof: ``<client nonce>:<server nonce>:<proof>`` (hex)
AUTH_HEADER = "X-Mooncake-Auth"
AUTH_REQUIRED = (
    "authentication required: this server needs the cluster secret (MOONCAKE_CLUSTER_SECRET)"
)
AUTH_CHALLENGE_S = 30.0
MAX_CHALLENGES = 4096


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

    def __contains__(self, key: object) -> bool:
        return key in self._data

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
        secret: str | bytes | None = None,
    ) -> None:
        if not path.startswith("/"):
            raise InvalidArgumentError(f"metadata path must start with '/', got {path!r}")
        self.store = store if store is not None else MetadataStore()
        self.path = path
        self.max_body = max_body
        self.max_connections = max_connections
        self.slots = _accept.Slots(max_connections, "metadata")
        self.secret = auth.load_secret(secret)
        # outstanding challenges: server nonce -> (client nonce, expiry); single use, bounded
        self._challenges: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self.requests = 0
        self.rejected = 0

    @property
    def active(self) -> int:
        """Connections open right now."""
        return len(self.slots)

    @property
    def evicted(self) -> int:
        """Idle connections closed to make room for new ones."""
        return self.slots.evicted

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 = any free port); ``task_status.started((host, port))``."""
        try:
            lsock = _accept.listen_tcp(host, port, 1024)
        except OSError as e:
            raise InvalidArgumentError(
                f"cannot listen on {host}:{port}: {e.strerror or e}"
            ) from None
        try:
            bound = int(lsock.getsockname()[1])
            log.info("HTTP metadata server on %s:%d%s", host, bound, self.path)
            task_status.started((host, bound))
            await _accept.accept_loop(lsock, self.slots, self._connection)
        finally:
            lsock.close()

    async def _connection(self, sock: socket.socket, slot: _accept.Slot) -> None:
        stream = await anyio.abc.SocketStream.from_socket(sock)
        async with stream:
            try:
                await self._serve_conn(stream, slot)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                log.debug("metadata connection dropped: %s", e)

    async def _serve_conn(self, stream: anyio.abc.SocketStream, slot: _accept.Slot) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        first = True
        while True:
            # idle until the next request's first byte: REQUEST_S on a fresh connection (the
            # clock starts at accept), IDLE_S between keep-alive requests
            slot.rest()
            with anyio.move_on_after(REQUEST_S if first else IDLE_S) as idle:
                more = await _first_bytes(conn, stream)
            if idle.cancelled_caught or not more:
                return
            first = False
            slot.busy()
            # then the whole request (head, body, answer) within REQUEST_S
            event: Any = None
            with anyio.move_on_after(REQUEST_S) as scope:
                event = await _next_event(conn, stream, first=True)
                if isinstance(event, h11.Request):
                    status, body = await self._handle(conn, stream, event)
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, _Reject):
                self.rejected += 1
                await _respond_conn(conn, stream, event.status, event.text.encode())
                return
            if scope.cancelled_caught:
                self.rejected += 1
                await _send_simple(stream, 408, "request not received in time")
                return
            assert isinstance(event, h11.Request)
            self.requests += 1
            close = status in (401, 408, 413) or conn.their_state is not h11.DONE
            await _respond_conn(conn, stream, status, body, close=close)
            if close or conn.our_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.ProtocolError:
                return

    # -- cluster secret --------------------------------------------------------------------

    def _challenge(self, client_nonce: str) -> tuple[int, bytes]:
        assert self.secret is not None
        try:
            cn = auth.check_hex(client_nonce, auth.NONCE_BYTES, "auth_challenge")
        except ValueError as e:
            return 400, str(e).encode()
        now = anyio.current_time()
        while self._challenges and (
            len(self._challenges) >= MAX_CHALLENGES
            or next(iter(self._challenges.values()))[1] < now
        ):
            self._challenges.popitem(last=False)
        sn = auth.new_nonce()
        self._challenges[sn] = (cn, now + AUTH_CHALLENGE_S)
        proof = auth.server_proof(self.secret, "http", cn, sn)
        return 200, json.dumps({"nonce": sn.hex(), "proof": proof.hex()}).encode()

    def _authorized(self, req: h11.Request, body: bytes) -> bool:
        """Whether ``req`` carries a valid proof for an outstanding challenge (used up)."""
        assert self.secret is not None
        value = ""
        for name, v in req.headers:
            if name == AUTH_HEADER.lower().encode():
                value = v.decode("latin-1")
        parts = value.split(":")
        if len(parts) != 3:
            return False
        try:
            cn = auth.check_hex(parts[0], auth.NONCE_BYTES, "nonce")
            sn = auth.check_hex(parts[1], auth.NONCE_BYTES, "nonce")
            proof = auth.check_hex(parts[2], auth.PROOF_BYTES, "proof")
        except ValueError:
            return False
        entry = self._challenges.pop(sn, None)
        if entry is None or entry[0] != cn or entry[1] < anyio.current_time():
            return False
        bound = http_auth_bound(req.method, req.target, body)
        return auth.verify(auth.client_proof(self.secret, "http", cn, sn, bound), proof)

    async def _handle(
        self, conn: h11.Connection, stream: anyio.abc.SocketStream, req: h11.Request
    ) -> tuple[int, bytes]:
        method = req.method.decode("ascii", "replace")
        target = req.target.decode("latin-1")
        parts = urlsplit(target)
        if parts.path == "/health" and method == "GET":  # as the published server answers
            if await _read_body(conn, stream, self.max_body) is None:
                return 413, b"body too large"
            return 200, b"OK"
        if parts.path.rstrip("/") != self.path.rstrip("/"):
            return 404, f"no such path {parts.path!r} (metadata lives at {self.path})".encode()
        if method not in ("GET", "PUT", "DELETE"):
            return 405, f"method {method} not allowed (GET, PUT, DELETE)".encode()
        query = parse_qs(parts.query)
        if self.secret is not None and method == "GET" and "auth_challenge" in query:
            if await _read_body(conn, stream, self.max_body) is None:
                return 413, b"body too large"
            return self._challenge(query["auth_challenge"][0])
        keys = query.get("key", [])
        key = keys[0].strip() if keys else ""
        if not key:
            return 400, b"metadata key is required"
        if self.secret is not None:
            body = await _read_body(conn, stream, self.max_body)
            if body is None:
                return 413, f"body exceeds {self.max_body} bytes".encode()
            if not self._authorized(req, body):
                self.rejected += 1
                return 401, AUTH_REQUIRED.encode()
            return self._apply(method, key, body)
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

    def _apply(self, method: str, key: str, body: bytes) -> tuple[int, bytes]:
        """One authenticated request whose body has been read."""
        if method == "PUT":
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
        if method == "GET":
            value = self.store.get(key)
            return (200, value) if value is not None else (404, b"metadata not found")
        if self.store.delete(key):
            return 200, b"metadata deleted"
        return 404, b"metadata not found"


def http_auth_bound(method: bytes, target: bytes, body: bytes) -> bytes:
    """What a client proof covers: ``METHOD SP target LF body``."""
    return method + b" " + target + b"\n" + body


def _content_length(req: h11.Request) -> int | None:
    for name, value in req.headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _first_bytes(conn: h11.Connection, stream: anyio.abc.SocketStream) -> bool:
    """Wait until the next request has begun (bytes buffered or received); False at EOF."""
    if conn.trailing_data[0]:
        return True
    try:
        data = await stream.receive(_RECV)
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return False
    conn.receive_data(data)
    return True


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


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    408: "Request Timeout",
    413: "Payload Too Large",
    431: "Header Too Large",
    503: "Busy",
}


async def serve_http_metadata(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    store: MetadataStore | None = None,
    path: str = DEFAULT_PATH,
    max_body: int = DEFAULT_MAX_BODY,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    secret: str | bytes | None = None,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve Mooncake's HTTP metadata protocol on ``host:port`` until cancelled.

    ``store`` may be shared with the embedding process; ``task_status.started((host, port))``
    reports the bound port (useful with ``port=0``).
    """
    server = HttpMetadataServer(
        store, path=path, max_body=max_body, max_connections=max_connections, secret=secret
    )
    await server.serve(host, port, task_status=task_status)
