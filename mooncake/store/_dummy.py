"""The dummy client: ``setup_dummy(mem_pool_size, local_buffer_size, server_address)``.

A dummy client owns no segment, engine or master connection: a ``mooncake_client`` process on
the same host (:mod:`mooncake.store._standalone`) does, and executes the dummy's calls. The
dummy creates a shared ``mem_pool_size``-byte pool (memfd) that the standalone client maps and
registers; ``alloc_from_mem_pool(size)`` hands out addresses in it, and the zero-copy calls take
those (or memory of :class:`~mooncake.store.MooncakeHostMemAllocator`, which
``register_buffer`` shares with the standalone client). Other memory cannot be shared:
``register_buffer`` answers -1 for it, as published. Bytes calls are staged through a shared
``local_buffer_size``-byte buffer; larger values are refused with ``INVALID_PARAMS``, as the
published dummy refuses them. ``alloc_from_mem_pool`` past the pool's capacity returns a fresh
shared allocation; ``get_hostname()`` is ``""`` (a dummy owns no segment), as published.

Once set up, the published methods of the instance forward to the standalone client (bound on
the instance, so the class and a real client are untouched); :meth:`close` detaches.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import socket
import threading
from typing import Any

from mooncake._core.staging import RangeAllocator
from mooncake.errors import ErrorCode, MooncakeError, to_code
from mooncake.store import _standalone as wire
from mooncake.store._base import StoreBase
from mooncake.store._bytes import BufferHandle
from mooncake.store._types import MooncakeHostMemAllocator, shared_memory_of

log = logging.getLogger("mooncake.store")

_RAISE = {"TypeError": TypeError, "ValueError": ValueError, "AttributeError": AttributeError}
_TUPLE_RESULTS = {"create_copy_task", "create_move_task", "query_task"}
_STAGED = (
    "put",
    "upsert",
    "put_parts",
    "upsert_parts",
    "put_batch",
    "upsert_batch",
    "get",
    "get_batch",
    "get_buffer",
    "batch_get_buffer",
)


class _Connection:
    """One dummy's connection to its standalone client, with its shared pool."""

    def __init__(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> None:
        self.local_buffer_size = local_buffer_size
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lock = threading.Lock()
        self.maps: dict[int, int] = {}  # shared base -> size, known to the standalone client
        self.extents: dict[int, int] = {}  # register_buffer(ptr, size) of this dummy
        self.pool: mmap.mmap | None = None
        self.pool_base = 0
        self.staging: mmap.mmap | None = None
        self.staging_base = 0
        self.stage_lock = threading.Lock()
        self.alloc_ranges = RangeAllocator(0)
        self.overflow = MooncakeHostMemAllocator()
        try:
            self.sock.connect(wire.socket_name(server_address))
            (self.hostname,) = self.request(["hello", local_buffer_size])
            if mem_pool_size:
                self.pool, self.pool_base = self._share(mem_pool_size, "mooncake-dummy-pool")
                self.alloc_ranges = RangeAllocator(mem_pool_size, align=64)
            if local_buffer_size:
                self.staging, self.staging_base = self._share(
                    local_buffer_size, "mooncake-dummy-local-buffer"
                )
        except BaseException:
            self.close()
            raise

    def _share(self, size: int, name: str) -> tuple[mmap.mmap, int]:
        """``size`` bytes of memfd memory, mapped here and by the standalone client."""
        fd = wire.shared_fd(size, name)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
            view = ctypes.c_char.from_buffer(mm)
            base = ctypes.addressof(view)
            del view
            (rc,) = self.request(["map", base, size], [fd])
        finally:
            os.close(fd)
        if rc != 0:
            mm.close()
            raise OSError(f"the standalone client could not map {name} ({rc})")
        self.maps[base] = size
        return mm, base

    # -- bytes calls: staged through the shared local buffer ------------------------------

    def put_value(self, method: str, key: str, value: Any, config: Any) -> int:
        """``put``/``upsert`` of a Python buffer: copied into the local buffer, then stored
        by the standalone client with ``put_from``/``upsert_from``."""
        try:
            mv = memoryview(value).cast("B")
        except TypeError:
            raise TypeError(f"value must support the buffer protocol, got {type(value).__name__}")
        n = mv.nbytes
        if n == 0 or n > self.local_buffer_size or self.staging is None:
            return int(ErrorCode.INVALID_PARAMS)
        with self.stage_lock:
            ctypes.memmove(self.staging_base, bytes(mv), n)
            rc = self.call(f"{method}_from", key, self.staging_base, n, config)
        return int(rc)

    def get_value(self, key: str) -> bytes:
        """``get`` through the local buffer (``b""`` when missing, failed or too large)."""
        if self.staging is None:
            return b""
        with self.stage_lock:
            n = self.call("get_into", key, self.staging_base, self.local_buffer_size)
            if not isinstance(n, int) or n <= 0:
                return b""
            return ctypes.string_at(self.staging_base, n)

    def request(self, msg: list[Any], fds: list[int] | None = None) -> list[Any]:
        with self.lock:
            wire.send_frame(self.sock, msg, fds)
            reply, extra = wire.recv_frame(self.sock)
        for fd in extra:
            os.close(fd)
        if not isinstance(reply, list) or not reply:
            raise OSError("malformed reply from the standalone client")
        if reply[0] == "raise":
            raise _RAISE.get(str(reply[1]), RuntimeError)(str(reply[2]))
        return list(reply[1:])

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        msg = [
            "call",
            method,
            [wire.encode_arg(a) for a in args],
            {k: wire.encode_arg(v) for k, v in kwargs.items()},
        ]
        (result,) = self.request(msg)
        out = wire.decode_result(result)
        if method in _TUPLE_RESULTS and isinstance(out, list):
            out = tuple(tuple(x) if isinstance(x, list) else x for x in out)
        return out

    def alloc(self, size: int) -> int:
        """An address of ``size`` bytes in the pool; past what the pool holds, a fresh shared
        allocation (as the published dummy does), shared on ``register_buffer``."""
        if size <= 0:
            return 0
        off = self.alloc_ranges.alloc(size) if self.pool is not None else None
        if off is not None:
            return self.pool_base + off
        return self.overflow.alloc(size)

    def register(self, ptr: int, size: int) -> int:
        for base, n in self.maps.items():
            if base <= ptr and ptr + size <= base + n:
                self.extents[ptr] = size
                return 0
        found = shared_memory_of(ptr, size)
        if found is None:
            log.error(
                "register_buffer(%#x): a dummy client registers only shared memory "
                "(alloc_from_mem_pool or MooncakeHostMemAllocator)",
                ptr,
            )
            return -1  # as the published dummy answers
        fd, base, n = found
        (rc,) = self.request(["map", base, n], [fd])
        if rc == 0:
            self.maps[base] = n
            self.extents[ptr] = size
        return int(rc)

    def capacity(self, ptr: int) -> int:
        """Bytes a call may write from ``ptr``: to the end of the registered buffer holding it
        (the innermost one), else to the end of the shared mapping holding it, else 0."""
        best = 0
        for base, n in self.extents.items():
            if base <= ptr < base + n and (best == 0 or base + n - ptr < best):
                best = base + n - ptr
        if best:
            return best
        for base, n in self.maps.items():
            if base <= ptr < base + n:
                return base + n - ptr
        return 0

    def unregister(self, ptr: int) -> int:
        self.extents.pop(ptr, None)
        if ptr in self.maps and ptr != self.pool_base:
            del self.maps[ptr]
            (rc,) = self.request(["unmap", ptr])
            return int(rc)
        return 0

    def health_check(self) -> int:
        try:
            return int(self.call("health_check"))
        except (OSError, EOFError):
            return 2

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            for mm in (self.pool, self.staging):
                if mm is None:
                    continue
                try:
                    mm.close()
                except BufferError:
                    log.warning("the dummy client's shared memory is still in use; it stays mapped")
            self.pool = self.staging = None


class DummyMethods(StoreBase):
    """``setup_dummy``: this client becomes a dummy of a ``mooncake_client`` process."""

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attach to the standalone client serving ``server_address`` (its ``--port``); 0 or
        a negative code."""
        if self._store is not None or self._dummy is not None:
            log.error("setup_dummy: the client is already set up")
            return int(ErrorCode.INVALID_PARAMS)
        for name, v in (("mem_pool_size", mem_pool_size), ("local_buffer_size", local_buffer_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"{name} must be a non-negative int, got {v!r}")
        try:
            conn = _Connection(mem_pool_size, local_buffer_size, str(server_address))
        except (OSError, EOFError, MooncakeError) as e:
            log.error("setup_dummy: cannot attach to %s: %s", server_address, e)
            return to_code(e) if isinstance(e, MooncakeError) else int(ErrorCode.RPC_FAIL)
        self._dummy = conn
        for name in wire.FORWARDED:
            setattr(self, name, functools.partial(self._forward, name))
        # the bytes calls: staged through the shared local buffer, as the published dummy does
        for name in _STAGED:
            setattr(self, name, getattr(self, f"_dummy_{name}"))
        self.get_into_ranges = self._dummy_get_into_ranges  # type: ignore[method-assign]
        self.register_buffer = conn.register  # type: ignore[method-assign]
        self.unregister_buffer = conn.unregister  # type: ignore[method-assign]
        self.get_hostname = lambda: ""  # type: ignore[method-assign]  # published: a dummy has no segment
        return 0

    def _forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        conn = self._dummy
        if conn is None:
            return int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
        try:
            return conn.call(name, *args, **kwargs)
        except (OSError, EOFError) as e:
            log.error("%s: the standalone client is unreachable: %s", name, e)
            return int(ErrorCode.RPC_FAIL)

    def _dummy_get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """``get_into_ranges`` of a dummy: a range that does not fit in the registered buffer
        holding its buffer address is refused here (``INVALID_PARAMS`` for that range, never
        forwarded), since the standalone client sees only the shared mapping around it; the
        other ranges are forwarded and their results put back in place."""
        bad = int(ErrorCode.INVALID_PARAMS)
        conn = self._dummy
        lists = (buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        if conn is None or not all(isinstance(x, list) for x in lists):
            return [[[bad] * len(d) for d in dsts] for dsts in (all_dst_offsets or [])]
        if not (
            len(buffer_ptrs)
            == len(all_keys)
            == len(all_dst_offsets)
            == len(all_src_offsets)
            == len(all_sizes)
        ):
            mismatched: list[list[list[int]]] = self._forward(
                "get_into_ranges",
                buffer_ptrs,
                all_keys,
                all_dst_offsets,
                all_src_offsets,
                all_sizes,
            )  # the standalone client shapes the refusal as published
            return mismatched
        keep: list[list[list[int]]] = []  # per buffer, key: indices of the ranges forwarded
        dst_f: list[list[list[int]]] = []
        src_f: list[list[list[int]]] = []
        len_f: list[list[list[int]]] = []
        for i, ptr in enumerate(buffer_ptrs):
            cap = conn.capacity(ptr) if isinstance(ptr, int) and ptr > 0 else 0
            keep.append([])
            dst_f.append([])
            src_f.append([])
            len_f.append([])
            for j in range(len(all_keys[i])):
                dst = all_dst_offsets[i][j] if j < len(all_dst_offsets[i]) else []
                src = all_src_offsets[i][j] if j < len(all_src_offsets[i]) else []
                sz = all_sizes[i][j] if j < len(all_sizes[i]) else []
                if not (len(dst) == len(src) == len(sz)):  # refused as a mismatch there
                    keep[i].append(list(range(len(dst))))
                    dst_f[i].append(list(dst))
                    src_f[i].append(list(src))
                    len_f[i].append(list(sz))
                    continue
                idx = [
                    k
                    for k, (d, n) in enumerate(zip(dst, sz, strict=True))
                    if isinstance(d, int) and isinstance(n, int) and d >= 0 and n >= 0
                    and d + n <= cap
                ]  # fmt: skip
                keep[i].append(idx)
                dst_f[i].append([dst[k] for k in idx])
                src_f[i].append([src[k] for k in idx])
                len_f[i].append([sz[k] for k in idx])
        got: Any = self._forward("get_into_ranges", buffer_ptrs, all_keys, dst_f, src_f, len_f)
        out: list[list[list[int]]] = []
        for i in range(len(buffer_ptrs)):
            row: list[list[int]] = []
            for j in range(len(all_keys[i])):
                # one result per range; one where the lists do not say how many (as published)
                res = [bad] * (len(all_dst_offsets[i][j]) if j < len(all_dst_offsets[i]) else 1)
                if isinstance(got, int):  # the whole call failed
                    res = [got] * len(res)
                else:
                    sent = got[i][j]
                    for pos, k in enumerate(keep[i][j]):
                        res[k] = int(sent[pos])
                row.append(res)
            out.append(row)
        return out

    # -- the bytes calls of a dummy (bound by setup_dummy) ---------------------------------

    def _conn(self) -> _Connection:
        conn: _Connection | None = self._dummy
        if conn is None:
            raise OSError("the dummy client is closed")
        return conn

    def _dummy_put(self, key: str, value: Any, config: Any = None) -> int:
        try:
            return self._conn().put_value("put", key, value, config)
        except (OSError, EOFError):
            return int(ErrorCode.RPC_FAIL)

    def _dummy_upsert(self, key: str, value: Any, config: Any = None) -> int:
        try:
            return self._conn().put_value("upsert", key, value, config)
        except (OSError, EOFError):
            return int(ErrorCode.RPC_FAIL)

    def _dummy_put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        return self._dummy_put(key, b"".join(bytes(memoryview(p)) for p in parts), config)

    def _dummy_upsert_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        return self._dummy_upsert(key, b"".join(bytes(memoryview(p)) for p in parts), config)

    def _dummy_put_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        if len(keys) != len(values):
            return int(ErrorCode.INVALID_PARAMS)
        for k, v in zip(keys, values, strict=True):
            rc = self._dummy_put(k, v, config)
            if rc != 0:
                return rc
        return 0

    def _dummy_upsert_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        if len(keys) != len(values):
            return int(ErrorCode.INVALID_PARAMS)
        for k, v in zip(keys, values, strict=True):
            rc = self._dummy_upsert(k, v, config)
            if rc != 0:
                return rc
        return 0

    def _dummy_get(self, key: str) -> bytes:
        try:
            return self._conn().get_value(key)
        except (OSError, EOFError):
            return b""

    def _dummy_get_batch(self, keys: list[str]) -> list[bytes]:
        return [self._dummy_get(k) for k in keys]

    def _dummy_get_buffer(self, key: str) -> BufferHandle | None:
        data = self._dummy_get(key)
        return BufferHandle(data) if data else None

    def _dummy_batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [self._dummy_get_buffer(k) for k in keys]
