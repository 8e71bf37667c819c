"""The lifecycle and plumbing every family of ``MooncakeDistributedStore`` builds on.

A set-up store holds an async :class:`~mooncake._store.client.Store` open on an event loop in a
background thread (:class:`~mooncake._sync.LoopThread`): its own, or, with
``setup(engine=te)``, the loop of the engine facade it shares. Every call is one crossing to
that loop (:meth:`StoreBase._call`); exceptions become the published int codes there.

Exit: a set-up store is registered with :func:`mooncake._sync.close_at_exit`, so a normal
interpreter exit closes it while the interpreter is alive (its segments are unmounted, the next
process's puts do not land on them); ``__del__`` never blocks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mooncake._store.client import Store, open_store
from mooncake._store.draining import drain_timeout
from mooncake._store.fastpath import FastPath
from mooncake._sync import LoopThread, close_at_exit, close_in_background, forget_at_exit
from mooncake.errors import ClosedError, ErrorCode, MooncakeError, to_code
from mooncake.store import _drain, _setup

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("mooncake.store")

_CAPSULE_NAME = b"mooncake.store.PyClient"


#: codes that are ordinary answers, not failures to explain (a miss, a duplicate put, a race)
_ORDINARY = frozenset(
    {
        ErrorCode.OBJECT_NOT_FOUND,
        ErrorCode.OBJECT_ALREADY_EXISTS,
        ErrorCode.OBJECT_HAS_LEASE,
        ErrorCode.REPLICA_IS_NOT_READY,
    }
)


def fail(op: str, e: BaseException) -> int:
    """The published int code of ``e``, raised by the API call ``op``.

    The int code alone says nothing of the cause, so every failure that is not an ordinary
    answer (a miss, an existing key) is logged once here at ERROR, naming the call and the
    exception's message (which names the argument and what to do): ``put: key must not be
    empty``. Ordinary answers are logged at DEBUG.
    """
    code = to_code(e)
    if code in _ORDINARY:
        log.debug("%s: %s", op, e)
    else:
        msg = str(e) if isinstance(e, MooncakeError) else f"{type(e).__name__}: {e}"
        log.error("%s", msg if msg.startswith(f"{op}:") else f"{op}: {msg}")
    return code


def _os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e`` (a failed bind, possibly wrapped), if any."""
    if isinstance(e, OSError):
        return e
    if isinstance(e.__cause__, OSError):
        return e.__cause__
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _os_error(sub)
            if found is not None:
                return found
    return None


