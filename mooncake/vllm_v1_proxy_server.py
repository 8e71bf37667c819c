"""The published ``mooncake.vllm_v1_proxy_server``: vLLM's prefill/decode disaggregation proxy.

vLLM's Mooncake connector docs start it as::

    python -m mooncake.vllm_v1_proxy_server --port 8000 \\
        --prefiller-host 127.0.0.1 --prefiller-port 8100 \\
        --decoder-host 127.0.0.1 --decoder-port 8200

Same flags, defaults and behaviour as the published module (a copy of vLLM's
``toy_proxy_server.py``): for each ``POST /v1/completions`` or ``POST /v1/chat/completions`` it
picks the next prefill and decode instance (round robin), sends the request to the prefill
instance with ``kv_transfer_params`` asking for a remote decode (``do_remote_decode: true``),
``stream: false`` and ``max_tokens: 1`` (``max_completion_tokens: 1`` when given;
``stream_options`` dropped), takes the ``kv_transfer_params`` of its answer into the original
request and streams the decode instance's answer back unchanged (``application/json``). Both
backend requests carry ``Authorization: Bearer $OPENAI_API_KEY`` and one fresh
``X-Request-Id``. ``GET /healthcheck`` answers
``{"status": "ok", "prefill_instances": N, "decode_instances": M}``.

Differences, deliberate: it runs on anyio with h11 and httpx (no FastAPI/uvicorn, so there is
no module-level ``app``); a backend that fails or answers an error status gives the client a
``502`` with ``{"error": ...}`` naming the backend and its status (the published proxy raises
and the client sees a 500, or a stream cut short); ``--port 0`` binds a free port; request
bodies are bounded (``MAX_BODY``) and must be JSON objects (else ``400``). Once listening it
prints ``vllm_v1_proxy_server: listening on http://HOST:PORT``. ``--host`` defaults to
127.0.0.1 as published.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import h11
import httpx

__all__ = ["Backend", "Proxy", "main", "parse_args", "serve"]

log = logging.getLogger(__name__)

#: bounds: request head (h11), request body, connections served at once
MAX_HEAD = 64 << 10
MAX_BODY = 64 << 20
MAX_CONNECTIONS = 1024
#: a client must send its whole request within this many seconds of its first byte
REQUEST_S = 60.0
IDLE_S = 300.0
_RECV = 65536
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    502: b"Bad Gateway",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published flags; ``prefiller_instances`` / ``decoder_instances`` pair hosts with
    ports (``ValueError`` when their counts differ, as published)."""
    p = argparse.ArgumentParser(prog="vllm_v1_proxy_server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument(
        "--prefiller-hosts", "--prefiller-host", type=str, nargs="+", default=["localhost"]
    )
    p.add_argument("--prefiller-ports", "--prefiller-port", type=int, nargs="+", default=[8100])
    p.add_argument("--decoder-hosts", "--decoder-host", type=str, nargs="+", default=["localhost"])
    p.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+", default=[8200])
    args = p.parse_args(argv)
    if len(args.prefiller_hosts) != len(args.prefiller_ports):
        raise ValueError("Number of prefiller hosts must match number of prefiller ports")
    if len(args.decoder_hosts) != len(args.decoder_ports):
        raise ValueError("Number of decoder hosts must match number of decoder ports")
    args.prefiller_instances = list(zip(args.prefiller_hosts, args.prefiller_ports, strict=True))
    args.decoder_instances = list(zip(args.decoder_hosts, args.decoder_ports, strict=True))
    return args


class BackendError(Exception):
    """A prefill or decode instance failed or answered an error status."""


@dataclass
class Backend:
    """One vLLM instance: ``http://host:port/v1``."""

    host: str
    port: int
    id: int
    client: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def _headers(request_id: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}",
        "X-Request-Id": request_id,
    }


def prefill_request(req: dict[str, Any]) -> dict[str, Any]:
    """The body sent to the prefill instance (the published rewrite of ``req``)."""
    out = dict(req)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


