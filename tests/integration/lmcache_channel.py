"""LMCache's own Mooncake transfer channel on our engine, two processes (a pull between L1s).

Run with the python of the venv that ``scripts/integration-lmcache.sh`` builds and this checkout
first on ``PYTHONPATH``::

    python tests/integration/lmcache_channel.py [--json OUT]

lmcache 0.5.6 has no ``lmcache/v1/transfer_channel/mooncake_channel.py`` (``MooncakeChannel``
of earlier releases: its ``v1/transfer_channel/`` holds only ``nixl_channel.py``,
``py_socket_channel.py`` and a mock). Its Mooncake PD/peer channel is now
``MooncakeTeTransferChannelContext`` in
``lmcache/v1/distributed/transfer_channel/impl/mooncake_te_impl.py`` (factory name
``"mooncake_te"``), which this check drives, unstubbed:

* each process builds the real context over its own L1 arena (``L1MemoryDesc``): our
  ``TransferEngine()``, ``initialize(host, "P2PHANDSHAKE", MC_TE_PROTOCOL (default "tcp"),
  "")``, ``get_rpc_port()``, ``register_memory`` of the whole arena, and its ZMQ handshake
  server;
* the server process fills its arena with a pattern; the client process (this one) calls
  ``get_transfer_channel_client(server_url)`` (LMCache's own handshake exchanges session ids and
  arena bases), ``submit_read`` of scattered objects (our ``batch_transfer_async_read``; a batch
  id of 0 or 2^64-1 is a failure for LMCache) and polls ``query_read_status`` (our
  ``transfer_check_status``: 1 done, 0 pending, -1 failed, -2 timed out) until finished;
* the bytes that arrived (sha256 per object) must equal the server's; then a read from a peer
  that has gone must come back as a failure (an exception at submit or a finished, failed
  mask), and ``close`` (``unregister_memory``) answers 0. LMCache never closes the engine it
  owns; both processes must still exit by themselves (the peer is waited for with a limit).

Prints one JSON object (bytes, objects, seconds) and a last line ending in ``OK``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.transfer_channel.impl.mooncake_te_impl import (
    MooncakeTeTransferChannelContext,
)

ARENA = 8 << 20
OBJ = 64 << 10
# (server offset, client offset) pairs: scattered objects of one request
OBJECTS = [(i * 3 * OBJ, i * 2 * OBJ) for i in range(32)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def context(buf: torch.Tensor, port: int) -> MooncakeTeTransferChannelContext:
    desc = L1MemoryDesc(ptr=buf.data_ptr(), size=buf.numel(), align_bytes=4096)
    url = f"127.0.0.1:{port}"
    return MooncakeTeTransferChannelContext(desc, listen_url=url, advertise_url=url)


def sha(buf: torch.Tensor, off: int, n: int) -> str:
    return hashlib.sha256(buf[off : off + n].numpy().tobytes()).hexdigest()


def server() -> int:
    g = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (ARENA,), dtype=torch.uint8, generator=g)
    port = free_port()
    ctx = context(buf, port)
    print("INFO " + json.dumps({"url": f"127.0.0.1:{port}"}), flush=True)
    for line in sys.stdin:
        if line.strip() != "digests":
            break
        out = {
            "digests": [sha(buf, s, OBJ) for s, _ in OBJECTS],
            "clients": ctx.get_num_connected_clients(),
        }
        print("DIGESTS " + json.dumps(out), flush=True)
    ctx.close()
    return 0


def wait(client: Any, task: int, limit: float = 60.0) -> Any:
    deadline = time.monotonic() + limit
    while True:
        st = client.query_read_status(task)
        if st.finished or time.monotonic() > deadline:
            return st
        time.sleep(0.001)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.server:
        return server()
    import mooncake

    res: dict[str, Any] = {"mooncake": mooncake.__file__}
    peer = subprocess.Popen(
        [sys.executable, __file__, "--server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None
        line = peer.stdout.readline()
        if not line.startswith("INFO "):
            raise SystemExit(f"server side did not start: {line!r}")
        server_url = json.loads(line[5:])["url"]
        buf = torch.zeros(ARENA, dtype=torch.uint8)
        t0 = time.monotonic()
        ctx = context(buf, free_port())
        client = ctx.get_transfer_channel_client(server_url)
        res["connect_s"] = round(time.monotonic() - t0, 3)
        local = ctx.get_transfer_channel_address([(c, OBJ) for _, c in OBJECTS])
        remote = ctx.get_transfer_channel_address([(s, OBJ) for s, _ in OBJECTS])
        t1 = time.monotonic()
        task = client.submit_read(local, remote)
        st = wait(client, task)
        res["read_s"] = round(time.monotonic() - t1, 4)
        res["objects"] = len(OBJECTS)
        res["bytes"] = len(OBJECTS) * OBJ
        res["finished"] = st.finished
        res["succeeded"] = sum(st.succeeded_mask)
        peer.stdin.write("digests\n")
        peer.stdin.flush()
        got = json.loads(peer.stdout.readline()[len("DIGESTS ") :])
        res["server_clients"] = got["clients"]
        res["bytes_equal"] = got["digests"] == [sha(buf, c, OBJ) for _, c in OBJECTS]
        peer.stdin.close()
        peer.wait(30)
        # the peer is gone: LMCache must see a failure, not success
        try:
            task2 = client.submit_read(local[:1], remote[:1])
            st2 = wait(client, task2)
            res["read_after_exit"] = {
                "finished": st2.finished,
                "succeeded": sum(st2.succeeded_mask),
            }
            res["dead_peer_failed"] = st2.finished and not any(st2.succeeded_mask)
        except RuntimeError as exc:
            res["read_after_exit"] = {"error": str(exc)[:200]}
            res["dead_peer_failed"] = True
        ctx.close()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ok = (
        res["finished"]
        and res["succeeded"] == len(OBJECTS)
        and res["bytes_equal"]
        and res["server_clients"] == 1
        and res["dead_peer_failed"]
    )
    print(
        f"lmcache channel: {res['objects']} objects, {res['bytes']} B in {res['read_s']} s, "
        f"dead peer failed: {res['dead_peer_failed']}: {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
