"""The local SSD tier: a client-owned directory of object files, with its own capacity and policy.

Open one with :func:`open_ssd_tier`. The format, the index and the admission rules are
sans-I/O in :mod:`mooncake._core.tiers`; this module does the file I/O, off the event loop in
worker threads (``anyio.to_thread``, at most ``io_threads`` at a time).

Layout of the directory::

    LOCK              flock'ed while a tier has the directory open (one owner at a time)
    TIER_ID           the directory's identity (random, made once): a client restarted on it
                      tells the master so, which hands it what its previous instance held
    tmp/              writes in progress (emptied at open)
    objects/ab/<blake2b-128 of key>.obj   committed objects (format in mooncake._core.tiers)

Durability (``sync=True``, the default): :meth:`SsdTier.put` returns after the object's file
was written under ``tmp/``, ``fsync``-ed, renamed to its final name and the directory
``fsync``-ed, so an acknowledged object survives a crash or power loss of the host (on a file
system that honours ``fsync``). With ``sync=False`` it survives a crash of the process but may be
lost (never misread) on power loss. A write interrupted at any point leaves either the previous
version or nothing visible: only the rename publishes a file.

Integrity: every read checks the header (magic, header CRC, key, generation, size), the file
length and the payload CRC-32 *before* returning, so a file deleted, truncated or corrupted under
the store raises :class:`~mooncake.errors.TierDataError`, the object is dropped from the tier
(and its file deleted), and the caller never sees wrong bytes.

Restart: :func:`open_ssd_tier` scans the directory, deletes leftovers of writes in progress
and every file whose header or length is bad (``verify="full"`` also checks each payload
checksum), and loads the rest in generation order; :attr:`SsdTier.recovered` lists what
came back so the owner can re-announce it, :attr:`SsdTier.dropped` what was dropped and why.

I/O: ``O_DIRECT`` with 4 KiB-aligned staging buffers of ``chunk`` bytes when the file system
supports it (probed at open; ``direct_io=None``), else buffered I/O in large writes. Either way
each write is a few large block-aligned ``pwrite`` calls.

Cancellation: a put or get whose file I/O has started finishes it before the cancellation is
delivered (a thread cannot be interrupted, and a destination buffer must not be written after
the caller was told the read is over); the put is then committed, the read result discarded.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from mooncake._core.policies import EvictionPolicy
from mooncake._core.tiers import (
    BLOCK,
    Admission,
    Reservation,
    SsdEntry,
    SsdHeader,
    SsdIndex,
    TierCounters,
    decode_header,
    encode_header,
    file_name,
    header_length,
    make_admission,
    round_up,
)
from mooncake.errors import (
    BufferOverflowError,
    ClosedError,
    InvalidArgumentError,
    NoAvailableHandleError,
    NotSupportedError,
    ObjectNotFoundError,
    TierDataError,
)

__all__ = ["DEFAULT_CHUNK", "SsdTier", "open_ssd_tier"]

DEFAULT_CHUNK = 4 << 20
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

OnDrop = Callable[[SsdEntry, str], None]
"""Called (on the loop) when an entry leaves the tier: ``(entry, why)`` with ``why`` one of
``"evicted"``, ``"removed"``, ``"corrupt"``."""


class _Lost(Exception):
    """A file is missing or does not hold what the index says (message says what)."""


class _Replaced(Exception):
    """The file holds a newer generation than the entry being read."""


@dataclass
class _Io:
    """What the worker threads need: the root, the mode, the staging buffers."""

    root: str
    direct: bool
    sync: bool
    chunk: int
    pool: queue.SimpleQueue[mmap.mmap] = field(default_factory=queue.SimpleQueue)

    def path(self, name: str) -> str:
        return os.path.join(self.root, "objects", name)

    def staging(self) -> mmap.mmap:
        try:
            return self.pool.get_nowait()
        except queue.Empty:
            return mmap.mmap(-1, self.chunk)  # page-aligned: fit for O_DIRECT

    # -- write --------------------------------------------------------------------------------

    def write(self, res: Reservation, data: memoryview) -> int:
        """Write, sync and publish ``res``'s file; return the payload CRC."""
        crc = zlib.crc32(data)
        head = encode_header(SsdHeader(res.key, res.size, res.generation, crc))
        name = file_name(res.key)
        tmp = os.path.join(self.root, "tmp", f"{name[3:]}.{res.generation}")
        final = self.path(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = os.open(tmp, flags | (_O_DIRECT if self.direct else 0), 0o644)
        try:
            try:
                if self.direct:
                    self._write_direct(fd, head, data)
                else:
                    self._write_buffered(fd, head, data)
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        if self.sync:
            _fsync_dir(os.path.dirname(final))
        return crc

    def _write_buffered(self, fd: int, head: bytes, data: memoryview) -> None:
        pad = bytes(round_up(len(data)) - len(data))
        _pwrite_all(fd, head, 0)
        off = 0
        base = len(head)
        while off < len(data):
            n = min(self.chunk, len(data) - off)
            _pwrite_all(fd, data[off : off + n], base + off)
            off += n
        if pad:
            _pwrite_all(fd, pad, base + len(data))

    def _write_direct(self, fd: int, head: bytes, data: memoryview) -> None:
        buf = self.staging()
        try:
            view = memoryview(buf)
            try:
                pos = 0
                hv = memoryview(head)
                while pos < len(hv):  # header blocks (usually one)
                    n = min(self.chunk, len(hv) - pos)
                    view[:n] = hv[pos : pos + n]
                    _pwrite_all(fd, view[:n], pos)
                    pos += n
                off = 0
                while off < len(data):
                    n = min(self.chunk, len(data) - off)
                    view[:n] = data[off : off + n]
                    m = round_up(n)
                    if m > n:
                        view[n:m] = bytes(m - n)
                    _pwrite_all(fd, view[:m], pos + off)
                    off += n
            finally:
                view.release()
        finally:
            self.pool.put(buf)

    # -- read ---------------------------------------------------------------------------------

    def read(self, entry: SsdEntry, dest: memoryview | None) -> bytes | None:
        """Fill ``dest`` (``entry.size`` bytes) from the file, verified; raise _Lost/_Replaced.

        With ``dest`` None, return a new ``bytes`` instead (read straight into it: one copy)."""
        out: bytes | None = None
        path = self.path(entry.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise _Lost("its file is missing") from None
        try:
            length = os.fstat(fd).st_size
            buf = self.staging() if self.direct else None
            try:
                hlen = header_length(len(entry.key.encode()))
                head = self._pread(fd, buf, hlen, 0)
                try:
                    h = decode_header(head)
                except ValueError as e:
                    raise _Lost(f"bad header ({e})") from None
                if h.key != entry.key:
                    raise _Lost(f"the file holds key {h.key!r}")
                if h.generation > entry.generation:
                    raise _Replaced
                if (h.generation, h.size, h.checksum) != (
                    entry.generation,
                    entry.size,
                    entry.checksum,
                ):
                    raise _Lost(
                        f"the file holds generation {h.generation} size {h.size}, expected "
                        f"generation {entry.generation} size {entry.size}"
                    )
                if length != entry.disk_bytes:
                    raise _Lost(f"file length {length}, expected {entry.disk_bytes}")
                if buf is None and dest is None:
                    out = os.pread(fd, entry.size, hlen)
                    if len(out) < entry.size:
                        raise _Lost(f"file ends early at {hlen + len(out)}")
                elif buf is None:
                    assert dest is not None
                    _pread_into(fd, dest, hlen)
                else:
                    chunks: list[bytes] = []
                    view = memoryview(buf)
                    try:
                        off = 0
                        while off < entry.size:
                            n = min(self.chunk, entry.size - off)
                            got = os.preadv(fd, [view[: round_up(n)]], hlen + off)
                            if got < n:
                                raise _Lost(f"file ends early at {hlen + off + got}")
                            if dest is None:
                                chunks.append(bytes(view[:n]))
                            else:
                                dest[off : off + n] = view[:n]
                            off += n
                    finally:
                        view.release()
                    if dest is None:
                        out = b"".join(chunks)  # one chunk: that very object
            finally:
                if buf is not None:
                    self.pool.put(buf)
        finally:
            os.close(fd)
        if zlib.crc32(dest if dest is not None else out or b"") != entry.checksum:
            raise _Lost("payload checksum mismatch")
        return out

    def _pread(self, fd: int, buf: mmap.mmap | None, n: int, off: int) -> bytes:
        """``n`` bytes at ``off`` (both block-aligned when ``buf``, the O_DIRECT staging)."""
        if buf is None:
            data = os.pread(fd, n, off)
        else:
            # A header longer than a chunk (a huge key) gets an aligned buffer of its own.
            big = mmap.mmap(-1, n) if n > len(buf) else None
            view = memoryview(big if big is not None else buf)
            try:
                got = os.preadv(fd, [view[:n]], off)
                data = bytes(view[:got])
            finally:
                view.release()
                if big is not None:
                    big.close()
        if len(data) < n:
            raise _Lost(f"file truncated to {off + len(data)} bytes")
        return data

    # -- scan -----------------------------------------------------------------------------------

    def scan(self, verify: bool) -> tuple[list[SsdHeader], list[tuple[str, str]]]:
        """Headers of the valid committed files; (path, why) of the bad ones (deleted)."""
        tmpdir = os.path.join(self.root, "tmp")
        bad: list[tuple[str, str]] = []
        for name in os.listdir(tmpdir):
            _unlink(os.path.join(tmpdir, name))
            bad.append((os.path.join(tmpdir, name), "unfinished write"))
        found: list[SsdHeader] = []
        objdir = os.path.join(self.root, "objects")
        for sub in sorted(os.listdir(objdir)):
            subdir = os.path.join(objdir, sub)
            if not os.path.isdir(subdir):
                continue
            for name in sorted(os.listdir(subdir)):
                path = os.path.join(subdir, name)
                why = self._check(path, f"{sub}/{name}", verify, found)
                if why:
                    _unlink(path)
                    bad.append((path, why))
        return found, bad

    def _check(self, path: str, rel: str, verify: bool, found: list[SsdHeader]) -> str:
        try:
            with open(path, "rb", buffering=0) as f:
                length = os.fstat(f.fileno()).st_size
                head = f.read(BLOCK)
                try:
                    h = decode_header(head)
                except ValueError:
                    # the key may spill over the first block
                    head += f.read(header_length(1 << 16) - BLOCK)
                    try:
                        h = decode_header(head)
                    except ValueError as e:
                        return f"bad header ({e})"
                if file_name(h.key) != rel:
                    return f"file name does not match its key {h.key!r}"
                if length != h.file_length:
                    return f"file length {length}, expected {h.file_length}"
                if verify:
                    f.seek(h.header_length)
                    crc = 0
                    left = h.size
                    while left:
                        block = f.read(min(self.chunk, left))
                        if not block:
                            return "truncated payload"
                        crc = zlib.crc32(block, crc)
                        left -= len(block)
                    if crc != h.checksum:
                        return "payload checksum mismatch"
        except OSError as e:
            return f"unreadable ({e.strerror})"
        found.append(h)
        return ""


def _pwrite_all(fd: int, data: bytes | memoryview, off: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwritev(fd, [mv], off)
        mv = mv[n:]
        off += n


def _pread_into(fd: int, dest: memoryview, off: int) -> None:
    pos = 0
    while pos < len(dest):
        n = os.preadv(fd, [dest[pos:]], off + pos)
        if n == 0:
            raise _Lost(f"file ends early at {off + pos}")
        pos += n


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe_direct(root: str) -> bool:
    """Whether files in ``root`` can be written and read with ``O_DIRECT``."""
    if not _O_DIRECT:
        return False
    path = os.path.join(root, "tmp", ".direct-probe")
    buf = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)
        _unlink(path)
        buf.close()


def _tier_id(root: str) -> str:
    """The directory's TIER_ID (created, durably, the first time)."""
    path = os.path.join(root, "TIER_ID")
    try:
        with open(path) as f:
            got = f.read().strip()
        if got:
            return got
    except FileNotFoundError:
        pass
    new = uuid.uuid4().hex
    tmp = os.path.join(root, "tmp", "TIER_ID")
    with open(tmp, "w") as f:
        f.write(new + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)
    return new


def _setup(root: str) -> tuple[str, int]:
    """Create the layout, take the directory lock; return the absolute root and the lock fd."""
    root = os.path.abspath(root)
    os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
    objdir = os.path.join(root, "objects")
    os.makedirs(objdir, exist_ok=True)
    fd = os.open(os.path.join(root, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InvalidArgumentError(
            f"SSD tier directory {root!r} is in use by another store (LOCK is held)"
        ) from None
    for i in range(256):
        os.makedirs(os.path.join(objdir, f"{i:02x}"), exist_ok=True)
    _fsync_dir(objdir)
    _fsync_dir(root)
    return root, fd


class SsdTier:
    """One open SSD tier. Create with :func:`open_ssd_tier`; use from one event loop.

    Keys are ``str``. Methods raise :class:`ObjectNotFoundError` for a key the tier does not
    hold, :class:`TierDataError` for one whose file turned out bad (now dropped),
    :class:`~mooncake.errors.NoAvailableHandleError` when an object cannot fit, and
    :class:`ClosedError` after close.
    """

    def __init__(
        self, io: _Io, index: SsdIndex, *, io_threads: int, on_drop: OnDrop | None
    ) -> None:
        self._io = io
        self.index = index
        self.counters = TierCounters()
        self.on_drop = on_drop
        self.recovered: list[SsdEntry] = []
        """Objects found valid at open (oldest generation first)."""
        self.dropped: list[tuple[str, str]] = []
        """(path, why) of files deleted at open: unfinished, bad header/length/checksum, no room."""
        self.tier_id = ""
        """The directory's identity (its ``TIER_ID`` file), the same across restarts."""
        self._limiter = anyio.CapacityLimiter(io_threads)
        self._locks: dict[str, anyio.Lock] = {}
        self._unlinking: dict[str, anyio.Event] = {}
        self._inflight = 0
        self._idle: anyio.Event | None = None
        self._closed = False
        self.admission: Admission | None = None
        """Demotion admission (``admit_ssd``): ``None`` writes every object put (write-through)."""

    @property
    def path(self) -> str:
        return self._io.root

    @property
    def direct_io(self) -> bool:
        """Whether files are written and read with ``O_DIRECT``."""
        return self._io.direct

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @property
    def used(self) -> int:
        """Bytes of committed files plus writes in flight (headers and padding included)."""
        return self.index.used

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.index.entries))

    def keys(self) -> list[str]:
        return list(self.index.entries)

    def size_of(self, key: str) -> int:
        entry = self.index.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"{key!r} is not on the SSD tier")
        return entry.size

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the SSD tier is closed")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Shielded: see "Cancellation" in the module docstring.
        self._inflight += 1
        try:
            with anyio.CancelScope(shield=True):
                return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self._inflight -= 1
            if not self._inflight and self._idle is not None:
                self._idle.set()

    async def _drain(self) -> None:
        """Wait until no file I/O is in flight."""
        while self._inflight:
            self._idle = anyio.Event()
            await self._idle.wait()

    def _drop(self, entry: SsdEntry, why: str) -> None:
        if self.on_drop is not None:
            self.on_drop(entry, why)

    async def _delete(self, entries: tuple[SsdEntry, ...] | list[SsdEntry], why: str) -> None:
        """Delete the files of entries already gone from the index.

        Called right after they left the index, with no checkpoint in between: a put of the
        same key waits for the deletion (see ``_unlinking``), so the unlink cannot hit its file.
        """
        if not entries:
            return
        done = anyio.Event()
        keys = [e.key for e in entries]
        for k in keys:
            self._unlinking[k] = done
        try:
            for e in entries:
                if why == "evicted":
                    self.counters.evictions += 1
                self._drop(e, why)
            await self._run(_unlink_many, [self._io.path(e.name) for e in entries])
        finally:
            for k in keys:
                if self._unlinking.get(k) is done:
                    del self._unlinking[k]
            done.set()

    # -- put ----------------------------------------------------------------------------------

    async def put(self, key: str, data: Any) -> SsdEntry:
        """Store ``data`` (any contiguous buffer) as ``key``, replacing an older version.

        Returns when the object is durable (see the module docstring) and readable. Evicts by
        the tier's policy to make room; objects being read or written are not evicted. With an
        :attr:`admission` rule, the put counts as an access of ``key`` and, if the rule's
        ``admit_ssd(key, victim)`` refuses it (``victim``: what the write would evict first),
        raises :class:`NoAvailableHandleError` without writing (counted as ``refused``).
        """
        self._check_open()
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"key must be a non-empty str, got {key!r}")
        mv = memoryview(data)
        if not mv.contiguous:
            raise InvalidArgumentError(f"data for {key!r} must be a contiguous buffer")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        lock = self._locks.setdefault(key, anyio.Lock())
        try:
            async with lock:
                while key in self._unlinking:
                    await self._unlinking[key].wait()
                self._check_open()
                adm = self.admission
                if adm is not None:
                    adm.record(key)
                    if not adm.admit_ssd(key, self.index.next_victim(key, len(mv))):
                        extra = self.counters.extra
                        extra["refused"] = extra.get("refused", 0) + 1
                        raise NoAvailableHandleError(
                            f"the SSD tier's admission rule {adm.name!r} refused {key!r}"
                        )
                res = self.index.reserve(key, len(mv))
                await self._delete(res.victims, "evicted")
                try:
                    crc = await self._run(self._io.write, res, mv)
                except BaseException:
                    self.index.abort(res)
                    raise
                self.index.commit(res, crc)  # the rename replaced the old version's file
                self.counters.bytes_written += len(mv)
                return self.index.entries[key]
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(key, None)

    # -- get ----------------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        """The bytes of ``key``, verified against its checksum."""
        _, data = await self._read(key, None)
        assert data is not None
        return data

    async def get_into(self, key: str, dest: Any) -> int:
        """Read ``key`` into the writable buffer ``dest``; return its size.

        If the call raises, ``dest`` may have been partly written and must not be used (a
        checksum failure is only known once the bytes are in it).
        """
        mv = memoryview(dest)
        if mv.readonly or not mv.contiguous:
            raise InvalidArgumentError("dest must be a writable contiguous buffer")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        n, _ = await self._read(key, mv)
        return n

    async def _read(self, key: str, mv: memoryview | None) -> tuple[int, bytes | None]:
        """Read ``key`` into ``mv``, or into new bytes (``mv`` None); (size, the bytes)."""
        self._check_open()
        for _ in range(8):  # retried only when a newer version was committed mid-read
            entry = self.index.begin_read(key)
            if self.admission is not None:
                self.admission.record(key)
            if entry is None:
                self.counters.misses += 1
                raise ObjectNotFoundError(f"{key!r} is not on the SSD tier")
            try:
                if mv is not None and len(mv) < entry.size:
                    raise BufferOverflowError(
                        f"buffer of {len(mv)} bytes is too small for {key!r} ({entry.size})"
                    )
                data: bytes | None = await self._run(
                    self._io.read, entry, mv[: entry.size] if mv is not None else None
                )
            except _Replaced:
                # A writer renamed a newer version in but has not committed it yet: wait for it.
                lock = self._locks.get(key)
                if lock is not None:
                    async with lock:
                        pass
                continue
            except _Lost as e:
                if self.index.get(key) is not entry:  # removed or replaced meanwhile
                    if key in self.index:
                        continue
                    self.counters.misses += 1
                    raise ObjectNotFoundError(
                        f"{key!r} left the SSD tier during the read"
                    ) from None
                self.index.remove(key)
                self.counters.errors += 1
                await self._delete([entry], "corrupt")
                raise TierDataError(
                    f"SSD copy of {key!r} is unusable: {e}; dropped from the tier "
                    f"({self._io.path(entry.name)})"
                ) from None
            finally:
                self.index.end_read(key)
            self.counters.hits += 1
            self.counters.bytes_read += entry.size
            return entry.size, data
        raise ObjectNotFoundError(
            f"{key!r} kept being replaced during the read"
        )  # pragma: no cover

    # -- remove -------------------------------------------------------------------------------

    async def remove(self, key: str) -> bool:
        """Drop ``key`` from the tier and delete its file; False if it was not there."""
        self._check_open()
        entry = self.index.remove(key)
        if entry is None:
            return False
        await self._delete([entry], "removed")
        return True

    async def drop_corrupt(self, key: str) -> bool:
        """Drop ``key``, whose bytes the caller found corrupt (they fail the writer's CRC32C),
        as a read that found its file bad does (``corrupt``: reported to the master as lost);
        False if it was not there."""
        self._check_open()
        entry = self.index.remove(key)
        if entry is None:
            return False
        self.counters.errors += 1
        await self._delete([entry], "corrupt")
        return True

    async def evict(self, nbytes: int) -> list[SsdEntry]:
        """Evict by policy until ``nbytes`` are freed (or nothing evictable is left)."""
        self._check_open()
        victims = self.index.evict(nbytes)
        await self._delete(victims, "evicted")
        return victims

    def stats(self) -> dict[str, int]:
        out = self.counters.as_dict()
        out.update(objects=len(self.index), used_bytes=self.used, capacity_bytes=self.capacity)
        return out


