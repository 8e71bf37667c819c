"""The Python half of ``libtransfer_engine.so``, Mooncake's C ABI (``transfer_engine_c.h``).

The C library (``mooncake/_fast/csrc/transfer_engine_c.c``) calls :func:`create` and the
methods of :class:`CEngine` with the GIL held; every method returns the int the C function
returns, with Mooncake's codes (see the constants below), and never raises for a caller's
mistake. Batches and their task states live in C: :meth:`CEngine.submit` starts transfers and
reports each task's end through the library's ``mc_cabi_finish`` (handed over by
:func:`_attach`), so polling ``getTransferStatus`` never takes the GIL.

The engine is the published facade, :class:`mooncake.engine.TransferEngine`, on its loop thread;
small host-memory batches to a peer already contacted run on the caller's thread through the
facade's sync path (:mod:`mooncake._engine.syncpath`) and are complete when ``submitTransfer``
returns.

Segment ids: ``openSegment`` hands out 1, 2, ... per distinct name (0 is the engine's own
segment, ``LOCAL_SEGMENT``); ``target_offset`` of a request is the peer's virtual address, as
in Mooncake.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from mooncake._core.transfer import Opcode, TransferRequest, TransferResult
from mooncake._engine.engine import Engine
from mooncake._sync import LoopThread
from mooncake.errors import (
    AddressOverlapError,
    MooncakeError,
    NotRegisteredError,
    PeerUnreachableError,
)

log = logging.getLogger("mooncake.cabi")

# error.h (int-returning calls)
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_METADATA = -200
# Status::Code (submitTransfer, getTransferStatus, freeBatchID)
S_OK = 0
S_INVALID_ARGUMENT = 1
S_ADDRESS_NOT_REGISTERED = 3
#: submit's answer when every task completed on the calling thread (the C side marks them)
DONE_INLINE = 1000
# transfer_status.status
STATUS_CANCELED = 3
STATUS_COMPLETED = 4
STATUS_TIMEOUT = 5
STATUS_FAILED = 6

#: ``struct transfer_request`` with the platform's alignment: opcode, source, target_id,
#: target_offset, length (40 bytes on LP64)
REQUEST = struct.Struct("@iPiQQ")

_Finish = Callable[[int, int, int, int], None]
_finish: _Finish | None = None


def _attach(finish_addr: int) -> None:
    """Called once by the library: the address of ``mc_cabi_finish(batch, first, n, status)``."""
    global _finish
    proto = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
    _finish = proto(finish_addr)


def _report(batch: int, first: int, n: int, status: int) -> None:
    if _finish is not None and n:
        _finish(batch, first, n, status)


def create(
    metadata: bytes, local_server_name: bytes, ip_or_host_name: bytes, rpc_port: int, auto: int
) -> CEngine | None:
    """``createTransferEngine``: a started engine, or None (the reason is logged).

    ``local_server_name`` is the host (as TensorRT-LLM passes it) or ``host:port``; with
    ``P2PHANDSHAKE`` the segment name becomes ``host:<rpc port>`` (read it back with
    ``getLocalIpAndPort``). ``auto_discover`` 0 keeps to ``tcp``; otherwise the engine uses the
    transports this machine has (``MOONCAKE_TRANSPORTS`` overrides both).
    """
    from mooncake.engine import TransferEngine

    host = (local_server_name or ip_or_host_name).decode()
    if not host:
        log.error("createTransferEngine: no local server name")
        return None
    meta = metadata.decode() or "P2PHANDSHAKE"
    if meta.upper() == "P2PHANDSHAKE" and host.count(":") == 1:
        host = host.rsplit(":", 1)[0]  # the port comes from the handshake server
    te = TransferEngine()
    if te.initialize(host, meta, "tcp" if not auto else "auto", "") != 0:
        return None
    return CEngine(te)


class CEngine:
    """One ``transfer_engine_t``: the facade plus the segment-id table of the C ABI."""

    def __init__(self, te: object) -> None:
        from mooncake.engine import TransferEngine, _timeout_s

        assert isinstance(te, TransferEngine)
        self.te = te
        loop, engine = te._e()
        self.loop: LoopThread = loop
        self.engine: Engine = engine
        self._timeout_s = _timeout_s
        self._fast = te._fast
        self._tbase = te._tbase
        self._names: dict[int, str] = {0: engine.segment_name}
        self._ids: dict[str, int] = {engine.segment_name: 0}
        self._next_id = 1
        self._closed = False

    # -- engine ---------------------------------------------------------------------------

    def local_ip_and_port(self) -> str:
        return self.engine.segment_name

    def has_transport(self, proto: bytes) -> int:
        names = {t.name for t in self.engine.transports}
        return 1 if proto.decode(errors="replace").lower() in names else 0

    def close(self) -> int:
        self._closed = True  # late completions must not touch batches the C side frees
        self.te.close()
        return 0

    # -- memory ---------------------------------------------------------------------------

    def register(self, addr: int, length: int, location: bytes) -> int:
        loc = location.decode(errors="replace") or "*"
        try:
            self.loop.call(_register, self.engine, addr, length, loc)
        except AddressOverlapError as e:
            log.error("registerLocalMemory(%#x, %d): %s", addr, length, e)
            return ERR_ADDRESS_OVERLAPPED
        except (MooncakeError, OSError) as e:
            log.error("registerLocalMemory(%#x, %d): %s", addr, length, e)
            return ERR_INVALID_ARGUMENT
        return 0

    def unregister(self, addr: int) -> int:
        if self.engine.registry.find(addr, 1) is None:
            return ERR_ADDRESS_NOT_REGISTERED
        try:
            self.loop.call(self.engine.unregister, addr)
        except NotRegisteredError:
            return ERR_ADDRESS_NOT_REGISTERED
        except MooncakeError as e:
            log.error("unregisterLocalMemory(%#x): %s", addr, e)
            return ERR_INVALID_ARGUMENT
        return 0

    # -- segments -------------------------------------------------------------------------

    def open_segment(self, name: bytes, refresh: int) -> int:
        """``openSegment``: the segment's id (>= 0), or -1 if it cannot be reached."""
        seg = name.decode(errors="replace").lstrip("/")
        if not seg:
            return ERR_INVALID_ARGUMENT
        sid = self._ids.get(seg)
        if sid == 0:
            return 0
        try:
            self.loop.call(_peer, self.engine, seg, bool(refresh))
        except (MooncakeError, OSError, TimeoutError) as e:
            log.error("openSegment(%s): %s", seg, e)
            return -1
        if sid is None:
            sid = self._next_id
            self._next_id += 1
            self._ids[seg] = sid
            self._names[sid] = seg
        return sid

    def close_segment(self, sid: int) -> int:
        name = self._names.get(sid)
        if name is None:
            return ERR_INVALID_ARGUMENT
        if sid != 0:  # the id stays valid, as in Mooncake; only cached state is dropped
            self.engine.forget(name)
        return 0

    def sync_segment_cache(self) -> int:
        for sid, name in list(self._names.items()):
            if sid:
                self.engine.forget(name)
        return 0

    # -- transfers ------------------------------------------------------------------------

    def submit(
        self, batch: int, first: int, raw: bytes, nname: bytes | None, nmsg: bytes | None
    ) -> int:
        """Start tasks ``first, first + 1, ...`` of ``batch`` (the C struct's address), one per
        ``struct transfer_request`` in ``raw``. A Status code if refused before anything
        moved (1: bad opcode or unknown segment, 3: a source range not registered), 0 when
        started (each task's end is reported to C), or :data:`DONE_INLINE`."""
        entries = list(REQUEST.iter_unpack(raw))
        names = self._names
        for opcode, _, target, _, _ in entries:
            if (opcode != 0 and opcode != 1) or target not in names:
                log.error("submitTransfer: bad opcode %d or unknown segment %d", opcode, target)
                return S_INVALID_ARGUMENT
        notify = None if nname is None or nmsg is None else (_text(nname), _text(nmsg))
        op0, _, target0, _, _ = entries[0]
        if notify is None and (
            len(entries) == 1 or all(e[2] == target0 and e[0] == op0 for e in entries)
        ):
            # the sync path checks the local ranges itself and moves nothing unless all hold
            failed = self._inline(names[target0], entries)
            if failed is not None:
                if not failed:
                    return DONE_INLINE
                _report(batch, first, len(entries), STATUS_FAILED)
                return S_OK
        find = self.engine.registry.find
        for _, src, _, _, length in entries:
            if not src or not length or find(src, length) is None:
                log.error("submitTransfer: [%#x, +%d) is not registered", src, length)
                return S_ADDRESS_NOT_REGISTERED
        groups: dict[int, list[tuple[int, TransferRequest]]] = {}
        for i, (opcode, src, target, offset, length) in enumerate(entries):
            op = Opcode.WRITE if opcode else Opcode.READ
            groups.setdefault(target, []).append(
                (first + i, TransferRequest(op, src, offset, length))
            )
        for target, items in groups.items():
            reqs = [r for _, r in items]
            timeout = self._timeout_s(sum(r.length for r in reqs), self._tbase)
            fut = self.loop.submit(_run, self.engine, names[target], reqs, timeout, notify)
            fut.add_done_callback(partial(self._done, batch, [i for i, _ in items]))
        return S_OK

    def _inline(self, segment: str, entries: list[tuple[int, int, int, int, int]]) -> bool | None:
        """Run a small single-opcode batch to one segment on this thread through the facade's
        sync path: False when every request completed, True when one failed, None when the
        batch belongs on the loop."""
        fast = self._fast
        if fast is None:
            return None
        if len(entries) == 1:
            op, la, _, ra, n = entries[0]
            las, ras, lens, total = [la], [ra], [n], n
        else:
            op = entries[0][0]
            las = [e[1] for e in entries]
            ras = [e[3] for e in entries]
            lens = [e[4] for e in entries]
            total = sum(lens)
        try:
            bad = fast.transfer(
                segment,
                Opcode.WRITE if op else Opcode.READ,
                las,
                ras,
                lens,
                self._tbase + total * 1e-9,  # the facade's deadline: base plus 1 ns per byte
            )
        except (MooncakeError, TimeoutError) as e:
            log.error("transfer to %s failed: %s", segment, e)
            return True
        if bad is None:
            return None
        if bad:
            log.error("transfer to %s: %d requests failed: %s", segment, len(bad), bad[0].error)
        return bool(bad)

    def _done(self, batch: int, tasks: list[int], fut: Future[list[TransferResult]]) -> None:
        if self._closed:
            return
        if fut.cancelled():
            _report_all(batch, tasks, STATUS_CANCELED)
            return
        try:
            results = fut.result()
        except TimeoutError:
            _report_all(batch, tasks, STATUS_TIMEOUT)
            return
        except BaseException as e:  # every outcome must reach the C side
            log.error("batch failed: %s", e)
            _report_all(batch, tasks, STATUS_FAILED)
            return
        ok = [t for t, r in zip(tasks, results, strict=True) if r.ok]
        bad = [t for t, r in zip(tasks, results, strict=True) if not r.ok]
        if bad:
            log.error("%d/%d transfers failed: %s", len(bad), len(tasks), results[0].error)
        _report_all(batch, ok, STATUS_COMPLETED)
        _report_all(batch, bad, STATUS_FAILED)

    # -- notifications --------------------------------------------------------------------

    def notify(self, sid: int, name: bytes, msg: bytes) -> int:
        """``genNotifyInEngine``: 0, ERR_METADATA for an unknown segment id, or ERR_SOCKET."""
        seg = self._names.get(sid)
        if seg is None:
            return ERR_METADATA
        try:
            self.loop.call(self.engine.notify, seg, _text(name), _text(msg))
        except (PeerUnreachableError, OSError, TimeoutError) as e:
            log.error("genNotifyInEngine(%s): %s", seg, e)
            return ERR_SOCKET
        except MooncakeError as e:
            log.error("genNotifyInEngine(%s): %s", seg, e)
            return ERR_METADATA
        return 0

    def get_notifies(self) -> list[tuple[bytes, bytes]]:
        return [(_raw(n.name), _raw(n.msg)) for n in self.engine.get_notifies()]


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _raw(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _report_all(batch: int, tasks: list[int], status: int) -> None:
    """Report ``tasks`` (ascending indices) in contiguous runs."""
    start = prev = -2
    for t in tasks:
        if t != prev + 1:
            if start >= 0:
                _report(batch, start, prev - start + 1, status)
            start = t
        prev = t
    if start >= 0:
        _report(batch, start, prev - start + 1, status)


async def _register(engine: Engine, addr: int, length: int, location: str) -> None:
    await engine.register((addr, length), location=location)


async def _peer(engine: Engine, segment: str, refresh: bool) -> None:
    await engine.peer(segment, refresh=refresh)


async def _run(
    engine: Engine,
    segment: str,
    reqs: list[TransferRequest],
    seconds: float,
    notify: tuple[str, str] | None,
) -> list[TransferResult]:
    """The batch on the loop, under its deadline; then the notification if every part moved."""
    import anyio

    with anyio.fail_after(seconds):
        results = await engine.transfer(segment, reqs)
    if notify is not None and all(r.ok for r in results):
        await engine.notify(segment, *notify)
    return results


__all__ = ["REQUEST", "CEngine", "create"]
