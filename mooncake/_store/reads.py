"""The get family of the store client: fenced reads into bytes, registered buffers or ranges.

``GetReplicaList`` (a read lease) -> read one complete replica, cheapest first (own
segment, same host, remote), the next one on a transfer failure -> fence: a read that finished
after its read window fails with ``LeaseExpiredError``. Batches read every key in one round of
transfers per failover attempt; multi-buffer reads scatter a value over ``(address, length,
object offset)`` ranges.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import anyio
import msgspec

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.master import parse_miss
from mooncake._core.misses import MissReason
from mooncake._engine import tracing as _tracing
from mooncake._store import batching
from mooncake._store.bounds import check_replica_list
from mooncake._store.moves import _check_key, _Op, _read_ttl, staging_refusal
from mooncake._store.verify import (
    NO_CRC,
    corrupt_report,
    crc_of,
    crc_of_bytes,
    crc_of_parts,
    none_verified,
)
from mooncake._store.writes import _Writes
from mooncake.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    MooncakeError,
    ObjectNotFoundError,
    PeerDiedError,
    TierDataError,
    TransferError,
)

log = logging.getLogger("mooncake.store")


def _landed_crc(ops: Sequence[_Op], landed: Sequence[tuple[int, int]]) -> int:
    """The CRC32C of a value read by ``ops`` (contiguous from offset 0, as ``landed``): from
    the CRCs their copies computed (combined in offset order), else one pass over ``landed``."""
    if len(ops) == 1 and ops[0].crc >= 0:  # one copy landed the whole value (the usual case)
        return ops[0].crc
    if ops and all(op.crc >= 0 for op in ops):
        ordered = sorted(ops, key=lambda op: op.offset)
        crc = ordered[0].crc
        for op in ordered[1:]:
            crc = _fast.crc32c_combine(crc, op.crc, op.length)
        return int(crc)
    return crc_of(*landed[0]) if len(landed) == 1 else crc_of_parts(landed)


class _Reads(_Writes):
    """The get family of the store client (part of :class:`~mooncake._store.client.Store`)."""

    def _order(self, replicas: Sequence[st.ReplicaDescriptor]) -> list[st.ReplicaDescriptor]:
        """Readable replicas, cheapest first: own segment, same-host mapped, then the rest."""
        complete = [r for r in replicas if r.status == st.ReplicaStatus.COMPLETE]

        def rank(r: st.ReplicaDescriptor) -> int:
            if r.segment_name == self.segment_name:
                return 0
            return 1 if self._route_cached(r.segment_name) is not None else 2

        return sorted(complete, key=rank)

    async def _query(
        self, key: str, *, for_read: bool = True
    ) -> tuple[st.GetReplicaListResponse, float]:
        """GetReplicaList and the read's fence deadline (measured from before the request; for a
        retried request, from before the attempt that was answered)."""
        try:
            resp: st.GetReplicaListResponse
            resp, t0 = await self.master.call_stamped(
                "GetReplicaList", rpc.KeyParams(key=_check_key(key), for_read=for_read)
            )
        except ObjectNotFoundError as e:
            e.miss = parse_miss(key, str(e), self.master.tenant)
            raise
        return check_replica_list(key, resp), t0 + _read_ttl(resp)

    async def _batch_query(
        self, keys: Sequence[str], *, for_read: bool = True
    ) -> tuple[list[st.GetReplicaListResponse | MooncakeError], float]:
        """``BatchGetReplicaList`` of ``keys`` and the stamp of the answered request; a batch
        past one call's bounds is asked chunk by chunk (:mod:`~mooncake._store.batching`),
        the stamp is the first chunk's and the read window of each later chunk's answers is
        lengthened by how much later its request was sent, so every key's read deadline is
        still that of its own lease."""
        from mooncake.errors import error_from_code

        keys = list(keys)
        items: list[rpc.Item[st.GetReplicaListResponse]] = []
        t0 = 0.0
        later: list[float] = []  # per answer: seconds its request was sent after t0
        for n, (lo, hi) in enumerate(batching.chunks(keys)):
            got, t = await self.master.call_stamped(
                "BatchGetReplicaList", rpc.KeysParams(keys=keys[lo:hi], for_read=for_read)
            )
            if n == 0:
                t0 = t
            items += got
            later += [t - t0] * len(got)
        out: list[st.GetReplicaListResponse | MooncakeError] = []
        for key, it, dt in zip(keys, items, later, strict=False):
            if it.code == 0 and it.value is not None:
                if dt > 0:  # its lease began dt after t0: its window ends dt later too
                    it.value.read_ttl_ms = int((_read_ttl(it.value) + dt) * 1000)
                try:
                    out.append(check_replica_list(key, it.value))
                except TransferError as e:
                    out.append(e)
            else:
                out.append(error_from_code(it.code))
        return out, t0

    @staticmethod
    def _size_of(resp: st.GetReplicaListResponse) -> int:
        if resp.size:
            return resp.size
        return resp.replicas[0].length if resp.replicas else 0

    def _want_crc(self, resp: st.GetReplicaListResponse, n: int, *, count: bool = True) -> int:
        """The CRC a read of ``n`` bytes from the start of ``resp``'s object must match
        (:data:`NO_CRC`: nothing to verify: no CRC recorded, verification off, or a part;
        counted as an unverified read unless ``count`` is false)."""
        if n != self._size_of(resp) or not self.verify.enabled or resp.crc < 0:
            if count:
                self.verify.unverified += 1
            return NO_CRC
        return resp.crc

    async def _proved(
        self,
        key: str,
        resp: st.GetReplicaListResponse,
        r: st.ReplicaDescriptor,
        want: int,
        got: int,
        deadline: float,
    ) -> bool:
        """Whether bytes read from replica ``r`` (CRC ``got``) are ``resp``'s version
        (``want``). A mismatch inside the read window reports ``r`` to the master (which drops
        it); one after it is a fenced read (:class:`LeaseExpiredError`), since the space may
        hold another object by then."""
        if self.verify.check(want, got, "dram", r.segment_name):
            return True
        if anyio.current_time() > deadline:
            self.lease_fences += 1
            raise LeaseExpiredError("the read finished after its lease expired")
        await self._report_corrupt(key, resp.vid, r)
        return False

    async def _report_corrupt(self, key: str, vid: int, r: st.ReplicaDescriptor) -> None:
        """Tell the master that replica ``r`` of version ``vid`` of ``key`` failed its CRC32C
        (it drops it; the last one takes the object with it). Best effort: a failed report is
        logged, the read's answer does not depend on it."""
        params = corrupt_report(self.client_id, key, vid, r)
        if not key:
            return
        try:
            with anyio.fail_after(5):
                await self.master.call("ReportCorruptReplica", params)
            self.verify.replicas_reported += 1
        except (MooncakeError, TimeoutError) as e:
            log.warning("reporting the corrupt replica of %r failed: %s", key, e)

    async def _read_one(
        self,
        resp: st.GetReplicaListResponse,
        local: int,
        n: int,
        deadline: float,
        key: str = "",
    ) -> None:
        """Read ``n`` bytes of the object into ``local``, trying replicas in order; fenced and,
        when ``n`` is the whole value, verified (a replica that fails is reported and the next
        one read; :class:`ChecksumMismatchError` if none verifies)."""
        order = self._order(resp.replicas)
        if not order:
            raise ObjectNotFoundError("no complete replica")
        if self._on_host([(local, n)]):
            want = self._want_crc(resp, n)
        else:  # device memory: the CPU cannot checksum what landed
            want = NO_CRC
            self.verify.unverified += 1
        err: MooncakeError | None = None
        for r in order:
            op = _Op(False, local, r, n, sum=want != NO_CRC)
            await self._move([op], deadline)  # past the window the bytes are of no use
            if op.error is None:
                if want != NO_CRC and not await self._proved(
                    key, resp, r, want, op.crc if op.crc >= 0 else crc_of(local, n), deadline
                ):
                    err = none_verified(key)
                    continue
                if anyio.current_time() > deadline:
                    self.lease_fences += 1
                    raise LeaseExpiredError(
                        "the read finished after its lease expired; the bytes may be stale"
                    )
                return
            err = op.error
        assert err is not None
        raise err

    def _note_miss(self, err: BaseException) -> None:
        """Count a failed read by reason/policy/tier (see :meth:`miss_stats`)."""
        if isinstance(err, ObjectNotFoundError):
            m = err.miss
            label = (m.reason.value, m.policy, m.tier) if m is not None else ("unknown", "", "")
        elif isinstance(err, LeaseExpiredError):
            label = (MissReason.LEASE_EXPIRED.value, "", "dram")
        elif isinstance(err, TierDataError):
            label = (MissReason.TRANSFER_FAILED.value, "", "ssd")
        elif isinstance(err, TransferError):
            label = (MissReason.TRANSFER_FAILED.value, "", "dram")
        else:
            return
        self._misses[label] += 1

    def miss_stats(self) -> dict[tuple[str, str, str], int]:
        """Failed reads of this client by (reason, policy, tier): misses the master attributed
        (``ObjectNotFoundError.miss``; batch misses carry no attribution: ``unknown``), reads
        fenced by their lease, transfers and SSD reads that failed. The master counts the
        misses it sees in ``master_misses_total``."""
        return dict(self._misses)

    @_tracing.traced("mooncake.store.get", lambda self, key: {"mooncake.key": key})
    async def get(self, key: str) -> bytes:
        """The value of ``key`` (raises :class:`ObjectNotFoundError` if there is none).

        A read fenced by its read window (it finished after its lease: the bytes may be stale,
        the object is not gone) is tried once more with a fresh ``GetReplicaList``."""
        try:
            try:
                return await self._get(key)
            except LeaseExpiredError:
                return await self._get(key)
        except MooncakeError as e:
            self._note_miss(e)
            raise

    async def _get(self, key: str) -> bytes:
        self._check_open()
        resp, deadline = await self._query(key)
        if not resp.replicas and resp.disk_clients:
            return await self._read_ssd(key, resp)
        return await self._get_with(resp, deadline, key)

    async def _get_with(
        self, resp: st.GetReplicaListResponse, deadline: float, key: str = ""
    ) -> bytes:
        """The rest of :meth:`get` once ``GetReplicaList`` has answered ``resp`` (verified as
        :meth:`_read_one`)."""
        n = self._size_of(resp)
        # same-host or own replica: copy straight into a new bytes object
        await self._resolve(r.segment_name for r in resp.replicas)
        order = self._order(resp.replicas)
        if order and self._is_copyable(order[0].segment_name):
            r = order[0]
            peer = (
                None if r.segment_name == self.segment_name else self._route_cached(r.segment_name)
            )
            # own replica (_is_copyable of our own segment) or a mapped same-host one
            src = self._own_extent(r.addr, n) if peer is None else peer.local(r.addr, n)
            if peer is not None and not peer.acquire():
                self._shm.forget(r.segment_name)
                raise PeerDiedError(f"{r.segment_name}: its owner is gone")
            try:
                data = ctypes.string_at(src, n)
            finally:
                if peer is not None:
                    peer.unpin()
            if peer is None or peer.alive():
                want = self._want_crc(resp, n)
                if want == NO_CRC or await self._proved(
                    key, resp, r, want, crc_of_bytes(data), deadline
                ):
                    if anyio.current_time() > deadline:
                        self.lease_fences += 1
                        raise LeaseExpiredError("the read finished after its lease expired")
                    return data
                # a corrupt replica (reported): the others, through the general path
                resp = msgspec.structs.replace(resp, replicas=[x for x in resp.replicas if x != r])
                if not self._order(resp.replicas):
                    raise none_verified(key)
            else:
                self._shm.forget(r.segment_name)
                raise PeerDiedError(
                    f"{r.segment_name}: its owner died while the read was in flight"
                )
        if n > self._staging.capacity:
            raise InvalidArgumentError(
                f"a {n}-byte value does not fit the local buffer ({self.local_buffer_size} bytes)"
            )
        off = await self._stage(n)
        try:
            assert self.local_buffer is not None
            addr = self.local_buffer.addr + off
            await self._read_one(resp, addr, n, deadline, key)
            return ctypes.string_at(addr, n)
        finally:
            self._unstage(off)

    async def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into the registered buffer ``[addr, addr+size)``; returns its length."""
        try:
            return await self._get_into(key, addr, size)
        except MooncakeError as e:
            self._note_miss(e)
            raise

    async def _get_into(self, key: str, addr: int, size: int) -> int:
        self._check_open()
        self._require_local(addr, size, "get_into")
        resp, deadline = await self._query(key)
        n = self._size_of(resp)
        if n > size:
            raise InvalidArgumentError(f"buffer of {size} bytes is smaller than the {n}-byte value")
        if not resp.replicas and resp.disk_clients:
            data = await self._read_ssd(key, resp)
            if len(data) != n:
                raise TransferError(f"the SSD copy of {key!r} has {len(data)} bytes, not {n}")
            ctypes.memmove(addr, data, n)
            return n
        await self._read_one(resp, addr, n, deadline, key)
        return n

    async def get_batch(self, keys: Sequence[str]) -> list[bytes | MooncakeError]:
        """Values of ``keys`` (an exception instance where a key failed)."""
        self._check_open()
        if not keys:
            return []
        try:
            for k in keys:
                _check_key(k)
            resps, t0 = await self._batch_query(keys)
        except MooncakeError as e:
            return [e] * len(keys)
        from_ssd = await self._batch_ssd(keys, resps)
        out: list[bytes | MooncakeError] = [b""] * len(keys)
        sizes = [self._size_of(r) if not isinstance(r, MooncakeError) else 0 for r in resps]
        total = sum(sizes)
        if total > self._staging.capacity:
            err = InvalidArgumentError(staging_refusal(total, self.local_buffer_size))
            return [err] * len(keys)
        off = await self._stage(total) if total else None
        try:
            addrs = []
            base = self.local_buffer.addr + off if (off is not None and self.local_buffer) else 0
            for n in sizes:
                addrs.append(base)
                base += n
            errs = await self._read_many(resps, addrs, sizes, t0, keys=keys)
            for i, r in enumerate(resps):
                if isinstance(r, MooncakeError):
                    out[i] = r
                elif (read_err := errs[i]) is not None:
                    out[i] = read_err
                else:
                    out[i] = ctypes.string_at(addrs[i], sizes[i])
        finally:
            if off is not None:
                self._unstage(off)
        for i, got in from_ssd.items():
            out[i] = got
        for value in out:
            if isinstance(value, MooncakeError):
                self._note_miss(value)
        return out

    async def _batch_ssd(
        self, keys: Sequence[str], resps: list[st.GetReplicaListResponse | MooncakeError]
    ) -> dict[int, bytes | MooncakeError]:
        """Serve the SSD-only answers of a batch; their slots in ``resps`` become errors so the
        memory path skips them (the caller puts the results back)."""
        out: dict[int, bytes | MooncakeError] = {}
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError) or r.replicas or not r.disk_clients:
                continue
            try:
                out[i] = await self._read_ssd(keys[i], r)
            except MooncakeError as e:
                out[i] = e
            resps[i] = ObjectNotFoundError("served from the SSD tier")
        return out

    async def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int | MooncakeError]:
        """Read each key into its registered buffer; bytes read (or an exception) per key."""
        self._check_open()
        if not (len(keys) == len(addrs) == len(sizes)):
            err = InvalidArgumentError(
                f"batch lengths differ: {len(keys)} keys, {len(addrs)} buffers, {len(sizes)} sizes"
            )
            return [err] * max(len(keys), len(addrs), len(sizes))
        if not keys:
            return []
        out: list[int | MooncakeError] = [0] * len(keys)
        try:
            for k in keys:
                _check_key(k)
            resps, t0 = await self._batch_query(keys)
        except MooncakeError as e:
            return [e] * len(keys)
        from_ssd = await self._batch_ssd(keys, resps)
        for i, got in from_ssd.items():
            if isinstance(got, MooncakeError):
                out[i] = got
                continue
            try:
                self._require_local(addrs[i], sizes[i], f"batch_get_into[{i}]")
                if len(got) > sizes[i]:
                    raise InvalidArgumentError(
                        f"buffer of {sizes[i]} bytes is smaller than the {len(got)}-byte value"
                    )
                ctypes.memmove(addrs[i], got, len(got))
                out[i] = len(got)
            except MooncakeError as e:
                out[i] = e
        lens: list[int] = []
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                if i not in from_ssd:
                    out[i] = r
                lens.append(0)
                continue
            n = self._size_of(r)
            try:
                self._require_local(addrs[i], sizes[i], f"batch_get_into[{i}]")
                if n > sizes[i]:
                    raise InvalidArgumentError(
                        f"buffer of {sizes[i]} bytes is smaller than the {n}-byte value"
                    )
            except MooncakeError as e:
                out[i] = e
                resps[i] = e
                lens.append(0)
                continue
            lens.append(n)
        errs = await self._read_many(resps, list(addrs), lens, t0, keys=keys)
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                continue
            read_err = errs[i]
            out[i] = read_err if read_err is not None else lens[i]
        return out

    async def _read_many(
        self,
        resps: Sequence[st.GetReplicaListResponse | MooncakeError],
        addrs: Sequence[int],
        sizes: Sequence[int],
        t0: float,
        parts: Sequence[Sequence[tuple[int, int, int]]] | None = None,
        keys: Sequence[str] | None = None,
    ) -> list[MooncakeError | None]:
        """Read every answered key (first replica, then failover rounds); fenced per key.

        Key ``i`` lands at ``addrs[i]`` (``sizes[i]`` bytes from the object's start), or, with
        ``parts``, as ``(address, length, object offset)`` ranges; a key fails if any of its
        ranges does. A key whose ranges cover its whole value is verified (a replica that
        fails is reported, under ``keys[i]``, and the next one read)."""
        errs: list[MooncakeError | None] = [None] * len(resps)
        orders: dict[int, list[st.ReplicaDescriptor]] = {}
        wants: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                continue
            o = self._order(r.replicas)
            if not o:
                errs[i] = ObjectNotFoundError("no complete replica")
                continue
            orders[i] = o
            if parts is None:
                landed, n = [(addrs[i], sizes[i])], sizes[i]
            else:
                landed, n = [], 0
                for off, a, pn in sorted((o, a, pn) for a, pn, o in parts[i] if pn):
                    if off != n:  # a gap or an overlap: not the value as one run
                        n = -1
                        break
                    landed.append((a, pn))
                    n += pn
            if n >= 0 and not self._on_host(landed):  # device memory: nothing to checksum
                n = -1
            want = self._want_crc(r, n)
            if want != NO_CRC:
                wants[i] = (want, landed)
        attempt = 0
        todo = list(orders)
        while todo:
            ops: list[tuple[int, _Op]] = []
            for i in todo:
                rep = orders[i][attempt]
                v = i in wants  # the copies checksum what they land (fused), where they can
                if parts is None:
                    ops.append((i, _Op(False, addrs[i], rep, sizes[i], sum=v)))
                else:
                    ops += [
                        (i, _Op(False, a, rep, n, offset=o, sum=v)) for a, n, o in parts[i] if n
                    ]
            # a round stops when the last window of its keys closes (each key is fenced below)
            round_end = max(
                (t0 + _read_ttl(r) for i in todo if not isinstance(r := resps[i], MooncakeError)),
                default=None,
            )
            await self._move([op for _, op in ops], round_end)
            failed: dict[int, MooncakeError] = {}
            for i, op in ops:
                if op.error is not None and i not in failed:
                    failed[i] = op.error
            fenced: set[int] = set()
            key_ops: dict[int, list[_Op]] = {}
            for i, op in ops:
                key_ops.setdefault(i, []).append(op)
            for i in todo:
                if i in failed or i not in wants:
                    continue
                want, landed = wants[i]
                rep = orders[i][attempt]
                got = _landed_crc(key_ops.get(i, []), landed)
                if self.verify.check(want, got, "dram", rep.segment_name):
                    continue
                r = resps[i]
                assert not isinstance(r, MooncakeError)
                if anyio.current_time() > t0 + _read_ttl(r):
                    fenced.add(i)  # proves nothing: the fence below fails it
                    continue
                key = keys[i] if keys is not None else ""
                await self._report_corrupt(key, r.vid, rep)
                failed[i] = none_verified(key)
            nxt = []
            for i in todo:
                if i in fenced or i not in failed:
                    errs[i] = None
                elif attempt + 1 < len(orders[i]):
                    nxt.append(i)
                else:
                    errs[i] = failed[i]
            todo = nxt
            attempt += 1
        now = anyio.current_time()
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError) or errs[i] is not None:
                continue
            if now > t0 + _read_ttl(r):
                self.lease_fences += 1
                errs[i] = LeaseExpiredError("the read finished after its lease expired")
        return errs

    async def batch_get_parts(
        self, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]]
    ) -> list[int | MooncakeError]:
        """Read key ``i`` scattered in order over its registered buffers ``parts[i]``; the
        object's length per key (an exception where it failed: missing, or larger than the
        buffers together)."""
        self._check_open()
        if len(keys) != len(parts):
            err = InvalidArgumentError(f"{len(keys)} keys but {len(parts)} buffer lists")
            return [err] * len(keys)
        if not keys:
            return []
        out: list[int | MooncakeError] = [0] * len(keys)
        try:
            for k in keys:
                _check_key(k)
            resps, t0 = await self._batch_query(keys)
        except MooncakeError as e:
            return [e] * len(keys)
        ranges: list[list[tuple[int, int, int]]] = [[] for _ in keys]
        for i, r in enumerate(resps):
            if isinstance(r, MooncakeError):
                out[i] = r
                continue
            try:
                cap = self._check_parts(parts[i], f"batch_get_into_multi_buffers[{i}]")
                n = self._size_of(r)
                if n > cap:
                    raise InvalidArgumentError(
                        f"buffers of {cap} bytes are smaller than the {n}-byte value"
                    )
                if n < cap:  # the published client reads every buffer in full: past the end
                    raise TransferError(
                        f"buffers of {cap} bytes are larger than the {n}-byte value"
                    )
            except MooncakeError as e:
                out[i] = resps[i] = e
                continue
            left, off = n, 0
            for a, pn in parts[i]:
                take = min(pn, left)
                if take:
                    ranges[i].append((a, take, off))
                off += take
                left -= take
            out[i] = n
        errs = await self._read_many(resps, [0] * len(keys), [0] * len(keys), t0, ranges, keys=keys)
        for i, read_err in enumerate(errs):
            if read_err is not None and not isinstance(resps[i], MooncakeError):
                out[i] = read_err
                self._note_miss(read_err)
        return out