def _unlink_many(paths: list[str]) -> None:
    for p in paths:
        _unlink(p)


@asynccontextmanager
async def open_ssd_tier(
    path: str | os.PathLike[str],
    capacity: int,
    *,
    policy: EvictionPolicy | str = "lru",
    direct_io: bool | None = None,
    sync: bool = True,
    verify: Literal["header", "full"] = "header",
    chunk: int = DEFAULT_CHUNK,
    io_threads: int = 4,
    on_drop: OnDrop | None = None,
    admission: Admission | str | None = None,
) -> AsyncIterator[SsdTier]:
    """Open (creating if needed) the SSD tier in directory ``path``; recover what it holds.

    ``capacity`` bounds the bytes of its files (headers and 4 KiB padding included);
    ``policy`` is the tier's own eviction policy (a name or a fresh object). ``direct_io``:
    ``None`` probes and uses ``O_DIRECT`` if the file system supports it, ``True`` requires it
    (:class:`NotSupportedError` otherwise), ``False`` uses buffered I/O. ``verify="full"``
    checks every payload checksum at open (reads everything); ``"header"`` only headers and
    lengths (payloads are always checked when read). ``on_drop`` is told of every entry that
    leaves the tier (evicted, removed, corrupt), for miss accounting. ``admission`` (a rule
    or its name, :func:`~mooncake._core.tiers.make_admission`: ``"tinylfu"``, ``"freq:2"``...)
    filters the writes (:attr:`SsdTier.admission`); ``None`` writes every put.
    """
    if chunk < BLOCK or chunk % BLOCK:
        raise InvalidArgumentError(f"chunk must be a positive multiple of {BLOCK}, got {chunk!r}")
    if io_threads < 1:
        raise InvalidArgumentError(f"io_threads must be >= 1, got {io_threads!r}")
    if verify not in ("header", "full"):
        raise InvalidArgumentError(f"verify must be 'header' or 'full', got {verify!r}")
    root = os.fspath(path)
    index = SsdIndex(capacity, policy)
    root, lock_fd = await anyio.to_thread.run_sync(_setup, root)
    try:
        supported = await anyio.to_thread.run_sync(_probe_direct, root)
        if direct_io and not supported:
            raise NotSupportedError(f"O_DIRECT is not supported by the file system of {root!r}")
        io = _Io(root, supported if direct_io is None else bool(direct_io), sync, chunk)
        tier = SsdTier(io, index, io_threads=io_threads, on_drop=on_drop)
        tier.admission = None if admission is None else make_admission(admission)
        headers, bad = await anyio.to_thread.run_sync(io.scan, verify == "full")
        extra = [
            (io.path(file_name(h.key)), "does not fit the capacity") for h in index.recover(headers)
        ]
        await anyio.to_thread.run_sync(_unlink_many, [p for p, _ in extra])
        bad += extra
        tier.recovered = sorted(index.entries.values(), key=lambda e: e.generation)
        tier.dropped = bad
        tier.tier_id = await anyio.to_thread.run_sync(_tier_id, root)
        try:
            yield tier
        finally:
            tier._closed = True
            with anyio.CancelScope(shield=True):
                await tier._drain()  # no thread may write after the lock is released
    finally:
        os.close(lock_fd)
