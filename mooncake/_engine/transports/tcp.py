"""The ``tcp`` transport: Mooncake's TCP data protocol v2, both ends.

Server: one listening socket on the engine's host; one task per connection, each serving
pipelined requests in order, straight from/into registered memory (no intermediate copies). A
request outside one registered buffer is refused with status 1; unlike the published server we
keep the connection (a refused WRITE's payload, up to ``DRAIN_LIMIT``, is read and dropped), so
one bad request costs its sender nothing else. v1 requests (no status frame) get the connection
closed on a refusal, since v1 has no way to say no.

Client: up to ``lanes`` connections per peer. A batch is split by opcode into groups of at most
``PIPELINE_DEPTH`` requests spread over the lanes by bytes; each lane sends a group's headers (and
WRITE payloads) in one ``writev`` stream, then reads the replies in order. Because a group holds
one opcode and at most ``PIPELINE_DEPTH`` replies, neither side can block the other on a full
socket buffer. A published server closes after a refusal, so requests behind a refused one on the
same lane are re-sent on a fresh connection.

Cancellation: a lane that is cancelled mid-group is closed, never reused; the peer may have
written part of a WRITE's bytes, and no bytes arrive into local memory after the call returns.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
from typing import Any

import anyio

from mooncake._core import tcpwire
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, completed, failed
from mooncake._engine import _sockio
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake.errors import (
    MooncakeError,
    PeerDiedError,
    ProtocolError,
    RemoteAccessError,
    TransferError,
)

log = logging.getLogger("mooncake.tcp")

PIPELINE_DEPTH = 256
DEFAULT_LANES = 4  # MC_TCP_LANES_PER_PEER
DRAIN_LIMIT = 64 << 20
MAX_CONNECTIONS = 1024


class _Lane:
    """One client connection to a peer's data port."""

    __slots__ = ("hdr", "sock", "status")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.hdr = _sockio.Scratch(tcpwire.HEADER_SIZE * PIPELINE_DEPTH)
        self.status = _sockio.Scratch(tcpwire.STATUS_SIZE * PIPELINE_DEPTH)

    def close(self) -> None:
        _sockio.close(self.sock)


class _PeerLanes:
    """Idle lanes of one peer plus a limiter on how many exist."""

    def __init__(self, lanes: int) -> None:
        self.idle: list[_Lane] = []
        self.limiter = anyio.CapacityLimiter(lanes)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for lane in self.idle:
            lane.close()
        self.idle.clear()


