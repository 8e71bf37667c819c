"""KV cache events (sans-I/O): what the master's state emits, the wire codec, gap tracking.

The master publishes one event per object key and tier as the key becomes readable there
(``stored``) or stops being readable there (``removed``), in the format of upstream Mooncake's
master publisher (RFC #1527 over ZMQ, the batch layout vLLM and SGLang use): three frames,
an empty topic (configurable), a big-endian u64 sequence number per batch, and a msgpack
payload ``[timestamp_ms, [event map, ...], dp_rank]``. Each event map carries upstream's fields
(``event_id``, ``timestamp``, ``event_type``, ``tenant_id``, ``backend_id``, ``medium``
(``"cpu"`` / ``"disk"``), ``seq_hashes``, ``object_key``, the legacy aliases ``type`` and
``block_hashes``, nil ``model_name`` ...) plus one extension field, ``epoch``: the stream's
identity (the HA leader's term). Decoders that match maps by key ignore it.

Streams: a stream is one leader's term. Its batches are numbered from 1, one by one; a new
leader starts a new stream (a new ``epoch``) with an empty announcement batch numbered 1. A
subscriber therefore sees every loss: a jump within a stream is a gap (replayable from the
publisher's bounded buffer while it holds the batches), a new epoch means "what you hold may
be stale: resync". The publisher's queue is bounded: when it is full the oldest event is
dropped and a sequence number is reserved for it, so the loss shows as a gap as upstream's
does (:class:`EventQueue`).

The state reports events through :func:`stored` / :func:`removed` on whatever
:class:`EventQueue` is attached to it (:func:`attach`; only the leader's is). The attachment
lives outside the state (a weak map), so snapshots and digests never see it; with nothing
attached a hook is one dict lookup.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from time import monotonic as _mono
from typing import Any

import msgspec

from mooncake._core.master.tenants import PREFIX as _TENANT_PREFIX
from mooncake._core.master.tenants import tenant_of, user_key
from mooncake._fast import encode_events as _encode_events
from mooncake._fast import parse_seq_hash as _parse_seq_hash

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "Batch",
    "BatchEncoder",
    "EventQueue",
    "KvEvent",
    "StreamTracker",
    "Verdict",
    "attach",
    "decode_batch",
    "decode_seq",
    "detach",
    "encode_batch",
    "encode_seq",
    "parse_seq_hash",
    "removed",
    "stored",
]

_DIGITS = frozenset("0123456789")
MEDIUM_CPU = "cpu"
MEDIUM_DISK = "disk"
_NEVER = 1 << 62
STORED = 0
REMOVED = 1
#: events per published batch (upstream's kMaxBatchSize)
MAX_BATCH = 64
#: a producer publishes once this many events are pending even if none is due yet (16
#: batches, sent back to back: one wake-up of ZMQ's I/O thread and of a subscriber for all)
INLINE_EVENTS = 16 * MAX_BATCH
#: the end-of-replay marker's sequence frame (vLLM's replay protocol: -1 as a signed u64)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


#: the u64 a key encodes in decimal or ``0x`` hex, else ``None`` (compiled where built)
parse_seq_hash = _parse_seq_hash


class EventQueue:
    """The bounded queue between the master's state (the producers) and the publisher (one
    consumer thread). ``capacity`` events at most (0: unbounded, as upstream allows); a full
    queue drops its oldest event and counts it in :attr:`dropped`, and the publisher reserves
    one sequence number per drop so subscribers see a gap.

    Producers are serialized by the master's state lock (the loop and the RPC threads take it
    to apply a command), so :meth:`put` takes no lock of its own: a ``deque`` append, which
    pushes the oldest out when full, plus a counter. A drop is counted when the queue looked
    full before the append; the consumer may have taken one meanwhile, so the count can be
    one too high (a gap reported that was none: safe), never too low. Stream markers
    (:meth:`mark`) travel apart, under a lock the consumer holds while it takes events, so
    every event is published in the stream it was put in.
    """

    def __init__(self, capacity: int = 65536, tenant_id: str = "default") -> None:
        if capacity < 0:
            raise ValueError(f"kv_events_queue_capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.tenant_id = tenant_id
        self._q: deque[tuple[int, str, str]] = deque(maxlen=capacity or None)
        self._mlock = threading.Lock()
        self._markers: list[tuple[int, str]] = []
        self.dropped = 0
        self._reported = 0
        self.idle = False
        """Set by the consumer before it sleeps: the next :meth:`put` calls :attr:`wake`."""
        self.wake: Any = None
        self.flush: Any = None
        """Called by :meth:`put` (the producer's thread, under the state lock) once the
        queue's oldest event waited :attr:`delay` seconds (or :data:`INLINE_EVENTS` are
        pending): the producer publishes what is due itself, all of it in batches of
        :data:`MAX_BATCH` sent back to back, so a busy master never wakes the consumer per
        batch. ``None``: only the consumer publishes (:meth:`publish_inline` sets it)."""
        self.delay = 0.0
        self.first = 0.0
        self._due = 0.0  # first + delay: the producers' flush is due from then on
        self._batch = _NEVER  # a producer flushes once the queue held this many
        self._full = capacity or _NEVER  # from this length a put drops the oldest
        """``time.monotonic()`` when the queue last went from empty to not empty (the
        oldest pending event's age, and the consumer's sign that producers are active)."""

    def publish_inline(self, flush: Any, delay: float) -> None:
        """Let producers call ``flush`` (see :attr:`flush`) once a batch is full or its
        oldest event waited ``delay`` seconds; ``flush=None``: never."""
        self.delay = delay
        self.flush = flush
        self._batch = INLINE_EVENTS - 1 if flush is not None else _NEVER

    def put(self, kind: int, key: str, medium: str) -> None:
        q = self._q
        n = len(q)
        if n >= self._full:
            self.dropped += 1
        q.append((kind, key, medium))
        if n:
            f = self.flush
            if f is not None and (n >= self._batch or _mono() >= self._due):
                f()
            return
        self.first = t = _mono()
        self._due = t + self.delay
        if self.idle:
            self.idle = False
            w = self.wake
            if w is not None:
                w()
        if self.delay <= 0:
            f = self.flush
            if f is not None:
                f()

    def mark(self, kind: int, value: str) -> None:
        """A stream marker: what is queued is discarded, the marker comes first."""
        with self._mlock:
            self._q.clear()
            self._markers.append((kind, value))
            self._reported = self.dropped
        w = self.wake
        if w is not None:
            w()

    def take(
        self, limit: int = MAX_BATCH
    ) -> tuple[list[tuple[int, str, str]], int, list[tuple[int, str]]]:
        """Pending markers (then no events), else up to ``limit`` events, oldest first, and
        the drops since the last take."""
        with self._mlock:
            if self._markers:
                marks, self._markers = self._markers, []
                return [], 0, marks
            q = self._q
            if len(q) <= limit:  # the usual case: all of it, at C speed
                out = list(q)
                q.clear()
            else:
                pop = q.popleft
                out = [pop() for _ in range(limit)]
            d = self.dropped
            drops, self._reported = d - self._reported, d
        return out, drops, []

    def pending(self) -> bool:
        return bool(self._q) or bool(self._markers)

    def __len__(self) -> int:
        return len(self._q)


# id(state) -> (a weak reference to it, its queue): a plain dict is cheaper per hook than a
# WeakKeyDictionary (no weakref made per lookup); the reference guards against a reused id
_SINKS: dict[int, tuple[weakref.ref[object], EventQueue, Any]] = {}


def attach(state: object, queue: EventQueue) -> None:
    """Route ``state``'s events into ``queue`` (replacing any earlier queue)."""
    for k in [k for k, (r, _, _) in _SINKS.items() if r() is None]:
        del _SINKS[k]
    _SINKS[id(state)] = (weakref.ref(state), queue, queue.put)


