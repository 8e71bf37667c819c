"""The master's connection handshake: ``AuthHello`` / ``AuthProve`` with the cluster secret
or a tenant's key (:mod:`mooncake._core.auth`, channel ``rpc``), for both connection drivers
(the loop's and :mod:`mooncake._store.rpc_thread`'s).
"""

from __future__ import annotations

import logging
import socket
from typing import Protocol

from mooncake._core import auth, rpc
from mooncake._store.tenancy import TenantBindings
from mooncake.errors import ErrorCode, MooncakeError

log = logging.getLogger("mooncake.master")

__all__ = ["AUTH_REQUIRED", "AuthHost", "auth_step"]

AUTH_REQUIRED = (
    "authentication required: this master needs the cluster secret (MOONCAKE_CLUSTER_SECRET)"
)


class _FrameLimit(Protocol):
    @property
    def max_frame(self) -> int: ...


class AuthHost(Protocol):
    """What the handshake asks of the server (a :class:`~mooncake._store.master.MasterServer`)."""

    auth_failures: int

    @property
    def config(self) -> _FrameLimit: ...
    @property
    def secret(self) -> bytes | None: ...
    @property
    def tenant_bindings(self) -> TenantBindings: ...


def auth_step(
    server: AuthHost,
    req: rpc.Request,
    authed: bool,
    nonces: tuple[bytes, bytes] | None,
    sock: socket.socket | None = None,
) -> tuple[bytes, bool, tuple[bytes, bytes] | None, bool]:
    """One request of a connection not yet authenticated (or an auth method):
    (reply, authenticated now, pending nonces, close the connection after the reply)."""
    mf = server.config.max_frame

    def refuse(text: str) -> tuple[bytes, bool, None, bool]:
        server.auth_failures += 1
        log.warning("master: refusing a connection: %s", text)
        return (
            rpc.encode_error(req.id, ErrorCode.RPC_FAIL, text, max_frame=mf),
            False,
            None,
            True,
        )

    if server.secret is None and server.tenant_bindings.secret is None:
        text = "no cluster secret is configured on this master"
        return (
            rpc.encode_error(req.id, ErrorCode.NOT_SUPPORTED, text, max_frame=mf),
            authed,
            None,
            False,
        )
    try:
        params = rpc.decode_params(req)
    except MooncakeError:
        params = None
    if authed and not server.tenant_bindings.binding_hello(params, nonces):
        return (
            rpc.encode_error(req.id, ErrorCode.RPC_FAIL, "already authenticated", max_frame=mf),
            True,
            None,
            False,
        )
    if req.method == "AuthHello" and isinstance(params, rpc.AuthHelloParams) and nonces is None:
        if len(params.nonce) != auth.NONCE_BYTES:
            return refuse("bad client nonce")
        try:  # a tenant's key instead of the secret: the connection is bound to it
            key = server.tenant_bindings.hello_key(server.secret, sock, params.tenant)
        except MooncakeError as e:
            return refuse(str(e))
        sn = auth.new_nonce()
        proof = auth.server_proof(key, "rpc", params.nonce, sn)
        reply = rpc.encode_result(req.id, rpc.AuthChallenge(nonce=sn, proof=proof), max_frame=mf)
        return reply, False, (params.nonce, sn), False
    if req.method == "AuthProve" and isinstance(params, rpc.AuthProveParams) and nonces:
        key, tenant = server.tenant_bindings.prove_key(server.secret, sock)
        expected = auth.client_proof(key, "rpc", nonces[0], nonces[1])
        if not auth.verify(expected, params.proof):
            return refuse("authentication failed: wrong cluster secret")
        server.tenant_bindings.bind(sock, tenant)
        return rpc.encode_result(req.id, None, max_frame=mf), True, None, False
    return refuse(AUTH_REQUIRED)
