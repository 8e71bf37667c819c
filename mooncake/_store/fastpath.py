"""The sync facade's fast path: small same-host operations without a trip through the loop.

Measured on the 2-core development VM under load, one sync ``put`` through the background loop
costs a loop crossing (caller -> loop -> caller, ~35 us idle, ~100 us loaded) plus two master
round trips made by the event loop (``add_reader``/``epoll``/``remove_reader`` around every
answer: ~2x a blocking round trip when the CPUs are contended). For the operations that dominate
small-value latency this module does the same protocol from the *caller's* thread instead: a
blocking master connection per thread (:class:`SyncMaster`), and ``memcpy`` into/out of the
replica when it lives in this client's own segment or in a same-host segment already mapped.

Exactly the async client's flows and checks (:mod:`mooncake._store.client`), only driven
synchronously:

* ``put``: ``PutStart`` -> ``memcpy`` into every replica -> ``PutEnd``; an existing key is
  success; any replica that is not memcpy-able hands the rest of the put (write, then
  ``PutEnd``/``PutRevoke``) to the async client on the loop; an exception after ``PutStart``
  revokes.
* ``get``: ``GetReplicaList`` -> ``memcpy`` from the cheapest replica -> the same fences (read
  window measured from before the request, owner alive after the copy); otherwise the read is
  handed to the async client with the answer already in hand.

Everything else, and values larger than :data:`FAST_MAX`, goes through the loop as before.
The blocking connection uses a 30 s socket timeout (the published client's RPC timeout).
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.master import parse_miss
from mooncake._store.bounds import check_replica_list, own_extent
from mooncake._store.metrics import instrument_fast
from mooncake._store.shm import MappedPeer
from mooncake.errors import (
    LeaseExpiredError,
    MooncakeError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    PeerDiedError,
    ProtocolError,
    RpcError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._sync import LoopThread

#: values up to this size take the fast path (larger copies belong in worker threads)
FAST_MAX = 1 << 20
RPC_TIMEOUT_S = 30.0


class SyncMaster:
    """A blocking master RPC connection for one thread."""

    def __init__(self, host: str, port: int) -> None:
        self._addr = (host, port)
        self._sock: socket.socket | None = None
        self._dec = rpc.MessageDecoder()
        self._ids = itertools.count(1)

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._addr, timeout=RPC_TIMEOUT_S)
        except OSError as e:
            raise RpcError(
                f"cannot reach the master at {self._addr[0]}:{self._addr[1]}: {e}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._dec = rpc.MessageDecoder()
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, method: str, params: msgspec.Struct) -> Any:
        """One request, answered on this connection; the master's errors raise their class."""
        sock = self._sock or self._connect()
        req_id = next(self._ids)
        try:
            sock.sendall(rpc.encode_request(req_id, method, params))
            while True:
                msg = self._dec.next_message()
                if msg is None:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise OSError("the master closed the connection")
                    self._dec.feed(data)
                elif isinstance(msg, rpc.Response) and msg.id == req_id:
                    break
                # else: the late answer of an interrupted call; skip it
        except (OSError, ProtocolError) as e:
            self.close()
            raise RpcError(f"master RPC {method} failed: {e}") from None
        return rpc.decode_result(method, msg)


