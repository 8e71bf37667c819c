"""KV events: the wire format (upstream Mooncake's master publisher), the bounded queue, gap
tracking; a real master process publishing to a subscriber (stored / removed per tier, gaps
replayed or reported); an HA failover announcing a new stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mooncake._core import kv_events as kv
from mooncake._core import rpc
from tests import services
from tests.helpers.ha_procs import HaMaster, call, mount, put, wait_leader
from tests.helpers.store_procs import _env, _readline

zmq = pytest.importorskip("zmq")

from mooncake.kv_events import Gap, KvEventSubscriber, NewStream, Received  # noqa: E402

# -- sans-I/O ---------------------------------------------------------------------------------


def test_batch_has_upstreams_fields() -> None:
    payload, n = kv.encode_batch(
        [(kv.STORED, "0x10", "cpu"), (kv.REMOVED, "prefix/a", "disk")],
        timestamp_ms=123,
        first_event_id=7,
        backend_id="node-1",
        tenant_id="default",
        epoch=42,
    )
    assert n == 2
    ts, events, dp = msgspec.msgpack.decode(payload)
    assert (ts, dp) == (123, 0)
    st, rm = events
    # upstream's map for a stored event, key by key (legacy aliases and object_key on)
    assert set(st) == {
        "event_id", "timestamp", "event_type", "type", "model_name", "block_size",
        "additional_salt", "lora_name", "tenant_id", "backend_id", "group_id", "medium",
        "dp_rank", "object_key", "seq_hashes", "block_hashes", "base_block_idx",
        "parent_hash", "token_ids", "parent_block_hash", "epoch",
    }  # fmt: skip
    assert st["event_type"] == "stored" and st["type"] == "BlockStored"
    assert st["seq_hashes"] == [16] and st["block_hashes"] == [16]
    assert st["event_id"] == 7 and st["base_block_idx"] == 0 and st["medium"] == "cpu"
    assert rm["event_type"] == "removed" and rm["type"] == "BlockRemoved"
    assert rm["seq_hashes"] == [] and rm["object_key"] == "prefix/a" and rm["medium"] == "disk"
    assert rm["event_id"] == 8 and rm["base_block_idx"] is None and "parent_hash" not in rm
    b = kv.decode_batch(payload)
    assert [e.event_type for e in b.events] == ["stored", "removed"]
    assert b.events[0].epoch == 42 and b.events[1].object_key == "prefix/a"
    # without object keys, keys that are no u64 hash are not published (as upstream)
    payload, n = kv.encode_batch(
        [(kv.STORED, "abc", "cpu"), (kv.STORED, "18446744073709551615", "cpu")],
        timestamp_ms=1,
        first_event_id=1,
        backend_id="b",
        tenant_id="t",
        epoch=1,
        emit_object_key=False,
        emit_legacy=False,
    )
    _, events, _ = msgspec.msgpack.decode(payload)
    assert n == 1 and events[0]["seq_hashes"] == [(1 << 64) - 1] and "type" not in events[0]


def test_seq_hash_keys() -> None:
    assert kv.parse_seq_hash("123") == 123
    assert kv.parse_seq_hash("0xff") == 255
    for bad in ("", "0x", "-1", "12a", "0xzz", str(1 << 64), "١٢"):
        assert kv.parse_seq_hash(bad) is None, bad


def test_queue_drops_oldest_and_keeps_stream_markers() -> None:
    q = kv.EventQueue(capacity=3)
    q.put(kv.STORED, "old", "cpu")
    q.mark(-1, "5")  # a stream marker: what was queued before is discarded
    for i in range(5):
        q.put(kv.STORED, f"k{i}", "cpu")
    assert len(q) == 3 and q.dropped == 2
    assert q.take() == ([], 0, [(-1, "5")])  # markers first, alone
    items, drops, marks = q.take()
    assert [i[1] for i in items] == ["k2", "k3", "k4"] and drops == 2 and not marks
    assert q.take() == ([], 0, [])
    woken: list[int] = []
    q.wake = lambda: woken.append(1)
    q.idle = True
    q.put(kv.REMOVED, "x", "disk")
    q.put(kv.REMOVED, "y", "disk")
    assert woken == [1]  # once per sleep of the consumer
    with pytest.raises(ValueError, match="queue_capacity"):
        kv.EventQueue(capacity=-1)


def test_tracker_verdicts() -> None:
    t = kv.StreamTracker()
    kinds = [t.feed(s).kind for s in (3, 4, 7, 7, 1, 2)]
    assert kinds == ["first", "next", "gap", "restart", "restart", "next"]
    # a new stream whose announcement was lost: its numbers lie below the old ones
    t = kv.StreamTracker()
    assert [t.feed(s, epoch=5).kind for s in (500, 501)] == ["first", "next"]
    assert t.feed(3, epoch=6).kind == "restart"
    # the epoch alone tells a new stream whose numbers happen to continue
    assert t.feed(4, epoch=6).kind == "next" and t.feed(5, epoch=7).kind == "restart"
    # an empty announcement (no epoch) opens a stream; its next batch names the epoch
    assert [t.feed(1).kind, t.feed(2, epoch=8).kind] == ["restart", "next"]
    t = kv.StreamTracker()
    t.feed(1)
    v = t.feed(4)
    assert (v.kind, v.expected, v.got) == ("gap", 2, 4)


def test_state_emits_per_tier_only_when_attached() -> None:
    from mooncake._core.master import MasterState
    from mooncake._core.store_types import ReplicateConfig, Segment

    s = MasterState()
    s.mount_segment("c", Segment(id="s", name="127.0.0.1:1", base=1 << 32, size=1 << 20), 0.0)
    q = kv.EventQueue()
    s.put_start("c", "a", 100, ReplicateConfig(), 0.0)
    s.put_end("c", "a", 0.0)
    assert len(q) == 0  # nothing attached: nothing emitted
    kv.attach(s, q)
    s.put_start("c", "b", 100, ReplicateConfig(), 0.0)
    s.put_end("c", "b", 0.0)
    s.remove("b", True, 1.0)
    s.remove("a", True, 1.0)
    kv.detach(s)
    items, _, _ = q.take()
    assert items == [(kv.STORED, "b", "cpu"), (kv.REMOVED, "b", "cpu"), (kv.REMOVED, "a", "cpu")]


# -- a real master ----------------------------------------------------------------------------

ANY = "tcp://127.0.0.1:*"


def _kv_status(metrics: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{metrics}/kv_events/status", timeout=5) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


class _Master:
    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "mooncake", "master", "--rpc-port", "0"]
        cmd += ["--metrics-port", "0", "--client-ttl", "600", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
        )
        line = _readline(self.proc, 120.0)
        self.address = line.split("rpc=", 1)[1].split()[0]
        self.metrics = line.split("metrics=", 1)[1].split()[0]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


KV_FLAGS = (
    "--enable-kv-events",
    "--kv-events-bind-endpoint",
    ANY,
    "--kv-events-replay-endpoint",
    ANY,
    "--kv-events-backend-id",
    "pool-1",
)


@pytest.fixture
def master() -> Iterator[_Master]:
    m = _Master(
        *KV_FLAGS,
        *("--kv-events-buffer-steps", "4", "--kv-events-heartbeat-interval", "0"),
        *("--kv-events-flush-delay", "0"),  # one batch per put: the gap test counts them
    )
    try:
        yield m
    finally:
        m.stop()


def _collect(sub: KvEventSubscriber, want: int, timeout: float = 30.0) -> list[Any]:
    """Notes until ``want`` events arrived (or the deadline)."""
    out: list[Any] = []
    n = 0
    deadline = time.monotonic() + timeout
    while n < want and time.monotonic() < deadline:
        for note in sub.poll(0.2):
            out.append(note)
            if isinstance(note, Received):
                n += len(note.batch.events)
    return out


def _wait_subscribed(sub: KvEventSubscriber, address: str, key: str) -> list[Any]:
    """ZMQ subscriptions are asynchronous: put probe keys until one arrives. Every note of
    every round is returned (the stream's announcement may come a round before an event)."""
    deadline = time.monotonic() + 30
    i = 0
    notes: list[Any] = []
    while time.monotonic() < deadline:
        put(address, f"{key}{i}")
        i += 1
        notes += _collect(sub, 1, timeout=1.0)
        if any(isinstance(n, Received) and n.batch.events for n in notes):
            return notes
    raise AssertionError("the subscriber never got an event")


def test_master_publishes_stored_and_removed(master: _Master) -> None:
    st = _kv_status(master.metrics)
    assert st["enabled"] and st["active"] and st["endpoint"].startswith("tcp://127.0.0.1:")
    mount(master.address)
    with KvEventSubscriber([st["endpoint"]], replay_endpoints=[st["replay_endpoint"]]) as sub:
        _wait_subscribed(sub, master.address, "probe")
        assert put(master.address, "0x2a")
        r = call(master.address, "Remove", rpc.RemoveParams("0x2a", True))
        assert r is not None and r[0] == 0, r
        notes = _collect(sub, 2)
    # (probe keys' events may still arrive first)
    events = [
        e
        for n in notes
        if isinstance(n, Received)
        for e in n.batch.events
        if e.object_key == "0x2a"
    ]
    assert [(e.event_type, e.object_key, e.medium) for e in events] == [
        ("stored", "0x2a", "cpu"),
        ("removed", "0x2a", "cpu"),
    ]
    assert events[0].seq_hashes == (42,) and events[0].backend_id == "pool-1"
    assert events[0].tenant_id == "default"
    assert not [n for n in notes if isinstance(n, Gap)]
    st = _kv_status(master.metrics)
    assert st["published_events"] >= 3 and st["dropped_events"] == 0


def test_a_tenants_events_carry_its_key_and_tenant(master: _Master) -> None:
    """A named tenant's object is published under the key its client used, with its tenant's
    name: never the master's internal key, never the default tenant."""
    st = _kv_status(master.metrics)
    mount(master.address)
    with KvEventSubscriber([st["endpoint"]], replay_endpoints=[st["replay_endpoint"]]) as sub:
        _wait_subscribed(sub, master.address, "probe")
        r = call(master.address, "PutStart", rpc.PutStartParams("c0", "0x2b", 4096, tenant="acme"))
        assert r is not None and r[0] == 0, r
        r = call(master.address, "PutEnd", rpc.KeyClientParams("c0", "0x2b", tenant="acme"))
        assert r is not None and r[0] == 0, r
        notes = _collect(sub, 1)
    events = [
        e
        for n in notes
        if isinstance(n, Received)
        for e in n.batch.events
        if e.event_type == "stored"
    ]
    mine = [e for e in events if e.tenant_id == "acme"]
    assert [(e.object_key, e.seq_hashes) for e in mine] == [("0x2b", (43,))], events
    assert not [e for e in events if e.object_key and "\0" in e.object_key]


def test_gap_replayed_then_reported_once_out_of_the_buffer(master: _Master) -> None:
    """A raw SUB socket receives every batch; the subscriber is fed only some of them, so it
    sees real gaps and asks the master's real replay socket (buffer: 4 batches)."""
    st = _kv_status(master.metrics)
    mount(master.address)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(st["endpoint"])
    sub = KvEventSubscriber([st["endpoint"]], replay_endpoints=[st["replay_endpoint"]])
    try:
        i = 0
        frames = None
        while frames is None:
            put(master.address, f"probe{i}")
            i += 1
            if raw.poll(1000):
                frames = raw.recv_multipart()
        out: list[Any] = []

        def feed(fr: list[bytes]) -> None:
            sub._take(0, kv.decode_seq(fr[1]), fr[2], out)

        feed(frames)
        while raw.poll(500):  # the other probes' batches, until the stream is quiet
            feed(raw.recv_multipart())

        def next_batch() -> list[bytes]:
            assert raw.poll(10_000)
            fr: list[bytes] = raw.recv_multipart()
            return fr

        def put_and_receive(key: str) -> list[list[bytes]]:
            """Put ``key`` and receive until the batch with its event: each key waited for
            has a batch of its own (a loaded publisher may merge events queued together)."""
            assert put(master.address, key)
            got: list[list[bytes]] = []
            while not got or key not in [e.object_key for e in kv.decode_batch(got[-1][2]).events]:
                got.append(next_batch())
            return got

        missed = put_and_receive("g1") + put_and_receive("g2")
        (*also_missed, last) = put_and_receive("g3")
        missed += also_missed
        feed(last)  # g3: g1, g2 missed, still in the buffer
        gaps = [n for n in out if isinstance(n, Gap)]
        assert len(gaps) == 1 and gaps[0].recovered
        replayed = [n for n in out if isinstance(n, Received) and n.replayed]
        assert [n.seq for n in replayed] == [kv.decode_seq(f[1]) for f in missed]
        assert [e.object_key for n in replayed for e in n.batch.events] == ["g1", "g2"]
        out.clear()
        for j in range(5):  # more batches missed than the buffer holds (4)
            put_and_receive(f"h{j}")
        feed(put_and_receive("h5")[-1])
        gaps = [n for n in out if isinstance(n, Gap)]
        assert len(gaps) == 1 and not gaps[0].recovered and sub.unrecovered_gaps == 1
    finally:
        sub.close()
        raw.close(0)
        ctx.term()


def test_bad_kv_events_flags_are_named() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mooncake", "master", "--enable-kv-events",
         "--kv-events-buffer-steps", "0"],
        capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "kv_events_buffer_steps" in r.stderr
    with pytest.raises(Exception, match="replay_endpoints must match"):
        KvEventSubscriber(["tcp://127.0.0.1:1"], replay_endpoints=[])  # type: ignore[list-item]


