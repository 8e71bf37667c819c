"""Follow a Mooncake master's KV event stream (``mooncake_master --enable_kv_events``).

::

    from mooncake.kv_events import KvEventSubscriber, Received, Gap, NewStream

    with KvEventSubscriber(["tcp://m1:5557", "tcp://m2:5557"],
                           replay_endpoints=["tcp://m1:5558", "tcp://m2:5558"]) as sub:
        while True:
            for note in sub.poll(timeout=1.0):
                if isinstance(note, Received):
                    for ev in note.batch.events:
                        index.apply(ev.event_type, ev.object_key, ev.medium)
                elif isinstance(note, NewStream) and note.resync:
                    index.rebuild_from_master()      # a leader change: what you hold may be stale
                elif isinstance(note, Gap) and not note.recovered:
                    index.rebuild_from_master()      # missed batches no longer in the buffer

Give every master of an HA cluster: one SUB socket per endpoint is connected at once, so the
new leader's first batch (its announcement) arrives as soon as it leads; no re-resolution.

Guarantees (the publisher's rules: :mod:`mooncake._core.kv_events`): every batch this
subscriber did not receive is reported, as a :class:`Gap` (a jump within one stream; it asks
the publisher's replay socket for the missing batches first and says whether that filled it)
or as a :class:`NewStream` with ``resync=True`` (another stream began after one was followed:
a leader change or a restarted master, whose predecessor's last batches may never have
arrived). Empty batches every ``--kv_events_heartbeat_interval`` make a lost tail a gap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from mooncake._core.kv_events import (
    END_SEQ,
    Batch,
    KvEvent,
    StreamTracker,
    decode_batch,
    decode_seq,
    encode_seq,
)
from mooncake.errors import InvalidArgumentError

__all__ = ["Batch", "Gap", "KvEvent", "KvEventSubscriber", "NewStream", "Received"]


@dataclass(frozen=True)
class Received:
    """A batch, in order (``replayed``: fetched from the replay buffer to fill a gap)."""

    source: int
    """Index of the endpoint it came from."""
    seq: int
    batch: Batch
    replayed: bool = False


@dataclass(frozen=True)
class Gap:
    """Batches ``expected .. got - 1`` of the current stream were missed."""

    source: int
    expected: int
    got: int
    recovered: bool
    """The replay delivered all of them (as :class:`Received` notes before this one's batch)."""


@dataclass(frozen=True)
class NewStream:
    """A stream began (the first batch seen, a new leader, or a restarted master)."""

    source: int
    seq: int
    epoch: int | None
    """The stream's epoch (the HA term) when its batch carried events, else ``None``."""
    resync: bool
    """Another stream was followed before: batches of it may be lost, rebuild the index."""


Notice = Received | Gap | NewStream


class KvEventSubscriber:
    """Subscribes to one or more publishers (see the module docstring). Not thread-safe: one
    thread polls it."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        replay_endpoints: Sequence[str | None] | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        hwm: int = 100_000,
    ) -> None:
        try:
            import zmq
        except ImportError:
            raise InvalidArgumentError(
                "KvEventSubscriber needs pyzmq: pip install 'mooncake-py[kvevents]'"
            ) from None
        if isinstance(endpoints, str) or not endpoints:
            raise InvalidArgumentError("endpoints must be a non-empty list of ZMQ addresses")
        replays = list(replay_endpoints) if replay_endpoints is not None else []
        if replay_endpoints is not None and len(replays) != len(endpoints):
            raise InvalidArgumentError(
                f"replay_endpoints must match endpoints one to one "
                f"({len(replays)} for {len(endpoints)})"
            )
        if replay_timeout <= 0:
            raise InvalidArgumentError(f"replay_timeout must be > 0, got {replay_timeout}")
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._subs: list[Any] = []
        self._poller = zmq.Poller()
        for ep in endpoints:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, hwm)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.connect(ep)
            self._subs.append(s)
            self._poller.register(s, zmq.POLLIN)
        self._index = {s: i for i, s in enumerate(self._subs)}
        self._replays: list[str | None] = replays or [None] * len(endpoints)
        self._replay_timeout = replay_timeout
        self._trackers = [StreamTracker() for _ in endpoints]
        self._epochs: list[int | None] = [None] * len(endpoints)
        self._current: int | None = None  # the source of the stream followed
        self.gaps = 0
        self.unrecovered_gaps = 0
        self.streams = 0

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for s in self._subs:
            s.close(0)
        self._subs.clear()
        self._ctx.term()

    def poll(self, timeout: float | None = None) -> list[Notice]:
        """Notes for what arrived within ``timeout`` seconds (``None``: wait for something;
        ``0``: only what is there), in order."""
        zmq = self._zmq
        out: list[Notice] = []
        ready = self._poller.poll(None if timeout is None else int(timeout * 1000))
        for sock, _ in ready:
            src = self._index[sock]
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 3:
                    continue  # not a KV event batch
                self._take(src, decode_seq(frames[1]), frames[2], out)
        return out

    def _take(self, src: int, seq: int, payload: bytes, out: list[Notice]) -> None:
        batch = decode_batch(payload)
        epoch = next((e.epoch for e in batch.events if e.epoch is not None), None)
        v = self._trackers[src].feed(seq, epoch=epoch)
        if epoch is not None:
            self._epochs[src] = epoch
        new = v.kind in ("first", "restart") or self._current != src
        if new:
            resync = self._current is not None
            self._current = src
            self.streams += 1
            self._epochs[src] = epoch
            out.append(NewStream(src, seq, epoch, resync))
            if seq > 1 and (resync or v.kind == "restart"):
                # joined a new stream late (its announcement lost): its start is replayable
                self._fill(src, 1, seq, out)
        elif v.kind == "gap":
            self._fill(src, v.expected, v.got, out)
        out.append(Received(src, seq, batch))

    def _fill(self, src: int, start: int, end: int, out: list[Notice]) -> None:
        self.gaps += 1
        got = self._replay(src, start, end)
        ok = got is not None and [s for s, _ in got] == list(range(start, end))
        if got:
            for s, b in got:
                out.append(Received(src, s, b, replayed=True))
        if not ok:
            self.unrecovered_gaps += 1
        out.append(Gap(src, start, end, ok))

    def _replay(self, src: int, start: int, end: int) -> list[tuple[int, Batch]] | None:
        ep = self._replays[src]
        if ep is None:
            return None
        zmq = self._zmq
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(ep)
            req = [b"", encode_seq(start)]
            epoch = self._epochs[src]
            if epoch is not None:
                req.append(encode_seq(epoch))
            s.send_multipart(req)
            got: list[tuple[int, Batch]] = []
            deadline = time.monotonic() + self._replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    return None
                frames = s.recv_multipart()
                if len(frames) < 3:
                    return None
                if frames[1] == END_SEQ:
                    return got
                seq = decode_seq(frames[1])
                if start <= seq < end:
                    got.append((seq, decode_batch(frames[2])))
        finally:
            s.close(0)
