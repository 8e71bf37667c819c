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
(``tcp``, ``shm``): through small pools of pinned host chunks, one chunk per in-flight step, so a
large request is pipelined (the device->host copy of one chunk overlaps the send of the previous
one) with bounded memory, and small requests share chunks. It serves both ends: the client side
(:meth:`Stager.run`: a batch whose local side is device memory) and a server receiving into or
sending from device memory (:meth:`Stager.serve_write` / :meth:`Stager.serve_read`), each side
with its own pool (see ``Stager.__init__`` for why).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

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
Recv = Callable[[int, int], Awaitable[None]]
Send = Callable[[int, int, bool], Awaitable[None]]


ChunkHook = Callable[[int, int], Awaitable[None]]


class PinnedPool:
    """``depth`` pinned host chunks of ``chunk`` bytes, allocated on first use.

    ``on_new(addr, length)`` runs once per chunk after allocating it (the engine registers it as
    local-only memory, so transports that need registered local memory, such as RDMA with its
    memory regions, can move staged bytes); if it fails, the chunk is freed and the error raised.
    """

    def __init__(
        self, rt: CudaRuntime, chunk: int, depth: int, on_new: ChunkHook | None = None
    ) -> None:
        self.rt = rt
        self.chunk = chunk
        self.depth = depth
        self._on_new = on_new
        self._idle: collections.deque[int] = collections.deque()
        self._all: list[int] = []
        self._slots = anyio.Semaphore(depth)
        self.closed = False

    async def acquire(self) -> int:
        """A chunk's address (waits while all are in use); give it back with :meth:`release`."""
        await self._slots.acquire()
        try:
            if self.closed:
                raise CudaError("pinned pool is closed")
            if self._idle:
                return self._idle.pop()
            buf = self.rt.host_alloc(self.chunk)
            if self._on_new is not None:
                try:
                    await self._on_new(buf, self.chunk)
                except BaseException:
                    self.rt.free_host(buf)
                    raise
            self._all.append(buf)
            return buf
        except BaseException:
            self._slots.release()
            raise

    def release(self, buf: int) -> None:
        self._idle.append(buf)
        self._slots.release()

    @asynccontextmanager
    async def buffer(self) -> AsyncIterator[int]:
        buf = await self.acquire()
        try:
            yield buf
        finally:
            self.release(buf)

    @property
    def in_use(self) -> int:
        return self.depth - self._slots.value

    @property
    def chunks(self) -> list[int]:
        """Addresses of every chunk allocated so far."""
        return list(self._all)

    def close(self) -> None:
        self.closed = True
        for buf in self._all:
            try:
                self.rt.free_host(buf)
            except CudaError as e:
                log.debug("free_host at close: %s", e)
        self._all.clear()
        self._idle.clear()


class Stager:
    """Device <-> host-transport staging through pinned chunks (see the module docstring)."""

    def __init__(
        self,
        rt: CudaRuntime,
        completions: Completions,
        *,
        chunk: int | None = None,
        depth: int | None = None,
        on_new_chunk: ChunkHook | None = None,
    ) -> None:
        self.rt = rt
        self.completions = completions
        self.chunk = chunk or int(os.environ.get("MC_CUDA_STAGING_CHUNK", "") or DEFAULT_CHUNK)
        self.depth = depth or int(os.environ.get("MC_CUDA_STAGING_DEPTH", "") or DEFAULT_DEPTH)
        if self.chunk <= 0 or self.depth <= 0:
            raise InvalidArgumentError("staging chunk and depth must be positive")
        self.streams = StreamSet(rt)
        # Two pools: a client job holds its chunk until the peer answers, and the peer's server
        # may need a chunk to answer; with one shared pool, two engines staging towards each
        # other could each hold every chunk and wait for the other forever.
        self.pool = PinnedPool(rt, self.chunk, self.depth, on_new_chunk)
        self.server_pool = PinnedPool(rt, self.chunk, self.depth, on_new_chunk)
        self.staged_bytes = 0

    def buffer(self) -> Any:
        """Borrow one client-side pinned chunk (``async with stager.buffer() as addr``)."""
        return self.pool.buffer()

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
            try:
                out = await execute([requests[i] for i in direct])
            except MooncakeError as e:  # the batch could not be attempted: each request fails
                out = [failed(e)] * len(direct)
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
        self.streams.close()
        self.pool.close()
        self.server_pool.close()

    # -- serving a host-transport request on a device region ------------------------------

    async def serve_write(self, recv_into: Recv, addr: int, size: int, device: int) -> None:
        """Receive ``size`` bytes for device ``addr`` chunk by chunk (``await recv_into(buf, n)``).

        The host->device copy of one chunk overlaps the receive of the next (up to ``depth``
        chunks in flight). Returns once every byte is on the device.
        """
        pool = self.server_pool
        errors: list[BaseException] = []

        async def land(buf: int, dst: int, n: int) -> None:
            try:
                await self.copy(dst, buf, n, device)
            except (MooncakeError, OSError) as e:
                errors.append(e)
                tg.cancel_scope.cancel()
            finally:
                pool.release(buf)

        # Failures are collected and re-raised alone (not as an exception group) so the
        # server's per-connection handler sees the error types it expects.
        async with anyio.create_task_group() as tg:
            off = 0
            while off < size and not errors:
                n = min(self.chunk, size - off)
                buf = await pool.acquire()
                try:
                    await recv_into(buf, n)
                except (MooncakeError, OSError) as e:
                    pool.release(buf)
                    errors.append(e)
                    break
                except BaseException:
                    pool.release(buf)
                    raise
                tg.start_soon(land, buf, addr + off, n)
                off += n
        if errors:
            raise errors[0]

    async def serve_read(self, send_from: Send, addr: int, size: int, device: int) -> None:
        """Send ``size`` bytes of device ``addr`` chunk by chunk (``await send_from(buf, n, first)``).

        The device->host copy of the next chunk overlaps the send of the current one.
        """
        pool = self.server_pool
        errors: list[BaseException] = []
        tx, rx = anyio.create_memory_object_stream[tuple[int, int]](self.depth)

        async def produce() -> None:
            with tx:
                off = 0
                while off < size:
                    n = min(self.chunk, size - off)
                    buf = await pool.acquire()
                    try:
                        await self.copy(buf, addr + off, n, device)
                        await tx.send((buf, n))
                    except (MooncakeError, OSError) as e:
                        pool.release(buf)
                        errors.append(e)
                        return  # closing tx ends the consumer's loop
                    except anyio.BrokenResourceError:  # the consumer is gone (it failed)
                        pool.release(buf)
                        return
                    except BaseException:
                        pool.release(buf)
                        raise
                    off += n

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            first = True
            try:
                async for buf, n in rx:
                    try:
                        await send_from(buf, n, first)
                    except (MooncakeError, OSError) as e:
                        errors.append(e)
                        tg.cancel_scope.cancel()
                        break
                    finally:
                        pool.release(buf)
                    first = False
            finally:
                while True:  # chunks the producer queued behind a failed send
                    try:
                        buf, _ = rx.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                        break
                    pool.release(buf)
                rx.close()
        if errors:
            raise errors[0]