@instrument_fast
class FastPath:
    """Sync put/get for one facade (see the module docstring)."""

    def __init__(self, store: Store, loop: LoopThread) -> None:
        self.store = store
        self.loop = loop
        self._local = threading.local()
        self._conns: list[SyncMaster] = []
        self._lock = threading.Lock()
        self.hits = 0

    def _master(self) -> SyncMaster:
        m: SyncMaster | None = getattr(self._local, "master", None)
        if m is None:
            m = SyncMaster(self.store.master.host, self.store.master.port)
            self._local.master = m
            with self._lock:
                self._conns.append(m)
        return m

    def close(self) -> None:
        with self._lock:
            for m in self._conns:
                m.close()
            self._conns.clear()

    def _target(self, r: st.ReplicaDescriptor, n: int) -> tuple[int, MappedPeer | None] | None:
        """Local address of replica ``r`` and the mapping to pin, or None if not memcpy-able."""
        s = self.store
        seg = s.segment
        if r.segment_name == s.segment_name and seg is not None:
            try:
                return own_extent(seg.addr, seg.size, r.addr, n), None
            except MooncakeError:
                return None  # the loop's path reports it
        p = s._shm.cached(r.segment_name)
        if p is None:
            return None
        try:
            return p.local(r.addr, n), p
        except MooncakeError:
            return None

    # -- put ------------------------------------------------------------------------------

    def put(self, key: str, addr: int, size: int, config: Any, upsert: bool) -> None:
        """Store ``size`` bytes at ``addr`` under ``key`` (the caller validated key and source)."""
        from mooncake._store.config import to_wire

        s = self.store
        m = self._master()
        prefix = "Upsert" if upsert else "Put"
        try:
            reps: list[st.ReplicaDescriptor] = m.call(
                f"{prefix}Start",
                rpc.PutStartParams(
                    client_id=s.client_id, key=key, size=size, config=to_wire(config)
                ),
            )
        except ObjectAlreadyExistsError:
            return
        try:
            targets = [self._target(r, size) for r in reps]
            if not reps or any(
                t is None or r.length != size for t, r in zip(targets, reps, strict=True)
            ):
                # remote (or unusual) replicas: the async client writes and finishes the put
                err = self.loop.call(s._complete_put, prefix, key, addr, size, reps)
                if err is not None:
                    raise err
                return
            pinned: list[MappedPeer] = []
            try:
                for t in targets:
                    assert t is not None
                    if t[1] is not None:
                        if not t[1].acquire():
                            raise PeerDiedError(f"{t[1].segment}: its owner is gone")
                        pinned.append(t[1])
                for t in targets:
                    assert t is not None
                    _fast.memcpy_at(t[0], addr, size)
            finally:
                for p in pinned:
                    p.unpin()
            for p in pinned:
                if not p.alive():
                    raise PeerDiedError(f"{p.segment}: its owner died during the write")
        except BaseException:
            try:
                m.call(f"{prefix}Revoke", rpc.KeyClientParams(client_id=s.client_id, key=key))
            except MooncakeError:
                pass
            raise
        m.call(f"{prefix}End", rpc.KeyClientParams(client_id=s.client_id, key=key))
        self.hits += 1

    # -- get ------------------------------------------------------------------------------

    def _query(self, key: str) -> tuple[st.GetReplicaListResponse, float]:
        t0 = time.monotonic()
        try:
            resp: st.GetReplicaListResponse = self._master().call(
                "GetReplicaList", rpc.KeyParams(key=key)
            )
        except ObjectNotFoundError as e:
            e.miss = parse_miss(key, str(e))
            raise
        return check_replica_list(key, resp), t0 + (resp.read_ttl_ms or resp.lease_ttl_ms) / 1000.0

    def _copy_out(self, resp: st.GetReplicaListResponse, n: int, into: int | None) -> bytes | None:
        """Copy the object from the cheapest memcpy-able replica; None if there is none."""
        for r in self.store._order(resp.replicas):
            t = self._target(r, n)
            if t is None:
                continue
            src, p = t
            if p is not None and not p.acquire():
                continue
            try:
                if into is None:
                    data = ctypes.string_at(src, n)
                else:
                    _fast.memcpy_at(into, src, n)
                    data = b""
            finally:
                if p is not None:
                    p.unpin()
            if p is not None and not p.alive():
                raise PeerDiedError(f"{p.segment}: its owner died while the read was in flight")
            return data
        return None

    def _fence(self, deadline: float) -> None:
        # anyio's clock on the asyncio loop is time.monotonic(), the clock used here
        if time.monotonic() > deadline:
            self.store.lease_fences += 1
            raise LeaseExpiredError("the read finished after its read window closed")

    def get(self, key: str) -> bytes:
        resp, deadline = self._query(key)
        if not resp.replicas and resp.disk_clients:  # on an SSD tier: the loop reads it
            ssd: bytes = self.loop.call(self.store._read_ssd, key, resp)
            return ssd
        n = self.store._size_of(resp)
        if n <= FAST_MAX:
            data = self._copy_out(resp, n, None)
            if data is not None:
                self._fence(deadline)
                self.hits += 1
                return data
        out: bytes = self.loop.call(self.store._get_with, resp, deadline)
        return out

    def get_into(self, key: str, addr: int, size: int) -> int:
        from mooncake.errors import InvalidArgumentError

        resp, deadline = self._query(key)
        n = self.store._size_of(resp)
        if n > size:
            raise InvalidArgumentError(f"buffer of {size} bytes is smaller than the {n}-byte value")
        if not resp.replicas and resp.disk_clients:  # on an SSD tier: the loop reads it
            data: bytes = self.loop.call(self.store._read_ssd, key, resp)
            if len(data) != n:
                raise TransferError(f"the SSD copy of {key!r} has {len(data)} bytes, not {n}")
            ctypes.memmove(addr, data, n)
            return n
        if n <= FAST_MAX and self._copy_out(resp, n, addr) is not None:
            self._fence(deadline)
            self.hits += 1
            return n
        self.loop.call(self.store._read_one, resp, addr, n, deadline)
        return n

    def call(self, method: str, params: msgspec.Struct) -> Any:
        """Any other single RPC, answered on this thread's blocking connection."""
        return self._master().call(method, params)
