"""The load generator: every request sent at its arrival time to vLLM's OpenAI server, streamed.

:func:`drive` starts one task per request at ``start + arrival_s`` (real time, so requests
overlap as the trace says), posts ``/v1/completions`` with the prompt as token ids, greedy
(``temperature=0``, ``ignore_eos``, exactly ``max_tokens``), ``stream=True`` with
``return_token_ids`` and usage, and fills a :class:`~.records.RequestRecord` from the chunks
as they arrive (the first token's time is the first chunk carrying a token id). A route
:class:`Single` sends to one server; :class:`Disagg` is the prefill/decode router vLLM's
Mooncake proxy is: the prompt to the prefill server first (``max_tokens=1``,
``do_remote_decode`` and a fresh ``transfer_id``), then to the decode server, streamed, with
``do_remote_prefill`` and the prefill engine's id and bootstrap address; the decode server's
connector pulls the prompt's KV from the prefiller. The record's ``sent_s`` is the first post,
so TTFT includes the prefill leg.

:func:`poll_metrics` scrapes Prometheus text from a set of URLs every ``interval_s`` into
``(t, source, {name: summed value})`` samples until cancelled.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from mooncake._eval.records import RequestRecord
from mooncake._eval.workload import ScaledRequest

__all__ = ["Disagg", "Route", "Single", "drive", "parse_prometheus", "poll_metrics"]

MODEL_NAME = "tiny"


@dataclass(frozen=True, slots=True)
class Single:
    """Send to one OpenAI server."""

    name: str
    url: str


@dataclass(frozen=True, slots=True)
class Disagg:
    """Prefill on ``prefill_url``, decode on ``decode_url`` (MooncakeConnector's params)."""

    name: str
    prefill_url: str
    decode_url: str
    prefill_engine_id: str
    bootstrap_addr: str


Route = Single | Disagg


def _body(req: ScaledRequest, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord, t0: float
) -> None:
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids:
                    now = time.monotonic() - t0
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.last_token_s = now
                    rec.tokens.extend(int(i) for i in ids)
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    rec.cached_tokens = int(details["cached_tokens"])


async def _one(
    client: httpx.AsyncClient, req: ScaledRequest, route: Route, rec: RequestRecord, t0: float
) -> None:
    rec.sent_s = time.monotonic() - t0
    try:
        if isinstance(route, Single):
            await _stream(client, route.url, _body(req, MODEL_NAME, req.max_tokens, True), rec, t0)
            return
        xfer = f"xfer-{req.index}-{time.monotonic_ns()}"
        pbody = _body(req, MODEL_NAME, 1, False)
        pbody["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": xfer,
        }
        resp = await client.post(route.prefill_url + "/v1/completions", json=pbody)
        if resp.status_code != 200:
            rec.error = f"prefill HTTP {resp.status_code}: {resp.text[:300]}"
            return
        dbody = _body(req, MODEL_NAME, req.max_tokens, True)
        dbody["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": xfer,
            "remote_engine_id": route.prefill_engine_id,
            "remote_bootstrap_addr": route.bootstrap_addr,
        }
        await _stream(client, route.decode_url, dbody, rec, t0)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def drive(
    requests: Sequence[ScaledRequest],
    route_of: Callable[[ScaledRequest], Route],
    *,
    on_done: Callable[[RequestRecord], None] | None = None,
    at_time: Sequence[tuple[float, Callable[[], Any]]] = (),
    request_timeout_s: float = 300.0,
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival; returns the records (request order) and the wall
    clock (``time.time()``) of the run's time 0. ``at_time`` callbacks run (in a worker thread)
    at their offsets, e.g. a fault injection. A request that waits ``request_timeout_s`` for a
    byte is recorded with its error (the run goes on)."""
    records = [
        RequestRecord(index=r.index, instance=route_of(r).name, arrival_s=r.arrival_s)
        for r in requests
    ]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits) as client:
        t0 = time.monotonic()
        wall0 = time.time()

        async def later(req: ScaledRequest, rec: RequestRecord) -> None:
            await anyio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
            await _one(client, req, route_of(req), rec, t0)
            if on_done is not None:
                on_done(rec)

        async def fire(offset: float, fn: Callable[[], Any]) -> None:
            await anyio.sleep(max(0.0, t0 + offset - time.monotonic()))
            await anyio.to_thread.run_sync(fn)

        async with anyio.create_task_group() as tg:
            for req, rec in zip(requests, records, strict=True):
                tg.start_soon(later, req, rec)
            for offset, fn in at_time:
                tg.start_soon(fire, offset, fn)
    return records, wall0


#: Labels kept apart when parsing (the first one a sample has): ``NAME:VALUE`` keys.
KEPT_LABELS = ("family", "op", "reason")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_prometheus(text: str, prefixes: Sequence[str]) -> dict[str, float]:
    """Sums of the samples whose name starts with one of ``prefixes``, over their labels;
    a sample with a label of :data:`KEPT_LABELS` is also summed under ``NAME:VALUE`` (so
    ``mooncake_store_bytes_total:get_into`` sits beside ``mooncake_store_bytes_total``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name, _, labels = name_part.partition("{")
        name = name.strip()
        if not name.startswith(tuple(prefixes)):
            continue
        found = dict(_LABEL.findall(labels))
        kept = next((found[k] for k in KEPT_LABELS if k in found), None)
        if kept is not None:
            try:
                key = f"{name}:{kept}"
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def poll_metrics(
    sources: dict[str, str],
    samples: list[tuple[float, str, dict[str, float]]],
    prefixes: Sequence[str],
    interval_s: float = 1.0,
) -> None:
    """Appends one sample per source (``name -> /metrics URL``) every ``interval_s`` (wall
    clock ``time.time()``) until cancelled; a source that does not answer is skipped."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        while True:
            for name, url in sources.items():
                try:
                    resp = await client.get(url)
                except httpx.HTTPError:
                    continue
                if resp.status_code == 200:
                    samples.append((time.time(), name, parse_prometheus(resp.text, prefixes)))
            await anyio.sleep(interval_s)