def detach(state: object) -> None:
    e = _SINKS.get(id(state))
    if e is not None and e[0]() is state:
        del _SINKS[id(state)]


def attached(state: object) -> EventQueue | None:
    e = _SINKS.get(id(state)) if _SINKS else None
    return e[1] if e is not None and e[0]() is state else None


def stored(state: object, key: str, medium: str = MEDIUM_CPU) -> None:
    """Hook: ``key`` became readable in ``medium``."""
    if _SINKS:
        e = _SINKS.get(id(state))
        if e is not None and e[0]() is state:
            e[2](STORED, key, medium)


def removed(state: object, key: str, medium: str = MEDIUM_CPU) -> None:
    """Hook: ``key`` stopped being readable in ``medium``."""
    if _SINKS:
        e = _SINKS.get(id(state))
        if e is not None and e[0]() is state:
            e[2](REMOVED, key, medium)


# -- wire --------------------------------------------------------------------------------------

_enc = msgspec.msgpack.Encoder()


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence frame as an int (``-1`` is the end-of-replay marker)."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)


def split_tenant(ikey: str) -> tuple[str, str]:
    """``(key, tenant)`` of the master's internal key ``ikey``: a named tenant's object is
    published under its own key with its tenant's name (``""``: the default tenant, whose
    events carry the stream's ``tenant_id``)."""
    if ikey[:1] != _TENANT_PREFIX:
        return ikey, ""
    tenant = tenant_of(ikey)
    return user_key(tenant, ikey), tenant


