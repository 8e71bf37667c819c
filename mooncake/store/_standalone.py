"""The standalone ("real") client and the wire its dummy clients speak.

A ``mooncake_client`` process owns a segment, a transfer engine and the master connection (a
set-up :class:`~mooncake.store.MooncakeDistributedStore`). Processes on the same host attach
to it with ``setup_dummy(mem_pool_size, local_buffer_size, server_address)``: they own no
segment and no engine, and every store call they make is executed by the standalone client.

Transport: a Unix stream socket in the abstract namespace, ``@mooncake_client_<port>.sock``
(``<port>`` from ``server_address``, as the published client names it), so only processes of
this host (and network namespace) reach it; connections from another uid are refused.
Memory a dummy shares must be a memfd holding the size it claims and sealed against
shrinking (``F_SEAL_SHRINK``), so a dummy cannot make the standalone client fault. Frames are a 4-byte big-endian length and a
msgpack array; memory is shared by passing ``memfd`` descriptors (``SCM_RIGHTS``):

* ``["hello", local_buffer_size]`` -> ``["ok", hostname]``
* ``["map", dummy_base, size]`` + one fd -> ``["ok", 0]``: the standalone client maps the
  dummy's shared memory (its ``mem_pool_size`` pool, or ``MooncakeHostMemAllocator`` memory),
  registers it with its engine, and from then on translates the dummy's addresses inside it;
  ``["unmap", dummy_base]`` undoes that.
* ``["call", method, args, kwargs]`` -> ``["ok", result]`` or ``["raise", type, message]``:
  one published method of :data:`FORWARDED`, with the dummy's buffer addresses (positions in
  :data:`POINTER_ARGS`) translated; an address outside every mapping becomes 0 (the call then
  answers ``INVALID_PARAMS``).

``ReplicateConfig`` arguments travel as ``{"__rc__": {field: value}}``; replica descriptors
and task responses as tagged lists (:func:`encode_result`). A frame larger than
:data:`MAX_FRAME`, an unknown request or undecodable bytes drop that connection only; the
mappings of a dummy are released when its connection ends (it exited or crashed).
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from mooncake._core import store_types as st
from mooncake._core.store_types import ObjectDataType, SoftPinAction
from mooncake._engine import _unix
from mooncake._store.config import ReplicaDescriptor, ReplicateConfig
from mooncake.errors import InvalidArgumentError
from mooncake.store._bytes import BufferHandle
from mooncake.store._types import QueryTaskResponse, TaskStatus

log = logging.getLogger("mooncake.store.standalone")

MAX_FRAME = 1 << 30
MAX_DUMMIES = 256
_HDR = struct.Struct(">I")

#: published methods a dummy client forwards to its standalone client
FORWARDED = frozenset(
    {
        "put",
        "put_parts",
        "put_batch",
        "upsert",
        "upsert_parts",
        "upsert_batch",
        "get",
        "get_batch",
        "get_buffer",
        "batch_get_buffer",
        "get_size",
        "is_exist",
        "batch_is_exist",
        "remove",
        "batch_remove",
        "remove_by_regex",
        "remove_all",
        "put_from",
        "upsert_from",
        "put_from_with_metadata",
        "batch_put_from",
        "batch_upsert_from",
        "get_into",
        "batch_get_into",
        "batch_put_from_multi_buffers",
        "batch_get_into_multi_buffers",
        "get_into_ranges",
        "batch_get_session_start",
        "batch_get_into_multi_buffer_ranges",
        "batch_get_session_end",
        "batch_put_session_start",
        "batch_put_from_multi_buffer_ranges",
        "batch_put_session_end",
        "batch_put_session_revoke",
        "get_replica_desc",
        "batch_get_replica_desc",
        "batch_replica_clear",
        "create_copy_task",
        "create_move_task",
        "query_task",
        "get_hostname",
        "health_check",
        "get_offload_rpc_read_count",
    }
)
#: argument positions holding buffer addresses: 0 one address, 1 a list, 2 a list of lists
POINTER_ARGS: dict[str, dict[int, int]] = {
    "put_from": {1: 0},
    "upsert_from": {1: 0},
    "get_into": {1: 0},
    "put_from_with_metadata": {1: 0, 2: 0},
    "batch_put_from": {1: 1},
    "batch_upsert_from": {1: 1},
    "batch_get_into": {1: 1},
    "batch_put_from_multi_buffers": {1: 2},
    "batch_get_into_multi_buffers": {1: 2},
    "get_into_ranges": {0: 1},
    "batch_get_into_multi_buffer_ranges": {1: 2},
    "batch_put_from_multi_buffer_ranges": {1: 2},
}
#: keyword names of those arguments
POINTER_KWARGS = {
    "buffer_ptr": 0,
    "metadata_buffer_ptr": 0,
    "buffer_ptrs": 1,
    "all_buffer_ptrs": 2,
}


def socket_name(server_address: str) -> str:
    """The abstract socket of the standalone client serving ``server_address``."""
    port = server_address.rsplit(":", 1)[-1]
    if not port.isdigit():
        raise InvalidArgumentError(f"server_address {server_address!r} has no port")
    return f"\0mooncake_client_{int(port)}.sock"


# -- frames -------------------------------------------------------------------------------


def send_frame(sock: socket.socket, msg: Any, fds: list[int] | None = None) -> None:
    body = msgspec.msgpack.encode(msg)
    data = _HDR.pack(len(body)) + body
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[Any, list[int]]:
    """One frame and the descriptors that came with it (raises EOFError at the end)."""
    fds: list[int] = []
    head = b""
    while len(head) < _HDR.size:
        data, anc, _, _ = sock.recvmsg(_HDR.size - len(head), socket.CMSG_SPACE(4 * 4))
        if not data:
            for fd in fds:
                _close_fd(fd)
            raise EOFError("connection closed")
        head += data
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                fds.extend(a)
    (n,) = _HDR.unpack(head)
    if n > MAX_FRAME:
        for fd in fds:
            _close_fd(fd)
        raise InvalidArgumentError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return msgspec.msgpack.decode(_recv_exact(sock, n)), fds


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def shared_fd(size: int, name: str) -> int:
    """A memfd of ``size`` bytes sealed against shrinking, as the standalone client requires
    of memory it maps (a shrunk file would fault its reads)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_shared_fd(fd: int, size: int) -> str | None:
    """Why the standalone client must not map ``size`` bytes of ``fd`` (None: it may): the
    file must hold them and be sealed against shrinking."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        return f"not a sealable memfd ({e})"
    if st.st_size < size:
        return f"the file holds {st.st_size} bytes, not {size}"
    if not seals & fcntl.F_SEAL_SHRINK:
        return "the memfd is not sealed against shrinking"
    return None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    return _unix.peer_credentials(sock)[1]


# -- values -------------------------------------------------------------------------------

_RC_FIELDS = (
    "replica_num",
    "nof_replica_num",
    "dfs_replica_num",
    "soft_pin_action",
    "soft_pin_ttl_ms",
    "with_hard_pin",
    "preferred_segments",
    "preferred_segment",
    "preferred_nof_segments",
    "prefer_alloc_in_same_node",
    "data_type",
    "group_ids",
)


def encode_arg(value: Any) -> Any:
    """A call argument for the wire (``ReplicateConfig`` as a tagged dict)."""
    if isinstance(value, ReplicateConfig):
        return {"__rc__": {f: _plain(getattr(value, f)) for f in _RC_FIELDS}}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [encode_arg(v) for v in value]
    if hasattr(value, "__buffer__") or _is_buffer(value):
        return bytes(memoryview(value))
    return value


def _is_buffer(value: Any) -> bool:
    try:
        memoryview(value)
    except TypeError:
        return False
    return not isinstance(value, (int, str, float))


def _plain(v: Any) -> Any:
    return int(v) if isinstance(v, int) else (list(v) if isinstance(v, (list, tuple)) else v)


def decode_arg(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__rc__"} and isinstance(value["__rc__"], dict):
        cfg = ReplicateConfig()
        for f, v in value["__rc__"].items():
            if f == "soft_pin_action":
                v = SoftPinAction(v)
            elif f == "data_type":
                v = ObjectDataType(v)
            if f in _RC_FIELDS:
                setattr(cfg, f, v)  # TypeError / ValueError for a bad one: answered, not fatal
        return cfg
    if isinstance(value, list):
        return [decode_arg(v) for v in value]
    return value


def encode_result(value: Any) -> Any:
    """A facade result for the wire: replica descriptors, task responses and buffer handles
    become tagged lists."""
    if isinstance(value, ReplicaDescriptor):
        if value.is_local_disk_replica():
            return ["__rld__", value.local_disk_client, value.local_disk_size]
        d = value.get_memory_descriptor().buffer_descriptor
        return ["__rd__", int(value.status), d.buffer_address, d.size, d.transport_endpoint]
    if isinstance(value, QueryTaskResponse):
        return [
            "__qt__",
            list(value.id),
            int(value.type),
            int(value.status),
            value.message,
            value.assigned_client,
        ]
    if isinstance(value, bytearray):
        return ["__bh__", bytes(value)]
    if isinstance(value, dict):
        return {k: encode_result(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_result(v) for v in value]
    return value


def decode_result(value: Any) -> Any:
    if isinstance(value, list) and value and isinstance(value[0], str):
        tag = value[0]
        if tag == "__rd__":
            _, status, addr, size, ep = value
            return ReplicaDescriptor(
                st.ReplicaDescriptor(segment_name=ep, addr=addr, length=size, status=status)
            )
        if tag == "__rld__":
            return ReplicaDescriptor.local_disk(value[1], value[2])
        if tag == "__qt__":
            q = QueryTaskResponse()
            q.id = (value[1][0], value[1][1])
            q.type, q.status = st.TaskType(value[2]), TaskStatus(value[3])
            q.message, q.assigned_client = value[4], value[5]
            return q
        if tag == "__bh__":
            return BufferHandle(value[1])
    if isinstance(value, dict):
        return {k: decode_result(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_result(v) for v in value]
    return value


# -- the server ---------------------------------------------------------------------------


class _Mapping:
    __slots__ = ("dummy_base", "mm", "real_base", "size")

    def __init__(self, dummy_base: int, size: int, mm: mmap.mmap, real_base: int) -> None:
        self.dummy_base, self.size, self.mm, self.real_base = dummy_base, size, mm, real_base


class StandaloneServer:
    """Serve dummy clients for ``store`` (a set-up ``MooncakeDistributedStore``) on the
    abstract socket for ``port``. :meth:`serve_forever` until :meth:`stop`."""

    def __init__(self, store: Any, port: int) -> None:
        self.store = store
        self.name = f"\0mooncake_client_{port}.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.name)
        self.listener.listen(64)
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        self.listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                uid = peer_uid(conn)
            except OSError:
                uid = -1
            if uid != os.getuid():
                log.warning(
                    "refusing a dummy client of uid %d (this client runs as %d)", uid, os.getuid()
                )
                conn.close()
                continue
            with self._lock:
                if len(self._conns) >= MAX_DUMMIES:
                    log.warning("refusing a dummy client: %d connected already", MAX_DUMMIES)
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.settimeout(None)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()

    def _serve(self, conn: socket.socket) -> None:
        maps: list[_Mapping] = []
        try:
            while True:
                try:
                    msg, fds = recv_frame(conn)
                except (EOFError, OSError):
                    return
                except (InvalidArgumentError, msgspec.MsgspecError) as e:
                    log.warning("dropping a dummy client: %s", e)
                    return
                try:
                    reply = self._handle(msg, fds, maps)
                except (InvalidArgumentError, ValueError, TypeError, IndexError, KeyError) as e:
                    log.warning("dropping a dummy client: bad request: %s", e)
                    return
                finally:
                    for fd in fds:
                        _close_fd(fd)
                send_frame(conn, reply)
        except (OSError, msgspec.MsgspecError) as e:
            log.warning("dummy client connection failed: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            for m in maps:
                self._unmap(m)

    def _handle(self, msg: Any, fds: list[int], maps: list[_Mapping]) -> Any:
        if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
            raise InvalidArgumentError("a request is a list starting with its kind")
        kind = msg[0]
        if kind == "hello":
            return ["ok", self.store.get_hostname()]
        if kind == "map":
            _, base, size = msg
            if len(fds) != 1 or not isinstance(base, int) or not isinstance(size, int) or size <= 0:
                return ["raise", "ValueError", "map needs one descriptor, a base and a size"]
            return self._map(fds[0], base, size, maps)
        if kind == "unmap":
            for m in list(maps):
                if m.dummy_base == msg[1]:
                    maps.remove(m)
                    self._unmap(m)
                    return ["ok", 0]
            return ["ok", -1]
        if kind == "call":
            _, method, args, kwargs = msg
            if (
                method not in FORWARDED
                or not isinstance(args, list)
                or not isinstance(kwargs, dict)
            ):
                return ["raise", "AttributeError", f"no forwarded method {method!r}"]
            fn: Callable[..., Any] = getattr(self.store, method)
            try:
                args = [decode_arg(a) for a in args]
                kwargs = {str(k): decode_arg(v) for k, v in kwargs.items()}
                self._translate(method, args, kwargs, maps)
                return ["ok", encode_result(fn(*args, **kwargs))]
            except (TypeError, ValueError) as e:
                return ["raise", type(e).__name__, str(e)]
        raise InvalidArgumentError(f"unknown request {kind!r}")

    def _map(self, fd: int, base: int, size: int, maps: list[_Mapping]) -> Any:
        why = check_shared_fd(fd, size)
        if why is not None:
            log.warning("refusing a dummy client's memory: %s", why)
            return ["ok", int(InvalidArgumentError.code)]
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            log.warning("mapping a dummy client's memory failed: %s", e)
            return ["ok", int(InvalidArgumentError.code)]
        view = ctypes.c_char.from_buffer(mm)
        real = ctypes.addressof(view)
        del view
        rc = self.store.register_buffer(real, size)
        if rc != 0:
            mm.close()
            return ["ok", rc]
        maps.append(_Mapping(base, size, mm, real))
        return ["ok", 0]

    def _unmap(self, m: _Mapping) -> None:
        self.store.unregister_buffer(m.real_base)
        try:
            m.mm.close()
        except BufferError:
            log.warning("a dummy client's memory is still in use; it stays mapped")

    @staticmethod
    def _addr(addr: Any, maps: list[_Mapping]) -> Any:
        if isinstance(addr, bool) or not isinstance(addr, int):
            return addr
        for m in maps:
            if m.dummy_base <= addr < m.dummy_base + m.size:
                return m.real_base + (addr - m.dummy_base)
        return 0

    def _convert(self, value: Any, depth: int, maps: list[_Mapping]) -> Any:
        if depth == 0:
            return self._addr(value, maps)
        if not isinstance(value, list):
            return value
        return [self._convert(v, depth - 1, maps) for v in value]

    def _translate(
        self, method: str, args: list[Any], kwargs: dict[str, Any], maps: list[_Mapping]
    ) -> None:
        spec = POINTER_ARGS.get(method)
        if spec is None:
            return
        for pos, depth in spec.items():
            if pos < len(args):
                args[pos] = self._convert(args[pos], depth, maps)
        for name, depth in POINTER_KWARGS.items():
            if name in kwargs:
                kwargs[name] = self._convert(kwargs[name], depth, maps)