# -- HA --------------------------------------------------------------------------------------


@pytest.mark.etcd
@pytest.mark.slow
def test_failover_announces_a_new_stream(tmp_path: Path) -> None:
    with services.etcd_cluster(1) as etcd:
        ms = [HaMaster(etcd.conn, *KV_FLAGS, cluster="kv", log=tmp_path / "m0.log")]
        try:
            first = wait_leader(ms)
            ms.append(HaMaster(etcd.conn, *KV_FLAGS, cluster="kv", log=tmp_path / "m1.log"))
            eps = [_kv_status(m.metrics) for m in ms]
            assert eps[0]["active"] and not eps[1]["active"]
            mount(first.address)
            with KvEventSubscriber(
                [e["endpoint"] for e in eps], replay_endpoints=[e["replay_endpoint"] for e in eps]
            ) as sub:
                notes = _wait_subscribed(sub, first.address, "a")
                assert isinstance(notes[0], NewStream) and notes[0].source == 0
                assert not notes[0].resync
                first.signal(signal.SIGKILL)
                second = wait_leader(ms[1:])
                epoch = _kv_status(second.metrics)["epoch"]
                assert epoch > eps[0]["epoch"]
                mount(second.address, client="c1", idx=1)
                assert put(second.address, "after", client="c1")
                notes = _collect(sub, 1)
        finally:
            for m in ms:
                m.stop()
    news = [n for n in notes if isinstance(n, NewStream)]
    assert news and news[0].source == 1 and news[0].resync and news[0].seq == 1
    got = [e for n in notes if isinstance(n, Received) for e in n.batch.events]
    assert any(e.object_key == "after" and e.epoch == epoch for e in got), got


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("object_key", [True, False])
def test_stream_encoder_is_byte_identical(legacy: bool, object_key: bool) -> None:
    import random

    rng = random.Random(1)
    keys = ["k", "7", "0xff", str((1 << 64) - 1), str(1 << 63), "", "0x", "12ab"]
    keys += ["\0a\0k", "\0a\07", "\0tenant-b\0" + str(1 << 63)]  # named tenants' objects
    enc = kv.BatchEncoder(
        backend_id="b", tenant_id="t", epoch=9, emit_legacy=legacy, emit_object_key=object_key
    )
    for n in (0, 1, 15, 16, 64):
        events = [
            (rng.choice((kv.STORED, kv.REMOVED)), rng.choice(keys), rng.choice(("cpu", "disk")))
            for _ in range(n)
        ]
        want = kv.encode_batch(
            events,
            timestamp_ms=5,
            first_event_id=3,
            backend_id="b",
            tenant_id="t",
            epoch=9,
            emit_legacy=legacy,
            emit_object_key=object_key,
        )
        assert enc.encode(events, 5, 3) == want