def encode_batch(
    events: list[tuple[int, str, str]],
    *,
    timestamp_ms: int,
    first_event_id: int,
    backend_id: str,
    tenant_id: str,
    epoch: int,
    emit_legacy: bool = True,
    emit_object_key: bool = True,
) -> tuple[bytes, int]:
    """The msgpack payload of one batch, and how many events it holds (an event whose key is
    not a u64 hash is left out when ``emit_object_key`` is off, as upstream does)."""
    maps: list[dict[str, Any]] = []
    eid = first_event_id
    for kind, ikey, medium in events:
        key, tenant = split_tenant(ikey)
        h = parse_seq_hash(key)
        if h is None and (not emit_object_key or not key):
            continue
        is_stored = kind == STORED
        m: dict[str, Any] = {
            "event_id": eid,
            "timestamp": timestamp_ms,
            "event_type": "stored" if is_stored else "removed",
        }
        if emit_legacy:
            m["type"] = "BlockStored" if is_stored else "BlockRemoved"
        m["model_name"] = None
        m["block_size"] = None
        m["additional_salt"] = None
        m["lora_name"] = None
        m["tenant_id"] = tenant or tenant_id
        m["backend_id"] = backend_id
        m["group_id"] = None
        m["medium"] = medium or None
        m["dp_rank"] = None
        if emit_object_key:
            m["object_key"] = key
        m["seq_hashes"] = [h] if h is not None else []
        if emit_legacy:
            # upstream packs the legacy alias as a signed i64
            m["block_hashes"] = [h - (1 << 64) if h >= (1 << 63) else h] if h is not None else []
        if is_stored:
            m["base_block_idx"] = 0
            m["parent_hash"] = None
            m["token_ids"] = None
            if emit_legacy:
                m["parent_block_hash"] = None
        else:
            m["base_block_idx"] = None
        m["epoch"] = epoch
        maps.append(m)
        eid += 1
    return _enc.encode([timestamp_ms, maps, 0]), len(maps)


def _entries(d: dict[str, Any]) -> bytes:
    """The msgpack bytes of ``d``'s entries, without the map header."""
    b = _enc.encode(d)
    return b[1:] if len(d) < 16 else b[3:]


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


