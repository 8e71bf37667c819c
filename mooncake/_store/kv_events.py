"""The master's KV event publisher: ZMQ PUB (upstream Mooncake's ``enable_kv_events``) plus a
replay socket (vLLM's ``replay_endpoint`` protocol).

Codec, queue and stream rules: :mod:`mooncake._core.kv_events`. This module owns the sockets
and everything numbered (sequence numbers, the replay buffer), under one lock (ZMQ sockets are
used by one thread at a time: the lock is the memory barrier they need between threads). The
master's loop or an RPC thread appends to the bounded
:class:`~mooncake._core.kv_events.EventQueue`; once the oldest pending event waited
``flush_delay`` (or 1024 are pending) that producer publishes everything pending itself, if it
gets the lock without waiting. The publisher's thread is woken through an eventfd when a burst
starts and then looks every ``max(flush_delay, 10 ms)`` until the puts stop: it publishes the
tail, heartbeats, stream changes and replays. The PUB socket never blocks (a
send that would is counted as dropped; ZMQ drops for a subscriber past its high-water mark),
so a slow subscriber never slows the master, and the memory held is bounded by the queue
capacity, the replay buffer (``buffer_steps`` batches) and ZMQ's high-water marks.

Streams: :meth:`KvEventPublisher.start_stream` opens a stream (``epoch``: the HA term, or
the start time in ms without HA) with an empty announcement batch numbered 1;
:meth:`stop_stream` ends it (a deposed leader publishes nothing). Every master of an HA
cluster binds its sockets at start, so subscribers are connected before it leads.

Replay (``kv_events_replay_endpoint``, a ROUTER socket): a request ``[b"", start_seq]``
(8-byte big-endian; an optional third frame, the 8-byte epoch the subscriber follows) is
answered with every buffered batch numbered ``start_seq`` or later, ``[b"", seq, payload]``,
then ``[b"", END_SEQ, epoch]``. A request naming another epoch gets only the end marker, whose
last frame carries the current epoch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from mooncake._core import kv_events as _kv
from mooncake.errors import InvalidArgumentError

__all__ = ["KvEventPublisher", "KvEventsConfig"]

log = logging.getLogger("mooncake.master")

_START = -1
_STOP = -2
#: the publisher thread's interval while producers publish inline: the longest a busy
#: stream's last events wait when the master stops producing (s)
_TAIL_S = 0.01


@dataclass
class KvEventsConfig:
    """The publisher's settings (flag names as upstream's ``mooncake_master``)."""

    #: ZMQ PUB bind address (``--kv_events_bind_endpoint``); loopback unless told otherwise
    bind_endpoint: str = "tcp://127.0.0.1:5557"
    #: the cache owner's identity stamped as ``backend_id`` (``--kv_events_backend_id``)
    backend_id: str = "mooncake-master"
    tenant_id: str = "default"
    emit_legacy_compat: bool = True
    emit_object_key: bool = True
    #: pending events at most; the oldest is dropped when full (0: unbounded)
    queue_capacity: int = 65536
    #: ROUTER bind address for replays (``--kv_events_replay_endpoint``); "" off
    replay_endpoint: str = ""
    #: batches kept for replay (``--kv_events_buffer_steps``, vLLM's ``buffer_steps``)
    buffer_steps: int = 10000
    #: seconds between empty batches on an idle stream (a lost tail shows as a gap); 0 off
    heartbeat_interval: float = 1.0
    topic: str = ""
    #: ZMQ send high-water mark (upstream's 10000)
    hwm: int = 10000
    #: seconds an event may wait to be published while events keep coming (fuller batches,
    #: published by the master's own threads; the tail of a burst waits at most
    #: max(this, 10 ms)); 0 publishes at once
    flush_delay: float = 0.001

    def validate(self) -> None:
        if not self.bind_endpoint:
            raise InvalidArgumentError("kv_events_bind_endpoint must be set when kv events are on")
        if not self.backend_id:
            raise InvalidArgumentError("kv_events_backend_id must not be empty")
        if self.queue_capacity < 0:
            raise InvalidArgumentError(
                f"kv_events_queue_capacity must be >= 0, got {self.queue_capacity}"
            )
        if self.buffer_steps < 1:
            raise InvalidArgumentError(
                f"kv_events_buffer_steps must be >= 1, got {self.buffer_steps}"
            )
        if not 0 <= self.flush_delay <= 1:
            raise InvalidArgumentError(
                f"kv_events_flush_delay must be in [0, 1] s, got {self.flush_delay}"
            )
        if self.heartbeat_interval < 0:
            raise InvalidArgumentError(
                f"kv_events_heartbeat_interval must be >= 0, got {self.heartbeat_interval}"
            )


class KvEventPublisher:
    """One master's publisher (see the module docstring). Thread-safe front: :attr:`queue`,
    :meth:`start_stream`, :meth:`stop_stream`, :meth:`stats`, :meth:`close`."""

    def __init__(self, config: KvEventsConfig) -> None:
        config.validate()
        try:
            import zmq
        except ImportError:
            raise InvalidArgumentError(
                "kv events need pyzmq: pip install 'mooncake-py[kvevents]'"
            ) from None
        self.config = config
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: Any = None
        try:
            self._pub.bind(config.bind_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if config.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.SNDHWM, config.buffer_steps + 16)
                self._router.bind(config.replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidArgumentError(f"kv events: cannot bind {e}") from None
        self.queue = _kv.EventQueue(config.queue_capacity, config.tenant_id)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.queue.wake = self._wake
        self.queue.publish_inline(self._flush_inline, config.flush_delay)
        # the sockets, the stream's counters and the replay buffer: the publisher thread
        # and a producer publishing inline (:meth:`_flush_inline`) take turns under it
        self._lock = threading.Lock()
        #: how long the thread sleeps between looks while producers publish inline
        self._tail = max(config.flush_delay, _TAIL_S)
        self._topic = config.topic.encode()
        self._more = int(zmq.NOBLOCK | zmq.SNDMORE)
        self._last = int(zmq.NOBLOCK)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.epoch = 0
        self.active = False
        self._encoder = _kv.BatchEncoder(
            backend_id=config.backend_id, tenant_id=config.tenant_id, epoch=0
        )
        self._seq = 0
        self._next_event_id = 1
        self.published_batches = 0
        self.published_events = 0
        self.dropped_events = 0
        self.skipped_unparsed_keys = 0
        self.replays = 0
        self.streams = 0
        self._last_send = time.monotonic()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mooncake-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "master: kv events on %s (replay %s), backend_id=%s",
            self.endpoint,
            self.replay_endpoint or "off",
            config.backend_id,
        )

    # -- front (any thread) ------------------------------------------------------------------

    def start_stream(self, epoch: int) -> None:
        """Open a stream numbered ``epoch``: everything queued before is discarded, the next
        batch is the announcement (seq 1); events put after this call belong to it."""
        self.queue.mark(_START, str(int(epoch)))

    def stop_stream(self) -> None:
        """End the stream: nothing more is published until :meth:`start_stream`."""
        self.queue.mark(_STOP, "")

    def stats(self) -> dict[str, Any]:
        """The ``/kv_events/status`` document (upstream's fields plus the stream's)."""
        return {
            "enabled": True,
            "published_batches": self.published_batches,
            "published_events": self.published_events,
            "dropped_events": self.dropped_events + self.queue.dropped,
            "skipped_unparsed_keys": self.skipped_unparsed_keys + self._encoder.unparsed,
            "active": self.active,
            "epoch": self.epoch,
            "seq": self._seq,
            "queued": len(self.queue),
            "replays": self.replays,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
        }

    def close(self) -> None:
        """Stop the thread (what is still queued is published first) and close the sockets."""
        if self._stopping:
            return
        self._stopping = True
        self.queue.publish_inline(None, 0.0)
        self._wake()
        self._thread.join()
        with self._lock:
            self._close_sockets()
        os.close(self._efd)

    def _flush_inline(self) -> None:
        """(A producer, under the state lock) publish what is due, unless the publisher
        thread is at it (then it takes these too): the master never waits here."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._stopping:
                    self._drain()
            finally:
                self._lock.release()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._efd, 1)
        except OSError:  # closed: the publisher is gone
            pass

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    # -- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._efd, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        hb = self.config.heartbeat_interval
        while True:
            timeout = None
            if self.active and hb > 0:
                timeout = max(0.0, self._last_send + hb - time.monotonic()) * 1000
            q = self.queue
            q.idle = True  # then look again: a put after this wakes us, one before is seen
            if q.pending() or self._stopping:
                q.idle = False
                timeout = 0
            ready = dict(poller.poll(timeout))
            if self._efd in ready:
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
                delay = self.config.flush_delay
                if delay > 0 and not self._stopping and len(q) < _kv.MAX_BATCH:
                    time.sleep(delay)  # more events arrive meanwhile: fuller batches
                with self._lock:
                    self._drain()
                self._linger()
            with self._lock:
                self._drain()
                if self._router is not None and self._router in ready:
                    self._serve_replays()
                if self._stopping:
                    self._drain()
                    return
                if self.active and hb > 0 and time.monotonic() - self._last_send >= hb:
                    self._send([])

    def _linger(self) -> None:
        """While producers keep putting (they publish full and due batches themselves), look
        every :attr:`_tail` seconds instead of being woken per batch: what is left when they
        stop is published within that, and a replay request waits at most that long (a
        burst that never ends must not starve the replay socket)."""
        q = self.queue
        seen = q.first
        while not self._stopping:
            time.sleep(self._tail)
            with self._lock:
                self._drain()
                if self._router is not None:
                    self._serve_replays()  # non-blocking: answers what has arrived
            if q.first == seen and not q.pending():
                return  # no event since the last look: sleep until woken
            seen = q.first

    def _drain(self) -> None:
        while True:
            items, drops, marks = self.queue.take()
            for kind, value in marks:
                if kind == _START:
                    self._open(int(value))
                else:
                    self.active = False
            if drops and self.active:
                # upstream reserves one sequence number per dropped event: the loss is a gap
                self._seq += drops
            if items:
                self._send(items)
            elif not marks:
                return

    def _open(self, epoch: int) -> None:
        cfg = self.config
        self.skipped_unparsed_keys += self._encoder.unparsed
        self._encoder = _kv.BatchEncoder(
            backend_id=cfg.backend_id,
            tenant_id=cfg.tenant_id,
            epoch=epoch,
            emit_legacy=cfg.emit_legacy_compat,
            emit_object_key=cfg.emit_object_key,
        )
        self.epoch = epoch
        self.active = True
        self._seq = 0
        self._buffer.clear()
        self.streams += 1
        self._send([], force=True)

    def _send(self, events: list[tuple[int, str, str]], *, force: bool = False) -> None:
        if not self.active or (not events and not force and self._last_send_recent()):
            return
        ts = int(time.time() * 1000)
        payload, n = self._encoder.encode(events, ts, self._next_event_id)
        if events and n == 0:
            return
        self._next_event_id += n
        self._seq += 1
        seq = self._seq
        self._buffer.append((seq, payload))
        self._last_send = time.monotonic()
        send = self._pub.send
        try:  # three sends (a PUB never refuses a part: past its high-water mark it drops)
            send(self._topic, self._more)
            send(seq.to_bytes(8, "big"), self._more)
            send(payload, self._last)
        except self._zmq.ZMQError:
            self.dropped_events += n
            return
        self.published_batches += 1
        self.published_events += n

    def _last_send_recent(self) -> bool:
        # an empty batch is a heartbeat: only when the stream was idle for the interval
        hb = self.config.heartbeat_interval
        return hb <= 0 or time.monotonic() - self._last_send < hb

    def _serve_replays(self) -> None:
        zmq = self._zmq
        router = self._router
        while True:
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) not in (3, 4) or len(frames[2]) != 8:
                log.warning("kv events: malformed replay request (%d frames) ignored", len(frames))
                continue
            ident = frames[0]
            start = int.from_bytes(frames[2], "big")
            epoch_frame = _kv.encode_seq(self.epoch)
            self.replays += 1
            if len(frames) == 4 and frames[3] != epoch_frame:
                router.send_multipart((ident, b"", _kv.END_SEQ, epoch_frame))
                continue
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        router.send_multipart(
                            (ident, b"", _kv.encode_seq(seq), payload), flags=zmq.NOBLOCK
                        )
                router.send_multipart((ident, b"", _kv.END_SEQ, epoch_frame), flags=zmq.NOBLOCK)
            except zmq.Again:  # that requester reads too slowly: it gets no end marker
                continue


def lead(server: Any, epoch: int) -> None:
    """``server`` (a :class:`~mooncake._store.master.MasterServer`) leads from now on: open a
    stream numbered ``epoch`` and route its state's events into it. No-op without a publisher."""
    pub = server.kv_publisher
    if pub is None:
        return
    pub.start_stream(epoch)
    _kv.attach(server.state, pub.queue)


def stand_down(server: Any) -> None:
    """``server`` no longer leads: its state's events (a standby's replay) are not published."""
    pub = server.kv_publisher
    if pub is None:
        return
    _kv.detach(server.state)
    pub.stop_stream()
