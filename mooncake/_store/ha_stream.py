"""Synchronous replication of a leader's log entries into its standbys' memory
(``--ha_ack_mode=replica``); etcd stays the one place of election, fencing and the durable log.

Leader: listens on an ephemeral TCP port of its RPC address and names it in the etcd key
``stream`` (``{"addr": "host:port", "term": T}``, written fenced by its term). Every log entry
(a group-committed batch of commands, with the seq it gets in etcd) is sent at once to every
connected standby; the etcd log is written behind, in order, several entries a txn (while the
in-sync set is not empty, an append waits up to ``etcd_linger`` seconds for more). A mutation is
acknowledged once its entry is in etcd **or** every member of the in-sync set (``isr`` key,
``{"term": T, "members": [...]}``, written fenced) has acknowledged holding it (with an empty
set: only etcd counts). A standby joins the set when it has acknowledged every entry sent; one
that is gone, or has left an entry unacknowledged for ``sync_timeout`` seconds, is removed
(after every entry acknowledged through the set is in etcd, so no acknowledged entry is held
by the leader alone once the set no longer names the standby).

Standby: connects to the ``stream`` of the term it follows, says ``hello`` (its address and that
term), keeps each entry it receives in memory and acknowledges it (one acknowledgement for the
last of the frames that arrived together). The leader tells it how far etcd holds its log (with
every entry, and an ``etcd`` frame when the etcd append advances): the standby applies the
entries it holds up to there from memory (an entry is written to etcd once, by this term's
leader, so they are the bytes etcd holds) and, while its stream is up, does not watch the etcd
log (the follow loop's poll still reads what it lacks from etcd). A master campaigns only if ``isr`` names it or names nobody, so a winner holds
every acknowledged entry: before it serves, it appends the entries it holds beyond the etcd log
(fenced by its own term) and applies them, then writes an empty in-sync set.

Frames: 4-byte big-endian length, then msgpack: ``["hello", addr, term]``, ``["ack", seq]``
(standby to leader), ``["entry", seq, data, etcd_seq]``, ``["etcd", etcd_seq]`` (leader to
standby; ``etcd_seq``: every entry up to it is in etcd).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from mooncake._core.commitlog import MAX_ENTRY
from mooncake._store.ha_base import LogGap
from mooncake.errors import MetadataError, ProtocolError

if TYPE_CHECKING:
    from mooncake._store.ha_base import StreamNode

log = logging.getLogger("mooncake.master.ha")

__all__ = ["HeldEntries", "ReplicaLeader", "follow_stream", "read_isr", "start_replica"]

_LEN = struct.Struct(">I")
#: what ends a replication connection (logged, never raised out of its task)
_ENDS: tuple[type[BaseException], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
    ProtocolError,
    TimeoutError,
    msgspec.DecodeError,
    ValueError,
    IndexError,
    TypeError,
)
_MAX_FRAME = 4 << 20
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
#: how often a standby re-checks the term it streams (and the leader its in-sync set)
_CHECK_S = 0.05
#: entries one etcd txn appends (each is a compare and a put; etcd allows 128 operations)
MAX_TXN_ENTRIES = 50


def _frame(obj: Any) -> bytes:
    data = _enc.encode(obj)
    return _LEN.pack(len(data)) + data


class _Reader:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    def buffered(self) -> bool:
        """Whether a whole frame is buffered already (:meth:`read` returns without I/O)."""
        if len(self.buf) < 4:
            return False
        n: int = _LEN.unpack_from(self.buf)[0]
        return len(self.buf) >= 4 + n

    async def read(self) -> list[Any]:
        while True:
            if len(self.buf) >= 4:
                (n,) = _LEN.unpack_from(self.buf)
                if n > _MAX_FRAME:
                    raise ProtocolError(f"replication frame of {n} bytes")
                if len(self.buf) >= 4 + n:
                    obj = _dec.decode(bytes(self.buf[4 : 4 + n]))
                    del self.buf[: 4 + n]
                    if not isinstance(obj, list) or not obj:
                        raise ProtocolError("bad replication frame")
                    return obj
            self.buf += await self.stream.receive()


def read_isr(value: bytes | None) -> list[str]:
    """The members of an ``isr`` key's value ([] when absent or empty)."""
    if not value:
        return []
    try:
        members = json.loads(value).get("members") or []
    except (ValueError, AttributeError):
        return []
    return [str(m) for m in members]


