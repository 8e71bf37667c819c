"""The target side of ``tllm_replay.c`` on the published Mooncake wheel (run with its python).

Serves an 8 MiB buffer filled with pattern 1 and prints ``READY <segment> <addr>``; on the
notification ``written <initiator addr hex>`` checks that [0, 4 MiB) holds pattern 2, writes its
[4 MiB, 4 MiB + 4 KiB) into the initiator's last 4 KiB with the notification ``verified:<0|1>``,
and waits for ``bye``. Prints ``DONE <failures>``; exit status 0 only with no failure.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode  # the published wheel

K4, MIB = 4096, 1 << 20
TSZ, WSZ, LSZ = 8 * MIB, 4 * MIB, 8 * MIB + K4


def pattern(seed: int, off: int, n: int) -> np.ndarray:
    o = np.arange(off, off + n, dtype=np.uint64)
    return ((o * 131 + seed * 29 + (o >> 12)) & 0xFF).astype(np.uint8)


def wait_notify(te: TransferEngine, prefix: str) -> tuple[str, str]:
    end = time.monotonic() + 120
    while time.monotonic() < end:
        for n in te.get_notifies():
            if n.msg.startswith(prefix):
                return n.name, n.msg
        time.sleep(0.001)
    raise TimeoutError(f"no notification {prefix!r}")


def main() -> int:
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("FAIL initialize", flush=True)
        return 1
    buf = pattern(1, 0, TSZ)
    base = int(buf.ctypes.data)
    assert te.register_memory(base, TSZ) == 0
    seg = f"127.0.0.1:{te.get_rpc_port()}"
    print(f"READY {seg} {base}", flush=True)
    failures = 0
    name, msg = wait_notify(te, "written ")
    ok = bool(np.array_equal(buf[:WSZ], pattern(2, 0, WSZ)))
    failures += not ok
    peer_addr = int(msg.split()[1], 16)
    rc = te.transfer_sync(
        name,
        base + WSZ,
        peer_addr + LSZ - K4,
        K4,
        TransferOpcode.Write,
        TransferNotify(seg, f"verified:{int(ok)}"),
    )
    failures += rc != 0
    wait_notify(te, "bye")
    print(f"DONE {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