def test_publisher_stays_bounded_beside_a_subscriber_that_never_reads() -> None:
    """Real sockets in this process: a SUB that reads nothing, a tiny high-water mark and
    queue; 20000 events go in without blocking, the queue never holds more than its capacity,
    and what could not be kept is counted (and shows as sequence gaps)."""
    from mooncake._store.kv_events import KvEventPublisher, KvEventsConfig

    pub = KvEventPublisher(
        KvEventsConfig(bind_endpoint=ANY, queue_capacity=100, hwm=4, heartbeat_interval=0)
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 4)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        pub.start_stream(7)
        peak = 0
        for i in range(20000):
            pub.queue.put(kv.STORED, f"k{i}", "cpu")
            peak = max(peak, len(pub.queue))
        assert peak <= 100
        deadline = time.monotonic() + 30
        while len(pub.queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = pub.stats()
        assert st["active"] and st["epoch"] == 7 and st["queued"] == 0
        # every event was published or counted as dropped; the sequence covers the drops
        assert st["published_events"] + st["dropped_events"] == 20000
        assert st["seq"] >= st["published_batches"]
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_replays_are_answered_while_producers_keep_publishing() -> None:
    """A producer puts an event about every millisecond (publishing due batches itself, so
    the publisher thread only lingers): a replay request is still answered, its batches and
    the end marker, while the puts go on."""
    import threading

    from mooncake._store.kv_events import KvEventPublisher, KvEventsConfig

    pub = KvEventPublisher(
        KvEventsConfig(bind_endpoint=ANY, replay_endpoint=ANY, heartbeat_interval=0)
    )
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    done = threading.Event()

    def producer() -> None:
        i = 0
        while not done.is_set():
            pub.queue.put(kv.STORED, f"k{i}", "cpu")
            i += 1
            time.sleep(0.001)

    t = threading.Thread(target=producer, daemon=True)
    try:
        pub.start_stream(3)
        t.start()
        while pub.stats()["published_batches"] < 2:
            time.sleep(0.01)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        while dealer.poll(20_000):
            _, seq, _payload = dealer.recv_multipart()
            if seq == kv.END_SEQ:
                break
            seqs.append(kv.decode_seq(seq))
        else:
            pytest.fail("no end marker: the replay was not answered while events kept coming")
        assert not done.is_set() and t.is_alive()  # answered during the puts
        assert seqs and seqs == sorted(seqs)
    finally:
        done.set()
        t.join()
        dealer.close(0)
        ctx.term()
        pub.close()


def test_published_gflags_configure_the_publisher() -> None:
    from mooncake._cli.master import parse_gflags

    p = parse_gflags(
        [
            "--enable_kv_events=true",
            "--kv_events_bind_endpoint=tcp://127.0.0.1:5999",
            "--kv_events_backend_id=node-7",
            "--kv_events_emit_legacy_compat=false",
            "--kv_events_queue_capacity=128",
            "--kv_events_model_name=ignored-as-upstream",
            "--kv_events_block_size=16",
            "--kv_events_replay_endpoint=tcp://127.0.0.1:6000",
        ],
        warn=lambda msg: None,
    )
    cfg = p.server.kv_events
    assert cfg is not None and cfg.bind_endpoint == "tcp://127.0.0.1:5999"
    assert cfg.backend_id == "node-7" and not cfg.emit_legacy_compat and cfg.emit_object_key
    assert cfg.queue_capacity == 128 and cfg.replay_endpoint == "tcp://127.0.0.1:6000"
    assert parse_gflags([], warn=lambda msg: None).server.kv_events is None
    with pytest.raises(Exception, match="kv_events_backend_id"):
        parse_gflags(["--enable_kv_events", "--kv_events_backend_id="], warn=lambda m: None)


def test_a_new_stream_whose_announcement_was_lost_is_reported() -> None:
    """A master that leads again numbers from 1; a subscriber that missed the first batches
    sees numbers below the old stream's: a new stream (resync), never duplicates."""

    def batch(epoch: int, key: str) -> bytes:
        payload, _ = kv.encode_batch(
            [(kv.STORED, key, "cpu")],
            timestamp_ms=1,
            first_event_id=1,
            backend_id="b",
            tenant_id="default",
            epoch=epoch,
        )
        return payload

    with KvEventSubscriber(["tcp://127.0.0.1:1"]) as sub:
        out: list[Any] = []
        for seq in (1, 2, 3):
            sub._take(0, seq, batch(10, f"a{seq}"), out)
        out.clear()
        sub._take(0, 2, batch(11, "b2"), out)  # epoch 11's seq 1 was lost
        kinds = [type(n).__name__ for n in out]
        assert kinds == ["NewStream", "Gap", "Received"], kinds
        assert out[0].resync and out[0].epoch == 11 and not out[1].recovered
        assert out[2].batch.events[0].object_key == "b2"
