"""The published ``mooncake.store`` API: a synchronous ``MooncakeDistributedStore``.

Same names, arguments and int return codes as the published wheel (``0`` ok, a negative
Mooncake ``ErrorCode`` on failure, byte counts where the published call returns them; ``get`` /
``get_batch`` return ``b""`` on failure). Underneath, the async client
(:func:`mooncake.open_store`) runs on an event loop in a background thread; every call makes one
crossing to it. Exceptions never escape a call that the published API gives an int code:
:func:`mooncake.errors.to_code` maps them (bad arguments -> ``INVALID_PARAMS``).

Not provided (they answer ``NOT_SUPPORTED``, -1012): the tensor APIs (no torch dependency), SSD
offload, NoF/DFS tiers, dummy clients, copy/move tasks, put/get sessions and the multi-buffer
forms.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mooncake._core import rpc
from mooncake._core.gpu import device_of
from mooncake._core.store_types import ObjectDataType, ReplicaStatus, SoftPinAction
from mooncake._store.client import Store, _check_key, _value_addr, open_store
from mooncake._store.config import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicateConfig,
    parse_size,
)
from mooncake._store.fastpath import FAST_MAX, FastPath
from mooncake._sync import LoopThread
from mooncake.errors import ErrorCode, InvalidArgumentError, MooncakeError, to_code

log = logging.getLogger("mooncake.store")

_NOT_SUPPORTED = int(ErrorCode.NOT_SUPPORTED)
_NO_FAST = object()  # _fast_rpc: the fast path is off, use the loop
_DEFAULT_SIZE = 16 << 20

# enum members at module level, as the published module has them
(
    UNKNOWN,
    KVCACHE,
    TENSOR,
    WEIGHT,
    SAMPLE,
    ACTIVATION,
    GRADIENT,
    OPTIMIZER_STATE,
    METADATA,
    GENERAL,
) = ObjectDataType
UNDEFINED, INITIALIZED, PROCESSING, COMPLETE, REMOVED, FAILED = ReplicaStatus


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: ``ptr()``, ``size()`` and the buffer protocol.

    The bytes live in this object (a ``bytearray``); ``ptr()`` stays valid while it is alive and
    not resized.
    """

    def ptr(self) -> int:
        return int(np.frombuffer(self, dtype=np.uint8).ctypes.data) if len(self) else 0

    def size(self) -> int:
        return len(self)


