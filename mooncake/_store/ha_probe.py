"""Fast failover's probe (a standby's side): connect to the leader's RPC port every
``PROBE_INTERVAL`` s and revoke the lease of a leader whose port stopped listening.

The decision (when refusals mean a dead leader) is :mod:`mooncake._core.leader_probe`; this
module does the I/O: :func:`probe_connect` and :class:`LeaderProbe`, which asks its master
through callables what to probe and how to revoke, so it imports nothing of the HA node (the contract of
*why* a live leader is never revoked is in :mod:`mooncake._store.ha`).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable

import anyio

from mooncake._core.leader_probe import PROBE_INTERVAL, DeathDetector, ProbeOutcome
from mooncake.errors import MetadataError

log = logging.getLogger("mooncake.master.ha")

__all__ = ["LeaderProbe", "probe_connect"]


class LeaderProbe:
    """Probe the leader that ``target()`` names, ``(address, term)``, or nothing (None: this
    master is not a standby following another master). Once the detector calls the leader
    dead, ``revoke(term, address)`` revokes that term's lease if the view still belongs to it
    (:meth:`mooncake._store.ha_base.Election.revoke_term`); one that did calls
    ``on_revoke()``."""

    def __init__(
        self,
        revoke: Callable[[int, str], Awaitable[bool]],
        target: Callable[[], tuple[str, int] | None],
        on_revoke: Callable[[], None],
    ) -> None:
        self.revoke = revoke
        self.target = target
        self.on_revoke = on_revoke
        self.detector = DeathDetector()

    async def run(self) -> None:
        """Probe every ``PROBE_INTERVAL`` s until cancelled."""
        while True:
            await anyio.sleep(PROBE_INTERVAL)
            want = self.target()
            if want is None:
                self.detector.reset()
                continue
            addr, term = want
            outcome = await probe_connect(addr, PROBE_INTERVAL)
            if self.target() != want:
                continue  # the view changed while the probe ran: the outcome is stale
            if self.detector.observe(term, addr, outcome):
                try:
                    if await self.revoke(term, addr):
                        self.on_revoke()
                except MetadataError as e:
                    log.warning("master HA: revoking the dead leader's lease: %s", e)


def _split_address(addr: str) -> tuple[str, int] | None:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host else None


async def probe_connect(addr: str, within: float) -> ProbeOutcome:
    """One TCP connect to ``host:port`` (closed at once, nothing sent): ``REFUSED`` only for
    ECONNREFUSED from the first resolved address, ``ACCEPTED`` when it connects, ``OTHER`` for
    everything else (no answer ``within`` seconds, unreachable, bad address, resolution
    failure)."""
    hp = _split_address(addr)
    if hp is None:
        return ProbeOutcome.OTHER
    with anyio.move_on_after(within):
        try:
            infos = await anyio.getaddrinfo(hp[0], hp[1], type=socket.SOCK_STREAM)
        except OSError:
            return ProbeOutcome.OTHER
        if not infos:
            return ProbeOutcome.OTHER
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
            if err in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                await anyio.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        finally:
            sock.close()
        if err == 0:
            return ProbeOutcome.ACCEPTED
        return ProbeOutcome.REFUSED if err == errno.ECONNREFUSED else ProbeOutcome.OTHER
    return ProbeOutcome.OTHER
