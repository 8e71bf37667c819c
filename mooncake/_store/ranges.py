"""Byte ranges of objects and the get/put sessions of the store client.

``get_into_ranges`` reads ranges of many objects in one query and one round of
transfers. A get session queries once and reads ranges with no master call until its lease
ends; a put session reserves objects (``BatchPutStart``), writes ranges into every replica, then
ends (``BatchPutEnd``) or revokes them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._store.config import to_wire
from mooncake._store.moves import Config, _check_key, _Op, _read_ttl
from mooncake._store.reads import _Reads
from mooncake.errors import ErrorCode, LeaseExpiredError, MooncakeError

log = logging.getLogger("mooncake.store")


class _Ranges(_Reads):
    """Byte ranges of objects and the get/put sessions of the store client (part of :class:`~mooncake._store.client.Store`)."""

    async def get_into_ranges(
        self,
        buffers: Sequence[int],
        all_keys: Sequence[Sequence[str]],
        all_dst: Sequence[Sequence[Sequence[int]]],
        all_src: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Byte ranges of objects into registered buffers: range ``k`` of key ``j`` of buffer
        ``i`` copies ``all_sizes[i][j][k]`` bytes from object offset ``all_src[i][j][k]`` to
        ``buffers[i] + all_dst[i][j][k]``. Result per range: bytes copied or a negative code
        (``INVALID_PARAMS`` for a range outside the buffer or the object, or mismatched
        lists; the key's error code where it could not be read). A key fenced by its read
        window is read once more with a fresh lease (:meth:`_reread_fenced`)."""
        self._check_open()
        bad = int(ErrorCode.INVALID_PARAMS)
        # shaped as the published client shapes it: one row per buffer, one range where the
        # lists do not say how many
        results: list[list[list[int]]] = [
            [
                [bad] * (len(all_dst[i][j]) if i < len(all_dst) and j < len(all_dst[i]) else 1)
                for j in range(len(all_keys[i]) if i < len(all_keys) else 1)
            ]
            for i in range(len(buffers))
        ]
        n_buf = len(buffers)
        if not (n_buf == len(all_keys) == len(all_dst) == len(all_src) == len(all_sizes)):
            return results
        uniq = list(dict.fromkeys(k for keys in all_keys for k in keys))
        if not uniq:
            return results
        try:
            for key in uniq:
                _check_key(key)
            resps, t0 = await self._batch_query(uniq)
        except MooncakeError as e:
            return [[[int(e.code)] * len(r) for r in row] for row in results]
        by_key = dict(zip(uniq, resps, strict=True))
        entries: list[tuple[int, int, list[int]]] = []  # (buffer, key slot, range indices)
        e_resps: list[st.GetReplicaListResponse | MooncakeError] = []
        e_parts: list[list[tuple[int, int, int]]] = []
        e_keys: list[str] = []
        for i, keys in enumerate(all_keys):
            region = self.engine.registry.find(buffers[i], 1) if buffers[i] else None
            cap = region.addr + region.length - buffers[i] if region is not None else 0
            for j, key in enumerate(keys):
                dst, src, sz = all_dst[i][j], all_src[i][j], all_sizes[i][j]
                if not (len(dst) == len(src) == len(sz)) or cap <= 0:
                    continue
                r = by_key[key]
                if isinstance(r, MooncakeError):
                    results[i][j] = [int(r.code)] * len(dst)
                    continue
                n = self._size_of(r)
                idx: list[int] = []
                part: list[tuple[int, int, int]] = []
                for kk, (d, so, ln) in enumerate(zip(dst, src, sz, strict=True)):
                    if d < 0 or so < 0 or ln < 0 or d + ln > cap or so + ln > n:
                        continue
                    idx.append(kk)
                    part.append((buffers[i] + d, ln, so))
                if idx:
                    entries.append((i, j, idx))
                    e_resps.append(r)
                    e_parts.append(part)
                    e_keys.append(key)
        errs = await self._read_many(
            e_resps, [0] * len(entries), [0] * len(entries), t0, e_parts, keys=e_keys
        )
        await self._reread_fenced(errs, e_parts, e_keys)
        for (i, j, idx), err, part in zip(entries, errs, e_parts, strict=True):
            for kk, (_, ln, _) in zip(idx, part, strict=True):
                results[i][j][kk] = int(err.code) if err is not None else ln
        return results

    async def _reread_fenced(
        self,
        errs: list[MooncakeError | None],
        parts: Sequence[Sequence[tuple[int, int, int]]],
        keys: Sequence[str],
    ) -> None:
        """Read once more, with a fresh ``GetReplicaList``, the entries fenced by their read
        window (finished after their lease: the bytes may be stale, the object is not gone),
        as :meth:`get` does; ``errs`` is updated in place. An entry whose object is now too
        small for its ranges, or is gone, keeps its fenced error or takes the fresh one."""
        fenced = [n for n, err in enumerate(errs) if isinstance(err, LeaseExpiredError)]
        if not fenced:
            return
        uniq = list(dict.fromkeys(keys[n] for n in fenced))
        try:
            resps, t1 = await self._batch_query(uniq)
        except MooncakeError:
            return
        fresh = dict(zip(uniq, resps, strict=True))
        redo: list[int] = []
        for n in fenced:
            r = fresh[keys[n]]
            if isinstance(r, MooncakeError):
                errs[n] = r
            elif all(so + ln <= self._size_of(r) for _, ln, so in parts[n]):
                redo.append(n)
        if not redo:
            return
        again = await self._read_many(
            [fresh[keys[n]] for n in redo],
            [0] * len(redo),
            [0] * len(redo),
            t1,
            [parts[n] for n in redo],
            keys=[keys[n] for n in redo],
        )
        for n, err in zip(redo, again, strict=True):
            errs[n] = err

    async def get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Query ``keys`` once and keep their replicas for ranged reads; a code per key."""
        self._check_open()
        if not keys:
            return []
        for k in keys:
            _check_key(k)
        resps, t0 = await self._batch_query(keys)
        out: list[int] = []
        for k, r in zip(keys, resps, strict=True):
            self._get_sessions.pop(k, None)
            if isinstance(r, MooncakeError):
                out.append(int(r.code))
            elif not self._order(r.replicas):
                out.append(int(ErrorCode.INVALID_REPLICA))
            else:
                self._get_sessions[k] = (r, t0 + _read_ttl(r))
                out.append(0)
        return out

    def get_session_end(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._get_sessions.pop(k, None)

    async def get_session_ranges(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Ranged reads of session keys into registered buffers (no master call); bytes read
        per key, ``INVALID_PARAMS`` without a session or for a range outside the object,
        ``LEASE_EXPIRED`` once the session's lease has run out."""
        self._check_open()
        bad = int(ErrorCode.INVALID_PARAMS)
        out = [bad] * len(keys)
        if not (len(keys) == len(parts) == len(sizes) == len(src_offsets)):
            return out
        idx: list[int] = []
        e_resps: list[st.GetReplicaListResponse | MooncakeError] = []
        e_parts: list[list[tuple[int, int, int]]] = []
        now = anyio.current_time()
        for i, k in enumerate(keys):
            sess = self._get_sessions.get(k)
            if sess is None or not (len(parts[i]) == len(sizes[i]) == len(src_offsets[i])):
                continue
            resp, deadline = sess
            if now >= deadline:
                del self._get_sessions[k]
                out[i] = int(ErrorCode.LEASE_EXPIRED)
                continue
            n = self._size_of(resp)
            try:
                for j, (a, ln) in enumerate(zip(parts[i], sizes[i], strict=True)):
                    self._require_local(a, ln, f"batch_get_into_multi_buffer_ranges[{i}][{j}]")
            except MooncakeError:
                continue
            if any(o < 0 or o + ln > n for o, ln in zip(src_offsets[i], sizes[i], strict=True)):
                continue
            idx.append(i)
            e_resps.append(resp)
            e_parts.append(list(zip(parts[i], sizes[i], src_offsets[i], strict=True)))
        errs = await self._read_many(
            e_resps, [0] * len(idx), [0] * len(idx), now, e_parts, keys=[keys[i] for i in idx]
        )
        done = anyio.current_time()
        for i, err, part in zip(idx, errs, e_parts, strict=True):
            sess = self._get_sessions.get(keys[i])
            if err is not None:
                out[i] = int(err.code)
            elif sess is None or done >= sess[1]:
                self._get_sessions.pop(keys[i], None)
                out[i] = int(ErrorCode.LEASE_EXPIRED)
            else:
                out[i] = sum(ln for _, ln, _ in part)
        return out

    async def put_session_start(
        self, keys: Sequence[str], sizes: Sequence[int], config: Config = None
    ) -> list[int]:
        """Reserve ``keys`` (``BatchPutStart``) for ranged writes; a code per key."""
        self._check_open()
        bad = int(ErrorCode.INVALID_PARAMS)
        if len(keys) != len(sizes):
            return [bad] * len(keys)
        wire = to_wire(config)
        out = [0] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            _check_key(k)
            if k in self._put_sessions or not isinstance(sizes[i], int) or sizes[i] <= 0:
                out[i] = bad
            else:
                todo.append(i)
        if not todo:
            return out
        items: list[rpc.Item[list[st.ReplicaDescriptor]]] = await self.master.call(
            "BatchPutStart",
            rpc.BatchPutStartParams(
                client_id=self.client_id,
                keys=[keys[i] for i in todo],
                sizes=[sizes[i] for i in todo],
                config=wire,
            ),
        )
        for i, item in zip(todo, items, strict=True):
            if item.code != 0 or item.value is None:
                out[i] = item.code or int(ErrorCode.INVALID_REPLICA)
            else:
                self._put_sessions[keys[i]] = (list(item.value), sizes[i])
        return out

    async def put_session_ranges(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Write registered buffers at object offsets of session keys, to every replica;
        bytes written per key (``INVALID_PARAMS`` without a session, or out of range)."""
        self._check_open()
        bad = int(ErrorCode.INVALID_PARAMS)
        out = [bad] * len(keys)
        if not (len(keys) == len(parts) == len(sizes) == len(dst_offsets)):
            return out
        ops: list[tuple[int, _Op]] = []
        idx: list[int] = []
        for i, k in enumerate(keys):
            sess = self._put_sessions.get(k)
            if sess is None or not (len(parts[i]) == len(sizes[i]) == len(dst_offsets[i])):
                continue
            reps, n = sess
            try:
                for j, (a, ln) in enumerate(zip(parts[i], sizes[i], strict=True)):
                    self._require_local(a, ln, f"batch_put_from_multi_buffer_ranges[{i}][{j}]")
            except MooncakeError:
                continue
            if any(o < 0 or o + ln > n for o, ln in zip(dst_offsets[i], sizes[i], strict=True)):
                continue
            idx.append(i)
            for r in reps:
                for a, ln, o in zip(parts[i], sizes[i], dst_offsets[i], strict=True):
                    ops.append((i, _Op(True, a, r, ln, offset=o)))
        await self._move([op for _, op in ops])
        for i in idx:
            out[i] = sum(sizes[i])
        for i, op in ops:
            if op.error is not None:
                out[i] = int(op.error.code)
        return out

    async def put_session_finish(self, keys: Sequence[str], *, revoke: bool) -> list[int]:
        """``BatchPutEnd`` (or ``BatchPutRevoke``) the session keys; a code per key."""
        self._check_open()
        out = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        idx = [i for i, k in enumerate(keys) if k in self._put_sessions]
        if not idx:
            return out
        names = [keys[i] for i in idx]
        codes: list[int] = await self.master.call(
            "BatchPutRevoke" if revoke else "BatchPutEnd",
            rpc.BatchKeyClientParams(client_id=self.client_id, keys=names)
            if revoke
            else rpc.BatchPutEndParams(client_id=self.client_id, keys=names),  # no CRC: ranges
        )
        for i, c in zip(idx, codes, strict=True):
            out[i] = c
            self._put_sessions.pop(keys[i], None)
        return out
