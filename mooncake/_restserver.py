"""A small HTTP/1.1 JSON server on asyncio streams and h11, with aiohttp-shaped handlers.

For modules that keep a published aiohttp handler surface without depending on aiohttp: a
handler is ``async def handler(request) -> Response`` where ``request`` has ``method``,
``path``, ``query``, ``headers``, ``match_info`` and ``await request.read() / .text() /
.json()``, and :class:`Response` takes aiohttp's ``status``, ``text``, ``body`` and
``content_type`` and has the same attributes.

Routes are ``(method, pattern, handler)``; a ``{name}`` segment of a pattern matches one
non-empty path segment, percent-decoded into ``request.match_info[name]``. A path no route has
is ``404``, a known path with another method ``405``, both ``{"error": "..."}`` naming the
path and the methods it takes. A handler that raises answers ``500``
``{"error": "<type>: <message>"}`` (logged with its traceback).

Bounds, every one answered in JSON before the connection is closed:

* request head :data:`MAX_HEAD` bytes (h11's limit: ``431``/``400``);
* request body ``max_body`` bytes (``413``, from ``Content-Length`` before reading, or once the
  body read so far passes it; the role of aiohttp's ``client_max_size``);
* ``max_connections`` served at once: a further connection is answered ``503`` and closed
  (at most as many again are being refused at once; beyond that they are closed unanswered);
* a request must arrive whole within :data:`REQUEST_S` of its first byte (``408``), and an idle
  keep-alive connection is closed after :data:`IDLE_S`.

An answer that ends the connection (these, and a malformed request) is followed by a
half-close and up to :data:`LINGER_S` of reading what the peer still sends, so that the peer
reads the answer instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote

import h11

__all__ = ["IDLE_S", "MAX_HEAD", "REQUEST_S", "Request", "Response", "RestServer"]

log = logging.getLogger(__name__)

#: the largest request head (request line and headers) accepted
MAX_HEAD = 64 << 10
#: a request must be received whole within this many seconds of its first byte
REQUEST_S = 120.0
#: an idle keep-alive connection is closed after this many seconds (aiohttp's default)
IDLE_S = 75.0
#: after an error answer that ends a connection, what the peer still sends is read and dropped
#: (up to this many bytes, for up to LINGER_S) so that closing does not reset the answer away
LINGER_BYTES = 1 << 20
LINGER_S = 2.0
_RECV = 1 << 16
_JSON = "application/json"
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


class Request:
    """One received request (the parts of aiohttp's ``web.Request`` the handlers use)."""

    def __init__(
        self,
        method: str,
        path: str,
        query: Mapping[str, str],
        headers: Mapping[str, str],
        body: bytes,
        match_info: Mapping[str, str],
    ) -> None:
        self.method = method
        self.path = path
        self.query = dict(query)
        self.headers = dict(headers)
        self.match_info = dict(match_info)
        self._body = body

    async def read(self) -> bytes:
        """The whole body."""
        return self._body

    async def text(self) -> str:
        """The body as UTF-8 text (``UnicodeDecodeError``, a ``ValueError``, if it is not)."""
        return self._body.decode("utf-8")

    async def json(self) -> Any:
        """The body parsed as JSON; ``ValueError`` (``json.JSONDecodeError`` or
        ``UnicodeDecodeError``) when it is not JSON."""
        return json.loads(self._body)


class Response:
    """An answer: ``text`` (sent as UTF-8, ``application/json`` unless ``content_type`` says
    otherwise) or raw ``body`` bytes (``application/octet-stream`` by default)."""

    def __init__(
        self,
        status: int = 200,
        text: str | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> None:
        if text is not None and body is not None:
            raise ValueError("Response takes text or body, not both")
        self.status = int(status)
        self._text = text
        self._body = body
        if content_type is None:
            content_type = "application/octet-stream" if body is not None else _JSON
        self.content_type = content_type

    @property
    def text(self) -> str:
        if self._text is not None:
            return self._text
        return (self._body or b"").decode("utf-8", "replace")

    @property
    def body(self) -> bytes:
        if self._body is not None:
            return bytes(self._body)
        return (self._text or "").encode("utf-8")

    def header_content_type(self) -> str:
        """The ``Content-Type`` header (text answers name their charset, as aiohttp does)."""
        if self._body is None and "charset=" not in self.content_type:
            return f"{self.content_type}; charset=utf-8"
        return self.content_type


def json_response(status: int, doc: Mapping[str, Any]) -> Response:
    """``doc`` as a JSON :class:`Response` with ``status``."""
    return Response(status=status, text=json.dumps(dict(doc)), content_type=_JSON)


Handler = Callable[[Request], Awaitable[Response]]


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Idle(Exception):
    """No byte of a next request arrived in time: close quietly."""


class _Route:
    def __init__(self, method: str, pattern: str, handler: Handler) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"route pattern {pattern!r} must start with '/'")
        self.method = method.upper()
        self.pattern = pattern
        self.handler = handler
        parts: list[str] = []
        self.names: list[str] = []
        for seg in pattern.strip("/").split("/"):
            m = re.fullmatch(r"\{(\w+)\}", seg)
            if m:
                self.names.append(m.group(1))
                parts.append("([^/]+)")
            else:
                parts.append(re.escape(seg))
        self.regex = re.compile("/" + "/".join(parts))

    def match(self, path: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(path)
        if m is None:
            return None
        return {n: unquote(v) for n, v in zip(self.names, m.groups(), strict=True)}


class _Conn:
    """One connection's h11 state, reader and writer, and its request deadline."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.deadline: float | None = None  # set at the first byte of a request

    async def next_event(self) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                raise _Reject(e.error_status_hint, f"bad request: {e}") from None
            if event is not h11.NEED_DATA:
                return event
            timeout = IDLE_S if self.deadline is None else max(0.0, self.deadline - loop.time())
            try:
                data = await asyncio.wait_for(self.reader.read(_RECV), timeout)
            except asyncio.TimeoutError:
                if self.deadline is None:
                    raise _Idle() from None
                raise _Reject(408, f"request not received within {REQUEST_S:.0f} s") from None
            if data and self.deadline is None:
                self.deadline = loop.time() + REQUEST_S
            self.h11.receive_data(data)

    async def send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def respond(self, resp: Response, close: bool = False) -> None:
        body = resp.body
        headers = [
            ("content-type", resp.header_content_type()),
            ("content-length", str(len(body))),
        ]
        if close:
            headers.append(("connection", "close"))
        reason = _REASONS.get(resp.status, b"")
        await self.send(h11.Response(status_code=resp.status, headers=headers, reason=reason))
        if body:
            await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())


async def _linger(conn: _Conn) -> None:
    """Half-close ``conn`` and drop what its peer still sends (up to :data:`LINGER_BYTES`, for
    up to :data:`LINGER_S`), so the close that follows does not reset the answer away."""
    loop = asyncio.get_running_loop()
    end = loop.time() + LINGER_S
    with contextlib.suppress(OSError, RuntimeError):
        if conn.writer.can_write_eof():
            conn.writer.write_eof()
    left = LINGER_BYTES
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        while left > 0:
            data = await asyncio.wait_for(conn.reader.read(_RECV), max(0.0, end - loop.time()))
            if not data:
                return
            left -= len(data)


class RestServer:
    """Serve ``routes`` (see the module docstring) on one TCP listener."""

    def __init__(
        self,
        routes: Sequence[tuple[str, str, Handler]],
        *,
        max_body: int,
        max_connections: int = 128,
        name: str = "http",
    ) -> None:
        if max_body <= 0 or max_connections <= 0:
            raise ValueError("max_body and max_connections must be positive")
        self.routes = [_Route(m, p, h) for m, p, h in routes]
        self.max_body = max_body
        self.max_connections = max_connections
        self.name = name
        self.host = ""
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # every connection's task
        self._served = 0  # connections being served (the others are being refused)

    @property
    def served(self) -> int:
        """Connections being served now (not counting those being refused)."""
        return self._served

    async def start(self, host: str, port: int) -> int:
        """Listen on exactly ``host:port`` (port 0: a free one); the bound port.
        ``OSError`` naming the address when it cannot be bound."""
        try:
            self._server = await asyncio.start_server(
                self._connection, host, port, limit=_RECV, backlog=1024
            )
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.host = host
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and end every open connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        conn = _Conn(reader, writer)
        served = False
        if task is not None:
            self._tasks.add(task)
        try:
            if self._served >= self.max_connections:
                # refused: answered (unless as many are being refused already) and closed
                if len(self._tasks) - self._served <= self.max_connections:
                    error = f"more than {self.max_connections} connections open"
                    await conn.respond(json_response(503, {"error": error}), close=True)
                    await _linger(conn)
                return
            served = True
            self._served += 1
            await self._serve(conn)
        except (ConnectionError, OSError, h11.ProtocolError) as e:
            log.debug("%s connection ended: %s", self.name, e)
        finally:
            if served:
                self._served -= 1
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, conn: _Conn) -> None:
        while True:
            conn.deadline = None
            try:
                event = await conn.next_event()
                if not isinstance(event, h11.Request):
                    return
                req = await self._receive(conn, event)
            except _Idle:
                return
            except _Reject as e:
                if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await conn.respond(json_response(e.status, {"error": e.message}), close=True)
                    await _linger(conn)
                return
            await conn.respond(await self._dispatch(req))
            if conn.h11.our_state is not h11.DONE or conn.h11.their_state is not h11.DONE:
                return
            conn.h11.start_next_cycle()

    async def _receive(self, conn: _Conn, event: h11.Request) -> Request:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise _Reject(413, f"request body of {length} bytes exceeds {self.max_body} bytes")
        parts: list[bytes] = []
        size = 0
        while True:
            ev = await conn.next_event()
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                if size > self.max_body:
                    raise _Reject(413, f"request body exceeds {self.max_body} bytes")
                parts.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise _Reject(400, "connection closed inside the request")
        target = event.target.decode("latin-1")
        path, _, qs = target.partition("?")
        return Request(
            event.method.decode("ascii", "replace").upper(),
            path,
            dict(parse_qsl(qs)),
            headers,
            b"".join(parts),
            {},
        )

    async def _dispatch(self, req: Request) -> Response:
        allowed: list[str] = []
        for route in self.routes:
            found = route.match(req.path)
            if found is None:
                continue
            if route.method != req.method:
                allowed.append(route.method)
                continue
            req.match_info = found
            try:
                return await route.handler(req)
            except Exception as e:
                log.exception("%s %s %s failed", self.name, req.method, req.path)
                return json_response(500, {"error": f"{type(e).__name__}: {e}"})
        if allowed:
            return json_response(
                405,
                {"error": f"{req.path} takes {', '.join(sorted(set(allowed)))}, not {req.method}"},
            )
        return json_response(404, {"error": f"no such path {req.path!r}"})
