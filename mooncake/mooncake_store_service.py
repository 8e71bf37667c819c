"""The published ``mooncake.mooncake_store_service``: a store client behind a REST API.

``mc_store_rest_server [--config FILE] [-D key=value ...] [--port 8080] [--max-wait-time 60]
[--host 127.0.0.1]`` loads a :class:`~mooncake.mooncake_config.MooncakeConfig` (the file, else
``MOONCAKE_CONFIG_PATH`` / ``MOONCAKE_*``; ``-D`` overrides one field: sizes take ``4gb``,
booleans ``true``/``false``), sets up a :class:`~mooncake.store.MooncakeDistributedStore`
(retried once a second for up to ``--max-wait-time`` seconds), then serves until SIGINT or
SIGTERM, when it closes the store and exits 0.

Routes, bodies and answers are the published ones (every answer is JSON but a ``get``'s value):

=========================== ====== ==================================================================
``/api/put``                PUT    ``{"key", "value"}`` (``value`` a string, stored as UTF-8) ->
                                   ``{"status": "success"}``; 400 ``Missing key or value``
``/api/get/{key}``          GET    the value (``application/octet-stream``); 404 ``Key not found``
``/api/exist/{key}``        GET    ``{"exists": true|false}``
``/api/remove/{key}``       DELETE ``{"status": "success"}``; 500 ``Remove operation failed``
``/api/remove_all``         DELETE ``{"status": "success removed N keys"}``
``/api/mount_shm``          POST   ``{"name", "size", "offset"=0, "protocol", "location"=""}``: mounts
                                   ``/dev/shm/<name>`` -> ``{"status", "segment_ids"}``
``/api/unmount_shm``        POST   ``{"segment_ids", "grace_period_seconds"=0}``, one id at a time;
                                   500 lists ``failed_segment_ids``
``/api/mount``              POST   ``{"size", "protocol", "location"}``: allocates and mounts ->
                                   ``{"status", "segment_ids", "allocated_size"}``
``/api/unmount``            POST   ``{"segment_ids", "grace_period_seconds"=0}``: unmounts and frees
``/api/unmount_local_disk`` POST   ``{"grace_period_seconds"=0}`` (0..3600): drains the SSD tier
``/api/reconfigure``        POST   ``{"mode": "decode", "path", "size", "offset", ...}`` mounts the
                                   file before retiring the previous decode segments (make before
                                   break; a failed mount keeps them, or with none rolls back to
                                   prefill); ``{"mode": "prefill"}`` unmounts them
=========================== ====== ==================================================================

A failed store call answers 500 ``{"error": ...}`` with the published text (``PUT operation
failed``, ``Mount failed, ret=N`` ...) and, where the store returned a code, ``"ret": N``.
An exception in a handler is logged (``PUT error: ...``) and answered 500 ``{"error": str(e)}``,
as published (:mod:`mooncake._store_service_http` holds that wrapper, the JSON answers and the
request checks).

Deliberate differences from the published module:

* it binds ``--host`` (default ``127.0.0.1``); the published one always binds ``0.0.0.0``
  (``--host 0.0.0.0`` does that). ``--port 0`` binds a free port; the log line
  ``REST API started on http://HOST:PORT`` names the bound one;
* HTTP is served by :mod:`mooncake._restserver` (asyncio and h11), not aiohttp: nothing more to
  install. Handlers keep the aiohttp shape (``await request.json()``, ``request.match_info``;
  they answer a :class:`~mooncake._restserver.Response` with ``status``, ``text``, ``body``).
  Bodies are bounded at :data:`MAX_BODY` (100 MiB, the published ``client_max_size``: 413);
  connections at :data:`MAX_CONNECTIONS`;
* an unknown path is 404 and a wrong method 405 with ``{"error": ...}`` naming them (aiohttp:
  ``text/plain`` ``404: Not Found``);
* a body that is not JSON, or not a JSON object, is 400 ``Malformed JSON body: ...`` /
  ``Request body must be a JSON object`` on every route (published: only on
  ``/api/unmount_local_disk``; elsewhere a 500 with Python's exception text); so are a
  non-string ``key``/``value``, a ``size`` that is not a positive integer (published
  ``mount_shm`` with size 0: 200 with no segment), ``segment_ids`` that
  are not strings, and a ``grace_period_seconds`` outside 0..3600 on the unmount routes;
* store calls run in worker threads (the published handlers block the event loop);
* ``-D`` values are converted to the field's type (``-Dglobal_segment_size=4gb``) and checked as
  the config file's are; an unknown ``-D`` key is warned about (published: ignored silently);
* a config object without the newer fields (``enable_client_http_server``,
  ``client_http_port``, ``tenant_id`` ...) sets up with their defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake._restserver import Response, RestServer
from mooncake._store_service_http import (
    _answer,
    _error,
    _errors_answer_500,
    _grace_error,
    _Handler,
    _json_object,
    _ok,
    _positive_int,
    _shm_name_to_path,
    _timed_handler,
    _unmount_request,
)
from mooncake.mooncake_config import MooncakeConfig, _parse_bool, _parse_segment_size
from mooncake.store import MooncakeDistributedStore

__all__ = [
    "DEFAULT_HOST",
    "MAX_BODY",
    "MAX_CONNECTIONS",
    "MooncakeStoreService",
    "main",
    "parse_arguments",
    "sync_main",
]

#: request bodies above this are refused with 413 (the published aiohttp ``client_max_size``)
MAX_BODY = 1024 * 1024 * 100
#: connections served at once; a further one is answered 503
MAX_CONNECTIONS = 128
#: the address the REST API binds unless told otherwise (published: always 0.0.0.0)
DEFAULT_HOST = "127.0.0.1"

#: ``-D`` fields that are not strings, and how their text is read
_SIZE_FIELDS = ("global_segment_size", "local_buffer_size")
_BOOL_FIELDS = ("enable_ssd_offload", "enable_client_http_server")
_INT_FIELDS = ("client_http_port",)


def _unblock_shutdown_signals() -> None:
    """Unblock SIGINT and SIGTERM in this thread (a launcher may have blocked them)."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    except AttributeError:
        pass