class Proxy:
    """The round-robin pools and the request flow; :meth:`open` creates the HTTP clients."""

    def __init__(
        self, prefill: Sequence[tuple[str, int]], decode: Sequence[tuple[str, int]]
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.prefill = [Backend(h, p, i) for i, (h, p) in enumerate(prefill)]
        self.decode = [Backend(h, p, i) for i, (h, p) in enumerate(decode)]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))

    async def open(self, stack: AsyncExitStack) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        for b in (*self.prefill, *self.decode):
            b.client = await stack.enter_async_context(
                httpx.AsyncClient(timeout=None, base_url=b.base_url, limits=limits)
            )
        print(
            f"Initialized {len(self.prefill)} prefill clients "
            f"and {len(self.decode)} decode clients.",
            flush=True,
        )

    def next_client(self, service_type: str) -> Backend:
        """The next instance of ``service_type`` (``prefill`` or ``decode``), round robin."""
        if service_type == "prefill":
            return self.prefill[next(self._next_prefill)]
        if service_type == "decode":
            return self.decode[next(self._next_decode)]
        raise ValueError(f"Unknown service type: {service_type}")

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "prefill_instances": len(self.prefill),
            "decode_instances": len(self.decode),
        }

    async def run_prefill(
        self, backend: Backend, endpoint: str, req: dict[str, Any], request_id: str
    ) -> dict[str, Any]:
        """POST the prefill rewrite of ``req``; its JSON answer (:class:`BackendError` else)."""
        assert backend.client is not None, "Proxy.open() was not called"
        what = f"prefill instance {backend.host}:{backend.port}"
        try:
            resp = await backend.client.post(
                endpoint, json=prefill_request(req), headers=_headers(request_id)
            )
            body = await resp.aread()
        except httpx.HTTPError as e:
            raise BackendError(f"{what}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise BackendError(f"{what} answered {resp.status_code}: {body[:200]!r}")
        try:
            out = json.loads(body)
        except ValueError:
            raise BackendError(f"{what} answered a body that is not JSON") from None
        return out if isinstance(out, dict) else {}

    async def handle_completions(
        self, endpoint: str, req: dict[str, Any]
    ) -> tuple[Backend, httpx.Response, AsyncExitStack]:
        """Prefill, then open the decode stream: (decode instance, response, its closer)."""
        request_id = str(uuid.uuid4())
        prefill = self.next_client("prefill")
        answer = await self.run_prefill(prefill, endpoint, req, request_id)
        params = answer.get("kv_transfer_params") or {}
        if params:
            req = {**req, "kv_transfer_params": params}
        decode = self.next_client("decode")
        log.debug("using prefill %s, decode %s", prefill, decode)
        assert decode.client is not None, "Proxy.open() was not called"
        what = f"decode instance {decode.host}:{decode.port}"
        stack = AsyncExitStack()
        try:
            resp = await stack.enter_async_context(
                decode.client.stream("POST", endpoint, json=req, headers=_headers(request_id))
            )
        except httpx.HTTPError as e:
            await stack.aclose()
            raise BackendError(f"{what}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            body = await resp.aread()
            await stack.aclose()
            raise BackendError(f"{what} answered {resp.status_code}: {body[:200]!r}")
        return decode, resp, stack


class _Reject(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


async def _next_event(conn: h11.Connection, stream: anyio.abc.SocketStream) -> Any:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise _Reject(e.error_status_hint, f"bad request: {e}") from None
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive(_RECV)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            data = b""
        conn.receive_data(data)


async def _read_body(conn: h11.Connection, stream: anyio.abc.SocketStream) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        event = await _next_event(conn, stream)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY:
                raise _Reject(413, f"request body exceeds {MAX_BODY} bytes")
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts)
        elif isinstance(event, h11.ConnectionClosed):
            raise _Reject(400, "connection closed inside the request")


async def _send(stream: anyio.abc.SocketStream, conn: h11.Connection, event: Any) -> None:
    data = conn.send(event)
    if data:
        await stream.send(data)


async def _respond(
    stream: anyio.abc.SocketStream, conn: h11.Connection, status: int, doc: dict[str, Any]
) -> None:
    body = json.dumps(doc).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    await _send(
        stream,
        conn,
        h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b"")),
    )
    await _send(stream, conn, h11.Data(data=body))
    await _send(stream, conn, h11.EndOfMessage())


