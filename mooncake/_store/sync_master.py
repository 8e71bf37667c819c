"""A blocking master RPC connection for one caller thread (:class:`SyncMaster`), beside the
store's async one: what the caller-thread fast path (:mod:`mooncake._store.fastpath`) sends its
RPCs on.

It speaks the same protocol as :class:`~mooncake._store.master_conn.MasterConnection` (the
same request ids, the same authentication), to the master the async connection resolved, and
hands a call it cannot finish (its connection lost, a standby answering) back to the async
connection on the loop with the request id it already sent, so the retry rules live in one
place. The socket has a 30 s timeout (the published client's RPC timeout).
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import TYPE_CHECKING, Any

import msgspec

from mooncake._core import auth, rpc
from mooncake.errors import (
    AuthError,
    NotLeaderError,
    NotSupportedError,
    ProtocolError,
    RpcError,
    UnavailableError,
)

if TYPE_CHECKING:
    from mooncake._store.master_conn import MasterConnection
    from mooncake._sync import LoopThread

RPC_TIMEOUT_S = 30.0


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
