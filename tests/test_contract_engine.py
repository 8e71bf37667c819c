"""The engine call sequences of vLLM, SGLang and LMCache, replayed on the published sync API.

Each test makes exactly the ``mooncake.engine.TransferEngine`` calls one integration makes (the
sequences and the return conventions it relies on are in docs/integrations.md, read from the
integrations' sources), between this process and a second process on the same API
(``tests/helpers/facade_peer.py``), and checks the bytes that arrive. Both sides start with the
protocol string the integration's default configuration passes (``"rdma"`` for vLLM and SGLang:
no RNIC here, so the engine falls back to the transports it has, as the published one does when
``MC_FORCE_TCP`` is set).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mooncake.engine import TransferEngine
from tests.helpers.driver import LineDriver
from tests.helpers.facade_peer import pattern

LAYER = 1 << 20  # bytes of one layer's KV region on each side
LAYERS = 4
BLOCK = 16 << 10  # one KV block of one layer


def _peer(*args: str) -> LineDriver:
    return LineDriver(
        [sys.executable, "-m", "tests.helpers.facade_peer", *args], what="facade peer"
    )


@pytest.fixture
def decode_rdma() -> Iterator[LineDriver]:
    d = _peer("--protocol", "rdma", "--size", str(LAYER), "--regions", str(LAYERS))
    try:
        yield d
    finally:
        d.close()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def test_vllm_mooncake_connector(decode_rdma: LineDriver) -> None:
    """MooncakeConnectorWorker: initialize with the default "rdma", get_rpc_port,
    batch_register_memory of every layer, then ``batch_transfer_sync_write`` of coalesced block
    runs from a pool of 10 threads at once (vLLM's default ``num_workers``); ``0`` is success."""
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        port = te.get_rpc_port()
        assert isinstance(port, int) and 0 < port < 65536
        kv = [pattern(100 + i, LAYER) for i in range(LAYERS)]
        ptrs = [int(a.ctypes.data) for a in kv]
        assert te.batch_register_memory(ptrs, [LAYER] * LAYERS) == 0
        remote = decode_rdma.info["addrs"]
        # request r owns blocks [6r, 6r+6) of every layer; it arrives as two coalesced runs
        # per layer (blocks 0-3 and 4-5), as _send_blocks groups contiguous block ids
        jobs = []
        for r in range(10):
            src, dst, lens = [], [], []
            for layer in range(LAYERS):
                for first, n in ((6 * r, 4), (6 * r + 4, 2)):
                    src.append(ptrs[layer] + first * BLOCK)
                    dst.append(remote[layer] + first * BLOCK)
                    lens.append(n * BLOCK)
            jobs.append((src, dst, lens))
        with ThreadPoolExecutor(10) as pool:
            rcs = list(
                pool.map(lambda j: te.batch_transfer_sync_write(decode_rdma.segment, *j), jobs)
            )
        assert rcs == [0] * 10
        span = 60 * BLOCK
        for layer in range(LAYERS):
            got = decode_rdma.cmd(op="digest", region=layer, offset=0, length=span)["digest"]
            assert got == _digest(kv[layer][:span]), f"layer {layer}"
        # anything but 0 is a failed request for vLLM: a run past the peer's region
        bad = te.batch_transfer_sync_write(
            decode_rdma.segment, [ptrs[0]], [remote[0] + LAYER - BLOCK], [2 * BLOCK]
        )
        assert bad != 0
        # and the engine keeps serving the others afterwards
        assert (
            te.batch_transfer_sync_write(decode_rdma.segment, [ptrs[1]], [remote[1]], [BLOCK]) == 0
        )
    finally:
        te.close()


def test_sglang_pd_transfer_engine(decode_rdma: LineDriver) -> None:
    """SGLang's MooncakeTransferEngine wrapper and MooncakeKVManager: register KV (batch) and aux
    (single) buffers, per-layer ``batch_transfer_sync_write`` from a thread pool, a single
    ``transfer_sync_write`` for aux data (``< 0`` is failure), ``send_probe`` (0 = alive),
    ``get_engine``, deregistration at teardown."""
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        session = f"127.0.0.1:{te.get_rpc_port()}"
        assert session.rsplit(":", 1)[1].isdigit()
        kv = [pattern(200 + i, LAYER) for i in range(LAYERS)]
        aux = pattern(300, 4096)
        ptrs = [int(a.ctypes.data) for a in kv]
        assert te.batch_register_memory(ptrs, [LAYER] * LAYERS) == 0
        assert te.register_memory(int(aux.ctypes.data), aux.nbytes) == 0
        remote = decode_rdma.info["addrs"]
        blocks = [3, 4, 5, 9, 17]
        with ThreadPoolExecutor(4) as pool:  # SGLANG_DISAGGREGATION_THREAD_POOL_SIZE
            rcs = list(
                pool.map(
                    lambda layer: te.batch_transfer_sync_write(
                        decode_rdma.segment,
                        [ptrs[layer] + b * BLOCK for b in blocks],
                        [remote[layer] + b * BLOCK for b in blocks],
                        [BLOCK] * len(blocks),
                    ),
                    range(LAYERS),
                )
            )
        assert rcs == [0] * LAYERS
        for layer in range(LAYERS):
            for b in blocks:
                got = decode_rdma.cmd(op="digest", region=layer, offset=b * BLOCK, length=BLOCK)
                assert got["digest"] == _digest(kv[layer][b * BLOCK : (b + 1) * BLOCK])
        aux_dst = remote[0] + LAYER - 4096
        rc = te.transfer_sync_write(decode_rdma.segment, int(aux.ctypes.data), aux_dst, 4096)
        assert rc >= 0
        got = decode_rdma.cmd(op="digest", region=0, offset=LAYER - 4096, length=4096)["digest"]
        assert got == _digest(aux)
        assert te.send_probe(decode_rdma.segment) == 0
        assert te.get_engine() is not None
        assert te.unregister_memory(int(aux.ctypes.data)) == 0
        assert te.batch_unregister_memory(ptrs) == 0
        # a dead decode peer: the probe and the transfers fail, they do not hang or raise
        decode_rdma.proc.kill()
        decode_rdma.proc.wait()
        assert te.send_probe(decode_rdma.segment) != 0
        assert te.register_memory(ptrs[0], LAYER) == 0
        assert te.transfer_sync_write(decode_rdma.segment, ptrs[0], remote[0], BLOCK) < 0
    finally:
        te.close()


def test_lmcache_mooncake_channel() -> None:
    """LMCache's MooncakeChannel with its environment defaults (``MC_LOCAL_HOSTNAME`` localhost,
    ``P2PHANDSHAKE``, ``tcp``): one big registered PD buffer per side, one
    ``transfer_sync_write`` per page, ``< 0`` raising; sessions are ``localhost:port``."""
    page = 64 << 10
    peer = _peer("--hostname", "localhost", "--protocol", "tcp", "--size", str(16 * page))
    te = TransferEngine()
    try:
        assert te.initialize("localhost", "P2PHANDSHAKE", "tcp", "") == 0
        assert peer.segment.startswith("localhost:")
        buf = pattern(400, 16 * page)
        base = int(buf.ctypes.data)
        assert te.register_memory(base, buf.nbytes) == 0
        (remote,) = peer.info["addrs"]
        for i in (0, 1, 7, 15):  # pages of one chunk, in the order the sender picks
            rc = te.transfer_sync_write(peer.segment, base + i * page, remote + i * page, page)
            if rc < 0:
                raise RuntimeError(f"transfer_sync_write page {i}: {rc}")
        for i in (0, 1, 7, 15):
            got = peer.cmd(op="digest", region=0, offset=i * page, length=page)["digest"]
            assert got == _digest(buf[i * page : (i + 1) * page])
        untouched = peer.cmd(op="digest", region=0, offset=2 * page, length=page)["digest"]
        assert untouched == _digest(np.zeros(page, dtype=np.uint8))
        assert te.unregister_memory(base) == 0
    finally:
        te.close()
        peer.close()