def _kw(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``fn`` with keyword arguments bound, for :meth:`StoreBase._call` (positional only)."""

    async def call(*args: Any) -> Any:
        return await fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")  # what :func:`fail` names
    return call


def _name(fn: Callable[..., Any]) -> str:
    """The API call ``fn`` implements, for log lines (``put``, ``get_into``)."""
    return str(getattr(fn, "__name__", "call"))


class StoreBase:
    """Lifecycle (``setup``, ``init_all``, ``close``), info and the call plumbing."""

    def __init__(self) -> None:
        self._loop: LoopThread | None = None
        self._store: Store | None = None
        self._fast: FastPath | None = None
        self._owns_loop = True
        self._exit_token: int | None = None
        self._dummy: Any = None  # the standalone-client connection of a dummy client
        self._mounted_kinds: dict[str, str] = {}  # segment id -> "mounted" / "allocated"
        self._drain_timeout: float | None = None  # setup's drain_timeout (None: the default)
        self._http: Any = None  # the client HTTP endpoints (enable_client_http_server)

    # -- lifecycle ------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config_dict)``; 0 or a negative code. See
        :mod:`mooncake.store._setup` for protocol fallback, ports and the SSD tier."""
        if self._store is not None or self._dummy is not None:
            log.warning("setup called twice on one MooncakeDistributedStore")
            return int(ErrorCode.INVALID_PARAMS)
        try:
            cfg = _setup.collect(args, kwargs)
            opts = _setup.open_store_options(cfg)
            if cfg.get("drain_timeout") is not None:
                self._drain_timeout = drain_timeout(cfg["drain_timeout"])
        except MooncakeError as e:
            return fail("setup", e)
        engine = cfg.get("engine")
        if engine is not None:
            return self._setup_shared(engine, opts, cfg)
        retries = int(os.environ.get("MC_STORE_CLIENT_SETUP_RETRIES", "20") or 20)
        host = opts["hostname"]
        for attempt in range(max(1, retries)):
            if not _setup.has_port(host):
                try:
                    opts["hostname"] = f"{host}:{_setup.pick_port(host)}"
                except MooncakeError as e:
                    return fail("setup", e)
            loop = LoopThread(name="mooncake-store")
            try:
                store = loop.enter(open_store(**opts))
            except Exception as e:
                loop.close()
                cause = _os_error(e)
                if cause is not None and not _setup.has_port(host) and attempt + 1 < retries:
                    continue  # the random port was taken meanwhile: another one
                return fail("setup", e)
            self._adopt(loop, store, owns_loop=True)
            self._start_http(cfg, opts["hostname"])
            return 0
        return int(ErrorCode.INTERNAL_ERROR)

    def _start_http(self, cfg: dict[str, Any], hostname: str) -> None:
        port = _setup.client_http_port(cfg)
        if port is not None:
            from mooncake.store import _client_http

            self._http = _client_http.start(
                hostname, port, self.health_check, lambda: self.metrics_registry
            )

    def _setup_shared(self, engine: Any, opts: dict[str, Any], cfg: dict[str, Any]) -> int:
        """``setup(engine=te)``: run on ``te``'s loop and use its engine (not a second one)."""
        loop, eng = getattr(engine, "_loop", None), getattr(engine, "_engine", None)
        if not isinstance(loop, LoopThread) or eng is None:
            log.error(
                "setup: engine must be an initialized mooncake.engine.TransferEngine, got %r",
                engine,
            )
            return int(ErrorCode.INVALID_PARAMS)
        try:
            store = loop.enter(open_store(engine=eng, **opts))
        except BaseException as e:
            return fail("setup", e)
        self._adopt(loop, store, owns_loop=False)
        self._start_http(cfg, opts["hostname"])
        return 0

    def _adopt(self, loop: LoopThread, store: Store, *, owns_loop: bool) -> None:
        self._loop, self._store, self._owns_loop = loop, store, owns_loop
        if os.environ.get("MC_STORE_SYNC_FASTPATH", "1") not in ("0", "false", "False"):
            self._fast = FastPath(store, loop)
        self._exit_token = close_at_exit(self)
        _drain.arm(self)

    def drain(self, timeout_s: float | None = None) -> int:
        """Drain this client's segments before it leaves (what SIGTERM does, see
        :mod:`mooncake.store._drain`): 0 once nothing is in flight on them, ``RPC_TIMEOUT``
        (-901) if the bound (``timeout_s``, else setup's ``drain_timeout``, else 5 s) ran out
        first, another negative code if the client is not set up. Close the store afterwards."""
        if self._store is None:
            return fail("drain", ClosedError("the store client is not set up"))
        bound = self._drain_timeout if timeout_s is None else timeout_s
        try:
            report = self._call(self._s.drain, bound)
        except MooncakeError as e:
            return fail("drain", e)
        return 0 if report.settled else int(ErrorCode.RPC_TIMEOUT)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """The published shortcut: ``setup("localhost:12345", "127.0.0.1:2379",
        mount_segment_size, 1 GiB, protocol, device_name)`` (an etcd metadata service on
        127.0.0.1:2379 and the master at its default address)."""
        if self._store is not None:
            log.error("init_all: the client is already set up")
            return int(ErrorCode.INVALID_PARAMS)
        return self.setup(
            "localhost:12345",
            "127.0.0.1:2379",
            mount_segment_size,
            1 << 30,
            protocol,
            device_name,
            "127.0.0.1:50051",
        )

    def close(self) -> int:
        """Unmount this client's segments and stop; 0 (idempotent). A store sharing an
        engine's loop leaves the loop (and the engine) running."""
        http, self._http = self._http, None
        if http is not None:
            http.close()
        dummy, self._dummy = self._dummy, None
        if dummy is not None:
            dummy.close()
            for name in [k for k in vars(self) if not k.startswith("_")]:
                del self.__dict__[name]  # the forwarding methods setup_dummy bound
        loop, self._loop = self._loop, None
        _drain.disarm(self)
        forget_at_exit(self._exit_token)
        self._exit_token = None
        if loop is None:
            return 0
        fast, self._fast = self._fast, None
        if fast is not None:
            fast.close()
        store, self._store = self._store, None
        if self._owns_loop:
            loop.close()  # exits open_store on the loop (unmount), then stops the loop
        elif store is not None:
            loop.leave(store)
        return 0

    def __del__(self) -> None:
        loop, store = getattr(self, "_loop", None), getattr(self, "_store", None)
        if loop is None:
            return
        if getattr(self, "_owns_loop", True):
            close_in_background(loop.close)
        elif store is not None:
            close_in_background(lambda: loop.leave(store))

    # -- plumbing -------------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop, store = self._loop, self._store
        if loop is None or store is None:
            raise ClosedError("the store is not set up (or closed)")
        return loop.call(fn, *args)

    def _rc(self, fn: Callable[..., Any], *args: Any) -> int:
        """0, or the code of what ``fn(*args)`` raised (logged by :func:`fail`)."""
        try:
            self._call(fn, *args)
        except Exception as e:
            return fail(_name(fn), e)
        return 0

    def _int(self, fn: Callable[..., Any], *args: Any) -> int:
        """The int ``fn(*args)`` returns, or the code of what it raised (logged)."""
        try:
            return int(self._call(fn, *args))
        except Exception as e:
            return fail(_name(fn), e)

    @property
    def _s(self) -> Store:
        if self._store is None:
            raise ClosedError("the store is not set up (or closed)")
        return self._store

    @staticmethod
    def _codes(results: Sequence[Any], op: str = "") -> list[int]:
        """Per-key results (None ok, an int, or an exception) as published int codes; with
        ``op``, the first failure of each distinct message is logged (:func:`fail`)."""
        seen: set[str] = set()
        out = []
        for r in results:
            if isinstance(r, BaseException):
                msg = str(r)
                if op and msg not in seen:
                    seen.add(msg)
                    out.append(fail(op, r))
                else:
                    out.append(to_code(r))
            else:
                out.append(int(r) if isinstance(r, int) else 0)
        return out

    def _batch_codes(self, n: int, fn: Callable[..., Any], *args: Any) -> list[int]:
        """``fn(*args)``'s per-key results as codes, sized ``n`` (``len(keys)``) as published."""
        try:
            res = self._codes(self._call(fn, *args), _name(fn))
        except Exception as e:
            return [fail(_name(fn), e)] * n
        if len(res) != n:
            code = int(ErrorCode.INVALID_PARAMS)
            return [code] * n
        return res

    # -- info -----------------------------------------------------------------------------

    def get_hostname(self) -> str:
        """This client's segment name (``host:port``), what ``preferred_segment`` takes."""
        return self._store.segment_name if self._store is not None else ""

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable."""
        if self._dummy is not None:
            return int(self._dummy.health_check())
        if self._store is None or self._loop is None:
            return 1
        try:
            return int(self._call(self._s.health))
        except Exception:
            return 2

    @property
    def metrics_registry(self) -> Any:
        """The ``prometheus_client`` registry of this client and its engine (None before
        setup; not in the published API, see docs/metrics.md)."""
        return None if self._store is None else self._store.metrics_registry

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve :attr:`metrics_registry` over HTTP until the store closes; returns the port
        (``MC_METRICS_PORT`` starts it at ``setup``). A negative code before setup."""
        if self._store is None:
            return int(ErrorCode.INVALID_PARAMS)
        return self._store.engine.serve_metrics(port, host)

    def get_engine(self) -> Any:
        """A :class:`mooncake.engine.TransferEngine` view of this store's engine (None before
        setup): pass it to another store's ``setup(engine=...)`` to share it, or use its
        transfer calls. Closing the view does not stop the engine."""
        from mooncake.engine import TransferEngine

        if self._store is None or self._loop is None:
            return None
        te = TransferEngine()
        te._loop, te._engine, te._owns_loop = self._loop, self._store.engine, False
        return te

    def _get_pyclient_capsule(self) -> Any:
        """A ``PyCapsule`` named ``mooncake.store.PyClient`` standing for this client (None
        before setup), as the published binding hands other extensions its C++ ``PyClient``.
        Its pointer is this Python object's address: there is no C++ client behind it, so it
        only identifies the store (``id(store)``) for code that passes it back to Python."""
        if self._store is None:
            return None
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        return new(id(self), _CAPSULE_NAME, None)
