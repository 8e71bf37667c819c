"""The master's drain control plane on its admin HTTP port, in the published wire shape.

Routes (``master_admin_service.cpp`` of the published master)::

    POST /api/v1/drain_jobs          {"segments": [...], "target_segments": [...], "max_concurrency": 4}
         -> {"success": true, "job_id": "<uuid>", "status": "CREATED", "error_code": 0, "error_message": ""}
    GET  /api/v1/drain_jobs/query?job_id=<uuid>
         -> {"success": true, "job_id", "type", "type_name", "status", "status_name",
             "created_at_ms_epoch", "last_updated_at_ms_epoch", "segments", "succeeded_units",
             "failed_units", "blocked_units", "active_units", "migrated_bytes", "message", ...}
    POST /api/v1/drain_jobs/cancel?job_id=<uuid>
         -> {"success": true, "job_id": "<uuid>", "status": "CANCELED", ...}
    GET  /api/v1/segments/status?segment=<name>
         -> {"success": true, "segment", "status", "status_name", "error_code": 0, "error_message": ""}

Errors are ``{"success": false, "error_code": N, "error_message": "..."}`` with the published
HTTP statuses: 400 for ``INVALID_PARAMS`` (bad JSON body, missing or malformed ``job_id`` or
``segment``), 404 for an unknown segment or job, 409 where the master cannot act in its
current mode, 405 for the wrong method.

The drain jobs themselves go through :func:`drain_call`, which runs them as the master's
:class:`~mooncake._store.drain_jobs.DrainJobs` (404 ``JOB_NOT_FOUND`` for an unknown job, 409
``UNAVAILABLE_IN_CURRENT_STATUS`` for a segment already draining or a cancel the published
master refuses). A segment's status is ``OK``, ``DRAINING``, or ``DRAINED`` once a draining
segment holds no object.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from mooncake._store.drain_jobs import JOB_STATUS as JOB_STATUS
from mooncake._store.drain_jobs import DrainJobs
from mooncake.errors import ErrorCode, MooncakeError, NotSupportedError

PREFIX = "/api/v1/"
#: request bodies above this are refused (the admin port takes small JSON documents only)
MAX_BODY = 1 << 20
#: the published ``SegmentStatus`` values
SEGMENT_STATUS = {
    0: "UNDEFINED",
    1: "OK",
    2: "DRAINING",
    3: "DRAINED",
    4: "GRACEFULLY_UNMOUNTING",
    5: "UNMOUNTING",
}
_HTTP_STATUS = {
    ErrorCode.INVALID_PARAMS: 400,
    ErrorCode.SEGMENT_NOT_FOUND: 404,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.OBJECT_NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE_IN_CURRENT_MODE: 409,
    ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS: 409,
    ErrorCode.NOT_SUPPORTED: 501,
}
_JSON = "application/json; charset=utf-8"

Response = tuple[int, str, bytes]


class _Master(Protocol):
    """What the routes read of the master server."""

    @property
    def state(self) -> Any: ...
    @property
    def ha(self) -> Any: ...
    @property
    def drain_jobs(self) -> DrainJobs: ...
    def now(self) -> float: ...
    def run_command(self, command: Any) -> Any: ...


def drain_call(server: _Master, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run drain operation ``op`` (``create``: ``segments``, ``target_segments``,
    ``max_concurrency`` -> ``{"job_id"}``; ``query``: ``job_id`` -> the job's fields;
    ``cancel``: ``job_id`` -> ``{}``) on ``server``'s drain jobs; raises a
    :class:`MooncakeError` (:class:`NotSupportedError` for another ``op``)."""
    jobs = server.drain_jobs
    if op == "create":
        job = jobs.create(
            server, list(args["segments"]), list(args["target_segments"]), args["max_concurrency"]
        )
        return {"job_id": job.id}
    if op == "query":
        return jobs.query(str(args["job_id"])).as_dict()
    if op == "cancel":
        jobs.cancel(server, str(args["job_id"]))
        return {}
    raise NotSupportedError(f"unknown drain operation {op!r}")


def _doc(status: int, doc: dict[str, Any]) -> Response:
    return status, _JSON, json.dumps(doc, separators=(",", ":")).encode()