def _setup_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Normalise both published ``setup`` forms to ``open_store`` keyword arguments."""
    names = (
        "local_hostname",
        "metadata_server",
        "global_segment_size",
        "local_buffer_size",
        "protocol",
        "rdma_devices",
        "master_server_addr",
        "engine",
        "enable_ssd_offload",
        "ssd_offload_path",
        "tenant_id",
        "enable_client_http_server",
        "client_http_port",
    )
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        cfg = dict(args[0])
        for req in ("local_hostname", "metadata_server"):
            if req not in cfg:
                raise InvalidArgumentError(f"setup(config): missing required key {req!r}")
        known = set(names) | {"ipc_socket_path"}
        unknown = set(cfg) - known
        if unknown:
            raise InvalidArgumentError(f"setup(config): unknown keys {sorted(unknown)}")
    else:
        if len(args) > len(names):
            raise InvalidArgumentError(f"setup takes at most {len(names)} arguments")
        cfg = dict(zip(names, args, strict=False))
        for k, v in kwargs.items():
            if k not in names:
                raise InvalidArgumentError(f"setup: unexpected argument {k!r}")
            if k in cfg:
                raise InvalidArgumentError(f"setup: {k!r} given twice")
            cfg[k] = v
        for req in ("local_hostname", "metadata_server"):
            if req not in cfg:
                raise InvalidArgumentError(f"setup: missing {req!r}")
    if cfg.get("enable_ssd_offload"):
        raise InvalidArgumentError("SSD offload is not supported")
    hostname = str(cfg["local_hostname"])
    return {
        "master": str(cfg.get("master_server_addr", "127.0.0.1:50051")),
        "hostname": hostname,
        "metadata": str(cfg["metadata_server"]),
        "segment_size": parse_size(
            cfg.get("global_segment_size", _DEFAULT_SIZE), "global_segment_size"
        ),
        "local_buffer_size": parse_size(
            cfg.get("local_buffer_size", _DEFAULT_SIZE), "local_buffer_size"
        ),
        "protocol": str(cfg.get("protocol", "tcp") or "tcp"),
    }


class MooncakeDistributedStore:
    """The published sync store client. Call :meth:`setup` first, :meth:`close` at the end."""

    def __init__(self) -> None:
        self._loop: LoopThread | None = None
        self._store: Store | None = None
        self._fast: FastPath | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, ...)`` or ``setup(config_dict)``; 0 or a code."""
        if self._store is not None:
            log.warning("setup called twice on one MooncakeDistributedStore")
            return int(ErrorCode.INVALID_PARAMS)
        try:
            opts = _setup_args(args, kwargs)
        except MooncakeError as e:
            log.error("setup: %s", e)
            return to_code(e)
        loop = LoopThread(name="mooncake-store")
        try:
            self._store = loop.enter(open_store(**opts))
        except BaseException as e:
            log.error("setup failed: %s", e)
            loop.close()
            return to_code(e)
        self._loop = loop
        if os.environ.get("MC_STORE_SYNC_FASTPATH", "1") not in ("0", "false", "False"):
            self._fast = FastPath(self._store, loop)
        return 0

    def close(self) -> int:
        """Unmount this client's segment and stop; 0 (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return 0
        fast, self._fast = self._fast, None
        if fast is not None:
            fast.close()

        try:
            loop.close()  # exits open_store on the loop (unmount), then stops the loop
        finally:
            self._store = None
        return 0

    def __del__(self) -> None:
        if getattr(self, "_loop", None) is not None:
            try:
                self.close()
            except Exception:
                pass

    # -- plumbing -------------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop, store = self._loop, self._store
        if loop is None or store is None:
            from mooncake.errors import ClosedError

            raise ClosedError("the store is not set up (or closed)")
        return loop.call(fn, *args)

    def _rc(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            self._call(fn, *args)
        except Exception as e:
            return to_code(e)
        return 0

    @property
    def _s(self) -> Store:
        if self._store is None:
            from mooncake.errors import ClosedError

            raise ClosedError("the store is not set up (or closed)")
        return self._store

    @staticmethod
    def _codes(results: Sequence[Any]) -> list[int]:
        return [
            to_code(r) if isinstance(r, BaseException) else (r if isinstance(r, int) else 0)
            for r in results
        ]

    # -- info -----------------------------------------------------------------------------

    def get_hostname(self) -> str:
        """This client's segment name (``host:port``), what ``preferred_segment`` takes."""
        return self._store.segment_name if self._store is not None else ""

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable."""
        if self._store is None or self._loop is None:
            return 1
        try:
            return int(self._call(self._s.health))
        except Exception:
            return 2

    # -- bytes API ------------------------------------------------------------------------

    def _fast_put(self, key: str, value: Any, config: Any, upsert: bool) -> int | None:
        """The caller-thread put for small values (None: take the loop path)."""
        fp, store = self._fast, self._store
        if fp is None or store is None or store._closed:
            return None
        try:
            addr, n, keep = _value_addr(value)
        except MooncakeError as e:
            return to_code(e)
        if not 0 < n <= FAST_MAX or n > store._staging.capacity:
            return None  # empty or too large: the loop path gives the published answer
        try:
            fp.put(_check_key(key), addr, n, config, upsert)
        except Exception as e:
            return to_code(e)
        finally:
            del keep
        return 0

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        rc = self._fast_put(key, value, config, False)
        if rc is not None:
            return rc
        try:
            return self._rc(self._s.put, key, value, config)
        except Exception as e:
            return to_code(e)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        rc = self._fast_put(key, value, config, True)
        if rc is not None:
            return rc
        try:
            return self._rc(self._s.upsert, key, value, config)
        except Exception as e:
            return to_code(e)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        try:
            value = b"".join(bytes(memoryview(p)) for p in parts)
        except TypeError as e:
            return to_code(InvalidArgumentError(str(e)))
        return self.put(key, value, config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        try:
            value = b"".join(bytes(memoryview(p)) for p in parts)
        except TypeError as e:
            return to_code(InvalidArgumentError(str(e)))
        return self.upsert(key, value, config)

    def _batch_rc(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            res = self._call(fn, *args)
        except Exception as e:
            return to_code(e)
        for r in res:
            if r is not None:
                return to_code(r)
        return 0

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        try:
            return self._batch_rc(self._s.put_batch, keys, values, config)
        except Exception as e:
            return to_code(e)

    def upsert_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        try:
            return self._batch_rc(self._s.upsert_batch, keys, values, config)
        except Exception as e:
            return to_code(e)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` if it is missing or the read failed."""
        fp, store = self._fast, self._store
        if fp is not None and store is not None and not store._closed:
            try:
                return fp.get(_check_key(key))
            except Exception as e:
                log.debug("get(%r): %s", key, e)
                return b""
        try:
            data: bytes = self._call(self._s.get, key)
            return data
        except Exception as e:
            log.debug("get(%r): %s", key, e)
            return b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        try:
            res = self._call(self._s.get_batch, keys)
        except Exception:
            return [b""] * len(keys)
        return [r if isinstance(r, bytes) else b"" for r in res]

    def get_buffer(self, key: str) -> BufferHandle | None:
        data = self.get(key)
        return BufferHandle(data) if data else None

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [BufferHandle(d) if d else None for d in self.get_batch(keys)]

    def _fast_rpc(self, method: str, params: Any) -> Any:
        """One master RPC on the caller's thread when the fast path is on (else None)."""
        fp, store = self._fast, self._store
        if fp is None or store is None or store._closed:
            return _NO_FAST
        return fp.call(method, params)

    def get_size(self, key: str) -> int:
        try:
            resp = self._fast_rpc(
                "GetReplicaList", rpc.KeyParams(key=_check_key(key), for_read=False)
            )
            if resp is not _NO_FAST:
                return int(Store._size_of(resp))
            return int(self._call(self._s.get_size, key))
        except Exception as e:
            return to_code(e)

    def is_exist(self, key: str) -> int:
        """1 exists, 0 does not, negative on error."""
        try:
            found = self._fast_rpc("ExistKey", rpc.KeyParams(key=_check_key(key)))
            if found is not _NO_FAST:
                return 1 if found else 0
            return 1 if self._call(self._s.exists, key) else 0
        except Exception as e:
            return to_code(e)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        try:
            return list(self._call(self._s.batch_exists, keys))
        except Exception as e:
            return [to_code(e)] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        try:
            done = self._fast_rpc(
                "Remove", rpc.RemoveParams(key=_check_key(key), force=bool(force))
            )
            if done is not _NO_FAST:
                return 0
            return self._rc(_kw(self._s.remove, force=force), key)
        except Exception as e:
            return to_code(e)

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        try:
            return list(self._call(_kw(self._s.batch_remove, force=force), keys))
        except Exception as e:
            return [to_code(e)] * len(keys)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        try:
            return int(self._call(_kw(self._s.remove_by_regex, force=force), regex_pattern))
        except Exception as e:
            return to_code(e)

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        try:
            return int(self._call(_kw(self._s.remove_all, force=force)))
        except Exception as e:
            return to_code(e)

    # -- zero-copy API --------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            return self._rc(self._s.register_buffer, buffer_ptr, size)
        except Exception as e:
            return to_code(e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            return self._rc(self._s.unregister_buffer, buffer_ptr)
        except Exception as e:
            return to_code(e)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        fp, store = self._fast, self._store
        fast_ok = isinstance(size, int) and 0 < size <= FAST_MAX
        if fp is not None and store is not None and not store._closed and fast_ok:
            try:
                region = store._require_local(buffer_ptr, size, "put_from")
                if device_of(region.location) is None:  # GPU buffers go through the loop
                    fp.put(_check_key(key), buffer_ptr, size, config, False)
                    return 0
            except Exception as e:
                return to_code(e)
        try:
            return self._rc(self._s.put_from, key, buffer_ptr, size, config)
        except Exception as e:
            return to_code(e)

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        try:
            return self._rc(self._s.upsert_from, key, buffer_ptr, size, config)
        except Exception as e:
            return to_code(e)

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        try:
            return self._codes(self._call(self._s.batch_put_from, keys, buffer_ptrs, sizes, config))
        except Exception as e:
            return [to_code(e)] * max(len(keys), len(buffer_ptrs), len(sizes))

    def batch_upsert_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        try:
            return self._codes(
                self._call(self._s.batch_upsert_from, keys, buffer_ptrs, sizes, config)
            )
        except Exception as e:
            return [to_code(e)] * max(len(keys), len(buffer_ptrs), len(sizes))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into ``[buffer_ptr, +size)`` (negative code on failure)."""
        fp, store = self._fast, self._store
        if fp is not None and store is not None and not store._closed:
            try:
                region = store._require_local(buffer_ptr, size, "get_into")
                if device_of(region.location) is None:  # GPU buffers go through the loop
                    return fp.get_into(_check_key(key), buffer_ptr, size)
            except Exception as e:
                return to_code(e)
        try:
            return int(self._call(self._s.get_into, key, buffer_ptr, size))
        except Exception as e:
            return to_code(e)

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        try:
            return self._codes(self._call(self._s.batch_get_into, keys, buffer_ptrs, sizes))
        except Exception as e:
            return [to_code(e)] * max(len(keys), len(buffer_ptrs), len(sizes))

    # -- introspection --------------------------------------------------------------------

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        try:
            reps = self._call(self._s.replica_descriptors, key)
        except Exception:
            return []
        return [ReplicaDescriptor(r) for r in reps]

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        try:
            got = self._call(self._s.batch_replica_descriptors, keys)
        except Exception:
            return {}
        return {k: [ReplicaDescriptor(r) for r in v] for k, v in got.items()}

    # -- published but not provided here -------------------------------------------------

    def _unsupported(self, what: str) -> int:
        log.warning("%s is not supported by this implementation", what)
        return _NOT_SUPPORTED

    def put_from_with_metadata(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("put_from_with_metadata")

    def setup_dummy(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("setup_dummy")

    def init_all(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("init_all")

    def unmount_segment(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("unmount_segment")

    def unmount_and_free_segment(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("unmount_and_free_segment")

    def unmount_local_disk_segment(self, *args: Any, **kwargs: Any) -> int:
        return self._unsupported("unmount_local_disk_segment")

    def get_offload_rpc_read_count(self) -> int:
        return 0

    def batch_put_from_multi_buffers(self, keys: list[str], *args: Any, **kwargs: Any) -> list[int]:
        return [self._unsupported("batch_put_from_multi_buffers")] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any, **kwargs: Any) -> list[int]:
        return [self._unsupported("batch_get_into_multi_buffers")] * len(keys)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if (
            "tensor" in name
            or "session" in name
            or name
            in (
                "get_into_ranges",
                "create_copy_task",
                "create_move_task",
                "query_task",
                "mount_segment",
                "allocate_and_mount_segment",
                "alloc_from_mem_pool",
                "batch_replica_clear",
                "batch_get_into_multi_buffer_ranges",
                "batch_put_from_multi_buffer_ranges",
            )
        ):

            def unsupported(*args: Any, **kwargs: Any) -> int:
                return self._unsupported(name)

            return unsupported
        raise AttributeError(f"'MooncakeDistributedStore' object has no attribute {name!r}")


def _kw(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    async def call(*args: Any) -> Any:
        return await fn(*args, **kwargs)

    return call


__all__ = [
    "ACTIVATION",
    "COMPLETE",
    "FAILED",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "KVCACHE",
    "METADATA",
    "OPTIMIZER_STATE",
    "PROCESSING",
    "REMOVED",
    "SAMPLE",
    "TENSOR",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
]
