"""Batched, zero-copy store I/O for bundles: many keys, each made of several memory parts.

:class:`BatchIO` turns "write key ``k`` as the concatenation of these parts" and "scatter key
``k`` over these destinations" into one ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` call each. Parts of at least :data:`REGISTER_MIN_BYTES` are
registered in place for the call (no copy); smaller ones, and any whose registration the store
refuses (already registered, overlapping), go through one staging buffer per call.

A store without those calls is served with the calls the published module uses, the store
formats unchanged: writes by ``put`` (tensor members by ``put_tensor``/``pub_tensor``, see
:meth:`BatchIO.tensor_put_call`), reads by ``batch_get_into`` into registered memory and
slices by ``get_into_ranges`` where the store has them and ``register_buffer``, else by
``get`` (any object with ``put``/``get``: the published ``BundleStore`` protocol); tensor
objects come back by ``get_tensor``. Given a buffer pool and a store with ``batch_put_from``,
writes go as published instead: per key, a lease, the parts copied in, one ``batch_put_from``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mooncake._structured.model import (
    AUTO_PARALLEL_MIN_BYTES,
    AUTO_PARALLEL_MIN_CHUNKS,
    MISSING_OBJECT_ERROR,
    BundleTransferPolicy,
    StructuredObjectError,
)

__all__ = [
    "READ_RETRIES",
    "REGISTER_MIN_BYTES",
    "SOLO_READ_BYTES",
    "BatchIO",
    "Part",
    "buffer_address",
    "grouped_config",
]

REGISTER_MIN_BYTES = 256 * 1024
SOLO_READ_BYTES = 4 * 1024 * 1024
READ_RETRIES = 3
LEASE_EXPIRED = -707
_ALIGN = 64


@dataclass
class Part:
    """``size`` bytes at ``ptr``; ``owner`` keeps the memory alive while the call runs."""

    ptr: int
    size: int
    owner: Any = None


@dataclass(frozen=True)
class _Sized:
    """A buffer of ``n`` bytes, as far as :meth:`BatchIO._resolve_buffer_group_put_mode` asks."""

    n: int

    def __len__(self) -> int:
        return self.n


@dataclass
class _Key:
    key: str
    parts: list[Part] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(p.size for p in self.parts)


def buffer_address(value: Any) -> tuple[int, int, Any]:
    """``(address, nbytes, owner)`` of a contiguous buffer-protocol object (read-only too)."""
    if isinstance(value, np.ndarray) and value.flags.c_contiguous:
        return int(value.ctypes.data), int(value.nbytes), value
    view = memoryview(value)
    if not view.c_contiguous:
        data = np.frombuffer(view.tobytes(), dtype=np.uint8)
    else:
        data = np.frombuffer(
            view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8
        )
    return (int(data.ctypes.data) if data.nbytes else 0), int(data.nbytes), data


def grouped_config(config: Any, key_count: int) -> Any:
    """``config`` with its one logical ``group_ids`` entry repeated once per physical key."""
    if config is None or key_count <= 0:
        return config
    group_ids = getattr(config, "group_ids", None)
    if group_ids is None:
        return config
    ids = [group_ids] if isinstance(group_ids, str) else list(group_ids)
    out = _copy_config(config)
    if not ids:
        out.group_ids = None
        return out
    if len(ids) != 1:
        from mooncake.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "structured object store config.group_ids must contain exactly one logical group "
            "id; it is expanded across internal Mooncake keys"
        )
    out.group_ids = [ids[0]] * key_count
    return out


_CONFIG_FIELDS = (
    "data_type",
    "group_ids",
    "nof_replica_num",
    "prefer_alloc_in_same_node",
    "preferred_nof_segments",
    "preferred_segment",
    "preferred_segments",
    "replica_num",
    "with_hard_pin",
    "with_soft_pin",
    "soft_pin_action",
    "soft_pin_ttl_ms",
    "dfs_replica_num",
)


def _copy_config(config: Any) -> Any:
    import copy

    try:
        return copy.copy(config)
    except TypeError:
        pass
    out = type(config)()
    for name in _CONFIG_FIELDS:
        if hasattr(config, name):
            value = getattr(config, name)
            setattr(out, name, list(value) if isinstance(value, list) else value)
    return out


def _check(code: Any, op: str, key: str) -> None:
    if code not in (None, 0):
        raise StructuredObjectError(f"{op} failed for {key}: {code}")


class _Staging:
    """Small parts copied through one registered buffer (or unregistered, for plain stores)."""

    def __init__(self) -> None:
        self.size = 0
        self.slots: list[tuple[Part, int]] = []  # (part, offset in the staging buffer)

    def add(self, part: Part) -> int:
        offset = self.size
        self.slots.append((part, offset))
        self.size += (part.size + _ALIGN - 1) // _ALIGN * _ALIGN
        return offset


class BatchIO:
    """Batched multi-part writes and reads over one store (see the module docstring)."""

    def __init__(self, store: Any, buffer_pool: Any = None) -> None:
        self.store = store
        #: a ``BufferPool``-like object (``acquire(size)`` -> a lease with ``ptr`` and
        #: ``release()``, its memory registered with the store) that stages writes on a store
        #: without the multi-buffer calls, as the published module stages them
        self.buffer_pool = buffer_pool
        self._batch_put_from = getattr(store, "batch_put_from", None)
        self._put_parts = getattr(store, "batch_put_from_multi_buffers", None)
        self._get_parts = getattr(store, "batch_get_into_multi_buffers", None)
        self._register = getattr(store, "register_buffer", None)
        self._unregister = getattr(store, "unregister_buffer", None)
        self._ranges = getattr(store, "get_into_ranges", None)
        #: a store without the multi-buffer calls reads by ``batch_get_into`` into registered
        #: memory when it has both (the published module's read), else by ``get``
        self._batch_get_into = all(
            callable(f)
            for f in (getattr(store, "batch_get_into", None), self._register, self._unregister)
        )

    @property
    def zero_copy(self) -> bool:
        """Whether the store has the registered multi-buffer calls."""
        return all(
            callable(f)
            for f in (self._put_parts, self._get_parts, self._register, self._unregister)
        )

    def tensor_put_call(self, config: Any) -> Any:
        """How a tensor member is written when the store lacks the multi-buffer calls: its
        ``put_tensor`` (``config`` None) or ``pub_tensor`` (with the one-key grouped
        ``config``), as the published module writes tensors; ``None`` on a store with the
        multi-buffer calls (every payload goes in one batch) or without those tensor calls.
        The callable takes ``(key, tensor)`` and answers the store's code."""
        if self.zero_copy:
            return None
        if config is None:
            put_tensor = getattr(self.store, "put_tensor", None)
            return put_tensor if callable(put_tensor) else None
        pub_tensor = getattr(self.store, "pub_tensor", None)
        if not callable(pub_tensor):
            return None
        cfg = grouped_config(config, 1)
        return lambda key, tensor: pub_tensor(key, tensor, config=cfg)

    def put_from_call(self, config: Any) -> Any:
        """How a tensor-object buffer is written whole when the store lacks the multi-buffer
        calls: ``put_tensor_from`` (``config`` None) or ``put_from`` (with the one-key
        grouped ``config``), as the published module writes one; ``None`` otherwise. The
        callable takes ``(key, ptr, size)`` and answers the store's code."""
        if self.zero_copy:
            return None
        put_tensor_from = getattr(self.store, "put_tensor_from", None)
        if config is None and callable(put_tensor_from):
            return put_tensor_from
        put_from = getattr(self.store, "put_from", None)
        if not callable(put_from):
            return None
        cfg = grouped_config(config, 1)
        return lambda key, ptr, size: _call(put_from, key, ptr, size, config=cfg)

    @property
    def range_reads(self) -> bool:
        """Whether a store without the multi-buffer calls reads byte ranges by
        ``get_into_ranges`` into registered memory (the published module's destination read)."""
        return (
            not self.zero_copy
            and callable(self._ranges)
            and callable(self._register)
            and callable(self._unregister)
        )

    def tensor_get_call(self) -> Any:
        """How a ``"kind": "tensor"`` payload is read whole when the store lacks the
        multi-buffer calls: its ``get_tensor`` (``key`` -> tensor); ``None`` where the bytes
        are read as any other payload (a store with the multi-buffer calls, or one without
        any tensor calls, whose tensors were written with ``put``). A store that writes
        tensors (``put_tensor``/``pub_tensor``) but cannot read them raises ``RuntimeError``
        naming ``get_tensor``, as the published module does."""
        if self.zero_copy:
            return None
        get_tensor = getattr(self.store, "get_tensor", None)
        if callable(get_tensor):
            return get_tensor
        if any(callable(getattr(self.store, n, None)) for n in ("put_tensor", "pub_tensor")):
            raise RuntimeError("structured tensor payload does not support get_tensor")
        return None

    # -- registration --------------------------------------------------------------------------

    def _plan(self, keys: Sequence[_Key]) -> tuple[list[int], _Staging]:
        """Register the large parts; the rest go to staging. Answers what was registered."""
        registered: list[int] = []
        done: set[tuple[int, int]] = set()
        staging = _Staging()
        for k in keys:
            for p in k.parts:
                if p.size == 0:
                    continue
                if p.size >= REGISTER_MIN_BYTES and (p.ptr, p.size) not in done:
                    assert self._register is not None
                    if self._register(p.ptr, p.size) == 0:
                        registered.append(p.ptr)
                        done.add((p.ptr, p.size))
                        continue
                elif (p.ptr, p.size) in done:
                    continue
                staging.add(p)
        return registered, staging

    def _release(self, registered: Sequence[int]) -> None:
        assert self._unregister is not None
        for ptr in registered:
            self._unregister(ptr)

    def _staging_buffer(self, staging: _Staging) -> tuple[np.ndarray, bool]:
        buf = np.empty(max(staging.size, 1), dtype=np.uint8)
        ok = staging.size > 0 and self._register is not None
        if ok:
            assert self._register is not None
            ok = self._register(int(buf.ctypes.data), int(buf.nbytes)) == 0
        return buf, ok

    # -- writes --------------------------------------------------------------------------------

    def _resolve_buffer_group_put_mode(
        self, chunk_groups: Sequence[Sequence[Any]], transfer_policy: BundleTransferPolicy
    ) -> Literal["batch", "parallel"]:
        """The published choice for staged writes of ``chunk_groups`` (each a sequence of
        sized buffers): ``put_mode`` when it is ``batch``/``parallel``; under ``auto``,
        ``parallel`` for at least :data:`AUTO_PARALLEL_MIN_CHUNKS` groups holding at least
        :data:`AUTO_PARALLEL_MIN_BYTES` with ``max_inflight_put`` >= 2, else ``batch``."""
        if transfer_policy.put_mode in ("batch", "parallel"):
            return transfer_policy.put_mode
        if transfer_policy.max_inflight_put <= 1 or len(chunk_groups) < AUTO_PARALLEL_MIN_CHUNKS:
            return "batch"
        if sum(len(b) for g in chunk_groups for b in g) < AUTO_PARALLEL_MIN_BYTES:
            return "batch"
        return "parallel"

    def put_many(
        self,
        writes: Sequence[tuple[str, Sequence[Part]]],
        config: Any = None,
        policy: BundleTransferPolicy | None = None,
    ) -> None:
        """Store each key as the concatenation of its parts (empty keys are skipped). On any
        failure, the keys of this call that were written are removed and
        :class:`StructuredObjectError` names the first failed key and its code. ``policy``
        matters only to staged writes (a buffer pool on a store without the multi-buffer
        calls): ``copy_mode="copy"`` writes by ``put`` instead, and a ``parallel`` put mode
        (:meth:`_resolve_buffer_group_put_mode`) writes up to ``max_inflight_put`` keys at
        once."""
        keys = [_Key(k, [p for p in parts if p.size]) for k, parts in writes]
        keys = [k for k in keys if k.parts]
        if not keys:
            return
        policy = policy or BundleTransferPolicy()
        if (
            not self.zero_copy
            and self.buffer_pool is not None
            and callable(self._batch_put_from)
            and policy.copy_mode != "copy"
        ):
            groups = [[_Sized(k.total)] for k in keys]
            mode = self._resolve_buffer_group_put_mode(groups, policy)
            self._put_staged(keys, config, policy.max_inflight_put if mode == "parallel" else 1)
            return
        if not self.zero_copy:
            written: list[str] = []
            try:
                for k in keys:
                    value = b"".join(ctypes.string_at(p.ptr, p.size) for p in k.parts)
                    code = _call(self.store.put, k.key, value, config=grouped_config(config, 1))
                    _check(code, "put", k.key)
                    written.append(k.key)
            except BaseException:
                # a failed code or a raising store: nothing of this call stays behind
                remove_keys(self.store, written, strict=False)
                raise
            return
        registered, staging = self._plan(keys)
        buf, buf_registered = self._staging_buffer(staging)
        try:
            base = int(buf.ctypes.data)
            moved: dict[int, int] = {}
            for part, offset in staging.slots:
                ctypes.memmove(base + offset, part.ptr, part.size)
                moved[id(part)] = base + offset
            if staging.size and not buf_registered:
                raise StructuredObjectError("register_buffer failed for the staging buffer")
            ptrs = [[moved.get(id(p), p.ptr) for p in k.parts] for k in keys]
            sizes = [[p.size for p in k.parts] for k in keys]
            names = [k.key for k in keys]
            assert self._put_parts is not None
            codes = _call(
                self._put_parts, names, ptrs, sizes, config=grouped_config(config, len(keys))
            )
        finally:
            if buf_registered:
                self._release([int(buf.ctypes.data)])
            self._release(registered)
        failed = [(n, c) for n, c in zip(names, codes, strict=True) if c not in (None, 0)]
        if len(codes) != len(names) or failed:
            remove_keys(
                self.store,
                [n for n, c in zip(names, codes, strict=False) if c in (None, 0)],
                strict=False,
            )
            key, code = failed[0] if failed else (names[0], codes)
            raise StructuredObjectError(f"batch_put_from_multi_buffers failed for {key}: {code}")

    def _put_staged(self, keys: Sequence[_Key], config: Any, workers: int = 1) -> None:
        """The published module's pooled write, for a store without the multi-buffer calls:
        per key, a pool lease of its size, its parts copied in, one ``batch_put_from`` of that
        key (with the one-key grouped ``config``), the lease released; up to ``workers`` keys
        at once. On a failure every key of this call that was tried is removed."""
        assert self._batch_put_from is not None
        cfg = grouped_config(config, 1)
        tried: list[str] = []

        def put_one(k: _Key) -> None:
            lease = self.buffer_pool.acquire(k.total)
            try:
                base, offset = int(lease.ptr), 0
                for p in k.parts:
                    ctypes.memmove(base + offset, p.ptr, p.size)
                    offset += p.size
                tried.append(k.key)
                codes = _call(self._batch_put_from, [k.key], [base], [k.total], config=cfg)
            finally:
                lease.release()
            if len(codes) != 1 or codes[0] not in (None, 0):
                raise StructuredObjectError(f"batch_put_from failed for {k.key}: {codes}")

        try:
            if workers <= 1 or len(keys) < 2:
                for k in keys:
                    put_one(k)
            else:
                with ThreadPoolExecutor(max_workers=min(workers, len(keys))) as pool:
                    for future in [pool.submit(put_one, k) for k in keys]:
                        future.result()
        except BaseException:
            remove_keys(self.store, tried, strict=False)
            raise

    # -- reads ---------------------------------------------------------------------------------

    def get_many(self, reads: Sequence[tuple[str, Sequence[Part]]]) -> None:
        """Scatter each key's value over its parts, in order; the value must fill them exactly
        (:class:`StructuredObjectError` otherwise, naming the key).

        A read must finish within its key's read lease, which grows with the key's size; so
        keys of at least :data:`SOLO_READ_BYTES` are read one per batch and smaller ones in
        batches of at most that many bytes, and a key whose lease ran out is read again."""
        keys = [_Key(k, [p for p in parts if p.size]) for k, parts in reads]
        keys = [k for k in keys if k.parts]
        if not keys:
            return
        if not self.zero_copy:
            self._get_batch(keys)
            return
        batches: list[list[_Key]] = []
        small: list[_Key] = []
        small_bytes = 0
        for k in keys:
            if k.total >= SOLO_READ_BYTES:
                batches.append([k])
                continue
            if small and small_bytes + k.total > SOLO_READ_BYTES:
                batches.append(small)
                small, small_bytes = [], 0
            small.append(k)
            small_bytes += k.total
        if small:
            batches.append(small)
        for batch in batches:
            expired = self._get_batch(batch)
            for _attempt in range(READ_RETRIES):
                if not expired:
                    break
                expired = [e for k in expired for e in self._get_batch([k])]
            if expired:
                raise StructuredObjectError(
                    f"batch_get_into_multi_buffers failed for {expired[0].key}: its read lease "
                    f"expired {READ_RETRIES + 1} times"
                )

    def _get_batch(self, keys: list[_Key]) -> list[_Key]:
        """One batched read of ``keys``; answers the keys whose read lease expired."""
        if not self.zero_copy and self._batch_get_into:
            self._get_batch_into(keys)
            return []
        if not self.zero_copy:
            for k in keys:
                data = self.store.get(k.key)
                if data is None or len(data) != k.total:
                    got = None if data is None else len(data)
                    raise StructuredObjectError(
                        f"get failed for {k.key}: expected {k.total} bytes, got {got}"
                    )
                src = np.frombuffer(data, dtype=np.uint8)
                offset = 0
                for p in k.parts:
                    ctypes.memmove(p.ptr, int(src.ctypes.data) + offset, p.size)
                    offset += p.size
            return []
        registered, staging = self._plan(keys)
        buf, buf_registered = self._staging_buffer(staging)
        try:
            base = int(buf.ctypes.data)
            moved = {id(part): base + offset for part, offset in staging.slots}
            if staging.size and not buf_registered:
                raise StructuredObjectError("register_buffer failed for the staging buffer")
            ptrs = [[moved.get(id(p), p.ptr) for p in k.parts] for k in keys]
            sizes = [[p.size for p in k.parts] for k in keys]
            assert self._get_parts is not None
            got = self._get_parts([k.key for k in keys], ptrs, sizes)
            for part, offset in staging.slots:
                ctypes.memmove(part.ptr, base + offset, part.size)
        finally:
            if buf_registered:
                self._release([int(buf.ctypes.data)])
            self._release(registered)
        expired = []
        for k, n in zip(keys, got, strict=True):
            if n == LEASE_EXPIRED:
                expired.append(k)
            elif n != k.total:
                raise StructuredObjectError(
                    f"batch_get_into_multi_buffers failed for {k.key}: expected {k.total} bytes, got {n}"
                )
        return expired

    def _get_batch_into(self, keys: list[_Key]) -> None:
        """``keys`` read by the store's ``batch_get_into`` (a store without the multi-buffer
        calls, as the published module reads) into one scratch buffer registered for the call,
        then scattered over each key's parts."""
        offsets: list[int] = []
        size = 0
        for k in keys:
            offsets.append(size)
            size += (k.total + _ALIGN - 1) // _ALIGN * _ALIGN
        buf = np.empty(max(size, 1), dtype=np.uint8)
        base = int(buf.ctypes.data)
        assert self._register is not None
        if self._register(base, int(buf.nbytes)) != 0:
            raise StructuredObjectError("register_buffer failed for a read buffer")
        try:
            got = self.store.batch_get_into(
                [k.key for k in keys], [base + o for o in offsets], [k.total for k in keys]
            )
        finally:
            self._release([base])
        got = list(got)
        if len(got) != len(keys):
            raise StructuredObjectError(f"batch_get_into answered {len(got)} of {len(keys)} keys")
        for k, offset, n in zip(keys, offsets, got, strict=True):
            if n != k.total:
                raise StructuredObjectError(
                    f"batch_get_into failed for {k.key}: expected {k.total} bytes, got {n}"
                )
            pos = base + offset
            for p in k.parts:
                ctypes.memmove(p.ptr, pos, p.size)
                pos += p.size

    def get_ranges(self, fragments: Sequence[tuple[str, int, int, int]], dest: Part) -> None:
        """Copy ``(key, src_offset, dst_offset, size)`` fragments of stored values into ``dest``."""
        frags = [f for f in fragments if f[3] > 0]
        if not frags:
            return
        if not (callable(self._ranges) and callable(self._register) and callable(self._unregister)):
            for key, src, dst, size in frags:
                data = self.store.get(key)
                if data is None or len(data) < src + size:
                    raise StructuredObjectError(f"get failed for {key}: value is too short")
                view = np.frombuffer(data, dtype=np.uint8)
                ctypes.memmove(dest.ptr + dst, int(view.ctypes.data) + src, size)
            return
        by_key: dict[str, list[tuple[int, int, int]]] = {}
        for key, src, dst, size in frags:
            by_key.setdefault(key, []).append((dst, src, size))
        assert self._register is not None and self._ranges is not None
        own = self._register(dest.ptr, dest.size) == 0
        target = dest
        scratch = None
        if not own:
            scratch = np.empty(dest.size, dtype=np.uint8)
            target = Part(int(scratch.ctypes.data), dest.size, scratch)
            if self._register(target.ptr, target.size) != 0:
                raise StructuredObjectError("register_buffer failed for a range destination")
        try:
            names = list(by_key)
            res = self._ranges(
                [target.ptr],
                [names],
                [[[d for d, _s, _n in by_key[k]] for k in names]],
                [[[s for _d, s, _n in by_key[k]] for k in names]],
                [[[n for _d, _s, n in by_key[k]] for k in names]],
            )
        finally:
            self._release([target.ptr])
        for name, got in zip(names, res[0], strict=True):
            want = [n for _d, _s, n in by_key[name]]
            if list(got) != want:
                raise StructuredObjectError(f"get_into_ranges failed for {name}: {list(got)}")
        if scratch is not None:
            ctypes.memmove(dest.ptr, target.ptr, dest.size)


def _call(fn: Any, *args: Any, config: Any = None) -> Any:
    return fn(*args) if config is None else fn(*args, config=config)


def remove_keys(store: Any, keys: Sequence[str], *, strict: bool) -> None:
    """Remove ``keys`` (forced); an already-missing key is not an error. With ``strict``, any
    other failure raises :class:`StructuredObjectError`."""
    pending = list(dict.fromkeys(keys))
    if not pending:
        return
    batch_remove = getattr(store, "batch_remove", None)
    if callable(batch_remove):
        try:
            results = list(batch_remove(pending, True))
        except Exception:
            if strict:
                raise
            results = []
        if len(results) == len(pending):
            pending = [
                k
                for k, c in zip(pending, results, strict=True)
                if c not in (None, 0, MISSING_OBJECT_ERROR)
            ]
    errors = []
    for key in pending:
        try:
            code = store.remove(key, True)
        except KeyError:
            continue
        except Exception:
            if strict:
                raise
            continue
        if code not in (None, 0, MISSING_OBJECT_ERROR):
            errors.append((key, code))
    if errors and strict:
        raise StructuredObjectError(f"failed to remove {len(errors)} Mooncake keys: {errors[:3]}")