def _error(code: ErrorCode, message: str, status: int | None = None) -> Response:
    return _doc(
        status or _HTTP_STATUS.get(code, 500),
        {"success": False, "error_code": int(code), "error_message": message},
    )


def _job_id(query: dict[str, list[str]]) -> str | None:
    raw = (query.get("job_id") or [""])[0].strip()
    try:
        return str(uuid.UUID(raw)) if raw else None
    except ValueError:
        return None


def handles(path: str) -> bool:
    """Whether ``path`` is one of these routes' (the master routes it here)."""
    return urlsplit(path).path.startswith(PREFIX)


def segment_status(server: _Master, name: str) -> int:
    """The published ``SegmentStatus`` of ``name`` (``SEGMENT_NOT_FOUND`` when unmounted)."""
    return server.drain_jobs.segment_status(server, name)


def response(server: _Master, method: str, target: str, body: bytes) -> Response:
    """(status, content type, body) for one request to a route of this module."""
    url = urlsplit(target)
    query = parse_qs(url.query)
    routes = {
        "/api/v1/drain_jobs": "POST",
        "/api/v1/drain_jobs/query": "GET",
        "/api/v1/drain_jobs/cancel": "POST",
        "/api/v1/segments/status": "GET",
    }
    want = routes.get(url.path)
    if want is None:
        return _error(ErrorCode.INVALID_PARAMS, f"no such path {url.path!r}", 404)
    if method != want:
        return _error(ErrorCode.INVALID_PARAMS, f"{url.path} takes {want}, not {method}", 405)
    try:
        if url.path == "/api/v1/segments/status":
            name = (query.get("segment") or [""])[0]
            if not name:
                return _error(ErrorCode.INVALID_PARAMS, "Missing segment query parameter")
            st = segment_status(server, name)
            return _doc(
                200,
                {
                    "success": True,
                    "segment": name,
                    "status": st,
                    "status_name": SEGMENT_STATUS[st],
                    "error_code": 0,
                    "error_message": "",
                },
            )
        if url.path == "/api/v1/drain_jobs":
            return _create(server, body)
        job_id = _job_id(query)
        if job_id is None:
            return _error(ErrorCode.INVALID_PARAMS, "Missing or invalid job_id")
        if url.path == "/api/v1/drain_jobs/query":
            job = drain_call(server, "query", {"job_id": job_id})
            return _doc(200, {"success": True, "job_id": job_id, **job})
        drain_call(server, "cancel", {"job_id": job_id})
        return _doc(
            200,
            {
                "success": True,
                "job_id": job_id,
                "status": "CANCELED",
                "error_code": 0,
                "error_message": "",
            },
        )
    except MooncakeError as e:
        return _error(ErrorCode(int(e.code)), str(e))


def _create(server: _Master, body: bytes) -> Response:
    if len(body) > MAX_BODY:
        return _error(ErrorCode.INVALID_PARAMS, f"body exceeds {MAX_BODY} bytes")
    try:
        req = json.loads(body or b"null")
    except ValueError as e:
        return _error(ErrorCode.INVALID_PARAMS, f"Invalid JSON body: {e}")
    if not isinstance(req, dict):
        return _error(ErrorCode.INVALID_PARAMS, "Invalid JSON body: expected an object")
    segments = req.get("segments", [])
    targets = req.get("target_segments", [])
    conc = req.get("max_concurrency", 4)
    for name, v in (("segments", segments), ("target_segments", targets)):
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            return _error(ErrorCode.INVALID_PARAMS, f"{name} must be a list of segment names")
    if not segments:
        return _error(ErrorCode.INVALID_PARAMS, "segments must name at least one segment")
    if isinstance(conc, bool) or not isinstance(conc, int) or not 0 < conc < 1 << 32:
        return _error(
            ErrorCode.INVALID_PARAMS, f"max_concurrency must be a positive int, got {conc!r}"
        )
    out = drain_call(
        server,
        "create",
        {"segments": segments, "target_segments": targets, "max_concurrency": conc},
    )
    return _doc(
        200,
        {
            "success": True,
            "job_id": str(out["job_id"]),
            "status": "CREATED",
            "error_code": 0,
            "error_message": "",
        },
    )