def _install_shutdown_signal_handlers(
    loop: asyncio.AbstractEventLoop, shutdown_event: asyncio.Event
) -> None:
    """SIGINT and SIGTERM set ``shutdown_event`` (through ``loop``; a plain signal handler
    that schedules it on ``loop`` where the loop cannot take signal handlers)."""

    def request_shutdown(signum: int) -> None:
        logging.info("Received signal %s, shutting down", signum)
        shutdown_event.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, request_shutdown, sig)
        except (NotImplementedError, RuntimeError):
            signal.signal(
                sig,
                lambda signum, _frame: loop.call_soon_threadsafe(request_shutdown, signum),
            )


def _apply_overrides(config: MooncakeConfig, overrides: dict[str, Any]) -> None:
    """Set ``config``'s fields from ``overrides`` (``-D`` values are text: converted to the
    field's type); re-checks the config; ``ValueError`` naming a bad value."""
    for key, value in overrides.items():
        if not hasattr(config, key):
            logging.warning("Ignoring unknown config key %r", key)
            continue
        if isinstance(value, str):
            try:
                if key in _SIZE_FIELDS:
                    value = _parse_segment_size(value)
                elif key in _BOOL_FIELDS:
                    value = _parse_bool(value)
                elif key in _INT_FIELDS:
                    value = int(value)
            except ValueError as e:
                raise ValueError(f"config override {key}={value!r}: {e}") from None
        setattr(config, key, value)
    if overrides and isinstance(config, MooncakeConfig):
        config.__post_init__()


