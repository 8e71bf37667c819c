"""The sync facade's fast path: small same-host operations without a trip through the loop.

One sync ``put`` through the background loop costs a loop crossing (caller -> loop -> caller)
plus two master round trips made by the event loop (``add_reader``/``epoll``/``remove_reader``
around every answer: more than a blocking round trip, most when the CPUs are contended; the
numbers are in docs/benchmarks.md, "Loop crossing"). For the operations that dominate
small-value latency this module does the same protocol from the *caller's* thread instead: a
blocking master connection per thread (:class:`~mooncake._store.sync_master.SyncMaster`), and
``memcpy`` into/out of the replica when it lives in this client's own segment or in a
same-host segment already mapped. The multi-part batches (the multi-buffer family, tensor
puts) are in :mod:`mooncake._store.fastpath_parts`.

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
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.master import parse_miss
from mooncake._store import fastpath_parts as _parts
from mooncake._store.bounds import check_replica_list, own_extent
from mooncake._store.metrics import instrument_fast
from mooncake._store.shm import MappedPeer
from mooncake._store.sync_master import SyncMaster
from mooncake._store.verify import NO_CRC, none_verified, report_blocking
from mooncake._store.writes import UPSERT_WAIT_S
from mooncake.errors import (
    LeaseExpiredError,
    MooncakeError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    PeerDiedError,
    ReplicaNotReadyError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._sync import LoopThread

#: values up to this size take the fast path (larger copies belong in worker threads)
FAST_MAX = 1 << 20
T = TypeVar("T")


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

    def master(self) -> SyncMaster:
        """This thread's blocking master connection (made on its first call)."""
        m: SyncMaster | None = getattr(self._local, "master", None)
        if m is None:
            m = SyncMaster(self.store.master, self.loop)
            self._local.master = m
            with self._lock:
                self._conns.append(m)
        return m

    def close(self) -> None:
        with self._lock:
            for m in self._conns:
                m.close()
            self._conns.clear()

    def target(self, r: st.ReplicaDescriptor, n: int) -> tuple[int, MappedPeer | None] | None:
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
        m = self.master()
        prefix = "Upsert" if upsert else "Put"
        params = rpc.PutStartParams(
            client_id=s.client_id, key=key, size=size, config=to_wire(config)
        )
        end, pause = time.monotonic() + UPSERT_WAIT_S, 0.001
        while True:
            try:
                reps: list[st.ReplicaDescriptor] = m.call(f"{prefix}Start", params)
                break
            except ObjectAlreadyExistsError:
                return
            except ReplicaNotReadyError:
                # another write of the key is in flight: wait for it (as the async client);
                # it may still fail, so its "exists" would not mean ours is stored
                if time.monotonic() + pause > end:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        try:
            targets = [self.target(r, size) for r in reps]
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
                crc = NO_CRC
                for j, t in enumerate(targets):
                    assert t is not None
                    if j == 0 and s.verify.enabled:  # one pass: the copy and its CRC32C
                        crc = _fast.copy_crc32c(t[0], addr, size)
                    else:
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
        m.call(f"{prefix}End", rpc.PutEndParams(client_id=s.client_id, key=key, crc=crc))
        self.hits += 1

    # -- get ------------------------------------------------------------------------------

    def _query(self, key: str) -> tuple[st.GetReplicaListResponse, float]:
        stamp = [time.monotonic()]
        try:
            resp: st.GetReplicaListResponse = self.master().call(
                "GetReplicaList", rpc.KeyParams(key=key), stamp
            )
        except ObjectNotFoundError as e:
            e.miss = parse_miss(key, str(e), self.store.master.tenant)
            raise
        return check_replica_list(key, resp), stamp[0] + (
            resp.read_ttl_ms or resp.lease_ttl_ms
        ) / 1000.0

    def _copy_out(
        self,
        key: str,
        resp: st.GetReplicaListResponse,
        n: int,
        into: int | None,
        deadline: float,
    ) -> tuple[bytes | None, st.GetReplicaListResponse]:
        """Copy the object from the cheapest memcpy-able replica that verifies (a corrupt one
        is reported, as by the async client): the bytes (``b""`` when copied ``into``), or
        None if there is none to copy from, and ``resp`` less the replicas found corrupt.
        :class:`ChecksumMismatchError` when every replica was copyable and none verified."""
        s = self.store
        want = s._want_crc(resp, n, count=False)  # counted below, if this path reads it
        order = s._order(resp.replicas)
        bad: list[st.ReplicaDescriptor] = []
        for r in order:
            t = self.target(r, n)
            if t is None:
                continue
            src, p = t
            if p is not None and not p.acquire():
                continue
            got = NO_CRC
            try:
                if into is None:
                    if want != NO_CRC:  # one pass: the new bytes and their CRC32C
                        data, got = _fast.bytes_crc32c(src, n)
                    else:
                        data = ctypes.string_at(src, n)
                else:
                    data = b""
                    if want != NO_CRC:  # one pass: the copy and the CRC32C of what landed
                        got = _fast.copy_crc32c(into, src, n)
                    else:
                        _fast.memcpy_at(into, src, n)
            finally:
                if p is not None:
                    p.unpin()
            if p is not None and not p.alive():
                raise PeerDiedError(f"{p.segment}: its owner died while the read was in flight")
            if want == NO_CRC:
                s.verify.unverified += 1
                return data, resp
            if s.verify.check(want, got, "dram", r.segment_name):
                return data, resp
            self._fence(deadline)  # a mismatch past the window proves nothing
            self.report_corrupt(key, resp.vid, r)
            bad.append(r)
        if not bad:
            return None, resp
        if len(bad) == len(order):
            raise none_verified(key)
        return None, msgspec.structs.replace(
            resp, replicas=[x for x in resp.replicas if x not in bad]
        )

    def report_corrupt(self, key: str, vid: int, r: st.ReplicaDescriptor) -> None:
        """:meth:`Store._report_corrupt` from the calling thread."""
        s = self.store
        report_blocking(self.master().call, s.verify, s.client_id, key, vid, r)

    def _fence(self, deadline: float) -> None:
        # anyio's clock on the asyncio loop is time.monotonic(), the clock used here
        if time.monotonic() > deadline:
            self.store.lease_fences += 1
            raise LeaseExpiredError("the read finished after its read window closed")

    def get(self, key: str) -> bytes:
        """As ``Store.get``: a read fenced by its read window is tried once more."""
        try:
            return self._get(key)
        except LeaseExpiredError:
            return self._get(key)

    def _get(self, key: str) -> bytes:
        resp, deadline = self._query(key)
        if not resp.replicas and resp.disk_clients:  # on an SSD tier: the loop reads it
            ssd: bytes = self.loop.call(self.store._read_ssd, key, resp)
            return ssd
        n = self.store._size_of(resp)
        if n <= FAST_MAX:
            data, resp = self._copy_out(key, resp, n, None, deadline)
            if data is not None:
                self._fence(deadline)
                self.hits += 1
                return data
        out: bytes = self.loop.call(self.store._get_with, resp, deadline, key)
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
        if n <= FAST_MAX:
            copied, resp = self._copy_out(key, resp, n, addr, deadline)
            if copied is not None:
                self._fence(deadline)
                self.hits += 1
                return n
        self.loop.call(self.store._read_one, resp, addr, n, deadline, key)
        return n

    # -- multi-part batches (mooncake._store.fastpath_parts) ----------------------------

    def batch_put_parts(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> list[MooncakeError | None]:
        """See :func:`~mooncake._store.fastpath_parts.batch_put_parts`."""
        return _parts.batch_put_parts(self, keys, ptrs, plens, sizes, config)

    def put_parts_local(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> tuple[list[MooncakeError | None], list[int], list[list[st.ReplicaDescriptor]]]:
        """See :func:`~mooncake._store.fastpath_parts.put_parts_local`."""
        return _parts.put_parts_local(self, keys, ptrs, plens, sizes, config)

    def revoke(self, keys: list[str]) -> None:
        """``BatchPutRevoke`` started keys (nothing of them becomes readable)."""
        _parts.revoke(self, keys)

    def batch_get_parts(
        self, keys: list[str], ptrs: list[list[int]], plens: list[list[int]], caps: list[int]
    ) -> list[int | MooncakeError]:
        """See :func:`~mooncake._store.fastpath_parts.batch_get_parts`."""
        return _parts.batch_get_parts(self, keys, ptrs, plens, caps)

    def read_with(self, key: str, fn: Callable[[int, int], T]) -> T | None:
        """``fn(address, size)`` on the cheapest memcpy-able replica of ``key`` while it is
        pinned, then the fences of :meth:`get`; None when no replica is memcpy-able (or the
        object is on the SSD tier): the caller takes the loop path. Raises what ``get``
        raises (:class:`ObjectNotFoundError` for a missing key, ``LeaseExpiredError``,
        ``PeerDiedError``)."""
        resp, deadline = self._query(key)
        s = self.store
        n = s._size_of(resp)
        want = s._want_crc(resp, n, count=False)  # counted below, if this path reads it
        order = s._order(resp.replicas)
        bad = 0
        for r in order:
            t = self.target(r, n)
            if t is None:
                continue
            src, p = t
            if p is not None and not p.acquire():
                continue
            got = NO_CRC
            try:
                result = fn(src, n)
                if want != NO_CRC:  # the replica's bytes fn used, while still pinned
                    got = _fast.crc32c_at(src, n)
            finally:
                if p is not None:
                    p.unpin()
            if p is not None and not p.alive():
                raise PeerDiedError(f"{p.segment}: its owner died while the read was in flight")
            if want != NO_CRC and not s.verify.check(want, got, "dram", r.segment_name):
                self._fence(deadline)
                self.report_corrupt(key, resp.vid, r)
                bad += 1
                continue
            if want == NO_CRC:
                s.verify.unverified += 1
            self._fence(deadline)
            self.hits += 1
            return result
        if bad and bad == len(order):
            raise none_verified(key)
        return None

    def call(self, method: str, params: msgspec.Struct) -> Any:
        """Any other single RPC, answered on this thread's blocking connection."""
        return self.master().call(method, params)
