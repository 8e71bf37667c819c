"""Fast failover's decision (sans-I/O) and its connect probe (real sockets): only a port that
accepted and then actively refuses counts as a dead leader."""

from __future__ import annotations

import socket

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._cli.master import parse_gflags
from mooncake._core.leader_probe import PROBE_REFUSALS, DeathDetector, ProbeOutcome
from mooncake._store.ha import probe_connect

A, R, X = ProbeOutcome.ACCEPTED, ProbeOutcome.REFUSED, ProbeOutcome.OTHER


def test_refusals_after_an_accept_fire_once() -> None:
    d = DeathDetector(3)
    assert not d.observe(7, "h:1", A)
    assert [d.observe(7, "h:1", R) for _ in range(5)] == [False, False, True, False, False]


def test_refusals_never_accepted_do_not_fire() -> None:
    # a leader this standby never reached at that address (misconfigured advertise address)
    d = DeathDetector(3)
    assert not any(d.observe(7, "h:1", R) for _ in range(100))


def test_timeouts_and_accepts_break_the_streak() -> None:
    d = DeathDetector(3)
    d.observe(7, "h:1", A)
    seq = [R, R, X, R, R, A, R, R, X]
    assert not any(d.observe(7, "h:1", o) for o in seq)
    assert d.streak == 0


def test_a_new_term_starts_over() -> None:
    d = DeathDetector(3)
    d.observe(7, "h:1", A)
    d.observe(7, "h:1", R)
    d.observe(7, "h:1", R)
    # the key changed hands: the old term's accept and refusals do not count for term 9
    assert not any(d.observe(9, "h:1", R) for _ in range(10))
    assert not d.observe(9, "h:2", A)
    assert [d.observe(9, "h:2", R) for _ in range(3)] == [False, False, True]


def test_bad_refusal_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="refusals"):
        DeathDetector(0)


@given(st.lists(st.sampled_from([A, R, X]), max_size=60), st.integers(1, 5))
def test_fires_exactly_when_n_refusals_follow_some_accept(seq: list[ProbeOutcome], n: int) -> None:
    d = DeathDetector(n)
    fired = [i for i, o in enumerate(seq) if d.observe(1, "h:1", o)]
    # reference: first index i where seq[i-n+1..i] are all R and some A precedes them
    expected: list[int] = []
    for i in range(len(seq)):
        window = seq[max(0, i - n + 1) : i + 1]
        if len(window) == n and all(o is R for o in window) and A in seq[: i - n + 1]:
            expected.append(i)
            break
    assert fired == expected


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
async def test_probe_outcomes_on_real_sockets(anyio_backend: str) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)  # listening, never accepting: what a SIGSTOPped leader's kernel does
    port = int(lsock.getsockname()[1])
    try:
        for _ in range(3):
            assert await probe_connect(f"127.0.0.1:{port}", 2.0) is A
    finally:
        lsock.close()
    assert await probe_connect(f"127.0.0.1:{port}", 2.0) is R  # nothing listens now
    assert await probe_connect(f"127.0.0.1:{_free_port()}", 2.0) is R
    assert await probe_connect("no-port", 2.0) is X
    assert await probe_connect("127.0.0.1:notaport", 2.0) is X
    assert await probe_connect("name.invalid:80", 2.0) is X  # resolution fails: not refused
    # a backlog that is full drops SYNs: the probe times out, which is never a refusal
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fport = int(full.getsockname()[1])
    fillers = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", fport))
            fillers.append(c)
        await anyio.sleep(0.05)
        assert await probe_connect(f"127.0.0.1:{fport}", 0.3) in (A, X)
    finally:
        for c in fillers:
            c.close()
        full.close()


def test_fast_failover_flag_default_on_and_can_be_turned_off() -> None:
    p = parse_gflags(["--enable_ha", "--etcd_endpoints=127.0.0.1:2379"])
    assert p.server.ha is not None and p.server.ha.fast_failover is True
    p = parse_gflags(["--enable_ha", "--etcd_endpoints=127.0.0.1:2379", "--ha_fast_failover=false"])
    assert p.server.ha is not None and p.server.ha.fast_failover is False
    assert PROBE_REFUSALS >= 2
