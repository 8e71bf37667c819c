"""A PutStart refused only because space is *held* waits for it instead of failing.

The master defers the free of a removed or replaced version while a read window on it is open
(:mod:`mooncake._core.master`, "Read window"), and of a revoked write for ``put_revoke_hold``.
Mooncake frees a force-removed object at once, so a client that removes what it just read and
puts again expects the space back. When the state refuses a ``PutStart``/``UpsertStart`` (or
a whole batch of them) for lack of space and reports (``space_held_until``) that enough held
bytes come back by a time within ``default_kv_lease_ttl``, the server holds that answer,
sleeps until then (plus one sweep interval, so the sweeper has freed them) and runs the call
again; it answers whatever the last try gives, and stops trying once the lease TTL has passed
since the first refusal. Only the refused connection waits: its later requests are answered
after it, in order, as always; other connections are not held up.
"""

from __future__ import annotations

import socket
from typing import Protocol

import anyio

from mooncake._core import rpc

__all__ = ["PUT_STARTS", "answer_put_start", "held_refusal"]

#: the methods whose refusal for held space is waited out
PUT_STARTS = frozenset({"PutStart", "UpsertStart", "BatchPutStart", "BatchUpsertStart"})


class _HeldState(Protocol):
    space_held_until: float


class _Server(Protocol):
    @property
    def state(self) -> _HeldState: ...

    def now(self) -> float: ...

    def execute(
        self,
        req: rpc.Request,
        now: float,
        matched: list[str] | None = ...,
        sock: socket.socket | None = ...,
        *,
        fresh: bool = ...,
    ) -> tuple[bytes, int]: ...


def held_refusal(state: _HeldState) -> float:
    """When the held space the last call was refused for comes back (0.0: it was not
    refused for held space); resets the mark."""
    until = state.space_held_until
    state.space_held_until = 0.0
    return until


async def answer_put_start(
    server: _Server,
    req: rpc.Request,
    sock: socket.socket | None,
    *,
    limit_s: float,
    sweep_s: float,
    refused_until: float = 0.0,
    reply: bytes | None = None,
) -> tuple[bytes, int]:
    """Answer the put-start ``req``, waiting out refusals for held space (module doc) for at
    most ``limit_s`` seconds; ``reply``/``refused_until``: a first answer already computed
    (by a serving thread) and its refusal time. Returns (framed reply, log ticket)."""
    ticket = 0
    until = refused_until
    if reply is None:
        held_refusal(server.state)
        reply, ticket = server.execute(req, server.now(), sock=sock)
        until = held_refusal(server.state)
    deadline = server.now() + limit_s
    while 0 < until <= deadline:
        await anyio.sleep(max(until - server.now(), 0.0) + sweep_s)
        # the refused call changed nothing: it is run again, not answered from the dedup ledger
        reply, ticket = server.execute(req, server.now(), sock=sock, fresh=True)
        until = held_refusal(server.state)
    return reply, ticket
