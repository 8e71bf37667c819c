"""One probe of a master, run where the test cannot reach it directly (inside a namespace).

  python tests/helpers/ha_probe.py status METRICS_HOST:PORT   -> the /status "ha" object
  python tests/helpers/ha_probe.py keys RPC_HOST:PORT         -> {"keys": [...]}
  python tests/helpers/ha_probe.py mount RPC_HOST:PORT        -> {"ok": true}
  python tests/helpers/ha_probe.py loop RPC_HOST:PORT SECONDS PREFIX
        -> first {"started": true} once a put and a read were answered, then (last line)
           {"puts": [[key, acknowledged, monotonic time of the answer], ...],
            "reads": [[key, answered with success, monotonic time of the answer], ...]}

One JSON line on stdout; monotonic times are the kernel's, comparable across namespaces.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

from mooncake._core import rpc
from tests.helpers.ha_procs import all_keys, call, mount, put


def main(argv: list[str]) -> None:
    what, target = argv[0], argv[1]
    if what == "status":
        try:
            with urllib.request.urlopen(f"http://{target}/status", timeout=5) as r:
                out = json.loads(r.read())["ha"]
        except OSError as e:
            out = {"role": "unreachable", "error": str(e)}
    elif what == "keys":
        out = {"keys": sorted(all_keys(target))}
    elif what == "mount":
        mount(target)
        out = {"ok": True}
    elif what == "loop":
        until = time.monotonic() + float(argv[2])
        puts, reads, i = [], [], 0
        started = False
        while time.monotonic() < until:
            key = f"{argv[3]}{i}"
            i += 1
            ok = put(target, key)
            puts.append([key, ok, time.monotonic()])
            try:
                r = call(target, "ExistKey", rpc.KeyParams(f"{argv[3]}0"), timeout=5)
            except OSError:
                r = None
            reads.append([key, r is not None and r[0] == 0, time.monotonic()])
            if ok and reads[-1][1] and not started:
                started = True  # the caller may cut now: something was answered before it
                print(json.dumps({"started": True}), flush=True)
            if not ok:
                time.sleep(0.1)
        out = {"puts": puts, "reads": reads}
    else:
        raise SystemExit(f"unknown probe {what!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