class MooncakeStoreService:
    """A :class:`~mooncake.store.MooncakeDistributedStore` behind the REST API (the module
    docstring lists the routes).

    ``config_path`` is a JSON config file (else ``MooncakeConfig.load_from_env()``);
    ``cli_config`` overrides its fields by name. Fields used: ``local_hostname``,
    ``metadata_server``, ``global_segment_size`` (0: mount no memory), ``local_buffer_size``,
    ``protocol``, ``device_name``, ``master_server_address``, ``enable_ssd_offload``,
    ``ssd_offload_path``, ``tenant_id``, ``enable_client_http_server``, ``client_http_port``.

    State for ``/api/reconfigure``: ``current_mode`` (``"prefill"`` or ``"decode"``),
    ``mounted_segment_ids`` (the decode segments) and ``last_mount_info``, changed under
    ``_state_lock``.
    """

    def __init__(self, config_path: str | None = None, cli_config: dict[str, Any] | None = None):
        self.store: Any = None
        self.config: Any = None
        self._http: RestServer | None = None
        self._setup_logging()

        self.current_mode = "prefill"
        self.mounted_segment_ids: list[str] = []
        self.last_mount_info: dict[str, Any] = {}
        self._state_lock = asyncio.Lock()

        try:
            if config_path:
                self.config = MooncakeConfig.from_file(config_path)
            else:
                self.config = MooncakeConfig.load_from_env()
            if cli_config:
                _apply_overrides(self.config, cli_config)
            logging.info("Mooncake configuration loaded")
        except Exception as e:
            logging.error("Configuration load failed: %s", e)
            raise

    def _setup_logging(self) -> None:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s - %(name)s - %(levelname)s - %(message)s",
        )

    @property
    def http_port(self) -> int:
        """The port the REST API listens on (0 before :meth:`start_http_service`)."""
        http = getattr(self, "_http", None)
        return http.port if http is not None else 0

    def _setup_config(self) -> dict[str, Any]:
        """The ``setup(config)`` dict of this service's config."""
        c = self.config
        device = c.device_name
        return {
            "local_hostname": c.local_hostname,
            "metadata_server": c.metadata_server,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "protocol": c.protocol,
            "rdma_devices": "" if device is None else device,
            "master_server_addr": c.master_server_address,
            "enable_ssd_offload": getattr(c, "enable_ssd_offload", False),
            "ssd_offload_path": getattr(c, "ssd_offload_path", ""),
            "tenant_id": getattr(c, "tenant_id", "default"),
            "enable_client_http_server": getattr(c, "enable_client_http_server", False),
            "client_http_port": getattr(c, "client_http_port", 9300),
        }

    async def start_store_service(
        self, max_wait_time: float = 60, shutdown_event: asyncio.Event | None = None
    ) -> bool:
        """Set up the store, retrying once a second for up to ``max_wait_time`` seconds;
        whether it is up. A set ``shutdown_event`` cancels the start (False; a store set up
        meanwhile is closed)."""
        retry_count = 0
        retry_interval = 1.0
        start_time = time.perf_counter()

        if shutdown_event is not None:
            # a signal callback queued just before startup runs first
            await asyncio.sleep(0)

        while True:
            if shutdown_event is not None and shutdown_event.is_set():
                logging.info("Store startup cancelled by shutdown request")
                return False

            elapsed = time.perf_counter() - start_time
            if elapsed >= max_wait_time:
                logging.error(
                    f"Store startup failed: exceeded max wait time of {max_wait_time}s "
                    f"after {retry_count} attempts"
                )
                return False

            try:
                retry_count += 1
                logging.info(
                    f"Attempting to start store service (attempt {retry_count}, "
                    f"elapsed: {elapsed:.1f}s/{max_wait_time}s)"
                )
                self.store = MooncakeDistributedStore()
                ret = self.store.setup(self._setup_config())

                if shutdown_event is not None:
                    # setup() is synchronous: let a signal that came meanwhile be seen
                    await asyncio.sleep(0)
                    if shutdown_event.is_set():
                        logging.info("Store startup cancelled by shutdown request")
                        await self.stop()
                        return False

                if ret != 0:
                    raise RuntimeError(f"Store initialization failed (ret={ret})")

                logging.info(f"Store service started successfully on {self.config.local_hostname}")
                return True

            except Exception as e:
                remaining_time = max_wait_time - (time.perf_counter() - start_time)
                actual_sleep_time = min(retry_interval, remaining_time) if remaining_time > 0 else 0
                logging.warning(
                    f"Store startup failed (attempt {retry_count}): {e}. "
                    f"Retrying in {actual_sleep_time:.1f}s... "
                    f"(remaining time: {remaining_time:.1f}s)"
                )
                if actual_sleep_time > 0:
                    if shutdown_event is not None:
                        try:
                            await asyncio.wait_for(shutdown_event.wait(), timeout=actual_sleep_time)
                            logging.info("Store startup cancelled by shutdown request")
                            return False
                        except asyncio.TimeoutError:
                            pass
                    else:
                        await asyncio.sleep(actual_sleep_time)

    def _routes(self) -> list[tuple[str, str, _Handler]]:
        t = _timed_handler
        return [
            ("POST", "/api/reconfigure", t("RECONFIGURE", self.handle_reconfigure)),
            ("POST", "/api/mount_shm", t("MOUNT_SHM", self.handle_mount_shm)),
            ("POST", "/api/unmount_shm", t("UNMOUNT_SHM", self.handle_unmount_shm)),
            ("POST", "/api/mount", t("MOUNT", self.handle_mount)),
            ("POST", "/api/unmount", t("UNMOUNT", self.handle_unmount)),
            (
                "POST",
                "/api/unmount_local_disk",
                t("UNMOUNT_LOCAL_DISK", self.handle_unmount_local_disk),
            ),
            ("PUT", "/api/put", t("PUT", self.handle_put)),
            ("GET", "/api/get/{key}", t("GET", self.handle_get)),
            ("GET", "/api/exist/{key}", t("EXIST", self.handle_exist)),
            ("DELETE", "/api/remove/{key}", t("REMOVE", self.handle_remove)),
            ("DELETE", "/api/remove_all", t("REMOVE_ALL", self.handle_remove_all)),
        ]

    async def start_http_service(self, port: int = 8080, host: str = DEFAULT_HOST) -> bool:
        """Serve the REST API on ``host:port`` (port 0: a free one, see :attr:`http_port`)
        in the background; True once listening (``OSError`` when it cannot bind)."""
        server = RestServer(
            self._routes(),
            max_body=MAX_BODY,
            max_connections=MAX_CONNECTIONS,
            name="mc_store_rest_server",
        )
        bound = await server.start(host, port)
        self._http = server
        logging.info(f"REST API started on http://{host}:{bound}")
        return True

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a blocking store call) in a worker thread."""
        return await asyncio.to_thread(fn, *args)

    # -- REST API handlers -------------------------------------------------------------

    @_errors_answer_500("RECONFIGURE")
    async def handle_reconfigure(self, request: Any) -> Response:
        data = await _json_object(request)
        if isinstance(data, Response):
            return data
        mode = data.get("mode", "")
        mode = mode.lower() if isinstance(mode, str) else ""

        if mode == "decode":
            return await self._reconfigure_decode(data)
        if mode == "prefill":
            async with self._state_lock:
                if self.mounted_segment_ids:
                    ret = await self._call(
                        self.store.unmount_segment, list(self.mounted_segment_ids)
                    )
                    if ret != 0:
                        return _error(500, f"Unmount failed, ret={ret}")
                    self.mounted_segment_ids.clear()
                self.current_mode = "prefill"
                self.last_mount_info.clear()
            return _ok(mode=self.current_mode)
        return _error(400, "Invalid mode. Use 'decode' or 'prefill'")

    async def _reconfigure_decode(self, data: dict[str, Any]) -> Response:
        path = data.get("path")
        size = data.get("size")
        offset = data.get("offset", 0)
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not path or size is None:
            return _error(400, "Missing path or size for decode mode")
        if not isinstance(path, str) or not _positive_int(size):
            return _error(400, "Invalid path or size, size must be a positive integer")
        if type(offset) is not int or offset < 0:
            return _error(400, "Invalid offset, must be a non-negative integer")

        async with self._state_lock:
            # Make before break: the new segment is mounted while the previous ones still
            # serve; they are retired (one id at a time, so a partial failure keeps exactly
            # the ids still mounted) only once it is up. Each mount is a fresh segment id,
            # so a same-path remount cannot collide with the segment it replaces.
            previous_segment_ids = list(self.mounted_segment_ids)
            result = await self._call(
                self.store.mount_segment, path, size, offset, protocol, location
            )
            if result["ret"] != 0:
                if previous_segment_ids:
                    logging.warning(
                        "Reconfigure decode: mount of %s failed (ret=%s); "
                        "keeping previous decode segments",
                        path,
                        result["ret"],
                    )
                    return _error(
                        500,
                        f"Mount failed, ret={result['ret']}; keeping previous decode segments",
                        mode=self.current_mode,
                    )
                self.current_mode = "prefill"
                self.mounted_segment_ids.clear()
                self.last_mount_info.clear()
                return _error(
                    500,
                    f"Mount failed, ret={result['ret']}; rolled back to prefill",
                    mode=self.current_mode,
                )

            failed_unmount_ids = []
            for sid in previous_segment_ids:
                ret = await self._call(self.store.unmount_segment, [sid])
                if ret != 0:
                    failed_unmount_ids.append(sid)
            if failed_unmount_ids:
                logging.warning(
                    "Reconfigure decode: new mount succeeded but unmount of previous "
                    "segments %s failed; keeping them tracked for future cleanup",
                    failed_unmount_ids,
                )
            self.mounted_segment_ids = list(result["segment_ids"]) + failed_unmount_ids
            self.current_mode = "decode"
            self.last_mount_info = {
                "path": path,
                "offset": offset,
                "size": size,
                "protocol": protocol,
                "location": location,
            }
        return _ok(mode=self.current_mode, segment_ids=self.mounted_segment_ids)

    @_errors_answer_500("MOUNT_SHM")
    async def handle_mount_shm(self, request: Any) -> Response:
        data = await _json_object(request)
        if isinstance(data, Response):
            return data
        path = _shm_name_to_path(data.get("name"))
        offset = data.get("offset", 0)
        size = data.get("size")
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not path or not _positive_int(size):
            return _error(400, "Missing or invalid name or size")
        if type(offset) is not int or offset < 0:
            return _error(400, "Invalid offset, must be a non-negative integer")

        result = await self._call(self.store.mount_segment, path, size, offset, protocol, location)
        if result["ret"] != 0:
            return _error(500, f"Mount failed, ret={result['ret']}")
        return _ok(segment_ids=list(result["segment_ids"]))

    @_errors_answer_500("UNMOUNT_SHM")
    async def handle_unmount_shm(self, request: Any) -> Response:
        args = await _unmount_request(request)
        if isinstance(args, Response):
            return args
        segment_ids, grace_period_seconds = args

        failed_segment_ids = []
        async with self._state_lock:
            for sid in segment_ids:
                ret = await self._call(self.store.unmount_segment, [sid], grace_period_seconds)
                if ret != 0:
                    failed_segment_ids.append(sid)
                    continue
                if sid in self.mounted_segment_ids:
                    self.mounted_segment_ids.remove(sid)
            if not self.mounted_segment_ids:
                self.current_mode = "prefill"

        if failed_segment_ids:
            return _error(
                500,
                "Unmount failed for one or more segments",
                failed_segment_ids=failed_segment_ids,
            )
        return _ok()

    @_errors_answer_500("MOUNT")
    async def handle_mount(self, request: Any) -> Response:
        data = await _json_object(request)
        if isinstance(data, Response):
            return data
        size = data.get("size")
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not _positive_int(size):
            return _error(400, "Invalid size, must be a positive integer")

        result = await self._call(self.store.allocate_and_mount_segment, size, protocol, location)
        if result["ret"] != 0:
            return _error(500, f"Allocate and mount failed, ret={result['ret']}")
        return _ok(
            segment_ids=list(result["segment_ids"]),
            allocated_size=result["allocated_size"],
        )

    @_errors_answer_500("UNMOUNT")
    async def handle_unmount(self, request: Any) -> Response:
        args = await _unmount_request(request)
        if isinstance(args, Response):
            return args
        segment_ids, grace_period_seconds = args
        ret = await self._call(
            self.store.unmount_and_free_segment, segment_ids, grace_period_seconds
        )
        if ret != 0:
            return _error(500, f"Unmount and free failed, ret={ret}")
        return _ok()

    @_errors_answer_500("UNMOUNT_LOCAL_DISK")
    async def handle_unmount_local_disk(self, request: Any) -> Response:
        """Deregister this store's SSD offload tier before the process goes away.

        Meant for a preStop hook: the master stops naming this store as the owner of its
        offloaded keys (a reader gets a clean miss, not a peer about to disappear); the call
        then holds for ``grace_period_seconds`` (0..3600) so offload reads in flight finish.
        Runs off the event loop because that wait is seconds long.
        """
        data = await _json_object(request)
        if isinstance(data, Response):
            return data
        grace_period_seconds = data.get("grace_period_seconds", 0)
        bad = _grace_error(grace_period_seconds)
        if bad is not None:
            return bad
        ret = await self._call(self.store.unmount_local_disk_segment, grace_period_seconds)
        if ret != 0:
            return _error(500, f"Unmount local disk failed, ret={ret}")
        return _ok()

    @_errors_answer_500("PUT")
    async def handle_put(self, request: Any) -> Response:
        data = await _json_object(request)
        if isinstance(data, Response):
            return data
        key = data.get("key")
        raw_value = data.get("value")
        if not key or raw_value is None:
            return _error(400, "Missing key or value")
        if not isinstance(key, str) or not isinstance(raw_value, str):
            return _error(400, "Invalid key or value, both must be strings")

        ret = await self._call(self.store.put, key, raw_value.encode())
        if ret != 0:
            return _error(500, "PUT operation failed", ret=ret)
        return _ok()

    @_errors_answer_500("GET")
    async def handle_get(self, request: Any) -> Response:
        key = request.match_info["key"]
        exists = await self._call(self.store.is_exist, key)
        if exists == 0:
            return _error(404, "Key not found")
        if exists < 0:
            return _error(500, "Exist check failed", ret=int(exists))

        value = await self._call(self.store.get, key)
        if value is None:
            return _error(500, "GET operation failed")
        if value == b"":
            # an empty value, or the key went away between the two calls
            exists = await self._call(self.store.is_exist, key)
            if exists == 0:
                return _error(404, "Key not found")
            if exists < 0:
                return _error(500, "Exist check failed", ret=int(exists))
        return Response(status=200, body=value, content_type="application/octet-stream")

    @_errors_answer_500("EXIST")
    async def handle_exist(self, request: Any) -> Response:
        key = request.match_info["key"]
        exists = await self._call(self.store.is_exist, key)
        if exists < 0:
            return _error(500, "Exist check failed")
        return _answer(200, {"exists": exists > 0})

    @_errors_answer_500("REMOVE")
    async def handle_remove(self, request: Any) -> Response:
        key = request.match_info["key"]
        ret = await self._call(self.store.remove, key)
        if ret != 0:
            return _error(500, "Remove operation failed", ret=ret)
        return _ok()

    @_errors_answer_500("REMOVE_ALL")
    async def handle_remove_all(self, request: Any) -> Response:
        ret = await self._call(self.store.remove_all)
        if ret < 0:
            return _error(500, "RemoveAll operation failed", ret=ret)
        return _answer(200, {"status": "success removed " + str(ret) + " keys"})

    async def stop(self) -> None:
        """Stop the REST API and close the store (each once; a second call does nothing)."""
        http = getattr(self, "_http", None)
        if http is not None:
            self._http = None
            await http.close()
        if self.store is not None:
            ret = self.store.close()
            self.store = None
            if ret != 0:
                logging.warning("Mooncake service close returned %s", ret)
            else:
                logging.info("Mooncake service stopped")


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published flags, and ``--host`` (default 127.0.0.1)."""
    parser = argparse.ArgumentParser(
        prog="mc_store_rest_server", description="Mooncake Store Service with REST API"
    )
    parser.add_argument("--config", type=str, help="Path to Mooncake config file", required=False)
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        help="Override configuration with key=value pairs (e.g., -Dlocal_hostname=example.com)",
        default=[],
    )
    parser.add_argument(
        "--port", type=int, help="HTTP API port (default: 8080)", default=8080, required=False
    )
    parser.add_argument(
        "--host",
        type=str,
        default=DEFAULT_HOST,
        help=f"address the HTTP API binds (default: {DEFAULT_HOST}; 0.0.0.0 for all interfaces)",
    )
    parser.add_argument(
        "--max-wait-time",
        type=float,
        help="Maximum total wait time in seconds (default: 60)",
        default=60,
        required=False,
    )
    return parser.parse_args(argv)


