"""GPU work seen from the event loop: completions, streams, and staging through pinned memory.

:class:`Completions` bridges "the work enqueued so far on this CUDA stream has finished" to an
awaitable, in one of two ways (``MC_CUDA_COMPLETION``):

``eventfd`` (default)  a host callback enqueued behind the work writes ``status + 1`` to an
                       eventfd, awaited with ``anyio.wait_readable``. No thread per wait, no
                       polling; the compiled runtime's callback is C and never takes the GIL.
                       eventfds are pooled (one per concurrent wait).
``thread``             an event is recorded behind the work and ``cudaEventSynchronize`` runs in
                       a worker thread (``anyio.to_thread``): simpler, one thread per wait.

``benchmarks/gpu_check.py`` measures both. Either way the wait is shielded from cancellation: a
copy cannot be recalled once enqueued, so the memory it touches must stay valid until it is done
(the transport contract in ``transports/base.py``).

:class:`Stager` moves bytes between device memory and transports that only handle host memory
(``tcp``, ``shm``): through a small pool of pinned host chunks, one chunk per in-flight step, so a
large request is pipelined (the device->host copy of one chunk overlaps the send of the previous
one) with bounded memory. It serves both ends: the client side (:meth:`Stager.run`: a batch whose
local side is device memory) and a server receiving into or sending from device memory
(:meth:`Stager.buffer` + :meth:`Stager.copy`).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio

from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, completed, failed
from mooncake._fast.cuda import CudaRuntime, check
from mooncake.errors import CudaError, InvalidArgumentError, MooncakeError, TransferError

log = logging.getLogger("mooncake.cuda")

DEFAULT_CHUNK = 4 << 20  # MC_CUDA_STAGING_CHUNK
DEFAULT_DEPTH = 4  # MC_CUDA_STAGING_DEPTH: pinned chunks per engine
MAX_IDLE_FDS = 64


class Completions:
    """Await the completion of the work enqueued so far on a stream (see the module docstring)."""

    def __init__(self, rt: CudaRuntime, mode: str | None = None) -> None:
        mode = mode or os.environ.get("MC_CUDA_COMPLETION", "") or "eventfd"
        if mode not in ("eventfd", "thread"):
            raise InvalidArgumentError(f"MC_CUDA_COMPLETION={mode!r}: expected eventfd or thread")
        self.rt = rt
        self.mode = mode
        self._fds: list[int] = []
        self._events: list[int] = []
        self._live_fds = 0
        self.closed = False

    async def wait(self, stream: int) -> None:
        """Return once everything enqueued on ``stream`` before this call is done.

        Raises :class:`CudaError` if that work failed. Shielded from cancellation.
        """
        if self.closed:
            raise CudaError("completion bridge is closed")
        if self.mode == "thread":
            await self._wait_thread(stream)
        else:
            await self._wait_eventfd(stream)

    async def _wait_eventfd(self, stream: int) -> None:
        fd = self._fds.pop() if self._fds else self._new_fd()
        try:
            self.rt.stream_notify_fd(stream, fd)
        except BaseException:
            self._put_fd(fd)  # nothing was enqueued: the fd is clean
            raise
        with anyio.CancelScope(shield=True):
            while True:
                try:
                    value = os.eventfd_read(fd)
                    break
                except BlockingIOError:
                    await anyio.wait_readable(fd)
        self._put_fd(fd)
        check(value - 1, "CUDA stream work")

    def _new_fd(self) -> int:
        self._live_fds += 1
        return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def _put_fd(self, fd: int) -> None:
        if self.closed or len(self._fds) >= MAX_IDLE_FDS:
            os.close(fd)
            self._live_fds -= 1
        else:
            self._fds.append(fd)

    async def _wait_thread(self, stream: int) -> None:
        ev = self._events.pop() if self._events else self.rt.event_create()
        try:
            self.rt.event_record(ev, stream)
        except BaseException:
            self._events.append(ev)
            raise
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.rt.event_synchronize, ev)
        finally:
            if self.closed:
                self.rt.event_destroy(ev)
            else:
                self._events.append(ev)

    @property
    def live_fds(self) -> int:
        """eventfds currently open (pooled or in use): tests check this stays bounded."""
        return self._live_fds

    def close(self) -> None:
        """Release pooled fds and events (waits still running release theirs on return)."""
        self.closed = True
        for fd in self._fds:
            os.close(fd)
            self._live_fds -= 1
        self._fds.clear()
        for ev in self._events:
            try:
                self.rt.event_destroy(ev)
            except CudaError as e:
                log.debug("event destroy at close: %s", e)
        self._events.clear()


class StreamSet:
    """One non-blocking stream per device, created on first use (per peer, or per stager)."""

    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        self._streams: dict[int, int] = {}

    def get(self, device: int) -> int:
        """The stream of ``device``; leaves ``device`` current on this thread."""
        self.rt.set_device(device)
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self.rt.stream_create()
        return s

    def __len__(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        for dev, s in self._streams.items():
            try:
                self.rt.set_device(dev)
                self.rt.stream_destroy(s)
            except CudaError as e:
                log.debug("stream destroy: %s", e)
        self._streams.clear()


Executor = Callable[[Sequence[TransferRequest]], Awaitable[list[TransferResult]]]


class Stager:
    """Device <-> host-transport staging through pinned chunks (see the module docstring)."""

    def __init__(
        self,
        rt: CudaRuntime,
        completions: Completions,
        *,
        chunk: int | None = None,
        depth: int | None = None,
    ) -> None:
        self.rt = rt
        self.completions = completions
        self.chunk = chunk or int(os.environ.get("MC_CUDA_STAGING_CHUNK", "") or DEFAULT_CHUNK)
        self.depth = depth or int(os.environ.get("MC_CUDA_STAGING_DEPTH", "") or DEFAULT_DEPTH)
        if self.chunk <= 0 or self.depth <= 0:
            raise InvalidArgumentError("staging chunk and depth must be positive")
        self.streams = StreamSet(rt)
        self._idle: collections.deque[int] = collections.deque()
        self._all: list[int] = []
        self._slots = anyio.Semaphore(self.depth)
        self.closed = False
        self.staged_bytes = 0

    @asynccontextmanager
    async def buffer(self) -> AsyncIterator[int]:
        """Borrow one pinned chunk of ``self.chunk`` bytes (waits while all are in use)."""
        async with self._slots:
            if self.closed:
                raise CudaError("stager is closed")
            if self._idle:
                buf = self._idle.pop()
            else:
                buf = self.rt.host_alloc(self.chunk)
                self._all.append(buf)
            try:
                yield buf
            finally:
                self._idle.append(buf)

    async def copy(self, dst: int, src: int, n: int, device: int) -> None:
        """Copy ``n`` bytes (either side device or host) on ``device``'s staging stream; await it."""
        await self.copy_many([(dst, src, n)], device)

    async def copy_many(self, copies: Sequence[tuple[int, int, int]], device: int) -> None:
        """Enqueue every ``(dst, src, n)`` on ``device``'s staging stream, then await them once.

        An enqueue failure still waits for the copies already enqueued before raising.
        """
        stream = self.streams.get(device)
        err: MooncakeError | None = None
        for dst, src, n in copies:
            try:
                self.rt.memcpy_async(dst, src, n, stream)
            except MooncakeError as e:
                err = e
                break
            self.staged_bytes += n
        await self.completions.wait(stream)
        if err is not None:
            raise err

    def plan(
        self, requests: Sequence[TransferRequest], devices: Sequence[int | None]
    ) -> list[tuple[int, Opcode, list[tuple[int, int, int, int]]]]:
        """Pack the device requests into jobs of at most one chunk each.

        A job is ``(device, opcode, pieces)``, a piece ``(request index, offset in the request,
        length, offset in the chunk)``. Requests larger than a chunk are split; smaller ones
        share a chunk (in order, at 256-byte aligned offsets) with others of the same device and
        opcode, so a batch of many small KV blocks costs one host-transport call per chunk, not
        one per block.
        """
        jobs: list[tuple[int, Opcode, list[tuple[int, int, int, int]]]] = []
        open_jobs: dict[tuple[int, Opcode], tuple[list[tuple[int, int, int, int]], list[int]]] = {}
        for i, dev in enumerate(devices):
            if dev is None:
                continue
            r = requests[i]
            key = (dev, r.opcode)
            for off in range(0, r.length, self.chunk):
                n = min(self.chunk, r.length - off)
                cur = open_jobs.get(key)
                if cur is not None and cur[1][0] + n > self.chunk:
                    cur = None
                if cur is None:
                    pieces: list[tuple[int, int, int, int]] = []
                    cur = open_jobs[key] = (pieces, [0])
                    jobs.append((dev, r.opcode, pieces))
                pieces, fill = cur
                pieces.append((i, off, n, fill[0]))
                fill[0] += (n + 255) & ~255
        return jobs

    async def run(
        self,
        execute: Executor,
        requests: Sequence[TransferRequest],
        devices: Sequence[int | None],
    ) -> list[TransferResult]:
        """Run ``requests`` through a host-only transport's ``execute``.

        ``devices[i]`` is the CUDA device of request i's local memory, or None for host memory
        (passed through unchanged, in one ``execute`` call). Device requests are packed into
        chunk-sized jobs (:meth:`plan`); each job borrows a pinned chunk, so at most ``depth``
        are in flight and they pipeline (the device copy of one job overlaps the transfer of
        another). A request fails with the first error of any of its pieces.
        """
        results: list[TransferResult | None] = [None] * len(requests)
        errors: dict[int, MooncakeError] = {}
        direct = [i for i, d in enumerate(devices) if d is None]

        async def run_direct() -> None:
            out = await execute([requests[i] for i in direct])
            for i, res in zip(direct, out, strict=True):
                results[i] = res

        def fail(i: int, e: MooncakeError) -> None:
            errors.setdefault(i, e)

        async def run_job(device: int, op: Opcode, pieces: list[tuple[int, int, int, int]]) -> None:
            async with self.buffer() as buf:
                try:
                    if op is Opcode.WRITE:
                        await self.copy_many(
                            [(buf + b, requests[i].local_addr + o, n) for i, o, n, b in pieces],
                            device,
                        )
                        out = await execute(
                            [
                                TransferRequest.write(buf + b, requests[i].remote_addr + o, n)
                                for i, o, n, b in pieces
                            ]
                        )
                        for (i, *_), res in zip(pieces, out, strict=True):
                            if not res.ok:
                                fail(i, res.error or TransferError("staged piece failed"))
                    else:
                        out = await execute(
                            [
                                TransferRequest.read(buf + b, requests[i].remote_addr + o, n)
                                for i, o, n, b in pieces
                            ]
                        )
                        landed = []
                        for (i, o, n, b), res in zip(pieces, out, strict=True):
                            if res.ok:
                                landed.append((requests[i].local_addr + o, buf + b, n))
                            else:
                                fail(i, res.error or TransferError("staged piece failed"))
                        if landed:
                            await self.copy_many(landed, device)
                except MooncakeError as e:
                    for i, *_ in pieces:
                        fail(i, e)

        async with anyio.create_task_group() as tg:
            if direct:
                tg.start_soon(run_direct)
            for device, op, pieces in self.plan(requests, devices):
                tg.start_soon(run_job, device, op, pieces)
        for i, dev in enumerate(devices):
            if dev is not None:
                err = errors.get(i)
                results[i] = completed(requests[i].length) if err is None else failed(err)
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    def close(self) -> None:
        """Free the pinned chunks and streams (call once nothing is in flight)."""
        self.closed = True
        self.streams.close()
        for buf in self._all:
            try:
                self.rt.free_host(buf)
            except CudaError as e:
                log.debug("free_host at close: %s", e)
        self._all.clear()
        self._idle.clear()