class TcpTransport(Transport):
    name = "tcp"
    priority = 10
    wire_protocol = "tcp"

    def __init__(self, engine: Any, *, lanes: int = DEFAULT_LANES, port: int = 0) -> None:
        super().__init__(engine)
        self.lanes = max(1, lanes)
        self._port = port
        self._listener: socket.socket | None = None
        self._conns = anyio.CapacityLimiter(MAX_CONNECTIONS)
        self.served_connections = 0
        self.refused_requests = 0

    # -- server ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._listener is not None, "transport not started"
        return int(self._listener.getsockname()[1])

    async def start(self) -> None:
        host = self.engine.bind_host
        infos = await anyio.getaddrinfo(host, self._port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        sock = socket.socket(family, stype, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.engine.task_group.start_soon(self._accept_loop, sock, name="tcp-accept")

    def descriptor_fields(self) -> dict[str, Any]:
        return {
            "tcp_data_host": self.engine.hostname,
            "tcp_data_port": self.port,
            "tcp_proto_version": tcpwire.PROTO_VERSION,
        }

    async def _accept_loop(self, lsock: socket.socket) -> None:
        async with anyio.create_task_group() as tg:
            try:
                while True:
                    await anyio.wait_readable(lsock)
                    try:
                        conn, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            log.warning("tcp accept: %s; backing off", e)
                            await anyio.sleep(0.05)
                            continue
                        raise
                    _sockio.tune(conn)
                    tg.start_soon(self._serve_conn, conn)
            finally:
                tg.cancel_scope.cancel()
                _sockio.close(lsock)
                self._listener = None

    async def _serve_conn(self, sock: socket.socket) -> None:
        self.served_connections += 1
        scratch = _sockio.Scratch(4096)
        registry = self.engine.registry
        try:
            async with self._conns:
                while True:
                    try:
                        raw = await _sockio.recv_exact(sock, tcpwire.HEADER_SIZE, scratch, "header")
                    except PeerDiedError:
                        return  # client went away between requests: normal end
                    hdr = tcpwire.decode_header(raw)
                    region = registry.find(hdr.addr, hdr.size) if hdr.size > 0 else None
                    if region is None or not region.remote_accessible:
                        self.refused_requests += 1
                        log.debug("refusing %s [%#x, +%d)", hdr.opcode.name, hdr.addr, hdr.size)
                        if not hdr.v2:
                            return
                        if hdr.opcode is Opcode.WRITE:
                            if hdr.size > DRAIN_LIMIT:
                                await self._send(
                                    sock, tcpwire.encode_status(tcpwire.Status.REJECTED)
                                )
                                return
                            await self._drain(sock, hdr.size, scratch)
                        await self._send(sock, tcpwire.encode_status(tcpwire.Status.REJECTED))
                        continue
                    region.users += 1
                    try:
                        if hdr.opcode is Opcode.WRITE:
                            await _sockio.recv_into_addr(sock, hdr.addr, hdr.size, "write payload")
                            if hdr.v2:
                                await self._send(sock, tcpwire.encode_status(tcpwire.Status.OK))
                        else:
                            addrs = [hdr.addr]
                            lens = [hdr.size]
                            if hdr.v2:
                                st = tcpwire.encode_status(tcpwire.Status.OK)
                                scratch.put(0, st)
                                addrs.insert(0, scratch.addr)
                                lens.insert(0, 8)
                            await _sockio.send_addrs(sock, addrs, lens, "read payload")
                    finally:
                        self.engine.release_region(region)
        except (MooncakeError, OSError) as e:
            log.debug("tcp connection dropped: %s", e)
        finally:
            _sockio.close(sock)

    async def _send(self, sock: socket.socket, data: bytes) -> None:
        scratch = _sockio.Scratch(len(data))
        scratch.put(0, data)
        await _sockio.send_addrs(sock, [scratch.addr], [len(data)], "status")

    async def _drain(self, sock: socket.socket, n: int, scratch: _sockio.Scratch) -> None:
        while n > 0:
            chunk = min(n, scratch.size)
            await _sockio.recv_into_addr(sock, scratch.addr, chunk, "refused payload")
            n -= chunk

    # -- client ---------------------------------------------------------------------------

    def can_reach(self, peer: PeerInfo) -> bool:
        return peer.descriptor.tcp_data_port > 0

    def _lanes_of(self, peer: PeerInfo) -> _PeerLanes:
        pl = peer.state.get(self.name)
        if pl is None or pl.closed:
            pl = peer.state[self.name] = _PeerLanes(self.lanes)
        assert isinstance(pl, _PeerLanes)
        return pl

    def forget_peer(self, peer: PeerInfo) -> None:
        pl = peer.state.pop(self.name, None)
        if isinstance(pl, _PeerLanes):
            pl.close()

    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        results: list[TransferResult | None] = [None] * len(requests)
        groups = _plan(requests, self.lanes)
        pl = self._lanes_of(peer)
        v2 = peer.descriptor.tcp_proto_version >= 2
        if len(groups) == 1:
            await self._run_group(peer, pl, requests, groups[0], results, v2)
        else:
            async with anyio.create_task_group() as tg:
                for g in groups:
                    tg.start_soon(self._run_group, peer, pl, requests, g, results, v2)
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    async def _run_group(
        self,
        peer: PeerInfo,
        pl: _PeerLanes,
        requests: Sequence[TransferRequest],
        group: list[int],
        results: list[TransferResult | None],
        v2: bool,
    ) -> None:
        pending = group
        attempts = 0
        while pending:
            attempts += 1
            async with pl.limiter:
                lane = pl.idle.pop() if pl.idle else None
                try:
                    if lane is None:
                        sock = await _sockio.connect(peer.data_host, peer.descriptor.tcp_data_port)
                        lane = _Lane(sock)
                    done, reusable = await self._pipeline(lane, requests, pending, results, v2)
                except MooncakeError as e:
                    if lane is not None:
                        lane.close()
                    for i in pending:
                        if results[i] is None:
                            results[i] = failed(e)
                    return
                except BaseException:
                    if lane is not None:
                        lane.close()
                    raise
                if reusable and not pl.closed:
                    pl.idle.append(lane)
                else:
                    lane.close()
            # A published server closes after a refusal: the rest go again on a new lane, as
            # long as each attempt makes progress.
            rest = pending[done:]
            if rest and done == 0 and attempts > 1:
                for i in rest:
                    results[i] = failed(PeerDiedError(f"{peer.segment}: connection lost"))
                return
            pending = rest

    async def _pipeline(
        self,
        lane: _Lane,
        requests: Sequence[TransferRequest],
        idx: list[int],
        results: list[TransferResult | None],
        v2: bool,
    ) -> tuple[int, bool]:
        """Send ``idx``'s requests on ``lane`` and collect replies.

        Returns (how many of ``idx`` got a definite result, whether the lane can be reused).
        """
        sock = lane.sock
        op = requests[idx[0]].opcode
        addrs: list[int] = []
        lens: list[int] = []
        hbuf = lane.hdr
        for k, i in enumerate(idx):
            r = requests[i]
            off = k * tcpwire.HEADER_SIZE
            tcpwire.HEADER.pack_into(
                hbuf.buf, off, r.length, r.remote_addr, int(op) | (tcpwire.V2_FLAG if v2 else 0)
            )
            addrs.append(hbuf.addr + off)
            lens.append(tcpwire.HEADER_SIZE)
            if op is Opcode.WRITE:
                addrs.append(r.local_addr)
                lens.append(r.length)
        await _sockio.send_addrs(sock, addrs, lens, "request")

        st = lane.status
        if not v2:
            # v1: no status frames; READ data follows directly, WRITE has no reply at all.
            if op is Opcode.READ:
                for i in idx:
                    r = requests[i]
                    await _sockio.recv_into_addr(sock, r.local_addr, r.length, "read data")
                    results[i] = completed(r.length)
            else:
                for i in idx:
                    results[i] = completed(requests[i].length)
            return len(idx), True

        last_refused = False
        for k, i in enumerate(idx):
            r = requests[i]
            try:
                raw = await _sockio.recv_exact(sock, tcpwire.STATUS_SIZE, st, "status")
            except PeerDiedError:
                if last_refused:
                    return k, False  # a published server closes after a refusal
                raise
            code = tcpwire.decode_status(raw)
            if code == tcpwire.Status.OK and op is Opcode.READ:
                await _sockio.recv_into_addr(sock, r.local_addr, r.length, "read data")
            results[i] = _status_result(code, r)
            last_refused = code != tcpwire.Status.OK
        return len(idx), True

    async def aclose(self) -> None:
        if self._listener is not None:  # never started serving
            _sockio.close(self._listener)
            self._listener = None


def _status_result(code: int, r: TransferRequest) -> TransferResult:
    if code == tcpwire.Status.OK:
        return completed(r.length)
    if code == tcpwire.Status.REJECTED:
        return failed(
            RemoteAccessError(
                f"peer refused {r.opcode.name} of [{r.remote_addr:#x}, +{r.length}): "
                "not inside one of its registered buffers"
            )
        )
    raise ProtocolError(f"unknown TCP status code {code}")


def _plan(requests: Sequence[TransferRequest], lanes: int) -> list[list[int]]:
    """Split request indices into single-opcode groups of <= PIPELINE_DEPTH, balanced by bytes."""
    by_op: dict[Opcode, list[int]] = {}
    for i, r in enumerate(requests):
        by_op.setdefault(r.opcode, []).append(i)
    groups: list[list[int]] = []
    for idx in by_op.values():
        total = sum(requests[i].length for i in idx)
        n = max(1, min(lanes, len(idx)))
        # small batches are latency-bound: one lane, one round trip
        if total < (256 << 10):
            n = 1
        target = total / n
        cur: list[int] = []
        acc = 0
        made = 0
        for i in idx:
            cur.append(i)
            acc += requests[i].length
            if len(cur) >= PIPELINE_DEPTH or (acc >= target and made < n - 1):
                groups.append(cur)
                made += 1
                cur = []
                acc = 0
        if cur:
            groups.append(cur)
    return groups