async def main(argv: Sequence[str] | None = None) -> None:
    """Run the service until SIGINT or SIGTERM (``argv``: the command line, default
    ``sys.argv[1:]``); raises ``RuntimeError`` when the store or the REST API does not come
    up."""
    args = parse_arguments(argv)

    cli_config: dict[str, Any] = {}
    for item in args.define:
        if "=" in item:
            key, value = item.split("=", 1)
            cli_config[key] = value
        else:
            logging.warning(f"Ignoring invalid CLI config: {item}")

    service = MooncakeStoreService(args.config, cli_config)
    shutdown_event = asyncio.Event()
    loop = asyncio.get_running_loop()

    _install_shutdown_signal_handlers(loop, shutdown_event)
    _unblock_shutdown_signals()

    try:
        if not await service.start_store_service(
            max_wait_time=args.max_wait_time, shutdown_event=shutdown_event
        ):
            if shutdown_event.is_set():
                return
            raise RuntimeError("Failed to start store service")

        _unblock_shutdown_signals()
        await asyncio.sleep(0)
        if shutdown_event.is_set():
            return

        host = getattr(args, "host", DEFAULT_HOST)
        try:
            started = await service.start_http_service(args.port, host)
        except OSError as e:
            raise RuntimeError(f"Failed to start HTTP service: {e.strerror or e}") from None
        if not started:
            raise RuntimeError("Failed to start HTTP service")

        logging.info("Mooncake Store Service is running")
        await shutdown_event.wait()

    except KeyboardInterrupt:
        logging.info("Received keyboard interrupt, shutting down")
    except Exception as e:
        logging.error("Service error: %s", e)
        raise
    finally:
        await service.stop()


def sync_main(argv: Sequence[str] | None = None) -> int:
    """Synchronous entry point for the ``mc_store_rest_server`` console script: 0 after a
    signalled shutdown, 1 (the reason on stderr) when the service could not start."""
    try:
        asyncio.run(main(argv))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"mc_store_rest_server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(sync_main())