class _Peer:
    def __init__(self, addr: str, stream: anyio.abc.SocketStream) -> None:
        self.addr = addr
        self.stream = stream
        #: framed messages to send, in order (queued ones go out in one send)
        self.send, self.recv = anyio.create_memory_object_stream[bytes](math.inf)


class ReplicaLeader:
    """The leader's half: the stream listener, the entries not yet in etcd, the in-sync set."""

    def __init__(self, node: StreamNode) -> None:
        self.node = node
        self.term = node.term
        self.port = 0
        self.peers: dict[str, _Peer] = {}
        self.acked: dict[str, int] = {}
        self.unflushed: dict[int, bytes] = {}
        self.sent_at: dict[int, float] = {}
        self.last_seq = node.applied_seq
        self.etcd_seq = node.applied_seq
        self.isr: frozenset[str] = frozenset()
        self.joining: frozenset[str] = frozenset()
        """Standbys being added to the set: acknowledgements wait for them already."""
        self.changed = anyio.Event()
        self.flush = anyio.Event()
        self.hurry = anyio.Event()
        """Set: the etcd append may not linger (something waits for ``etcd_seq``)."""

    # -- entries -----------------------------------------------------------------------------

    def publish(self, seq: int, data: bytes) -> None:
        """Send a new entry to every standby and queue it for etcd."""
        self.unflushed[seq] = data
        self.sent_at[seq] = anyio.current_time()
        self.last_seq = seq
        if self.peers:
            frame = _frame(["entry", seq, data, self.etcd_seq])
            for p in self.peers.values():
                p.send.send_nowait(frame)
        self.flush.set()
        if len(self.unflushed) >= MAX_TXN_ENTRIES:
            self.hurry.set()

    def isr_seq(self) -> int:
        """Every entry up to this seq is held by every in-sync standby (0: the set is empty)."""
        members = self.isr | self.joining
        if not self.isr:
            return 0
        return min(self.acked.get(a, 0) for a in members)

    def ack_seq(self) -> int:
        return max(self.etcd_seq, self.isr_seq())

    def take(self, budget: int) -> list[tuple[int, bytes]]:
        """The next entries for etcd (in order, at most ``budget`` bytes, at least one)."""
        out: list[tuple[int, bytes]] = []
        size = 0
        seq = self.etcd_seq + 1
        while seq in self.unflushed:
            data = self.unflushed[seq]
            if out and (size + len(data) > budget or len(out) >= MAX_TXN_ENTRIES):
                break
            out.append((seq, data))
            size += len(data)
            seq += 1
        return out

    def flushed(self, upto: int) -> None:
        """Every entry up to ``upto`` is in etcd: forget them, tell the standbys (they apply
        what they hold up to there)."""
        for seq in [s for s in self.unflushed if s <= upto]:
            del self.unflushed[seq]
            self.sent_at.pop(seq, None)
        if upto > self.etcd_seq:
            self.etcd_seq = upto
            frame = _frame(["etcd", upto])
            for p in self.peers.values():
                p.send.send_nowait(frame)

    async def write_etcd(self) -> None:
        """Append the published entries to the etcd log, in order, several a txn.

        While the in-sync set is not empty (acknowledgements do not wait for etcd) an append
        waits until its first entry is ``etcd_linger`` seconds old, :data:`MAX_TXN_ENTRIES`
        entries are waiting, or :attr:`hurry` is set, so one txn (one fsync, one watch event
        for each master) carries many entries instead of one."""
        node = self.node
        linger = node.config.etcd_linger
        while node.role == "leader":
            self.flush = anyio.Event()
            items = self.take(MAX_ENTRY)
            if not items:
                with anyio.move_on_after(0.1):
                    await self.flush.wait()
                continue
            if linger > 0 and self.isr and len(items) < MAX_TXN_ENTRIES:
                wait = self.sent_at.get(items[0][0], 0.0) + linger - anyio.current_time()
                if wait > 0 and not self.hurry.is_set():
                    with anyio.move_on_after(wait):
                        await self.hurry.wait()
                items = self.take(MAX_ENTRY)
            self.hurry = anyio.Event()
            refused = await node.append_entries(items)
            if refused is not None:
                node.step_down(refused)
                return
            self.flushed(items[-1][0])
            node.replica_progress()

    def _changed(self) -> None:
        ev, self.changed = self.changed, anyio.Event()
        ev.set()

    # -- the listener --------------------------------------------------------------------------

    async def serve(
        self, host: str, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host=host or "0.0.0.0", local_port=0)
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        task_status.started()
        await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        reader = _Reader(stream)
        peer: _Peer | None = None
        try:
            with anyio.fail_after(5):
                hello = await reader.read()
            if hello[0] != "hello" or len(hello) != 3 or hello[2] != self.term:
                return
            addr = str(hello[1])
            old = self.peers.get(addr)
            if old is not None:
                await old.stream.aclose()
            peer = _Peer(addr, stream)
            self.peers[addr] = peer
            # it holds what etcd holds; everything else is sent to it now
            first = min(self.unflushed, default=self.last_seq + 1)
            self.acked[addr] = first - 1
            for seq, data in self.unflushed.items():
                peer.send.send_nowait(_frame(["entry", seq, data, self.etcd_seq]))
            self._changed()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write, peer, tg.cancel_scope)
                try:
                    while True:
                        msg = await reader.read()
                        if msg[0] == "ack" and len(msg) == 2:
                            self.acked[addr] = max(self.acked.get(addr, 0), int(msg[1]))
                            self.node.replica_progress()
                except _ENDS as e:
                    log.info("master HA: replication stream to %s ended: %r", addr, e)
                finally:
                    tg.cancel_scope.cancel()
        except _ENDS:
            pass
        finally:
            if peer is not None and self.peers.get(peer.addr) is peer:
                del self.peers[peer.addr]
                self._changed()
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _write(self, peer: _Peer, scope: anyio.CancelScope) -> None:
        try:
            async for frame in peer.recv:
                parts = [frame]
                while True:  # what queued meanwhile goes in the same send
                    try:
                        parts.append(peer.recv.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await peer.stream.send(parts[0] if len(parts) == 1 else b"".join(parts))
        except _ENDS:
            pass
        scope.cancel()

    # -- the in-sync set -----------------------------------------------------------------------

    async def keep_isr(self) -> None:
        """Add standbys that caught up, remove those gone or lagging (written fenced)."""
        cfg = self.node.config
        while self.node.role == "leader":
            with anyio.move_on_after(_CHECK_S):
                await self.changed.wait()
            now = anyio.current_time()
            want = set(self.isr)
            for addr in self.peers:
                # it holds every entry acknowledged so far (and from now on, acknowledgements
                # wait for it too: ``joining``), so it may lead after the write
                if addr not in want and self.acked.get(addr, 0) >= self.ack_seq():
                    want.add(addr)
            drop = set()
            for addr in self.isr:
                nxt = self.acked.get(addr, 0) + 1
                sent = self.sent_at.get(nxt)
                if addr not in self.peers or (sent is not None and now - sent > cfg.sync_timeout):
                    drop.add(addr)
            if drop:
                # nothing acknowledged through the set may rest on the leader alone
                target = self.isr_seq()
                while self.etcd_seq < target and self.node.role == "leader":
                    self.flush.set()
                    self.hurry.set()
                    await anyio.sleep(0.005)
                want -= drop
            if want != set(self.isr):
                members = frozenset(want)
                self.joining = members - self.isr
                try:
                    if not await self.node.write_replica_keys(members, None):
                        return
                finally:
                    self.joining = frozenset()
                if drop:
                    log.warning("master HA: standbys %s left the in-sync set", sorted(drop))
                self.isr = members
                self.node.replica_progress()


async def start_replica(node: StreamNode, tg: anyio.abc.TaskGroup) -> ReplicaLeader | None:
    """A new ``replica`` leader, before it serves: append and apply the entries it holds
    beyond the log (every entry the last leader acknowledged), then open the stream (in
    ``tg``) and name it with an empty in-sync set. None: it stepped down meanwhile; else the
    stream's leader half, whose :meth:`~ReplicaLeader.write_etcd` and
    :meth:`~ReplicaLeader.keep_isr` the caller runs."""
    held, node.held = node.held, {}
    first = seq = node.applied_seq + 1
    while seq in held:
        chunk: list[tuple[int, bytes]] = []
        size = 0
        while seq in held and len(chunk) < MAX_TXN_ENTRIES:
            if chunk and size + len(held[seq]) > MAX_ENTRY:
                break
            chunk.append((seq, held[seq]))
            size += len(held[seq])
            seq += 1
        refused = await node.append_entries(chunk)  # several a txn, as the stream wrote
        if refused is not None:
            node.step_down(refused)
            return None
        for s, data in chunk:
            node.apply_entry(s, data)
            node.latest_seq = s
    node.adopted += seq - first
    if seq > first:
        log.info("master HA: appended %d held entries (%d to %d)", seq - first, first, seq - 1)
    rep = ReplicaLeader(node)
    await tg.start(rep.serve, node.listen_host)
    host = node.address.rpartition(":")[0]
    if not await node.write_replica_keys(frozenset(), f"{host}:{rep.port}"):
        node.step_down("a newer leader holds master_view (stream key fenced)")
        return None
    return rep


class HeldEntries:
    """A ``replica`` standby's streamed entries, applied up to the leader's etcd watermark."""

    def __init__(self, node: StreamNode) -> None:
        self.node = node
        self.target = 0
        self.applied = 0
        """Entries applied from the stream (the rest came from the log)."""
        self._wanted = anyio.Event()

    def durable_upto(self, committed: int) -> None:
        """The leader says its log holds every entry up to ``committed``."""
        node = self.node
        if node.role != "standby" or committed <= self.target:
            return
        node.latest_seq = max(node.latest_seq, committed)
        self.target = committed
        self._wanted.set()

    async def run(self) -> None:
        """Apply held entries up to the watermark, one per scheduler turn (so the stream
        reader acknowledges what arrives meanwhile without waiting for a burst); a seq not
        held (from before the stream began) or one that does not decode wakes the follow
        loop, which reads it from the log (and reloads on a bad one)."""
        node = self.node
        while True:
            await self._wanted.wait()
            self._wanted = anyio.Event()
            while node.role == "standby" and node.applied_seq < self.target:
                data = node.held.get(node.applied_seq + 1)
                if data is None:
                    node.wake()
                    break
                try:
                    node.apply_entry(node.applied_seq + 1, data)
                except LogGap:
                    node.wake()
                    break
                self.applied += 1
                await anyio.lowlevel.checkpoint()


async def follow_stream(node: StreamNode) -> None:
    """A standby's half: stream the entries of the leader it follows into ``node.held``."""
    while True:
        try:
            await _follow_once(node)
        except Exception:  # a bug here must not take the master down
            log.exception("master HA: following the replication stream failed")
            await anyio.sleep(1.0)


async def _follow_once(node: StreamNode) -> None:
    while True:
        await anyio.sleep(_CHECK_S * 2)
        term = node.stream_term()
        if not term:
            continue
        try:
            spec = await node.log.read_stream()
        except MetadataError:
            continue
        if spec is None:
            continue
        addr, sterm = spec
        if sterm != term:
            continue
        host, _, port = addr.rpartition(":")
        try:
            with anyio.fail_after(2):
                stream = await anyio.connect_tcp(host.strip("[]"), int(port))
        except (OSError, TimeoutError, ValueError):
            continue
        # entries of an older term not in etcd were never acknowledged (the new leader holds
        # and appended every one that was): only this term's stream counts from now on
        if node.held_term != term:
            node.held.clear()
            node.held_term = term
        try:
            await _stream(node, stream, term, addr)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()


async def _stream(node: StreamNode, stream: anyio.abc.SocketStream, term: int, addr: str) -> None:
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while node.stream_term() == term:  # noqa: ASYNC110 (polls the followed term)
                await anyio.sleep(_CHECK_S)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            await stream.send(_frame(["hello", node.address, term]))
            node.streaming = True
            reader = _Reader(stream)
            unacked = 0
            while True:
                msg = await reader.read()
                if msg[0] == "etcd" and len(msg) == 2:
                    committed = int(msg[1])
                elif msg[0] == "entry":
                    seq, data = int(msg[1]), bytes(msg[2])
                    if seq > node.applied_seq:
                        node.held[seq] = data
                    unacked = seq
                    committed = int(msg[3]) if len(msg) > 3 else 0
                else:
                    raise ProtocolError(f"unexpected replication frame {msg[0]!r}")
                if unacked and not reader.buffered():  # one ack for what came together
                    await stream.send(_frame(["ack", unacked]))
                    unacked = 0
                node.apply_held(committed)
        except _ENDS as e:
            log.info("master HA: replication stream from %s ended: %r", addr, e)
        finally:
            node.streaming = False
            tg.cancel_scope.cancel()