class BatchEncoder:
    """:func:`encode_batch` for one stream, byte for byte, from pre-encoded pieces: only the
    event id, the timestamp, the key and its hash are encoded per event (about a fifth of
    the cost of building and encoding a map per event)."""

    def __init__(
        self,
        *,
        backend_id: str,
        tenant_id: str,
        epoch: int,
        emit_legacy: bool = True,
        emit_object_key: bool = True,
    ) -> None:
        self.legacy = emit_legacy
        self.object_key = emit_object_key
        self.unparsed = 0
        """Events published whose key is not a u64 hash (upstream's skipped_unparsed_keys)."""
        self._empty_hashes = _entries(
            {"seq_hashes": [], "block_hashes": []} if emit_legacy else {"seq_hashes": []}
        )
        self._okey = _entries({"object_key": 0})[:-1]
        self._seq_key = _entries({"seq_hashes": 0})[:-1]
        self._block_key = _entries({"block_hashes": 0})[:-1]
        self._eid_key = _entries({"event_id": 0})[:-1]
        self._ts_key = _entries({"timestamp": 0})[:-1]
        self._head: dict[int, bytes] = {}
        self._mid: dict[tuple[int, str, str], bytes] = {}
        self._tail: dict[int, bytes] = {}
        for kind in (STORED, REMOVED):
            is_stored = kind == STORED
            n = 13 + (2 if emit_legacy else 0) + (1 if emit_object_key else 0)
            n += (3 + (1 if emit_legacy else 0)) if is_stored else 1
            n += 1  # epoch
            self._head[kind] = _map_header(n) + self._eid_key
            tail: dict[str, Any] = (
                {"base_block_idx": 0, "parent_hash": None, "token_ids": None}
                if is_stored
                else {"base_block_idx": None}
            )
            if is_stored and emit_legacy:
                tail["parent_block_hash"] = None
            tail["epoch"] = epoch
            self._tail[kind] = _entries(tail)
        self._heads = (self._head[STORED], self._head[REMOVED])
        self._tails = (self._tail[STORED], self._tail[REMOVED])
        self._consts = (tenant_id, backend_id)

    def _middle(self, kind: int, medium: str, tenant: str = "") -> bytes:
        mid = self._mid.get((kind, medium, tenant))
        if mid is None:
            tenant_id, backend_id = self._consts
            tenant_id = tenant or tenant_id
            is_stored = kind == STORED
            m: dict[str, Any] = {"event_type": "stored" if is_stored else "removed"}
            if self.legacy:
                m["type"] = "BlockStored" if is_stored else "BlockRemoved"
            m.update(
                model_name=None,
                block_size=None,
                additional_salt=None,
                lora_name=None,
                tenant_id=tenant_id,
                backend_id=backend_id,
                group_id=None,
                medium=medium or None,
                dp_rank=None,
            )
            if len(self._mid) >= 4096:  # many tenants: keep the cache bounded
                self._mid.clear()
            mid = self._mid[(kind, medium, tenant)] = _entries(m)
        return mid

    def encode(
        self, events: list[tuple[int, str, str]], timestamp_ms: int, first_event_id: int
    ) -> tuple[bytes, int]:
        """The payload of one batch of ``events`` and how many it holds (as
        :func:`encode_batch`; the per-event loop is :func:`mooncake._fast.encode_events`,
        compiled where built)."""
        ts = _enc.encode(timestamp_ms)
        body, n, unparsed = _encode_events(
            events,
            first_event_id,
            self._ts_key + ts,
            self._heads,
            self._tails,
            self._mid,
            self._middle,
            _TENANT_PREFIX,
            split_tenant,
            self._okey if self.object_key else None,
            self._seq_key,
            self._block_key if self.legacy else None,
            self._empty_hashes,
        )
        self.unparsed += unparsed
        arr = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return b"\x93" + ts + arr + body + b"\x00", n


