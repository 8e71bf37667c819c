"""The far side of :mod:`mooncake.testing.transport`: an engine in a child process, and its driver.

``python -m mooncake.testing._transport_peer --transports shm,tcp --memory array`` starts an
engine with those transports and registers one region of ``--size`` bytes, then prints one JSON
line ``{"segment", "addr", "length", "guard", "pid"}`` and answers one JSON line per command.
The region is watched through a view that outlives its registration, so a check can tell
whether bytes landed after an ``unregister`` returned:

* ``--memory array``: the middle of a numpy array with ``--guard`` bytes of plain memory on
  each side (memory the engine did not allocate: shm reaches it with process_vm, tcp and rdma
  as any buffer); re-registering registers the same memory again.
* ``--memory alloc``: an ``engine.allocate`` buffer (memfd-backed: shm maps it), watched
  through a second mapping of its memfd; no guard; re-registering allocates a new buffer.

Commands (offsets are relative to the region's start; a negative one reaches into the guard):

  {"op": "fill", "seed": s}                      the whole watched span gets pattern(s)
  {"op": "digest", "offset": o, "length": n}     -> {"digest"}
  {"op": "unregister"}                           -> {"digest"} of the region as the call returned
  {"op": "register"}                             -> {"addr"}
  {"op": "quit"}

Closing stdin also ends it. :class:`ProcessPeer` drives it from an async test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from mooncake.errors import InvalidArgumentError

#: the period of :func:`pattern` (a prime, so patterns of different seeds never line up)
_PERIOD = 251


def pattern(seed: int, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``n`` deterministic bytes for ``seed`` (the same on both sides of a check)."""
    period = ((np.arange(_PERIOD, dtype=np.int64) * (2 * seed + 1) + seed) & 0xFF).astype(np.uint8)
    return np.resize(period, n)


def digest(data: Any) -> str:
    """The sha256 hex digest of a buffer (bytes, memoryview or a contiguous numpy array)."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


async def _serve(args: argparse.Namespace) -> None:
    from mooncake._engine.engine import Buffer, open_engine

    size: int = args.size
    guard: int = args.guard
    async with open_engine("127.0.0.1", transports=args.transports.split(",")) as engine:
        buf: Buffer | None = None
        backing: np.ndarray[Any, np.dtype[np.uint8]]
        watch: mmap.mmap | None = None

        async def register() -> int:
            nonlocal buf, backing, watch
            if args.memory == "alloc":
                buf = await engine.allocate(size)
                if buf.fd < 0:
                    raise InvalidArgumentError("--memory alloc needs memfd-backed buffers")
                watch = mmap.mmap(buf.fd, buf.length)  # a second mapping (mmap dups the fd)
                backing = np.frombuffer(watch, dtype=np.uint8)
                return buf.addr
            start = int(backing.ctypes.data) + guard
            await engine.register((start, size))
            return start

        if args.memory == "array":
            backing = np.zeros(size + 2 * guard, dtype=np.uint8)
        else:
            guard = 0
        addr = await register()
        info = {"segment": engine.segment_name, "addr": addr, "length": size}
        print(json.dumps(info | {"guard": guard, "pid": os.getpid()}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                break
            cmd = json.loads(line)
            op = cmd.get("op")
            reply: dict[str, Any] = {"ok": True}
            if op == "quit":
                break
            if op == "fill":
                backing[:] = pattern(cmd["seed"], len(backing))
            elif op == "digest":
                o = guard + cmd["offset"]
                reply["digest"] = digest(backing[o : o + cmd["length"]])
            elif op == "unregister":
                await engine.unregister(buf if buf is not None else addr)
                buf = None
                reply["digest"] = digest(backing[guard : guard + size])
            elif op == "register":
                addr = reply["addr"] = await register()
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
            print(json.dumps(reply), flush=True)
        del backing
        if watch is not None:
            watch.close()


class ProcessPeer:
    """Drives one ``_transport_peer`` child; every method but :meth:`kill` waits on a thread.

    ``env`` is added to this process's environment for the child (e.g. the software verbs
    provider's variables); the child imports the same ``mooncake`` as this process.
    """

    can_die = True

    def __init__(
        self,
        transports: list[str],
        *,
        memory: str = "array",
        size: int = 8 << 20,
        guard: int = 64 << 10,
        env: dict[str, str] | None = None,
    ) -> None:
        if memory not in ("array", "alloc"):
            raise InvalidArgumentError(f"memory must be 'array' or 'alloc', got {memory!r}")
        root = str(Path(__file__).resolve().parent.parent.parent)
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = root + os.pathsep + child_env.get("PYTHONPATH", "")
        child_env.update(env or {})
        argv = [sys.executable, "-m", "mooncake.testing._transport_peer"]
        argv += ["--transports", ",".join(transports), "--memory", memory]
        argv += ["--size", str(size), "--guard", str(guard)]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env
        )
        info = self._read()
        self.segment: str = info["segment"]
        self.addr: int = info["addr"]
        self.length: int = info["length"]
        self.guard: int = info["guard"]
        self._lock = anyio.Lock()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"transport peer exited with {self.proc.wait()} (its stderr above)")
        out: dict[str, Any] = json.loads(line)
        if not out.get("ok", True):
            raise RuntimeError(f"transport peer: {out.get('error')}")
        return out

    async def cmd(self, **c: Any) -> dict[str, Any]:
        """Send one command and return its reply (raises if the child died or refused it)."""

        def run() -> dict[str, Any]:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(c) + "\n")
            self.proc.stdin.flush()
            return self._read()

        async with self._lock:
            return await anyio.to_thread.run_sync(run)

    async def fill(self, seed: int) -> None:
        await self.cmd(op="fill", seed=seed)

    async def digest(self, offset: int, length: int) -> str:
        return str((await self.cmd(op="digest", offset=offset, length=length))["digest"])

    async def unregister(self) -> str:
        return str((await self.cmd(op="unregister"))["digest"])

    async def register(self) -> None:
        self.addr = int((await self.cmd(op="register"))["addr"])

    async def kill(self) -> None:
        """SIGKILL the child and reap it."""
        self.proc.kill()
        await anyio.to_thread.run_sync(self.proc.wait)

    def close(self) -> None:
        """Ask the child to quit (kill it if it does not within 30 s) and close the pipes."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="tcp")
    ap.add_argument("--memory", choices=("array", "alloc"), default="array")
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--guard", type=int, default=64 << 10)
    anyio.run(_serve, ap.parse_args(), backend="trio")
