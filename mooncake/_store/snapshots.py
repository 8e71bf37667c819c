"""Snapshots of the master's state: in etcd (chunked keys + manifest) or in a local directory.

A snapshot is ``(seq, data, last_now)``: the state's bytes (:meth:`MasterState.snapshot`) after
applying the log up to batch ``seq`` (0 without a log), and the state clock then. Both stores
verify a SHA-256 of the data when loading and fall back to the next older snapshot when one is
damaged; both keep the newest ``retention`` snapshots.

etcd layout under ``mooncake-store/<cluster_id>/snapshot/``: ``<20-digit seq>/chunk/<6-digit n>``
(at most :data:`CHUNK` bytes each: an etcd value is limited to ~1.5 MiB) and, written last,
``<20-digit seq>/manifest`` (msgpack: seq, size, sha256, chunks, last_now, created). A snapshot
without its manifest (a writer that died mid-way) is ignored and deleted by the next retention
pass. Chunk and manifest writes are fenced by the caller's ``fence`` compare (the leader's
``master_view`` key), so a deposed leader cannot write one.

Directory layout: ``<dir>/<cluster_id>-<20-digit seq>.snap``, each a 4-byte magic, a u32 manifest
length, the msgpack manifest and the data; written to a temporary name, fsynced, renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from mooncake._engine.metadata.etcd import EtcdKV, _b64, _unb64, prefix_end
from mooncake.errors import InvalidArgumentError

log = logging.getLogger("mooncake.master.snapshot")

__all__ = [
    "CHUNK",
    "DirSnapshots",
    "EtcdSnapshots",
    "ForkedSnapshot",
    "Snapshot",
    "SnapshotConfig",
    "restore_local",
    "snapshot_loop",
]

CHUNK = 1 << 20
_MAGIC = b"MCS1"
_HEAD = struct.Struct("<4sI")


@dataclass(frozen=True)
class Snapshot:
    seq: int
    data: bytes
    last_now: float


class _Manifest(msgspec.Struct, kw_only=True):
    seq: int
    size: int
    sha256: str
    chunks: int = 0
    last_now: float = 0.0
    created: float = 0.0


def _check(m: _Manifest, data: bytes, where: str) -> None:
    if len(data) != m.size or hashlib.sha256(data).hexdigest() != m.sha256:
        raise InvalidArgumentError(f"snapshot {where}: size or checksum mismatch")


def _seq_key(seq: int) -> str:
    return f"{seq:020d}"


class EtcdSnapshots:
    """Snapshots in etcd under ``prefix`` (``.../snapshot/``)."""

    def __init__(self, etcd: EtcdKV, prefix: str, retention: int = 2) -> None:
        if retention < 1:
            raise InvalidArgumentError(f"snapshot retention must be >= 1, got {retention}")
        self.etcd = etcd
        self.prefix = prefix
        self.retention = retention

    async def seqs(self) -> list[int]:
        """Seqs of complete snapshots (with a manifest), newest first."""
        p = self.prefix.encode()
        obj = await self.etcd.call(
            "/v3/kv/range",
            {"key": _b64(p), "range_end": _b64(prefix_end(p)), "keys_only": True},
        )
        out = set()
        for kv in obj.get("kvs") or []:
            key = _unb64(kv["key"]).decode()
            rest = key[len(self.prefix) :]
            if rest.endswith("/manifest"):
                with contextlib.suppress(ValueError):
                    out.add(int(rest.split("/", 1)[0]))
        return sorted(out, reverse=True)

    async def write(self, snap: Snapshot, fence: list[dict[str, Any]]) -> bool:
        """Store ``snap`` (False: the fence failed, nothing usable was written)."""
        base = self.prefix + _seq_key(snap.seq) + "/"
        data = snap.data
        n = max(1, -(-len(data) // CHUNK))
        for i in range(n):
            part = data[i * CHUNK : (i + 1) * CHUNK]
            if not await self._put(base + f"chunk/{i:06d}", part, fence):
                return False
        m = _Manifest(
            seq=snap.seq,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            chunks=n,
            last_now=snap.last_now,
            created=time.time(),
        )
        return await self._put(base + "manifest", msgspec.msgpack.encode(m), fence)

    async def _put(self, key: str, value: bytes, fence: list[dict[str, Any]]) -> bool:
        obj = await self.etcd.call(
            "/v3/kv/txn",
            {
                "compare": fence,
                "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            },
        )
        return bool(obj.get("succeeded"))

    async def prune(self) -> int:
        """Delete snapshots beyond the newest ``retention`` and incomplete ones older than the
        newest; returns the newest complete seq (0: none)."""
        seqs = await self.seqs()
        if not seqs:
            return 0
        keep = set(seqs[: self.retention])
        p = self.prefix.encode()
        obj = await self.etcd.call(
            "/v3/kv/range",
            {"key": _b64(p), "range_end": _b64(prefix_end(p)), "keys_only": True},
        )
        present = set()
        for kv in obj.get("kvs") or []:
            rest = _unb64(kv["key"]).decode()[len(self.prefix) :]
            with contextlib.suppress(ValueError):
                present.add(int(rest.split("/", 1)[0]))
        for seq in sorted(present):
            if seq in keep or seq > seqs[0]:  # newer than the newest: may be being written
                continue
            sp = (self.prefix + _seq_key(seq) + "/").encode()
            await self.etcd.call(
                "/v3/kv/deleterange", {"key": _b64(sp), "range_end": _b64(prefix_end(sp))}
            )
        return seqs[0]

    async def load(self, seq: int) -> Snapshot:
        base = (self.prefix + _seq_key(seq) + "/").encode()
        mobj = await self.etcd.call("/v3/kv/range", {"key": _b64(base + b"manifest")})
        kvs = mobj.get("kvs") or []
        if not kvs:
            raise InvalidArgumentError(f"snapshot {seq}: no manifest")
        try:
            m = msgspec.msgpack.decode(_unb64(kvs[0].get("value", "")), type=_Manifest)
        except msgspec.DecodeError as e:
            raise InvalidArgumentError(f"snapshot {seq}: bad manifest: {e}") from None
        cp = base + b"chunk/"
        parts: list[bytes] = []
        start = cp
        while True:  # one chunk per range call keeps each answer within etcd's limits
            obj = await self.etcd.call(
                "/v3/kv/range",
                {"key": _b64(start), "range_end": _b64(prefix_end(cp)), "limit": 1},
            )
            got = obj.get("kvs") or []
            if not got:
                break
            key = _unb64(got[0]["key"])
            parts.append(_unb64(got[0].get("value", "")))
            start = key + b"\0"
        if len(parts) != m.chunks:
            raise InvalidArgumentError(f"snapshot {seq}: {len(parts)} of {m.chunks} chunks")
        data = b"".join(parts)
        _check(m, data, str(seq))
        return Snapshot(m.seq, data, m.last_now)

    async def newest(self) -> Snapshot | None:
        """The newest snapshot that verifies (older ones when it does not), or None."""
        for seq in await self.seqs():
            try:
                return await self.load(seq)
            except InvalidArgumentError as e:
                log.warning("skipping damaged snapshot: %s", e)
        return None


class DirSnapshots:
    """Snapshots as files in a local directory (``--snapshot_backup_dir``)."""

    def __init__(self, directory: str | os.PathLike[str], cluster_id: str, retention: int = 2):
        if retention < 1:
            raise InvalidArgumentError(f"snapshot retention must be >= 1, got {retention}")
        self.dir = Path(directory)
        self.cluster_id = cluster_id
        self.retention = retention

    def _path(self, seq: int) -> Path:
        return self.dir / f"{self.cluster_id}-{_seq_key(seq)}.snap"

    def seqs(self) -> list[int]:
        out = []
        pre = self.cluster_id + "-"
        if not self.dir.is_dir():
            return []
        for p in self.dir.iterdir():
            if p.name.startswith(pre) and p.name.endswith(".snap"):
                with contextlib.suppress(ValueError):
                    out.append(int(p.name[len(pre) : -5]))
        return sorted(out, reverse=True)

    def write_sync(self, snap: Snapshot) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        m = _Manifest(
            seq=snap.seq,
            size=len(snap.data),
            sha256=hashlib.sha256(snap.data).hexdigest(),
            last_now=snap.last_now,
            created=time.time(),
        )
        head = msgspec.msgpack.encode(m)
        path = self._path(snap.seq)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, len(head)))
            f.write(head)
            f.write(snap.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for old in self.seqs()[self.retention :]:
            with contextlib.suppress(OSError):
                self._path(old).unlink()
        return path

    def load_sync(self, seq: int) -> Snapshot:
        raw = self._path(seq).read_bytes()
        if len(raw) < _HEAD.size:
            raise InvalidArgumentError(f"snapshot file {seq}: truncated")
        magic, n = _HEAD.unpack_from(raw)
        if magic != _MAGIC:
            raise InvalidArgumentError(f"snapshot file {seq}: not a snapshot (magic {magic!r})")
        try:
            m = msgspec.msgpack.decode(raw[_HEAD.size : _HEAD.size + n], type=_Manifest)
        except msgspec.DecodeError as e:
            raise InvalidArgumentError(f"snapshot file {seq}: bad manifest: {e}") from None
        data = raw[_HEAD.size + n :]
        _check(m, data, f"file {seq}")
        return Snapshot(m.seq, data, m.last_now)

    def newest_sync(self) -> Snapshot | None:
        for seq in self.seqs():
            try:
                return self.load_sync(seq)
            except (InvalidArgumentError, OSError) as e:
                log.warning("skipping damaged snapshot: %s", e)
        return None

    async def write(self, snap: Snapshot) -> Path:
        return await anyio.to_thread.run_sync(self.write_sync, snap)

    async def newest(self) -> Snapshot | None:
        return await anyio.to_thread.run_sync(self.newest_sync)


@dataclass
class SnapshotConfig:
    """Local snapshots of a master without HA (``--enable_snapshot``,
    ``--enable_snapshot_restore``, ``--snapshot_backup_dir``)."""

    directory: str
    cluster_id: str = "mooncake_cluster"
    interval: float = 600.0
    retention: int = 2
    restore: bool = False
    child_timeout: float = 300.0


async def restore_local(store: DirSnapshots, config: Any) -> tuple[Any, float] | None:
    """(state, its clock then) of the newest verifying snapshot in ``store``; None: none."""
    from mooncake._core.master import MasterState

    snap = await store.newest()
    if snap is None:
        log.info("no snapshot to restore in %s", store.dir)
        return None
    log.info("restoring snapshot %d from %s", snap.seq, store.dir)
    return MasterState.restore(snap.data, config), snap.last_now


async def snapshot_loop(
    server: Any, store: DirSnapshots, interval: float, child_timeout: float = 300.0
) -> None:
    """Every ``interval`` seconds: the server's state to ``store`` (seq counts up)."""
    seq = max(store.seqs(), default=0)
    while True:
        await anyio.sleep(interval)
        seq += 1
        try:
            now = server.now()  # the child sees the state as of this instant
            child = ForkedSnapshot(server.state.snapshot, child_timeout)
            snap = Snapshot(seq, await child.result(), now)
            await store.write(snap)
            server.last_snapshot_seq = seq
        except OSError as e:
            log.warning("snapshot %d to %s failed: %s", seq, store.dir, e)