@dataclass(frozen=True)
class KvEvent:
    """One decoded event."""

    event_type: str
    """``"stored"``, ``"removed"`` or ``"cleared"``."""
    object_key: str | None
    medium: str | None
    tenant_id: str | None
    backend_id: str | None
    event_id: int | None
    seq_hashes: tuple[int, ...]
    epoch: int | None
    raw: dict[str, Any] = field(repr=False, compare=False)


@dataclass(frozen=True)
class Batch:
    """One decoded batch (the payload frame)."""

    timestamp: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None


_dec = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """Decode a payload frame (upstream's map events; vLLM's array events are accepted with
    their tag as the type). Raises ``ValueError`` naming what is malformed."""
    try:
        doc = _dec.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"kv event payload is not msgpack: {e}") from None
    if not isinstance(doc, list) or len(doc) < 2 or not isinstance(doc[1], list):
        raise ValueError("kv event payload is not [timestamp, [events], dp_rank]")
    events = []
    for ev in doc[1]:
        if isinstance(ev, dict):
            et = ev.get("event_type") or {"BlockStored": "stored", "BlockRemoved": "removed"}.get(
                str(ev.get("type")), str(ev.get("type"))
            )
            hashes = ev.get("seq_hashes") or ev.get("block_hashes") or []
            events.append(
                KvEvent(
                    str(et),
                    ev.get("object_key"),
                    ev.get("medium"),
                    ev.get("tenant_id"),
                    ev.get("backend_id"),
                    ev.get("event_id"),
                    tuple(int(h) for h in hashes),
                    ev.get("epoch"),
                    ev,
                )
            )
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            tag = {"BlockStored": "stored", "BlockRemoved": "removed"}.get(ev[0], "cleared")
            hashes = ev[1] if len(ev) > 1 and isinstance(ev[1], list) else []
            events.append(
                KvEvent(tag, None, None, None, None, None, tuple(hashes), None, {"raw": ev})
            )
        else:
            raise ValueError(f"kv event of unknown shape: {type(ev).__name__}")
    ts = doc[0]
    dp = doc[2] if len(doc) > 2 else None
    return Batch(float(ts), tuple(events), dp if isinstance(dp, int) else None)


# -- gap tracking --------------------------------------------------------------------------------


class Verdict(msgspec.Struct, frozen=True):
    """What one received sequence number means for a stream (:meth:`StreamTracker.feed`)."""

    kind: str
    """``"next"`` (in order), ``"first"`` (the first batch seen), ``"gap"`` (batches
    ``expected .. got-1`` were missed), ``"restart"`` (the numbering went back or started
    again: a new stream from that publisher, whose announcement may have been missed too).
    A live PUB socket never repeats a batch, so a number not above the last is never taken
    for a duplicate: that would drop a new stream's batches until it passed the old one."""
    expected: int = 0
    got: int = 0


class StreamTracker:
    """Tracks one publisher's sequence numbers (sans-I/O)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.epoch: int | None = None

    def feed(self, seq: int, *, epoch: int | None = None) -> Verdict:
        """``seq`` arrived on the live socket (``epoch``: the batch's, when it carried
        events: a different one than before is a new stream even if the numbers fit)."""
        last, known = self.last, self.epoch
        self.last = seq
        if last is None:
            self.epoch = epoch
            return Verdict("first", seq, seq)
        if epoch is not None and known is not None and epoch != known:
            self.epoch = epoch
            return Verdict("restart", last + 1, seq)
        if seq > last:
            if epoch is not None:
                self.epoch = epoch
            return Verdict("next", seq, seq) if seq == last + 1 else Verdict("gap", last + 1, seq)
        # numbered again from below: a new stream, whose epoch is this batch's (unknown for
        # an empty announcement: the next batch with events tells it, without a restart)
        self.epoch = epoch
        return Verdict("restart", last + 1, seq)
