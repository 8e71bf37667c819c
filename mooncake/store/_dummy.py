"""The dummy client: ``setup_dummy(mem_pool_size, local_buffer_size, server_address)``.

A dummy client owns no segment, engine or master connection: a ``mooncake_client`` process on
the same host (:mod:`mooncake._store.standalone`) does, and executes the dummy's calls. The
dummy creates a shared ``mem_pool_size``-byte pool (memfd) that the standalone client maps and
registers; ``alloc_from_mem_pool(size)`` hands out addresses in it, and the zero-copy calls take
those (or memory of :class:`~mooncake.store.MooncakeHostMemAllocator`, which
``register_buffer`` shares with the standalone client). Other memory cannot be shared:
``register_buffer`` answers ``INVALID_PARAMS`` for it. Bytes calls carry their values in the
request; values larger than ``local_buffer_size`` are refused with ``INVALID_PARAMS``, as the
published dummy's staging buffer refuses them.

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
from mooncake._store import standalone as wire
from mooncake.errors import ErrorCode, MooncakeError, to_code
from mooncake.store._base import StoreBase
from mooncake.store._types import shared_memory_of

log = logging.getLogger("mooncake.store")

_RAISE = {"TypeError": TypeError, "ValueError": ValueError, "AttributeError": AttributeError}
_BYTES_PUTS = {"put": 1, "upsert": 1}
_TUPLE_RESULTS = {"create_copy_task", "create_move_task", "query_task"}


class _Connection:
    """One dummy's connection to its standalone client, with its shared pool."""

    def __init__(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> None:
        self.local_buffer_size = local_buffer_size
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lock = threading.Lock()
        self.maps: dict[int, int] = {}  # shared base -> size, known to the standalone client
        self.pool: mmap.mmap | None = None
        self.pool_base = 0
        self.alloc_ranges = RangeAllocator(0)
        try:
            self.sock.connect(wire.socket_name(server_address))
            (self.hostname,) = self.request(["hello", local_buffer_size])
            if mem_pool_size:
                fd = os.memfd_create("mooncake-dummy-pool", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, mem_pool_size)
                    self.pool = mmap.mmap(fd, mem_pool_size, mmap.MAP_SHARED)
                    view = ctypes.c_char.from_buffer(self.pool)
                    self.pool_base = ctypes.addressof(view)
                    del view
                    (rc,) = self.request(["map", self.pool_base, mem_pool_size], [fd])
                finally:
                    os.close(fd)
                if rc != 0:
                    raise OSError(f"the standalone client could not map the pool ({rc})")
                self.maps[self.pool_base] = mem_pool_size
                self.alloc_ranges = RangeAllocator(mem_pool_size, align=64)
        except BaseException:
            self.close()
            raise

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
        limit = _BYTES_PUTS.get(method)
        if limit is not None and len(args) > limit:
            n = memoryview(args[limit]).nbytes if not isinstance(args[limit], int) else 0
            if n > self.local_buffer_size:
                return int(ErrorCode.INVALID_PARAMS)
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
        if self.pool is None or size <= 0:
            return 0
        off = self.alloc_ranges.alloc(size)
        return 0 if off is None else self.pool_base + off

    def register(self, ptr: int, size: int) -> int:
        for base, n in self.maps.items():
            if base <= ptr and ptr + size <= base + n:
                return 0
        found = shared_memory_of(ptr, size)
        if found is None:
            log.error(
                "register_buffer(%#x): a dummy client registers only shared memory "
                "(alloc_from_mem_pool or MooncakeHostMemAllocator)",
                ptr,
            )
            return int(ErrorCode.INVALID_PARAMS)
        fd, base, n = found
        (rc,) = self.request(["map", base, n], [fd])
        if rc == 0:
            self.maps[base] = n
        return int(rc)

    def unregister(self, ptr: int) -> int:
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
            if self.pool is not None:
                try:
                    self.pool.close()
                except BufferError:
                    log.warning("the dummy client's pool is still in use; it stays mapped")
                self.pool = None


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
        self.register_buffer = conn.register  # type: ignore[method-assign]
        self.unregister_buffer = conn.unregister  # type: ignore[method-assign]
        self.get_hostname = lambda: str(conn.hostname)  # type: ignore[method-assign]
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