class ForkedSnapshot:
    """A state serialized by a forked child: the fork is the only pause on the caller's loop
    (the child sees the state exactly as it was at :meth:`start`, copy-on-write), the child
    writes the bytes to a pipe that :meth:`result` reads without blocking the loop.

    Where ``fork`` is unavailable the state is serialized at :meth:`start`, on the caller.
    """

    def __init__(self, serialize: Any, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._data: bytes | None = None
        self._pid = 0
        self._fd = -1
        if not hasattr(os, "fork"):
            self._data = serialize()
            return
        r, w = os.pipe()
        import warnings

        with warnings.catch_warnings():  # the child only serializes and exits
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(r)
                data = serialize()
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view) :]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        os.set_blocking(r, False)
        self._pid, self._fd = pid, r

    async def result(self) -> bytes:
        """The serialized state; raises :class:`OSError` if the child failed or timed out."""
        if self._data is not None:
            return self._data
        parts: list[bytes] = []
        try:
            with anyio.fail_after(self.timeout):
                while True:
                    try:
                        chunk = os.read(self._fd, 1 << 20)
                    except BlockingIOError:
                        await anyio.wait_readable(self._fd)
                        continue
                    if not chunk:
                        break
                    parts.append(chunk)
                code = await self._reap()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, 9)
            await self._reap()
            raise OSError(f"snapshot child timed out after {self.timeout} s") from None
        finally:
            os.close(self._fd)
        if code != 0:
            raise OSError(f"snapshot child exited with status {code}")
        return b"".join(parts)

    async def _reap(self) -> int:
        while True:
            pid, status = os.waitpid(self._pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG
            if pid:
                return os.waitstatus_to_exitcode(status)
            await anyio.sleep(0.01)
