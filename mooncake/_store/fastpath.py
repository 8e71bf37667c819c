"""The sync facade's fast path: small same-host operations without a trip through the loop.

One sync ``put`` through the background loop costs a loop crossing (caller -> loop -> caller)
plus two master round trips made by the event loop (``add_reader``/``epoll``/``remove_reader``
around every answer: more than a blocking round trip, most when the CPUs are contended; the
numbers are in docs/benchmarks.md, "Loop crossing"). For the operations that dominate
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from mooncake import _fast
from mooncake._core import auth, rpc
from mooncake._core import store_types as st
from mooncake._core.master import parse_miss
from mooncake._store import batching
from mooncake._store.bounds import check_replica_list, own_extent
from mooncake._store.metrics import instrument_fast
from mooncake._store.moves import _subset
from mooncake._store.shm import MappedPeer
from mooncake._store.verify import NO_CRC, none_verified, report_blocking
from mooncake._store.writes import UPSERT_WAIT_S
from mooncake.errors import (
    AuthError,
    LeaseExpiredError,
    MooncakeError,
    NotLeaderError,
    NotSupportedError,
    ObjectAlreadyExistsError,
    ObjectNotFoundError,
    PeerDiedError,
    ProtocolError,
    ReplicaNotReadyError,
    RpcError,
    TransferError,
    UnavailableError,
)

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._store.master_conn import MasterConnection
    from mooncake._sync import LoopThread

#: values up to this size take the fast path (larger copies belong in worker threads)
FAST_MAX = 1 << 20
RPC_TIMEOUT_S = 30.0
T = TypeVar("T")


class SyncMaster:
    """A blocking master RPC connection for one thread, beside the store's async one.

    It talks to the master the async connection resolved (the leader, for an HA address) and
    sends the same request ids. When it loses its connection, or a standby answers, it hands
    the call -- with the request id it already sent -- to the async connection on the loop,
    whose retry rules (one reconnect; an HA cluster: follow the leader) finish it.
    """

    def __init__(self, master: MasterConnection, loop: LoopThread) -> None:
        self._master = master
        self._loop = loop
        self._sock: socket.socket | None = None
        self._dec = rpc.MessageDecoder()
        self._ids = itertools.count(1)
        self._rbuf = memoryview(bytearray(1 << 16))  # recv_into: no allocation per answer
        self._epoch = 0

    def _connect(self) -> socket.socket:
        """A new connection to the master the async connection resolved, authenticated with
        the cluster secret when the store has one (as :meth:`MasterConnection.connect`)."""
        m = self._master
        epoch = m.leader_epoch
        if not m.port:  # an HA address not resolved yet: let the loop do it
            raise OSError("the leader is not resolved yet")
        sock = socket.create_connection((m.host, m.port), timeout=RPC_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._dec = rpc.MessageDecoder()
        # a leader change shuts the socket down at once (a stopped or partitioned leader
        # would otherwise hold this thread for RPC_TIMEOUT_S), authentication included
        if m.register_sync(sock) != epoch:
            self.close()
            raise OSError("the leader changed while connecting")
        self._epoch = epoch
        if m.secret is not None:
            try:
                self._authenticate(sock, m.secret)
            except BaseException:
                self.close()
                raise
        return sock

    def _authenticate(self, sock: socket.socket, key: bytes) -> None:
        """``AuthHello``/``AuthProve`` on a fresh connection; :class:`AuthError` when the
        master takes no secret, does not know ours, or refuses our proof."""
        where = f"{self._master.host}:{self._master.port}"
        cn = auth.new_nonce()
        try:
            ch: rpc.AuthChallenge = self._roundtrip(
                sock, "AuthHello", rpc.AuthHelloParams(nonce=cn, tenant=self._master.auth_tenant)
            )
        except NotSupportedError:
            raise AuthError(f"the master at {where} takes no cluster secret") from None
        if not auth.verify(auth.server_proof(key, "rpc", cn, ch.nonce), ch.proof):
            raise AuthError(f"the master at {where} does not know the cluster secret")
        proof = auth.client_proof(key, "rpc", cn, ch.nonce)
        try:
            self._roundtrip(sock, "AuthProve", rpc.AuthProveParams(proof=proof))
        except RpcError as e:
            raise AuthError(f"the master at {where} refused us: {e}") from None

    def _roundtrip(
        self, sock: socket.socket, method: str, params: msgspec.Struct, rid: bytes | None = None
    ) -> Any:
        """Send one request on ``sock`` and decode its answer (skipping late answers of
        interrupted calls); the master's errors raise their class."""
        req_id = next(self._ids)
        params = self._master.scoped(method, params)
        sock.sendall(rpc.encode_request(req_id, method, params, rid=rid))
        while True:
            msg = self._dec.next_message()
            if msg is None:
                n = sock.recv_into(self._rbuf)
                if not n:
                    raise OSError("the master closed the connection")
                self._dec.feed(self._rbuf[:n])
            elif isinstance(msg, rpc.Response) and msg.id == req_id:
                return rpc.decode_result(method, msg)
            # else: the late answer of an interrupted call; skip it

    def close(self) -> None:
        if self._sock is not None:
            self._master.unregister_sync(self._sock)
            self._sock.close()
            self._sock = None

    def call(self, method: str, params: msgspec.Struct, stamp: list[float] | None = None) -> Any:
        """One request, answered on this connection; the master's errors raise their class.
        ``stamp`` as :meth:`MasterConnection.call` (``time.monotonic()``, the loop's clock)."""
        rid = self._master.next_rid() if method in rpc.MUTATING else None
        try:
            if self._sock is not None and self._epoch != self._master.leader_epoch:
                self.close()  # connected to a leader since replaced
            sock = self._sock or self._connect()
            if stamp is not None:
                stamp[0] = time.monotonic()
            # the first attempt says so (never refused as stale); the loop resends the plain id
            first = rpc.first_attempt(rid) if rid is not None else None
            return self._roundtrip(sock, method, params, first)
        except (OSError, ProtocolError):
            self.close()
        except (NotLeaderError, UnavailableError):
            if self._master.resolver is None:
                raise
            self.close()
        resumed: Any = self._loop.call(self._master.call, method, params, rid, stamp)
        return resumed


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
            resp: st.GetReplicaListResponse = self._master().call(
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
            t = self._target(r, n)
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
            self._report_corrupt(key, resp.vid, r)
            bad.append(r)
        if not bad:
            return None, resp
        if len(bad) == len(order):
            raise none_verified(key)
        return None, msgspec.structs.replace(
            resp, replicas=[x for x in resp.replicas if x not in bad]
        )

    def _report_corrupt(self, key: str, vid: int, r: st.ReplicaDescriptor) -> None:
        """:meth:`Store._report_corrupt` from the calling thread."""
        s = self.store
        report_blocking(self._master().call, s.verify, s.client_id, key, vid, r)

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

    # -- multi-part batches (the multi-buffer family, tensors) -----------------------------

    def _pin(self, p: MappedPeer | None, pinned: dict[int, MappedPeer]) -> bool:
        """Pin ``p`` once for this call (own segment: nothing to pin); False if it died."""
        if p is None or id(p) in pinned:
            return True
        if not p.acquire():
            return False
        pinned[id(p)] = p
        return True

    def batch_put_parts(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> list[MooncakeError | None]:
        """Put key ``i`` as the concatenation of the ``plens[i][j]`` bytes at ``ptrs[i][j]``
        (``sizes[i]`` bytes in all; the
        caller validated keys and host sources): one ``BatchPutStart``, every part of every
        memcpy-able replica in one GIL-free :func:`~mooncake._fast.memcpy_batch`, one
        ``BatchPutEnd`` (``BatchPutRevoke`` for what failed). Keys with a replica that is not
        memcpy-able are written and finished by the async client on the loop. An existing key
        is success, as for ``put``. Sources must be registered host memory (the async client
        writes remote replicas straight from them). A batch past one call's bounds is done
        chunk by chunk (:mod:`~mooncake._store.batching`)."""
        parts = batching.chunks(keys)
        if len(parts) > 1:
            done: list[MooncakeError | None] = []
            n = len(keys)
            for lo, hi in parts:
                done += self.batch_put_parts(
                    keys[lo:hi],
                    ptrs[lo:hi],
                    plens[lo:hi],
                    sizes[lo:hi],
                    _subset(config, range(lo, hi), n),
                )
            return done
        out, slow, slow_reps = self.put_parts_local(keys, ptrs, plens, sizes, config)
        if slow:
            res: list[MooncakeError | None] = self.loop.call(
                self.store._complete_puts,
                "Put",
                [keys[i] for i in slow],
                [list(zip(ptrs[i], plens[i], strict=True)) for i in slow],
                [sizes[i] for i in slow],
                slow_reps,
            )
            for i, r in zip(slow, res, strict=True):
                out[i] = r
        return out

    def put_parts_local(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> tuple[list[MooncakeError | None], list[int], list[list[st.ReplicaDescriptor]]]:
        """The caller-thread half of :meth:`batch_put_parts`, for any host sources (registered
        or not): the keys whose replicas are all memcpy-able are written and finished; the
        others come back *started* as ``(indexes, their replicas)``, and the caller must
        finish them (``Store._complete_puts`` from registered memory, or :meth:`revoke`)."""
        from mooncake._store.config import to_wire
        from mooncake.errors import error_from_code

        s = self.store
        m = self._master()
        out: list[MooncakeError | None] = [None] * len(keys)
        items: list[rpc.Item[list[st.ReplicaDescriptor]]] = m.call(
            "BatchPutStart",
            rpc.BatchPutStartParams(
                client_id=s.client_id, keys=keys, sizes=sizes, config=to_wire(config)
            ),
        )
        if len(items) != len(keys):
            self._finish_batch(
                m, "Put", [], [k for k, it in zip(keys, items, strict=False) if it.code == 0]
            )
            raise ProtocolError(f"BatchPutStart answered {len(items)} results for {len(keys)} keys")
        fast: list[int] = []
        slow: list[int] = []
        slow_reps: list[list[st.ReplicaDescriptor]] = []
        dsts: list[int] = []
        srcs: list[int] = []
        lens: list[int] = []
        summed = s.verify.enabled
        sdsts: list[int] = []  # the first replicas' parts: copied with their CRC32C
        ssrcs: list[int] = []
        slens: list[int] = []
        parts_of: dict[int, int] = {}  # key -> how many of those parts are its
        got: list[int] = []
        owners: list[tuple[int, MappedPeer | None]] = []
        pinned: dict[int, MappedPeer] = {}
        exists = int(ObjectAlreadyExistsError.code)
        try:
            for i, item in enumerate(items):
                reps = item.value
                if item.code != 0 or reps is None:
                    if item.code != exists:
                        out[i] = error_from_code(item.code)
                    continue
                n = sizes[i]
                targets = [self._target(r, n) if r.length == n else None for r in reps]
                if not reps or any(t is None for t in targets):
                    slow.append(i)
                    slow_reps.append(reps)
                    continue
                fast.append(i)
                for j, t in enumerate(targets):
                    assert t is not None
                    dst, peer = t
                    if not self._pin(peer, pinned):
                        out[i] = PeerDiedError(
                            f"{peer.segment if peer else '?'}: its owner is gone"
                        )
                        break
                    owners.append((i, peer))
                    if summed and not j:  # the first replica: copied and checksummed at once
                        parts_of[i] = len(plens[i])
                        sdsts += itertools.accumulate(plens[i][:-1], initial=dst)
                        ssrcs += ptrs[i]
                        slens += plens[i]
                        continue
                    dsts += itertools.accumulate(plens[i][:-1], initial=dst)
                    srcs += ptrs[i]
                    lens += plens[i]
            if sdsts:
                got = _fast.copy_crc32c_batch(sdsts, ssrcs, slens, [True] * len(sdsts), stream=True)
            if dsts:  # into segments: not read again soon, so non-temporal stores
                _fast.memcpy_batch(dsts, srcs, lens, stream=True)
        except BaseException:
            self._unpin(pinned)
            self._finish_batch(m, "Put", [], [keys[i] for i in fast + slow])
            raise
        self._unpin(pinned)
        for i, peer in owners:
            if peer is not None and not peer.alive() and out[i] is None:
                out[i] = PeerDiedError(f"{peer.segment}: its owner died during the write")
        ok = [i for i in fast if out[i] is None]
        bad = [i for i in fast if out[i] is not None]
        crcs = None
        if summed:  # each key's parts' CRCs, combined in order
            value_crc: dict[int, int] = {}
            pos = 0
            for i, k in parts_of.items():
                crc = got[pos]
                for q in range(pos + 1, pos + k):
                    crc = _fast.crc32c_combine(crc, got[q], slens[q])
                value_crc[i] = crc
                pos += k
            crcs = [value_crc.get(i, NO_CRC) for i in ok]
        for i, err in self._finish_batch(
            m, "Put", [keys[i] for i in ok], [keys[i] for i in bad], crcs
        ).items():
            out[ok[i]] = err
        self.hits += 1
        return out, slow, slow_reps

    def revoke(self, keys: list[str]) -> None:
        """``BatchPutRevoke`` started keys (nothing of them becomes readable)."""
        self._finish_batch(self._master(), "Put", [], keys)

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
            t = self._target(r, n)
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
                self._report_corrupt(key, resp.vid, r)
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

    @staticmethod
    def _unpin(pinned: dict[int, MappedPeer]) -> None:
        for p in pinned.values():
            p.unpin()
        pinned.clear()

    def _finish_batch(
        self,
        m: SyncMaster,
        prefix: str,
        ends: list[str],
        revokes: list[str],
        crcs: list[int] | None = None,
    ) -> dict[int, MooncakeError]:
        """``Batch{prefix}End`` ``ends`` (with their values' CRC32Cs ``crcs``, when given)
        and ``Batch{prefix}Revoke`` ``revokes``; the End errors by index into ``ends`` (a
        failed revoke leaves the object unreadable anyway: the master drops unfinished puts
        at their TTL)."""
        from mooncake.errors import error_from_code

        errs: dict[int, MooncakeError] = {}
        cid = self.store.client_id
        if revokes:
            try:
                m.call(
                    f"Batch{prefix}Revoke", rpc.BatchKeyClientParams(client_id=cid, keys=revokes)
                )
            except MooncakeError:
                pass
        if ends:
            try:
                codes: list[int] = m.call(
                    f"Batch{prefix}End",
                    rpc.BatchPutEndParams(client_id=cid, keys=ends, crcs=crcs or []),
                )
            except MooncakeError as e:
                return dict.fromkeys(range(len(ends)), e)
            for j, c in enumerate(codes):
                if c != 0:
                    errs[j] = error_from_code(c)
        return errs

    def batch_get_parts(
        self, keys: list[str], ptrs: list[list[int]], plens: list[list[int]], caps: list[int]
    ) -> list[int | MooncakeError]:
        """Read key ``i`` scattered in order over the ``plens[i][j]`` bytes at ``ptrs[i][j]``
        (``caps[i]`` bytes in all; the
        caller validated keys and host buffers): one ``BatchGetReplicaList``, every part from
        the cheapest memcpy-able replica in one GIL-free
        :func:`~mooncake._fast.memcpy_batch`, then the fences of :meth:`get` per key (read
        window measured from before the request, owner alive after the copy). The value's
        length per key, or the exception: missing, buffers larger or smaller than the value
        (as the async client). Keys with no memcpy-able replica are read by the async client."""
        from mooncake.errors import InvalidArgumentError, error_from_code

        parts = batching.chunks(keys)
        if len(parts) > 1:  # past one call's bounds: chunk by chunk
            joined: list[int | MooncakeError] = []
            for lo, hi in parts:
                joined += self.batch_get_parts(keys[lo:hi], ptrs[lo:hi], plens[lo:hi], caps[lo:hi])
            return joined
        s = self.store
        stamp = [time.monotonic()]
        items: list[rpc.Item[st.GetReplicaListResponse]] = self._master().call(
            "BatchGetReplicaList", rpc.KeysParams(keys=keys, for_read=True), stamp
        )
        t0 = stamp[0]
        if len(items) != len(keys):
            raise ProtocolError(
                f"BatchGetReplicaList answered {len(items)} results for {len(keys)} keys"
            )
        out: list[int | MooncakeError] = [0] * len(keys)
        slow: list[int] = []
        dsts: list[int] = []
        srcs: list[int] = []
        lens: list[int] = []
        owners: list[tuple[int, MappedPeer | None, float]] = []
        checks: list[tuple[int, int, st.ReplicaDescriptor, st.GetReplicaListResponse, int, int]]
        checks = []
        sums: list[bool] = []  # per copied part: checksum it (its key is verified)
        landed: list[int] = []
        pinned: dict[int, MappedPeer] = {}
        try:
            for i, item in enumerate(items):
                resp = item.value
                if item.code != 0 or resp is None:
                    out[i] = error_from_code(item.code)
                    continue
                try:
                    check_replica_list(keys[i], resp)
                except MooncakeError as e:
                    out[i] = e
                    continue
                if not resp.replicas and resp.disk_clients:
                    slow.append(i)
                    continue
                n = s._size_of(resp)
                if n > caps[i]:
                    out[i] = InvalidArgumentError(
                        f"buffers of {caps[i]} bytes are smaller than the {n}-byte value"
                    )
                    continue
                if n < caps[i]:  # the published client reads every buffer in full
                    out[i] = TransferError(
                        f"buffers of {caps[i]} bytes are larger than the {n}-byte value"
                    )
                    continue
                target = None
                rep_of_target = None
                for r in s._order(resp.replicas):
                    t = self._target(r, n)
                    if t is not None and self._pin(t[1], pinned):
                        target, rep_of_target = t, r
                        break
                if target is None:
                    slow.append(i)
                    continue
                src, peer = target
                dsts += ptrs[i]
                srcs += itertools.accumulate(plens[i][:-1], initial=src)
                lens += plens[i]
                owners.append((i, peer, t0 + (resp.read_ttl_ms or resp.lease_ttl_ms) / 1000.0))
                want = s._want_crc(resp, n)
                if want != NO_CRC:
                    assert rep_of_target is not None
                    checks.append((i, want, rep_of_target, resp, len(sums), len(plens[i])))
                sums += [want != NO_CRC] * len(plens[i])
                out[i] = n
            if dsts:
                if checks:  # copied and checksummed in one pass
                    landed = _fast.copy_crc32c_batch(dsts, srcs, lens, sums)
                else:
                    _fast.memcpy_batch(dsts, srcs, lens)
        finally:
            self._unpin(pinned)
        now = time.monotonic()
        for i, peer, deadline in owners:
            if peer is not None and not peer.alive():
                out[i] = PeerDiedError(
                    f"{peer.segment}: its owner died while the read was in flight"
                )
            elif now > deadline:
                s.lease_fences += 1
                out[i] = LeaseExpiredError("the read finished after its lease expired")
        for i, want, r, resp, pos, k in checks:  # what landed, against the writer's CRC
            if isinstance(out[i], MooncakeError):
                continue
            crc = landed[pos]
            for q in range(pos + 1, pos + k):
                crc = _fast.crc32c_combine(crc, landed[q], lens[q])
            if s.verify.check(want, crc, "dram", r.segment_name):
                continue
            self._report_corrupt(keys[i], resp.vid, r)
            if len(s._order(resp.replicas)) > 1:
                slow.append(i)  # the loop path reads the others (the master dropped this one)
            else:
                out[i] = none_verified(keys[i])
        if slow:
            got: list[int | MooncakeError] = self.loop.call(
                s.batch_get_parts,
                [keys[i] for i in slow],
                [list(zip(ptrs[i], plens[i], strict=True)) for i in slow],
            )
            for i, g in zip(slow, got, strict=True):
                out[i] = g
        for g in out:
            if isinstance(g, MooncakeError):
                s._note_miss(g)
        self.hits += 1
        return out

    def call(self, method: str, params: msgspec.Struct) -> Any:
        """Any other single RPC, answered on this thread's blocking connection."""
        return self._master().call(method, params)
