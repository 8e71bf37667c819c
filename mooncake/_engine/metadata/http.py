"""``http://host:port/metadata``: Mooncake's HTTP metadata protocol (client side).

``GET|PUT|DELETE <url>?key=<key>``; PUT bodies are JSON (``Content-Type: application/json``);
200 means done, 404 means the key is missing. Any server speaking it works: ours
(:mod:`mooncake._engine.metadata.server`, ``mooncake metadata-server``), the published wheel's
aiohttp server, or the one embedded in a Mooncake master. No leases and no watches: a dead
engine's keys stay until it restarts under the same name (its stale entry is then replaced).

Timeouts follow the published client: 1.5 s to connect, 3 s per request. Every failure is a
:class:`MetadataError` naming the server and the key.

With a cluster secret (``MOONCAKE_CLUSTER_SECRET`` or ``secret=``) every request first fetches a
challenge and carries its proof (``X-Mooncake-Auth``; see :mod:`mooncake._core.auth`); a server
that does not take the secret, or does not know it, raises :class:`AuthError`.
"""

from __future__ import annotations

import json

import httpx

from mooncake._core import auth
from mooncake._engine.metadata.kv import KVStore
from mooncake.errors import AuthError, InvalidArgumentError, MetadataError, MooncakeError

CONNECT_S = 1.5
REQUEST_S = 3.0
#: bodies we accept from the server (descriptors of many buffers are large, but not this large)
MAX_REPLY = 64 << 20


class HttpKV(KVStore):
    def __init__(self, url: str, *, secret: str | bytes | None = None) -> None:
        u = httpx.URL(url)
        if u.scheme not in ("http", "https") or not u.host:
            raise InvalidArgumentError(f"metadata URL {url!r} needs http(s)://host[:port]/path")
        self.url = url
        self.secret = auth.load_secret(secret)
        self._client: httpx.AsyncClient | None = None

    def describe(self) -> str:
        return f"metadata server {self.url}"

    def _c(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(REQUEST_S, connect=CONNECT_S), trust_env=False
            )
        return self._client

    async def _request(self, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            req = self._c().build_request(
                method, self.url, params={"key": key}, content=body, headers=headers
            )
            if self.secret is not None:
                req.headers["X-Mooncake-Auth"] = await self._proof(req, body or b"")
            resp = await self._c().send(req, stream=True)
            try:
                chunks: list[bytes] = []
                n = 0
                async for chunk in resp.aiter_bytes():
                    n += len(chunk)
                    if n > MAX_REPLY:
                        raise MetadataError(
                            f"{self.describe()}: reply to {method} {key} exceeds {MAX_REPLY} bytes"
                        )
                    chunks.append(chunk)
                return resp.status_code, b"".join(chunks)
            finally:
                await resp.aclose()
        except httpx.HTTPError as e:
            raise MetadataError(
                f"{self.describe()} unreachable ({method} {key}): {type(e).__name__}: {e}"
            ) from None

    async def _proof(self, req: httpx.Request, body: bytes) -> str:
        """Fetch a challenge and return the ``X-Mooncake-Auth`` value for ``req``."""
        from mooncake._engine.metadata.server import http_auth_bound

        assert self.secret is not None
        cn = auth.new_nonce()
        r = await self._c().get(self.url, params={"auth_challenge": cn.hex()})
        try:
            obj = json.loads(r.content) if r.status_code == 200 else None
            if not isinstance(obj, dict):
                raise ValueError(f"HTTP {r.status_code}")
            sn = auth.check_hex(obj.get("nonce"), auth.NONCE_BYTES, "server nonce")
            sp = auth.check_hex(obj.get("proof"), auth.PROOF_BYTES, "server proof")
        except ValueError as e:
            raise AuthError(f"{self.describe()} does not take the cluster secret ({e})") from None
        if not auth.verify(auth.server_proof(self.secret, "http", cn, sn), sp):
            raise AuthError(f"{self.describe()} does not know the cluster secret")
        bound = http_auth_bound(req.method.encode(), req.url.raw_path, body)
        proof = auth.client_proof(self.secret, "http", cn, sn, bound)
        return f"{cn.hex()}:{sn.hex()}:{proof.hex()}"

    def _fail(self, method: str, key: str, status: int, body: bytes) -> MooncakeError:
        text = body[:200].decode("utf-8", "replace")
        if status == 401:
            return AuthError(f"{self.describe()}: {method} {key} refused: {text}")
        return MetadataError(f"{self.describe()}: {method} {key} -> HTTP {status}: {text}")

    async def get(self, key: str) -> bytes | None:
        status, body = await self._request("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise self._fail("GET", key, status, body)
        return body

    async def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        status, body = await self._request("PUT", key, value)
        if status != 200:
            raise self._fail("PUT", key, status, body)

    async def delete(self, key: str) -> bool:
        status, body = await self._request("DELETE", key)
        if status == 404:
            return False
        if status != 200:
            raise self._fail("DELETE", key, status, body)
        return True

    async def aclose(self) -> None:
        if self._client is not None:
            c, self._client = self._client, None
            await c.aclose()
