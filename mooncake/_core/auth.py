"""The opt-in cluster secret: HMAC-SHA256 challenge-response with nonces from both sides.

Sans-I/O: this module makes and checks nonces and proofs; each protocol (P2P handshake, master
RPC, HTTP metadata) carries them in its own frames (``docs/protocol.md``, "Cluster secret").

With a secret set (``MOONCAKE_CLUSTER_SECRET``, or passed explicitly), every connection runs::

    client -> server   client_nonce (32 random bytes)
    server -> client   server_nonce (32 random bytes), server_proof
    client -> server   client_proof (bound to the request that follows, where there is one)

    server_proof = HMAC-SHA256(secret, "mooncake-auth-v1" 0x00 "server" 0x00 channel 0x00
                                       client_nonce server_nonce SHA256(b""))
    client_proof = HMAC-SHA256(secret, "mooncake-auth-v1" 0x00 "client" 0x00 channel 0x00
                                       client_nonce server_nonce SHA256(bound))

``channel`` names the protocol (``handshake``, ``rpc``, ``http``) so a proof made for one cannot be
replayed on another; fresh nonces from both sides mean a recorded exchange cannot be replayed.
Both sides prove knowledge of the secret (mutual), and the secret never crosses the wire. It
gives authentication of who may talk, not confidentiality: the traffic itself is not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "MOONCAKE_CLUSTER_SECRET"
TENANT_SECRET_ENV = "MOONCAKE_TENANT_SECRET"
TENANT_AUTH_SECRET_ENV = "MOONCAKE_TENANT_AUTH_SECRET"
NONCE_BYTES = 32
PROOF_BYTES = 32
_TAG = b"mooncake-auth-v1"

__all__ = [
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SECRET_ENV",
    "TENANT_AUTH_SECRET_ENV",
    "TENANT_SECRET_ENV",
    "check_hex",
    "client_proof",
    "load_secret",
    "new_nonce",
    "server_proof",
    "tenant_key",
    "verify",
]


def load_secret(explicit: str | bytes | None = None) -> bytes | None:
    """The cluster secret: ``explicit`` if given (``""`` = none), else ``$MOONCAKE_CLUSTER_SECRET``;
    ``None`` when unset or empty (authentication off)."""
    raw: str | bytes | None = explicit if explicit is not None else os.environ.get(SECRET_ENV)
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    return data or None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(secret: bytes, role: bytes, channel: str, cn: bytes, sn: bytes, bound: bytes) -> bytes:
    msg = b"\0".join((_TAG, role, channel.encode())) + b"\0" + cn + sn
    return hmac.new(secret, msg + hashlib.sha256(bound).digest(), hashlib.sha256).digest()


def server_proof(secret: bytes, channel: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(secret, b"server", channel, client_nonce, server_nonce, b"")


def client_proof(
    secret: bytes, channel: str, client_nonce: bytes, server_nonce: bytes, bound: bytes = b""
) -> bytes:
    return _mac(secret, b"client", channel, client_nonce, server_nonce, bound)


def tenant_key(secret: bytes, tenant: str) -> bytes:
    """The key of ``tenant`` derived from ``secret`` (the master's tenant secret
    ``MOONCAKE_TENANT_AUTH_SECRET``, else the cluster secret; hex text, as bytes)::

        tenant_key = hex(HMAC-SHA256(secret, "mooncake-tenant-v1" 0x00 tenant))

    A client given only this key (``MOONCAKE_TENANT_SECRET``) authenticates to the master as
    ``tenant`` (``AuthHello`` names it; both proofs use this key instead of the secret) and the
    master binds the connection to it: it cannot derive another tenant's key, nor ``secret``.
    """
    msg = _TAG.replace(b"auth", b"tenant") + b"\0" + tenant.encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest().encode()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)


def check_hex(value: object, nbytes: int, what: str) -> bytes:
    """``value`` as bytes if it is a hex string of exactly ``nbytes`` bytes, else ValueError."""
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise ValueError(f"{what} must be {2 * nbytes} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{what} must be {2 * nbytes} hex digits") from None