async def _stream_decode(
    stream: anyio.abc.SocketStream, conn: h11.Connection, resp: httpx.Response
) -> None:
    """Relay the decode answer chunk by chunk (chunked transfer encoding)."""
    headers = [("content-type", "application/json"), ("transfer-encoding", "chunked")]
    await _send(stream, conn, h11.Response(status_code=200, headers=headers, reason=b"OK"))
    async for chunk in resp.aiter_bytes():
        if chunk:
            await _send(stream, conn, h11.Data(data=chunk))
    await _send(stream, conn, h11.EndOfMessage())


class _Server:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.limit = anyio.CapacityLimiter(MAX_CONNECTIONS)

    async def connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream, self.limit:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
            try:
                while await self._one(stream, conn):
                    conn.start_next_cycle()
            except _Reject as e:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await _respond(stream, conn, e.status, {"error": e.text})
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                log.debug("proxy connection dropped: %s", e)
            except (h11.ProtocolError, httpx.HTTPError) as e:
                log.info("proxy connection ended: %s", e)

    async def _one(self, stream: anyio.abc.SocketStream, conn: h11.Connection) -> bool:
        """Serve one request; whether the connection may carry another."""
        with anyio.move_on_after(IDLE_S):
            event = await _next_event(conn, stream)
        if not isinstance(event, h11.Request):
            return False
        body = b""
        with anyio.move_on_after(REQUEST_S) as scope:
            body = await _read_body(conn, stream)
        if scope.cancelled_caught:
            raise _Reject(408, f"request not received within {REQUEST_S:.0f} s")
        path = event.target.decode("latin-1").split("?", 1)[0]
        method = event.method.decode("ascii", "replace")
        routes = {"/v1/completions": "/completions", "/v1/chat/completions": "/chat/completions"}
        if path == "/healthcheck":
            if method != "GET":
                await _respond(stream, conn, 405, {"error": "use GET"})
            else:
                await _respond(stream, conn, 200, self.proxy.health())
        elif path in routes:
            if method != "POST":
                await _respond(stream, conn, 405, {"error": "use POST"})
            else:
                await self._completions(stream, conn, routes[path], body)
        else:
            await _respond(stream, conn, 404, {"error": f"no such path {path!r}"})
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    async def _completions(
        self, stream: anyio.abc.SocketStream, conn: h11.Connection, endpoint: str, body: bytes
    ) -> None:
        try:
            req = json.loads(body)
        except ValueError as e:
            raise _Reject(400, f"request body is not JSON: {e}") from None
        if not isinstance(req, dict):
            raise _Reject(400, "request body must be a JSON object")
        try:
            _, resp, closer = await self.proxy.handle_completions(endpoint, req)
        except BackendError as e:
            log.error("disagg proxy, %s endpoint: %s", endpoint, e)
            await _respond(stream, conn, 502, {"error": str(e)})
            return
        async with closer:
            await _stream_decode(stream, conn, resp)


async def serve(
    args: argparse.Namespace,
    *,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the proxy for ``args`` (from :func:`parse_args`) until cancelled;
    ``task_status.started((host, port))`` once listening."""
    proxy = Proxy(args.prefiller_instances, args.decoder_instances)
    async with AsyncExitStack() as stack:
        await proxy.open(stack)
        try:
            listener = await anyio.create_tcp_listener(
                local_host=args.host, local_port=args.port, reuse_port=False, backlog=1024
            )
        except OSError as e:
            raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        async with listener:
            port = int(listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port))
            print(f"vllm_v1_proxy_server: listening on http://{args.host}:{port}", flush=True)
            task_status.started((args.host, port))
            await listener.serve(_Server(proxy).connection)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mooncake.vllm_v1_proxy_server``: serve until SIGINT / SIGTERM."""
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"vllm_v1_proxy_server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def run() -> None:
        import signal

        async with anyio.create_task_group() as tg:
            await tg.start(serve, args)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

    try:
        anyio.run(run)
    except OSError as e:
        print(f"vllm_v1_proxy_server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
