"""The put family of the store client: put, upsert, zero-copy and multi-part sources.

``PutStart`` (or ``UpsertStart``) -> write every replica -> ``PutEnd`` if every write
succeeded, else ``PutRevoke``; batches use the ``Batch*`` calls. A source is one registered
address or ``(address, length)`` parts whose concatenation is the value (multi-buffer puts,
``put_from_with_metadata``); copying puts stage through the local buffer when a replica is
remote.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._core.gpu import device_of
from mooncake._core.memory import Region
from mooncake._engine import tracing as _tracing
from mooncake._store.config import to_wire
from mooncake._store.moves import (
    Config,
    Source,
    _check_key,
    _memcpy_many,
    _Op,
    _parts_of,
    _subset,
    _value_addr,
    staging_refusal,
)
from mooncake._store.tiering import _Tiered
from mooncake._store.verify import NO_CRC, crc_of_parts
from mooncake.errors import (
    InvalidArgumentError,
    MooncakeError,
    NoAvailableHandleError,
    ObjectAlreadyExistsError,
    ReplicaNotReadyError,
    TransferError,
)

log = logging.getLogger("mooncake.store")

#: an upsert of a key another write is in flight for waits (retrying, with backoff from 1 ms
#: to 50 ms) up to this long for that write to end, so the two are ordered instead of the
#: later one failing with REPLICA_IS_NOT_READY; past it, -703 is the answer
UPSERT_WAIT_S = 5.0


def _value_crcs(
    ops: Sequence[tuple[int, _Op]],
    local: Sequence[Sequence[tuple[int, int]]],
    n: int,
    out: Sequence[MooncakeError | None],
    on_host: Callable[[Sequence[tuple[int, int]]], bool],
) -> list[int]:
    """The CRC32C of each written key's value: from its first replica's copies (summed ops,
    combined in offset order) where they all computed one, else a pass over its source parts
    ``local[i]`` (network writes) when they are host memory; :data:`NO_CRC` for the keys that
    failed and for device-memory sources (their values are stored without a CRC)."""
    per: dict[int, list[_Op]] = {}
    for i, op in ops:
        if op.sum:
            per.setdefault(i, []).append(op)
    crcs = [NO_CRC] * n
    for i in range(n):
        if out[i] is not None:
            continue
        mine = per.get(i, [])
        if mine and all(op.crc >= 0 for op in mine):
            mine.sort(key=lambda op: op.offset)
            crc = mine[0].crc
            for op in mine[1:]:
                crc = _fast.crc32c_combine(crc, op.crc, op.length)
            crcs[i] = int(crc)
        elif local[i] and on_host(local[i]):
            crcs[i] = crc_of_parts(local[i])
    return crcs


class _Writes(_Tiered):
    """The put family of the store client (part of :class:`~mooncake._store.client.Store`)."""

    def _on_host(self, parts: Sequence[tuple[int, int]]) -> bool:
        """Whether every ``(address, length)`` part is host memory the CPU can checksum (not
        inside a region registered as device memory): verified reads skip the rest."""
        find = self.engine.registry.find
        for a, n in parts:
            region = find(a, n) if n else None
            if region is not None and device_of(region.location) is not None:
                return False
        return True

    @_tracing.traced("mooncake.store.put", lambda self, key, *a, **k: {"mooncake.key": key})
    async def put(self, key: str, value: Any, config: Config = None) -> None:
        """Store ``value`` (any C-contiguous buffer) under ``key``; a no-op if ``key`` exists."""
        (err,) = await self._put_values([key], [value], config, upsert=False, batch=False)
        if err is not None:
            raise err

    async def upsert(self, key: str, value: Any, config: Config = None) -> None:
        """Insert or replace ``key`` with ``value``."""
        (err,) = await self._put_values([key], [value], config, upsert=True, batch=False)
        if err is not None:
            raise err

    async def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: Config = None
    ) -> list[MooncakeError | None]:
        """Store each ``values[i]`` under ``keys[i]``; one result (None = ok) per key."""
        return await self._put_values(keys, values, config, upsert=False, batch=True)

    async def upsert_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: Config = None
    ) -> list[MooncakeError | None]:
        return await self._put_values(keys, values, config, upsert=True, batch=True)

    async def put_from(self, key: str, addr: int, size: int, config: Config = None) -> None:
        """Store ``size`` bytes at registered address ``addr`` under ``key`` (zero-copy)."""
        self._require_local(addr, size, "put_from")
        (err,) = await self._put_addrs([key], [addr], [size], config, upsert=False, batch=False)
        if err is not None:
            raise err

    async def upsert_from(self, key: str, addr: int, size: int, config: Config = None) -> None:
        self._require_local(addr, size, "upsert_from")
        (err,) = await self._put_addrs([key], [addr], [size], config, upsert=True, batch=False)
        if err is not None:
            raise err

    async def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], config: Config = None
    ) -> list[MooncakeError | None]:
        """Zero-copy batch put; one result (None = ok) per key."""
        return await self._batch_from(keys, addrs, sizes, config, upsert=False)

    async def batch_upsert_from(
        self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], config: Config = None
    ) -> list[MooncakeError | None]:
        return await self._batch_from(keys, addrs, sizes, config, upsert=True)

    async def _batch_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
    ) -> list[MooncakeError | None]:
        if not (len(keys) == len(addrs) == len(sizes)):
            err = InvalidArgumentError(
                f"batch lengths differ: {len(keys)} keys, {len(addrs)} buffers, {len(sizes)} sizes"
            )
            return [err] * max(len(keys), len(addrs), len(sizes))
        out: list[MooncakeError | None] = [None] * len(keys)
        good: list[int] = []
        for i, (a, n) in enumerate(zip(addrs, sizes, strict=True)):
            try:
                self._require_local(a, n, f"batch_put_from[{i}]")
                good.append(i)
            except MooncakeError as e:
                out[i] = e
        if good:
            res = await self._put_addrs(
                [keys[i] for i in good],
                [addrs[i] for i in good],
                [sizes[i] for i in good],
                _subset(config, good, len(keys)),
                upsert=upsert,
                batch=True,
            )
            for i, r in zip(good, res, strict=True):
                out[i] = r
        return out

    async def _put_values(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
    ) -> list[MooncakeError | None]:
        self._check_open()
        if len(keys) != len(values):
            err = InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
            return [err] * max(len(keys), len(values))
        if not keys:
            return []
        spans = [_value_addr(v) for v in values]
        total = sum(n for _, n, _ in spans)
        if any(n == 0 for _, n, _ in spans):
            # b"" could not be told apart from "missing" by get(), so Mooncake refuses it
            return [
                InvalidArgumentError(
                    "empty values cannot be stored (get answers b'' for a missing key)"
                )
            ] * len(keys)
        # The published client stages every copying put through its local buffer: a value (or a
        # batch) larger than the buffer is refused up front, before anything is allocated.
        if total > self._staging.capacity:
            return [InvalidArgumentError(staging_refusal(total, self.local_buffer_size))] * len(
                keys
            )
        addrs = [a for a, _, _ in spans]
        sizes = [n for _, n, _ in spans]
        try:
            return await self._put_addrs(
                keys, addrs, sizes, config, upsert=upsert, batch=batch, copy=True
            )
        finally:
            del spans  # the exports stay alive until every write has finished

    async def _put_addrs(
        self,
        keys: Sequence[str],
        addrs: Sequence[Source],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
        copy: bool = False,
    ) -> list[MooncakeError | None]:
        """:meth:`_put_addrs_once`; with an SSD tier, keys refused for lack of space are retried
        after doing the demotions the master has queued for this client (the space they hold
        comes back only when the copies are confirmed), while that makes progress."""
        errs = await self._put_addrs_once(
            keys, addrs, sizes, config, upsert=upsert, batch=batch, copy=copy
        )
        # another write of a key in flight: wait for it (it may fail, so "exists" is not ours)
        await self._wait_writes(
            errs, keys, addrs, sizes, config, upsert=upsert, batch=batch, copy=copy
        )
        if self.ssd is None:
            return errs
        while True:  # while rounds make progress (each places at least one key)
            again = [i for i, e in enumerate(errs) if isinstance(e, NoAvailableHandleError)]
            if not again:
                break
            try:
                await self._tier_round()
            except (MooncakeError, OSError) as e:
                log.warning("SSD tier round failed: %s", e)
                break
            retried = await self._put_addrs_once(
                [keys[i] for i in again],
                [addrs[i] for i in again],
                [sizes[i] for i in again],
                _subset(config, again, len(keys)),
                upsert=upsert,
                batch=batch,
                copy=copy,
            )
            for i, result in zip(again, retried, strict=True):
                errs[i] = result
            if all(isinstance(r, NoAvailableHandleError) for r in retried):
                break
        return errs

    async def _wait_writes(
        self,
        errs: list[MooncakeError | None],
        keys: Sequence[str],
        addrs: Sequence[Source],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
        copy: bool,
    ) -> None:
        """Retry (in place in ``errs``) the puts or upserts refused because another write of
        their key was in flight (``REPLICA_IS_NOT_READY``), until it ended or
        :data:`UPSERT_WAIT_S` passed: a put then finds the key readable (success: the other
        put's bytes are stored) or starts its own write (the other was revoked or its writer
        is gone); past the wait the error stays."""
        end = anyio.current_time() + UPSERT_WAIT_S
        pause = 0.001
        while True:
            again = [i for i, e in enumerate(errs) if isinstance(e, ReplicaNotReadyError)]
            if not again or anyio.current_time() + pause > end:
                return
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.05)
            retried = await self._put_addrs_once(
                [keys[i] for i in again],
                [addrs[i] for i in again],
                [sizes[i] for i in again],
                _subset(config, again, len(keys)),
                upsert=upsert,
                batch=batch,
                copy=copy,
            )
            for i, result in zip(again, retried, strict=True):
                errs[i] = result

    async def _put_addrs_once(
        self,
        keys: Sequence[str],
        addrs: Sequence[Source],
        sizes: Sequence[int],
        config: Config,
        *,
        upsert: bool,
        batch: bool,
        copy: bool = False,
    ) -> list[MooncakeError | None]:
        """PutStart -> writes -> PutEnd/PutRevoke for each key (sources already validated)."""
        self._check_open()
        wire = to_wire(config)
        out: list[MooncakeError | None] = [None] * len(keys)
        try:
            for k in keys:
                _check_key(k)
        except MooncakeError as e:
            return [e] * len(keys)
        prefix = "Upsert" if upsert else "Put"
        # -- start
        replicas: list[list[st.ReplicaDescriptor] | None] = [None] * len(keys)
        if not batch:
            try:
                replicas[0] = await self.master.call(
                    f"{prefix}Start",
                    rpc.PutStartParams(
                        client_id=self.client_id, key=keys[0], size=sizes[0], config=wire
                    ),
                )
            except ObjectAlreadyExistsError:
                return [None]  # Mooncake's put of an existing key succeeds and changes nothing
            except MooncakeError as e:
                return [e]
        else:
            try:
                items: list[rpc.Item[list[st.ReplicaDescriptor]]] = await self.master.call(
                    f"Batch{prefix}Start",
                    rpc.BatchPutStartParams(
                        client_id=self.client_id, keys=list(keys), sizes=list(sizes), config=wire
                    ),
                )
            except MooncakeError as e:
                return [e] * len(keys)
            for i, item in enumerate(items):
                if item.code == 0 and item.value is not None:
                    replicas[i] = item.value
                elif item.code != int(ObjectAlreadyExistsError.code):
                    from mooncake.errors import error_from_code

                    out[i] = error_from_code(item.code)
        started = [i for i in range(len(keys)) if replicas[i] is not None]
        if not started:
            return out
        # -- write
        staged: list[int] = []
        crcs = [NO_CRC] * len(keys)
        try:
            with anyio.CancelScope(shield=False):
                ops: list[tuple[int, _Op]] = []
                need_stage: list[int] = []
                for i in started:
                    reps = replicas[i]
                    assert reps is not None
                    if not reps:
                        out[i] = TransferError(f"master allocated no replica for {keys[i]!r}")
                    if copy:
                        await self._resolve(r.segment_name for r in reps)
                    for r in reps:
                        if copy and not self._is_copyable(r.segment_name):
                            need_stage.append(i)
                            break
                local = [_parts_of(a, n) for a, n in zip(addrs, sizes, strict=True)]
                if need_stage:
                    # one staging range for the batch: remote replicas need registered sources
                    tot = sum(sizes[i] for i in need_stage)
                    off = await self._stage(tot)
                    staged.append(off)
                    assert self.local_buffer is not None
                    base = self.local_buffer.addr + off
                    copies = []
                    for i in need_stage:
                        start = base
                        for pa, pn in local[i]:
                            copies.append((base, pa, pn))
                            base += pn
                        local[i] = [(start, sizes[i])]
                    await _memcpy_many(copies)
                summed = self.verify.enabled  # the first replica's copies checksum (fused)
                for i in started:
                    if out[i] is not None:
                        continue
                    reps = replicas[i]
                    assert reps is not None
                    for j, r in enumerate(reps):
                        if r.length != sizes[i]:
                            out[i] = TransferError(
                                f"master allocated {r.length} bytes for {sizes[i]}-byte {keys[i]!r}"
                            )
                            break
                        roff = 0
                        for pa, pn in local[i]:
                            ops.append((i, _Op(True, pa, r, pn, offset=roff, sum=summed and not j)))
                            roff += pn
                await self._move([op for _, op in ops])
                for i, op in ops:
                    if op.error is not None and out[i] is None:
                        out[i] = op.error
                if summed:
                    crcs = _value_crcs(ops, local, len(keys), out, self._on_host)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish(prefix, keys, started, [True] * len(keys), batch)
            raise
        finally:
            for off in staged:
                self._unstage(off)
        # -- end / revoke
        failed = [out[i] is not None for i in range(len(keys))]
        end_errs = await self._finish(prefix, keys, started, failed, batch, crcs)
        for i, end_err in end_errs.items():
            if out[i] is None:
                out[i] = end_err
        return out

    async def _complete_put(
        self, prefix: str, key: str, addr: int, size: int, reps: list[st.ReplicaDescriptor]
    ) -> MooncakeError | None:
        """Write ``reps`` (already PutStart-ed elsewhere) from ``addr``, then End or Revoke."""
        err: MooncakeError | None = None
        staged: int | None = None
        crc = NO_CRC
        try:
            await self._resolve(r.segment_name for r in reps)
            src = addr
            remote = any(not self._is_copyable(r.segment_name) for r in reps)
            if remote and self.engine.registry.find(addr, size) is None:
                staged = await self._stage(size)
                assert self.local_buffer is not None
                src = self.local_buffer.addr + staged
                await _memcpy_many([(src, addr, size)])
            if not reps:
                err = TransferError(f"master allocated no replica for {key!r}")
            elif any(r.length != size for r in reps):
                err = TransferError(f"master allocated a replica of the wrong size for {key!r}")
            else:
                v = self.verify.enabled
                ops = [_Op(True, src, r, size, sum=v and not j) for j, r in enumerate(reps)]
                await self._move(ops)
                err = next((op.error for op in ops if op.error is not None), None)
                if v and err is None:
                    if ops[0].crc >= 0:
                        crc = ops[0].crc
                    elif self._on_host([(src, size)]):
                        crc = crc_of_parts([(src, size)])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish(prefix, [key], [0], [True], False)
            raise
        finally:
            if staged is not None:
                self._unstage(staged)
        errs = await self._finish(prefix, [key], [0], [err is not None], False, [crc])
        return err or errs.get(0)

    async def _complete_puts(
        self,
        prefix: str,
        keys: Sequence[str],
        sources: Sequence[Source],
        sizes: Sequence[int],
        reps: Sequence[list[st.ReplicaDescriptor]],
    ) -> list[MooncakeError | None]:
        """Write already ``Batch{prefix}Start``-ed keys from registered ``sources`` (one
        address or ``(address, length)`` parts each), then End the ones written and Revoke
        the rest; one result per key. The caller-thread path hands over keys it cannot copy."""
        out: list[MooncakeError | None] = [None] * len(keys)
        ops: list[tuple[int, _Op]] = []
        crcs = [NO_CRC] * len(keys)
        summed = self.verify.enabled  # the first replica's copies checksum (fused)
        locals_: list[list[tuple[int, int]]] = [[] for _ in keys]
        try:
            await self._resolve(r.segment_name for rs in reps for r in rs)
            for i, rs in enumerate(reps):
                if not rs:
                    out[i] = TransferError(f"master allocated no replica for {keys[i]!r}")
                    continue
                if any(r.length != sizes[i] for r in rs):
                    out[i] = TransferError(
                        f"master allocated a replica of the wrong size for {keys[i]!r}"
                    )
                    continue
                local = _parts_of(sources[i], sizes[i])
                locals_[i] = local
                for j, r in enumerate(rs):
                    roff = 0
                    for pa, pn in local:
                        ops.append((i, _Op(True, pa, r, pn, offset=roff, sum=summed and not j)))
                        roff += pn
            await self._move([op for _, op in ops])
            for i, op in ops:
                if op.error is not None and out[i] is None:
                    out[i] = op.error
            if summed:
                crcs = _value_crcs(ops, locals_, len(keys), out, self._on_host)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._finish(prefix, keys, list(range(len(keys))), [True] * len(keys), True)
            raise
        failed = [e is not None for e in out]
        end_errs = await self._finish(prefix, keys, list(range(len(keys))), failed, True, crcs)
        for i, end_err in end_errs.items():
            if out[i] is None:
                out[i] = end_err
        return out

    async def _finish(
        self,
        prefix: str,
        keys: Sequence[str],
        started: list[int],
        failed: list[bool],
        batch: bool,
        crcs: Sequence[int] | None = None,
    ) -> dict[int, MooncakeError]:
        """PutEnd the started keys that succeeded (with ``crcs[i]``, the CRC32C of key ``i``'s
        value, when given), PutRevoke the rest; errors per index."""
        errs: dict[int, MooncakeError] = {}
        ends = [i for i in started if not failed[i]]
        revokes = [i for i in started if failed[i]]
        cid = self.client_id
        for method, idx in ((f"{prefix}End", ends), (f"{prefix}Revoke", revokes)):
            if not idx:
                continue
            end = idx is ends
            if not batch:
                k = keys[idx[0]]
                crc = crcs[idx[0]] if crcs is not None else NO_CRC
                try:
                    await self.master.call(
                        method,
                        rpc.PutEndParams(client_id=cid, key=k, crc=crc)
                        if end
                        else rpc.KeyClientParams(client_id=cid, key=k),
                    )
                except MooncakeError as e:
                    errs[idx[0]] = e
                continue
            names = [keys[i] for i in idx]
            try:
                codes: list[int] = await self.master.call(
                    f"Batch{method}",
                    rpc.BatchPutEndParams(
                        client_id=cid,
                        keys=names,
                        crcs=[crcs[i] for i in idx] if crcs is not None else [],
                    )
                    if end
                    else rpc.BatchKeyClientParams(client_id=cid, keys=names),
                )
            except MooncakeError as e:
                for i in idx:
                    errs[i] = e
                continue
            from mooncake.errors import error_from_code

            for i, c in zip(idx, codes, strict=False):
                if c != 0:
                    errs[i] = error_from_code(c)
        return errs

    def _check_parts(
        self, parts: Sequence[tuple[int, int]], what: str, regions: list[Region] | None = None
    ) -> int:
        """Validate registered ``(address, length)`` parts; their total length (and, with
        ``regions``, the registered regions they lie in appended to it). (Parts are usually
        slices of one registered region: a hit on the last region found skips the registry
        lookup.)"""
        total = 0
        last: Region | None = None
        for j, (a, n) in enumerate(parts):
            if (
                last is not None
                and type(a) is int
                and type(n) is int
                and a > 0
                and n > 0
                and last.covers(a, n)
            ):
                total += n
                continue
            last = self._require_local(a, n, f"{what}[{j}]")
            if regions is not None:
                regions.append(last)
            total += n
        if not parts:
            raise InvalidArgumentError(f"{what}: no buffers")
        return total

    async def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[tuple[int, int]]],
        config: Config = None,
        *,
        upsert: bool = False,
    ) -> list[MooncakeError | None]:
        """Zero-copy batch put where key ``i``'s value is the concatenation of its registered
        ``(address, length)`` buffers ``parts[i]``; one result (None = ok) per key."""
        self._check_open()
        if len(keys) != len(parts):
            err = InvalidArgumentError(f"{len(keys)} keys but {len(parts)} buffer lists")
            return [err] * len(keys)
        out: list[MooncakeError | None] = [None] * len(keys)
        good: list[int] = []
        sizes: dict[int, int] = {}
        for i, p in enumerate(parts):
            try:
                sizes[i] = self._check_parts(p, f"batch_put_from_multi_buffers[{i}]")
                good.append(i)
            except MooncakeError as e:
                out[i] = e
        if good:
            res = await self._put_addrs(
                [keys[i] for i in good],
                [list(parts[i]) for i in good],
                [sizes[i] for i in good],
                _subset(config, good, len(keys)),
                upsert=upsert,
                batch=True,
            )
            for i, r in zip(good, res, strict=True):
                out[i] = r
        return out
