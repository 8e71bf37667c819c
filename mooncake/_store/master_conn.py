"""The client end of the master RPC: one pipelined TCP connection, responses matched by id.

:class:`MasterConnection` sends framed requests (:mod:`mooncake._core.rpc`) and waits for the
response with the same id. There is no reader task: the first waiter whose answer has not
arrived reads the socket for everyone ("leader/follower"), hands each decoded response to its
waiter, and when its own has come, passes the reading role to another waiter. One request in
flight therefore costs one ``send`` and one ``recv`` on the caller's own task, with no task
switch -- the master RPC sits on the latency path of every put and get.

Addresses: ``host:port`` (one master), or ``etcd://host:port[;host:port...]`` (an HA cluster:
the etcd members to ask, :mod:`mooncake._store.leader`), whose leader is read from
``mooncake-store/<cluster_id>/master_view`` (``cluster_id`` from ``MC_STORE_CLUSTER_ID``, default
``mooncake_cluster``, the master's ``--cluster_id`` default) and followed as it changes.

Request ids: every :data:`~mooncake._core.rpc.MUTATING` call carries a ``rid`` (this
connection's random 8-byte instance id + a sequence number) and keeps it across retries, so the
master applies it once (:mod:`mooncake._core.dedup`).

Failure: if the connection breaks (reset, EOF, a frame that does not parse) the call in flight
fails with :class:`~mooncake.errors.MasterUnreachableError`, and it is retried:

* one master: once, on a fresh connection (a master that closed an idle connection, or a
  connection reset, costs nothing visible); a master that cannot be reached fails the call.
* an HA cluster: until an answer comes or ``failover_timeout`` seconds (``MC_STORE_FAILOVER_
  TIMEOUT``, default 30: longer than the leader lease plus an election) have passed since the
  first failure: on each failure, and on a ``NotLeaderError`` or ``UnavailableError`` answer
  (a standby, or a master still taking over), the leader is re-read from etcd and the call
  re-sent there with the same ``rid``. Every call in flight
  during a failover is retried this way, none is dropped; past the timeout it raises
  :class:`~mooncake.errors.MasterUnreachableError` naming the cluster and the last error. A
  leader change seen by :meth:`follow` (the key deleted, or naming another master) closes the
  connection to the old leader at once, and shuts every blocking socket registered with
  :meth:`register_sync` (the caller-thread path, :class:`mooncake._store.sync_master.SyncMaster`),
  so a call blocked on a stopped or partitioned leader fails at once and is resumed here.

The master's error answers raise the matching :mod:`mooncake.errors` class
(:func:`~mooncake._core.rpc.decode_result`) and are not retried. A silent master is bounded by TCP
keepalive and ``TCP_USER_TIMEOUT`` (see :mod:`mooncake._engine._sockio`); callers add their own
deadlines with ``anyio.fail_after``.

Cluster secret: with ``secret`` (or ``MOONCAKE_CLUSTER_SECRET``) every (re)connection first runs
``AuthHello``/``AuthProve`` (:mod:`mooncake._core.auth`); a master that does not know the secret
(or takes none) raises :class:`~mooncake.errors.AuthError`.

Cancellation: a cancelled call forgets its request id; its answer, when it comes, is dropped.
The connection stays usable unless the cancellation interrupted a send mid-frame (then it is
closed and the next call reconnects).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
from typing import Any

import anyio
import anyio.abc
import msgspec

from mooncake._core import auth, rpc
from mooncake._core import store_types as st
from mooncake._core.tenantscope import TENANT_SCOPED
from mooncake._engine import _sockio
from mooncake._engine import tracing as _tracing
from mooncake._store import batching
from mooncake._store.leader import (
    LeaderResolver,
    failover_timeout_from_env,
    is_ha_address,
    parse_address,
)
from mooncake.errors import (
    AuthError,
    MasterUnreachableError,
    MooncakeError,
    NotLeaderError,
    NotSupportedError,
    RpcError,
    UnavailableError,
)

log = logging.getLogger("mooncake.store")

_RECV = 256 << 10


class _Waiter:
    __slots__ = ("event", "method", "response", "take_over")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = anyio.Event()
        self.response: rpc.Response | None = None
        self.take_over = False


class MasterConnection:
    """A pipelined RPC connection to the master (open with :meth:`connect`).

    ``address`` is ``host:port`` or ``etcd://...`` (see the module docstring); ``cluster_id``
    and ``failover_timeout`` matter for the latter only (None: from the environment).
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | bytes | None = None,
        cluster_id: str | None = None,
        failover_timeout: float | None = None,
    ) -> None:
        self.address = address
        self.secret = auth.load_secret(secret)
        self.resolver: LeaderResolver | None = None
        if is_ha_address(address):
            self.resolver = LeaderResolver(address, cluster_id)
            self.host, self.port = "", 0  # until the leader is resolved
        else:
            self.host, self.port = parse_address(address)
        self.failover_timeout = (
            failover_timeout if failover_timeout is not None else failover_timeout_from_env()
        )
        self.instance = os.urandom(8)
        """This client instance's half of every request id."""
        self._seq = itertools.count(1)
        self._connect_lock = anyio.Lock()
        self.retries = 0
        """Calls re-sent after a lost connection or a standby's answer."""
        self.leader_changes = 0
        self._change: anyio.Event | None = None
        self.hello: rpc.ClientParams | None = None
        """Set by a store client once mounted: every *re*connection first sends this ``Ping``
        (before any retried call), so the master, which quarantines a client's segments when
        its heartbeat connection closes, sees it alive again at once."""
        self.remount_asked = False
        """That ``Ping`` was answered ``NEED_REMOUNT`` (the heartbeat loop remounts)."""
        self._sock: socket.socket | None = None
        self._decoder = rpc.MessageDecoder()
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._reading = False
        self._send_lock = anyio.Lock()
        self._broken: MooncakeError | None = None
        self._scratch = _sockio.Scratch(_RECV)
        self.calls = 0
        self._sync_socks: set[socket.socket] = set()
        self._sync_lock = threading.Lock()
        self.tenant = ""
        """This client's tenant (``""``: the default): sent in the params of every call of
        :data:`~mooncake._core.tenantscope.TENANT_SCOPED` (:meth:`scoped`)."""
        self.auth_tenant = ""
        """With a tenant key as ``secret`` (:func:`mooncake._core.auth.tenant_key`): the tenant
        ``AuthHello`` names, so the master checks the tenant key and binds the connection."""
        self.leader_epoch = 0
        """Bumped on every leader change :meth:`follow` sees (a blocking socket connected
        before the change must not be used after it)."""

    def scoped(self, method: str, params: msgspec.Struct) -> msgspec.Struct:
        """``params`` with this client's tenant, when ``method`` is scoped by tenant."""
        if self.tenant and method in TENANT_SCOPED:
            return msgspec.structs.replace(params, tenant=self.tenant)
        return params

    @property
    def connected(self) -> bool:
        return self._sock is not None and self._broken is None

    @property
    def leader(self) -> str:
        """``host:port`` of the master this connection talks to (the leader last resolved)."""
        return f"{self.host}:{self.port}" if self.port else ""

    def next_rid(self) -> bytes:
        """A fresh request id of this client instance (thread-safe)."""
        return rpc.make_rid(self.instance, next(self._seq))

    async def connect(self) -> None:
        """(Re)connect; outstanding calls of a previous connection have already failed.

        For an HA address, first read the current leader from etcd (waiting up to
        ``failover_timeout`` for one to appear)."""
        if self.resolver is not None:
            with anyio.move_on_after(self.failover_timeout) as scope:
                addr = await self.resolver.resolve()
            if scope.cancelled_caught:
                raise MasterUnreachableError(
                    f"no leader of {self.resolver.describe()} appeared within "
                    f"{self.failover_timeout:g} s"
                )
            self.host, self.port = parse_address(addr)
        target = self.leader
        try:
            sock = await _sockio.connect(self.host, self.port)
        except MooncakeError as e:
            raise MasterUnreachableError(f"cannot reach the master at {target}: {e}") from None
        self.close()
        self._sock = sock
        self._decoder = rpc.MessageDecoder()
        self._broken = None
        if self.secret is not None:
            try:
                await self._authenticate(self.secret)
            except BaseException:
                self.close()
                raise
        if self.hello is not None:
            await self._say_hello(self.hello)

    async def _say_hello(self, params: rpc.ClientParams) -> None:
        try:
            resp: st.PingResponse = await self._call_once("Ping", params, None, None)
        except MooncakeError as e:  # the call that reconnected fails or retries as always
            log.info("ping after reconnecting to %s failed: %s", self.leader, e)
            return
        if resp.client_status == st.ClientStatus.NEED_REMOUNT:
            self.remount_asked = True
            ev, self._change = self._change, None
            if ev is not None:
                ev.set()  # wake the heartbeat loop: it remounts

    async def _authenticate(self, key: bytes) -> None:
        cn = auth.new_nonce()
        try:
            ch: rpc.AuthChallenge = await self.call(
                "AuthHello", rpc.AuthHelloParams(nonce=cn, tenant=self.auth_tenant)
            )
        except NotSupportedError:
            raise AuthError(f"the master at {self.leader} takes no cluster secret") from None
        if not auth.verify(auth.server_proof(key, "rpc", cn, ch.nonce), ch.proof):
            raise AuthError(f"the master at {self.leader} does not know the cluster secret")
        try:
            await self.call(
                "AuthProve", rpc.AuthProveParams(proof=auth.client_proof(key, "rpc", cn, ch.nonce))
            )
        except RpcError as e:
            raise AuthError(f"the master at {self.leader} refused us: {e}") from None

    async def _ensure_connected(self) -> None:
        if self.connected:
            return
        async with self._connect_lock:  # concurrent callers share one reconnect
            if not self.connected:
                await self.connect()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            _sockio.close(sock)
        self._fail(MasterUnreachableError(f"connection to the master at {self.leader} closed"))

    async def aclose(self) -> None:
        """Close the connection and the etcd client of an HA address."""
        self.close()
        if self.resolver is not None:
            await self.resolver.aclose()

    async def follow(self) -> None:
        """Watch the leader key of an HA address until cancelled (returns at once for a plain
        address): when another master becomes leader, drop the connection to the old one so
        calls in flight are retried at the new one without waiting for a timeout."""
        if self.resolver is None:
            return
        await self.resolver.watch(self._leader_changed)

    def register_sync(self, sock: socket.socket) -> int:
        """Track a blocking socket to the current leader (any thread): it is shut down at
        the next leader change. Returns :attr:`leader_epoch` as of registering: if it differs
        from the epoch read before the socket was connected, the leader changed meanwhile."""
        with self._sync_lock:
            self._sync_socks.add(sock)
            return self.leader_epoch

    def unregister_sync(self, sock: socket.socket) -> None:
        with self._sync_lock:
            self._sync_socks.discard(sock)

    def _shut_sync(self) -> None:
        with self._sync_lock:
            self.leader_epoch += 1
            socks = list(self._sync_socks)
        for sock in socks:  # wakes a thread blocked in recv on it (EOF), which resumes here
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _leader_changed(self, addr: str | None) -> None:
        if addr != self.leader and (self._sock is not None or self._sync_socks):
            log.warning("master leader changed from %s to %s", self.leader, addr or "(none)")
            self._shut_sync()
            self.close()
        if addr is not None:
            self.leader_changes += 1
            ev, self._change = self._change, None
            if ev is not None:
                ev.set()

    async def sleep_or_leader_change(self, seconds: float) -> None:
        """Sleep ``seconds``, or less: until the leader key names a master (the heartbeat pings
        the new leader at once, so a client it does not know re-mounts without delay)."""
        if self._change is None:
            self._change = anyio.Event()
        with anyio.move_on_after(seconds):
            await self._change.wait()

    def _fail(self, err: MooncakeError) -> None:
        if self._broken is None:
            self._broken = err
        for w in self._waiters.values():
            w.event.set()

    @_tracing.traced("mooncake.master.call", lambda self, method, *a, **k: {"rpc.method": method})
    async def call(
        self,
        method: str,
        params: msgspec.Struct,
        rid: bytes | None = None,
        stamp: list[float] | None = None,
    ) -> Any:
        """Send one request and return its decoded result (or raise the master's error).

        A mutating call gets a fresh request id unless ``rid`` is given (a caller resuming a
        call it already sent elsewhere passes the one it used). Lost connections and standbys'
        answers are retried as the module docstring says. ``stamp[0]``, when given, is set to
        ``anyio.current_time()`` just before each attempt is sent: after the call it is the
        send time of the attempt that was answered (read fences measure from it)."""
        if rid is None and (parts := batching.split(method, params)) is not None:
            return await self._call_chunks(method, parts, stamp)
        fresh = rid is None and method in rpc.MUTATING
        if fresh:
            rid = self.next_rid()
        try:
            # the first attempt says so (never refused as stale); retries resend the plain id
            first = rpc.first_attempt(rid) if fresh and rid is not None else rid
            return await self._call_once(method, params, first, stamp)
        except (MasterUnreachableError, NotLeaderError, UnavailableError) as e:
            if method in rpc.AUTH_METHODS or (
                self.resolver is None and not isinstance(e, MasterUnreachableError)
            ):
                raise
            return await self._retry(method, params, rid, e, stamp)

    async def _call_chunks(
        self, method: str, parts: list[Any], stamp: list[float] | None
    ) -> list[Any]:
        """A batch too big for one call, as one call per chunk (:mod:`~mooncake._store.
        batching`); the answers joined in order, ``stamp`` that of the first chunk."""
        out: list[Any] = []
        first: float | None = None
        for part in parts:
            mine = [anyio.current_time()] if stamp is not None else None
            out.extend(await self.call(method, part, None, mine))
            if mine is not None and first is None:
                first = mine[0]
        if stamp is not None and first is not None:
            stamp[0] = first
        return out

    async def call_stamped(self, method: str, params: msgspec.Struct) -> tuple[Any, float]:
        """:meth:`call`, and the clock reading taken just before the answered attempt was sent
        (a lease granted in the answer began after it, whichever master granted it)."""
        stamp = [anyio.current_time()]
        result = await self.call(method, params, None, stamp)
        return result, stamp[0]

    async def _retry(
        self,
        method: str,
        params: msgspec.Struct,
        rid: bytes | None,
        first: MooncakeError,
        stamp: list[float] | None,
    ) -> Any:
        if self.resolver is None:
            self.retries += 1
            return await self._call_once(method, params, rid, stamp)  # once, on a fresh connection
        err: MooncakeError = first
        delay = 0.05
        with anyio.move_on_after(self.failover_timeout):
            while True:
                if isinstance(err, NotLeaderError | UnavailableError):
                    self.resolver.forget(self.leader)
                    self.close()
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.5)
                self.retries += 1
                try:
                    return await self._call_once(method, params, rid, stamp)
                except (MasterUnreachableError, NotLeaderError, UnavailableError) as e:
                    err = e
        raise MasterUnreachableError(
            f"master RPC {method}: no leader of {self.resolver.describe()} answered within "
            f"{self.failover_timeout:g} s (last: {err})"
        )

    async def _call_once(
        self, method: str, params: msgspec.Struct, rid: bytes | None, stamp: list[float] | None
    ) -> Any:
        await self._ensure_connected()
        sock = self._sock
        if sock is None:
            raise MasterUnreachableError(f"connection to the master at {self.leader} closed")
        req_id = next(self._ids)
        frame = rpc.encode_request(req_id, method, self.scoped(method, params), rid=rid)
        w = _Waiter(method)
        self._waiters[req_id] = w
        self.calls += 1
        if stamp is not None:
            stamp[0] = anyio.current_time()
        try:
            await self._send(sock, frame)
            while w.response is None:
                if self._broken is not None or self._sock is not sock:
                    why = self._broken or "the connection it was sent on was closed"
                    raise MasterUnreachableError(f"master RPC {method} failed: {why}")
                if self._reading:
                    await w.event.wait()
                    w.event = anyio.Event()
                    continue
                self._reading = True
                try:
                    await self._read_until(sock, w)
                finally:
                    self._reading = False
                    self._hand_over()
        finally:
            self._waiters.pop(req_id, None)
        return rpc.decode_result(method, w.response)

    def _hand_over(self) -> None:
        """Wake one waiter still without an answer so that it becomes the reader."""
        for other in self._waiters.values():
            if other.response is None:
                other.take_over = True
                other.event.set()
                return

    async def _send(self, sock: socket.socket, frame: bytes) -> None:
        # Fast path: small frames almost always go out in one non-blocking send, and taking the
        # uncontended lock without a checkpoint saves a trip through the event loop per call.
        try:
            self._send_lock.acquire_nowait()
        except anyio.WouldBlock:
            await self._send_lock.acquire()
        try:
            try:
                n = sock.send(frame)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._fail(
                    MasterUnreachableError(
                        f"master connection lost ({errno.errorcode.get(e.errno or 0, e)})"
                    )
                )
                raise MasterUnreachableError(
                    f"cannot send to the master at {self.leader}: {e}"
                ) from None
            if n == len(frame):
                return
            view = memoryview(frame)[n:]
            try:
                while view:
                    try:
                        await anyio.wait_writable(sock)
                    except (anyio.ClosedResourceError, OSError):  # closed by another task
                        raise MasterUnreachableError(
                            "the connection to the master was closed"
                        ) from None
                    try:
                        n = sock.send(view)
                    except BlockingIOError:
                        continue
                    except OSError as e:
                        raise MasterUnreachableError(f"cannot send to the master: {e}") from None
                    view = view[n:]
            except BaseException as e:
                # a partial frame on the wire poisons the stream
                self._fail(MasterUnreachableError(f"send to the master interrupted: {e!r}"))
                raise
        finally:
            self._send_lock.release()

    async def _read_until(self, sock: socket.socket, w: _Waiter) -> None:
        scratch = self._scratch
        fd = sock.fileno()
        from mooncake import _fast

        while w.response is None and self._broken is None and self._sock is sock:
            r = _fast.recv_at(fd, scratch.addr, scratch.size)
            if r > 0:
                self._decoder.feed(scratch.bytes(0, r))
                try:
                    for msg in self._decoder:
                        if isinstance(msg, rpc.Response):
                            other = self._waiters.get(msg.id)
                            if other is not None:
                                other.response = msg
                                if other is not w:
                                    other.event.set()
                except MooncakeError as e:
                    self._fail(MasterUnreachableError(f"bad frame from the master: {e}"))
            elif r == 0:
                self._fail(
                    MasterUnreachableError(f"the master at {self.leader} closed the connection")
                )
            elif -r in (errno.EAGAIN, errno.EWOULDBLOCK):
                try:
                    await anyio.wait_readable(sock)
                except (anyio.ClosedResourceError, OSError):  # closed by another task
                    if self._sock is sock:
                        self._fail(MasterUnreachableError("the connection to the master closed"))
                    return
            elif -r != errno.EINTR:
                self._fail(
                    MasterUnreachableError(
                        f"master connection failed ({errno.errorcode.get(-r, str(-r))})"
                    )
                )
