"""A passive RDMA peer process for the verbs-layer tests (one RC QP, one registered buffer).

Speaks JSON lines on stdin/stdout. Runs unchanged over the software provider
(``MOONCAKE_IBVERBS=soft``) or a real RNIC (``MOONCAKE_IBVERBS`` unset, ``MC_VERBS_TEST_DEVICE``).

    -> {"qpn", "lid", "gid", "addr", "rkey", "length"}     (on start)
    <- {"qpn", "lid", "gid"}                              (the initiator's QP)
    -> {"ready": true}
    <- {"cmd": "sha", "off": int, "len": int}             -> {"sha": hex}
    <- {"cmd": "fill", "seed": int}                       -> {"ok": true}
    <- {"cmd": "exit"}                                    -> {"live": {...}, "provider": {...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys


def main() -> None:
    from mooncake._fast import verbs as v

    device = os.environ.get("MC_VERBS_TEST_DEVICE") or v.get_device_list()[0]
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    gid_index = int(os.environ.get("MC_GID_INDEX", "0"))
    ctx = v.Context(device)
    pd = v.PD(ctx)
    cq = v.CQ(ctx, 64)
    buf = bytearray(length)
    mr = v.MR(pd, buf)
    qp = v.QP(pd, cq)
    port = ctx.query_port()
    gid = ctx.query_gid(1, gid_index)

    def out(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    out(
        {
            "qpn": qp.qp_num,
            "lid": port["lid"],
            "gid": gid.hex(),
            "addr": mr.addr,
            "rkey": mr.rkey,
            "length": length,
        }
    )
    peer = json.loads(sys.stdin.readline())
    qp.to_init()
    qp.to_rtr(peer["qpn"], peer["lid"], bytes.fromhex(peer["gid"]), sgid_index=gid_index)
    qp.to_rts()
    out({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "sha":
            out({"sha": hashlib.sha256(buf[cmd["off"] : cmd["off"] + cmd["len"]]).hexdigest()})
        elif cmd["cmd"] == "fill":
            buf[:] = random.Random(cmd["seed"]).randbytes(length)
            out({"ok": True})
        elif cmd["cmd"] == "exit":
            ctx.close()
            out({"live": v.live_objects(), "provider": v.provider_live_objects()})
            return


if __name__ == "__main__":
    main()
