"""SGLang's own PD transfer wrapper ``MooncakeTransferEngine`` on our engine, two processes.

Run with the python of the venv that ``scripts/integration-sglang.sh`` builds and this checkout
first on ``PYTHONPATH``::

    python tests/integration/sglang_pd.py [--json OUT]

Both sides are SGLang's real ``MooncakeTransferEngine(hostname="127.0.0.1")`` from
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py`` (its ``initialize``
calls ``TransferEngine.initialize(host, "P2PHANDSHAKE", MOONCAKE_PROTOCOL, "")`` through
``run_with_deadline``; SGLang's default protocol ``"rdma"`` is left as it is, and our engine
falls back to the transports it has). The calls are those of SGLang's ``MooncakeKVManager``
(``disaggregation/mooncake/conn.py``):

* decode process: ``batch_register`` of its KV layers and aux buffer (zeroed), prints its
  ``get_session_id()`` and addresses;
* prefill process (this one): ``batch_register`` of its KV layers, ``register`` of its aux
  buffer, ``batch_transfer_sync`` of each layer's pages from a thread pool (as
  ``send_kvcache`` does per layer), ``transfer_sync`` of the aux buffer, ``send_probe`` of the
  live peer (0), the decode side's sha256 of what arrived compared with the prefill pages,
  ``batch_deregister``, then ``send_probe`` of the peer after it exited (non-zero).

Only ``sglang/__init__.py`` is skipped (see ``sglang_stubs.py``); this module needs no stub.
Prints one JSON object (bytes, transfers, seconds) and a last line ending in ``OK``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_stubs  # noqa: E402

sglang_stubs.install()

import torch  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    MooncakeTransferEngine,
)

LAYERS = 8
LAYER_BYTES = 1 << 20
PAGE = 16 << 10  # bytes of one page of one layer
PAGES = [1, 2, 3, 7, 8, 20, 33, 34, 35, 36, 60]  # the request's pages (decode = prefill ids)
AUX = 4096


def sha(t: torch.Tensor, off: int, n: int) -> str:
    return hashlib.sha256(t.view(torch.uint8)[off : off + n].numpy().tobytes()).hexdigest()


def decode_side() -> int:
    te = MooncakeTransferEngine(hostname="127.0.0.1")
    kv = [torch.zeros(LAYER_BYTES, dtype=torch.uint8) for _ in range(LAYERS)]
    aux = torch.zeros(AUX, dtype=torch.uint8)
    bufs = [*kv, aux]
    rc = te.batch_register([b.data_ptr() for b in bufs], [b.numel() for b in bufs])
    info = {
        "session": te.get_session_id(),
        "kv": [b.data_ptr() for b in kv],
        "aux": aux.data_ptr(),
        "register_rc": rc,
    }
    print("INFO " + json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() != "digests":
            break
        out = {
            "kv": [[sha(k, p * PAGE, PAGE) for p in PAGES] for k in kv],
            "aux": sha(aux, 0, AUX),
        }
        print("DIGESTS " + json.dumps(out), flush=True)
    te.batch_deregister([b.data_ptr() for b in bufs])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.decode:
        return decode_side()
    import mooncake

    res: dict[str, Any] = {"mooncake": mooncake.__file__}
    peer = subprocess.Popen(
        [sys.executable, __file__, "--decode"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None
        line = peer.stdout.readline()
        if not line.startswith("INFO "):
            raise SystemExit(f"decode side did not start: {line!r}")
        info = json.loads(line[5:])
        res["decode_register_rc"] = info["register_rc"]
        t0 = time.monotonic()
        te = MooncakeTransferEngine(hostname="127.0.0.1")
        res["init_s"] = round(time.monotonic() - t0, 3)
        g = torch.Generator().manual_seed(3)
        kv = [
            torch.randint(0, 256, (LAYER_BYTES,), dtype=torch.uint8, generator=g)
            for _ in range(LAYERS)
        ]
        aux = torch.randint(0, 256, (AUX,), dtype=torch.uint8, generator=g)
        res["register_rc"] = te.batch_register([k.data_ptr() for k in kv], [LAYER_BYTES] * LAYERS)
        te.register(aux.data_ptr(), AUX)
        session = info["session"]

        def send_layer(layer: int) -> int:
            return te.batch_transfer_sync(
                session,
                [kv[layer].data_ptr() + p * PAGE for p in PAGES],
                [info["kv"][layer] + p * PAGE for p in PAGES],
                [PAGE] * len(PAGES),
            )

        t1 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            res["layer_rcs"] = list(pool.map(send_layer, range(LAYERS)))
        res["aux_rc"] = te.transfer_sync(session, aux.data_ptr(), info["aux"], AUX)
        res["transfer_s"] = round(time.monotonic() - t1, 4)
        res["bytes"] = LAYERS * len(PAGES) * PAGE + AUX
        res["transfers"] = LAYERS * len(PAGES) + 1
        res["probe_live"] = te.send_probe(session)
        peer.stdin.write("digests\n")
        peer.stdin.flush()
        got = json.loads(peer.stdout.readline()[len("DIGESTS ") :])
        want = [[sha(k, p * PAGE, PAGE) for p in PAGES] for k in kv]
        res["kv_bytes_equal"] = got["kv"] == want
        res["aux_bytes_equal"] = got["aux"] == sha(aux, 0, AUX)
        peer.stdin.close()
        peer.wait(30)
        res["deregister_rc"] = te.batch_deregister([k.data_ptr() for k in kv])
        te.deregister(aux.data_ptr())
        res["probe_after_exit"] = te.send_probe(session)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ok = (
        res["register_rc"] == 0
        and res["decode_register_rc"] == 0
        and res["layer_rcs"] == [0] * LAYERS
        and res["aux_rc"] >= 0
        and res["probe_live"] == 0
        and res["kv_bytes_equal"]
        and res["aux_bytes_equal"]
        and res["deregister_rc"] == 0
        and res["probe_after_exit"] != 0
    )
    print(
        f"sglang pd: {res['transfers']} transfers, {res['bytes']} B in {res['transfer_s']} s, "
        f"probe live {res['probe_live']}, after exit {res['probe_after_exit']}: "
        f"{'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
