"""The HTTP side of :mod:`mooncake.mooncake_store_service`'s handlers: JSON answers, request
checks, and the wrapper that turns a failed store call into the published 500.

Every check answers the 400 :class:`~mooncake._restserver.Response` saying what is wrong (the
caller returns it as is) or hands back the checked value. Nothing here touches a store.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mooncake._restserver import Response

# Caps a caller's /api/unmount_local_disk grace period so a malformed value
# (e.g. milliseconds passed where seconds are expected) blocks a preStop hook
# for minutes rather than hours.
_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS = 3600

_JSON = "application/json"
_Handler = Callable[[Any], Awaitable[Response]]
_S = TypeVar("_S")


def _timed_handler(operation_name: str, handler: _Handler) -> _Handler:
    """``handler``, logging how long each call took (as published)."""

    async def wrapper(request: Any) -> Response:
        start_time = time.perf_counter()
        try:
            return await handler(request)
        finally:
            elapsed_ms = (time.perf_counter() - start_time) * 1000
            logging.info(f"{operation_name} operation completed in {elapsed_ms:.2f} ms")

    return wrapper


def _errors_answer_500(
    operation: str,
) -> Callable[[Callable[[_S, Any], Awaitable[Response]]], Callable[[_S, Any], Awaitable[Response]]]:
    """Decorator for a handler method: an exception it raises is logged
    (``"<operation> error: <exception>"``, level ERROR) and answered 500
    ``{"error": str(exception)}``, as the published handlers do. Answers it returns pass
    through unchanged."""

    def decorate(
        method: Callable[[_S, Any], Awaitable[Response]],
    ) -> Callable[[_S, Any], Awaitable[Response]]:
        @functools.wraps(method)
        async def guarded(self: _S, request: Any) -> Response:
            try:
                return await method(self, request)
            except Exception as e:
                logging.error(f"{operation} error: %s", e)
                return _error(500, str(e))

        return guarded

    return decorate


def _shm_name_to_path(name: object) -> str | None:
    """``/dev/shm/<name>`` for a POSIX shared-memory name (one leading ``/`` allowed); None
    for anything else (not a string, empty, ``.``/``..``, a nested path)."""
    if not isinstance(name, str) or not name:
        return None
    normalized = name[1:] if name.startswith("/") else name
    if not normalized or "/" in normalized or normalized in {".", ".."}:
        return None
    return f"/dev/shm/{normalized}"


def _answer(status: int, doc: dict[str, Any]) -> Response:
    """``doc`` as a JSON answer with ``status``."""
    return Response(status=status, text=json.dumps(doc), content_type=_JSON)


def _error(status: int, message: str, **extra: Any) -> Response:
    """``{"error": message, **extra}`` with ``status``."""
    return _answer(status, {"error": message, **extra})


def _ok(**extra: Any) -> Response:
    """200 ``{"status": "success", **extra}``."""
    return _answer(200, {"status": "success", **extra})


async def _json_object(request: Any) -> dict[str, Any] | Response:
    """The request's JSON object body, or the 400 answer saying why there is none."""
    try:
        data = await request.json()
    except Exception as e:
        return _error(400, f"Malformed JSON body: {e}")
    if not isinstance(data, dict):
        return _error(400, "Request body must be a JSON object")
    return data


def _positive_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) above 0."""
    return type(value) is int and value > 0


def _grace_error(value: object) -> Response | None:
    """The 400 answer for a ``grace_period_seconds`` outside 0..3600 (or not an int)."""
    if type(value) is int and 0 <= value <= _MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS:
        return None
    return _error(
        400,
        "Invalid grace_period_seconds, must be a non-negative integer no greater than "
        f"{_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS}",
    )


def _segment_ids(data: dict[str, Any]) -> list[str] | Response:
    """``segment_ids`` (one string or a list of strings), or the 400 answer."""
    segment_ids = data.get("segment_ids", [])
    if isinstance(segment_ids, str):
        segment_ids = [segment_ids]
    if not segment_ids:
        return _error(400, "Missing segment_ids")
    if not isinstance(segment_ids, list) or not all(isinstance(s, str) for s in segment_ids):
        return _error(400, "Invalid segment_ids, must be a string or a list of strings")
    return list(segment_ids)


async def _unmount_request(request: Any) -> tuple[list[str], int] | Response:
    """``(segment_ids, grace_period_seconds)`` of an unmount route's body (the grace period
    defaults to 0), or the 400 answer for the first thing wrong: the body, the ids, the grace
    period."""
    data = await _json_object(request)
    if isinstance(data, Response):
        return data
    segment_ids = _segment_ids(data)
    if isinstance(segment_ids, Response):
        return segment_ids
    grace_period_seconds = data.get("grace_period_seconds", 0)
    bad = _grace_error(grace_period_seconds)
    if bad is not None:
        return bad
    return segment_ids, grace_period_seconds
