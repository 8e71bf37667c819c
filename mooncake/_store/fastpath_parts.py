"""The caller-thread fast path's multi-part batches: the multi-buffer family and the tensor
puts, as functions of a :class:`~mooncake._store.fastpath.FastPath` (a :class:`PartsHost`).

A put of key ``i`` is the concatenation of ``plens[i][j]`` bytes at ``ptrs[i][j]``: one
``BatchPutStart``, every part of every memcpy-able replica in one GIL-free
:func:`~mooncake._fast.memcpy_batch`, one ``BatchPutEnd`` (``BatchPutRevoke`` for what
failed); keys with a replica that is not memcpy-able are finished by the async client on the
loop. A get scatters each value over its parts, with the fences of the single-key path. The
flows are the async client's (:mod:`mooncake._store.client`), driven from the caller's thread.

:class:`PartsHost` is what the batches use of the fast path: its store, loop, this thread's
blocking master connection, the replica targets, and the (instrumented) entry points a
chunked batch calls again. The functions hold no state of their own (the fast path passes
itself in), so the two form no reference cycle.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Protocol

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake._store import batching
from mooncake._store.bounds import check_replica_list
from mooncake._store.moves import _subset
from mooncake._store.verify import NO_CRC, none_verified
from mooncake.errors import (
    LeaseExpiredError,
    MooncakeError,
    ObjectAlreadyExistsError,
    PeerDiedError,
    ProtocolError,
    TransferError,
)

if TYPE_CHECKING:
    from mooncake._store.client import Store
    from mooncake._store.shm import MappedPeer
    from mooncake._store.sync_master import SyncMaster
    from mooncake._sync import LoopThread


class PartsHost(Protocol):
    """What the functions here ask of its :class:`~mooncake._store.fastpath.FastPath`."""

    hits: int
    """Calls served on the caller's thread (counted up here too)."""

    @property
    def store(self) -> Store:
        """The async client."""

    @property
    def loop(self) -> LoopThread:
        """The loop the async client runs on."""

    def master(self) -> SyncMaster:
        """This thread's blocking master connection."""

    def target(self, r: st.ReplicaDescriptor, n: int) -> tuple[int, MappedPeer | None] | None:
        """Local address of replica ``r`` and the mapping to pin, or None if not memcpy-able."""

    def report_corrupt(self, key: str, vid: int, r: st.ReplicaDescriptor) -> None:
        """Report replica ``r`` of ``key`` corrupt (from the calling thread)."""

    def batch_put_parts(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> list[MooncakeError | None]:
        """:func:`batch_put_parts`, as the facade calls it."""

    def put_parts_local(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        plens: list[list[int]],
        sizes: list[int],
        config: Any,
    ) -> tuple[list[MooncakeError | None], list[int], list[list[st.ReplicaDescriptor]]]:
        """:func:`put_parts_local`, as the facade calls it (instrumented)."""

    def batch_get_parts(
        self, keys: list[str], ptrs: list[list[int]], plens: list[list[int]], caps: list[int]
    ) -> list[int | MooncakeError]:
        """:func:`batch_get_parts`, as the facade calls it (instrumented)."""


def _pin(p: MappedPeer | None, pinned: dict[int, MappedPeer]) -> bool:
    """Pin ``p`` once for this call (own segment: nothing to pin); False if it died."""
    if p is None or id(p) in pinned:
        return True
    if not p.acquire():
        return False
    pinned[id(p)] = p
    return True


def batch_put_parts(
    fp: PartsHost,
    keys: list[str],
    ptrs: list[list[int]],
    plens: list[list[int]],
    sizes: list[int],
    config: Any,
) -> list[MooncakeError | None]:
    """Put key ``i`` as the concatenation of the ``plens[i][j]`` bytes at ``ptrs[i][j]``
    (``sizes[i]`` bytes in all; the
    caller validated keys and host sources): one ``BatchPutStart``, every part of every
    memcpy-able replica in one GIL-free :func:`~mooncake._fast.memcpy_batch`, one
    ``BatchPutEnd`` (``BatchPutRevoke`` for what failed). Keys with a replica that is not
    memcpy-able are written and finished by the async client on the loop. An existing key
    is success, as for ``put``. Sources must be registered host memory (the async client
    writes remote replicas straight from them). A batch past one call's bounds is done
    chunk by chunk (:mod:`~mooncake._store.batching`)."""
    parts = batching.chunks(keys)
    if len(parts) > 1:
        done: list[MooncakeError | None] = []
        n = len(keys)
        for lo, hi in parts:
            done += fp.batch_put_parts(
                keys[lo:hi],
                ptrs[lo:hi],
                plens[lo:hi],
                sizes[lo:hi],
                _subset(config, range(lo, hi), n),
            )
        return done
    out, slow, slow_reps = fp.put_parts_local(keys, ptrs, plens, sizes, config)
    if slow:
        res: list[MooncakeError | None] = fp.loop.call(
            fp.store._complete_puts,
            "Put",
            [keys[i] for i in slow],
            [list(zip(ptrs[i], plens[i], strict=True)) for i in slow],
            [sizes[i] for i in slow],
            slow_reps,
        )
        for i, r in zip(slow, res, strict=True):
            out[i] = r
    return out


def put_parts_local(
    fp: PartsHost,
    keys: list[str],
    ptrs: list[list[int]],
    plens: list[list[int]],
    sizes: list[int],
    config: Any,
) -> tuple[list[MooncakeError | None], list[int], list[list[st.ReplicaDescriptor]]]:
    """The caller-thread half of :func:`batch_put_parts`, for any host sources (registered
    or not): the keys whose replicas are all memcpy-able are written and finished; the
    others come back *started* as ``(indexes, their replicas)``, and the caller must
    finish them (``Store._complete_puts`` from registered memory, or :meth:`revoke`)."""
    from mooncake._store.config import to_wire
    from mooncake.errors import error_from_code

    s = fp.store
    m = fp.master()
    out: list[MooncakeError | None] = [None] * len(keys)
    items: list[rpc.Item[list[st.ReplicaDescriptor]]] = m.call(
        "BatchPutStart",
        rpc.BatchPutStartParams(
            client_id=s.client_id, keys=keys, sizes=sizes, config=to_wire(config)
        ),
    )
    if len(items) != len(keys):
        _finish_batch(
            fp, m, "Put", [], [k for k, it in zip(keys, items, strict=False) if it.code == 0]
        )
        raise ProtocolError(f"BatchPutStart answered {len(items)} results for {len(keys)} keys")
    fast: list[int] = []
    slow: list[int] = []
    slow_reps: list[list[st.ReplicaDescriptor]] = []
    dsts: list[int] = []
    srcs: list[int] = []
    lens: list[int] = []
    summed = s.verify.enabled
    sdsts: list[int] = []  # the first replicas' parts: copied with their CRC32C
    ssrcs: list[int] = []
    slens: list[int] = []
    parts_of: dict[int, int] = {}  # key -> how many of those parts are its
    got: list[int] = []
    owners: list[tuple[int, MappedPeer | None]] = []
    pinned: dict[int, MappedPeer] = {}
    exists = int(ObjectAlreadyExistsError.code)
    try:
        for i, item in enumerate(items):
            reps = item.value
            if item.code != 0 or reps is None:
                if item.code != exists:
                    out[i] = error_from_code(item.code)
                continue
            n = sizes[i]
            targets = [fp.target(r, n) if r.length == n else None for r in reps]
            if not reps or any(t is None for t in targets):
                slow.append(i)
                slow_reps.append(reps)
                continue
            fast.append(i)
            for j, t in enumerate(targets):
                assert t is not None
                dst, peer = t
                if not _pin(peer, pinned):
                    out[i] = PeerDiedError(f"{peer.segment if peer else '?'}: its owner is gone")
                    break
                owners.append((i, peer))
                if summed and not j:  # the first replica: copied and checksummed at once
                    parts_of[i] = len(plens[i])
                    sdsts += itertools.accumulate(plens[i][:-1], initial=dst)
                    ssrcs += ptrs[i]
                    slens += plens[i]
                    continue
                dsts += itertools.accumulate(plens[i][:-1], initial=dst)
                srcs += ptrs[i]
                lens += plens[i]
        if sdsts:
            got = _fast.copy_crc32c_batch(sdsts, ssrcs, slens, [True] * len(sdsts), stream=True)
        if dsts:  # into segments: not read again soon, so non-temporal stores
            _fast.memcpy_batch(dsts, srcs, lens, stream=True)
    except BaseException:
        _unpin(pinned)
        _finish_batch(fp, m, "Put", [], [keys[i] for i in fast + slow])
        raise
    _unpin(pinned)
    for i, peer in owners:
        if peer is not None and not peer.alive() and out[i] is None:
            out[i] = PeerDiedError(f"{peer.segment}: its owner died during the write")
    ok = [i for i in fast if out[i] is None]
    bad = [i for i in fast if out[i] is not None]
    crcs = None
    if summed:  # each key's parts' CRCs, combined in order
        value_crc: dict[int, int] = {}
        pos = 0
        for i, k in parts_of.items():
            crc = got[pos]
            for q in range(pos + 1, pos + k):
                crc = _fast.crc32c_combine(crc, got[q], slens[q])
            value_crc[i] = crc
            pos += k
        crcs = [value_crc.get(i, NO_CRC) for i in ok]
    for i, err in _finish_batch(
        fp, m, "Put", [keys[i] for i in ok], [keys[i] for i in bad], crcs
    ).items():
        out[ok[i]] = err
    fp.hits += 1
    return out, slow, slow_reps


def revoke(fp: PartsHost, keys: list[str]) -> None:
    """``BatchPutRevoke`` started keys (nothing of them becomes readable)."""
    _finish_batch(fp, fp.master(), "Put", [], keys)


def _unpin(pinned: dict[int, MappedPeer]) -> None:
    for p in pinned.values():
        p.unpin()
    pinned.clear()


def _finish_batch(
    fp: PartsHost,
    m: SyncMaster,
    prefix: str,
    ends: list[str],
    revokes: list[str],
    crcs: list[int] | None = None,
) -> dict[int, MooncakeError]:
    """``Batch{prefix}End`` ``ends`` (with their values' CRC32Cs ``crcs``, when given)
    and ``Batch{prefix}Revoke`` ``revokes``; the End errors by index into ``ends`` (a
    failed revoke leaves the object unreadable anyway: the master drops unfinished puts
    at their TTL)."""
    from mooncake.errors import error_from_code

    errs: dict[int, MooncakeError] = {}
    cid = fp.store.client_id
    if revokes:
        try:
            m.call(f"Batch{prefix}Revoke", rpc.BatchKeyClientParams(client_id=cid, keys=revokes))
        except MooncakeError:
            pass
    if ends:
        try:
            codes: list[int] = m.call(
                f"Batch{prefix}End",
                rpc.BatchPutEndParams(client_id=cid, keys=ends, crcs=crcs or []),
            )
        except MooncakeError as e:
            return dict.fromkeys(range(len(ends)), e)
        for j, c in enumerate(codes):
            if c != 0:
                errs[j] = error_from_code(c)
    return errs


def batch_get_parts(
    fp: PartsHost, keys: list[str], ptrs: list[list[int]], plens: list[list[int]], caps: list[int]
) -> list[int | MooncakeError]:
    """Read key ``i`` scattered in order over the ``plens[i][j]`` bytes at ``ptrs[i][j]``
    (``caps[i]`` bytes in all; the
    caller validated keys and host buffers): one ``BatchGetReplicaList``, every part from
    the cheapest memcpy-able replica in one GIL-free
    :func:`~mooncake._fast.memcpy_batch`, then the fences of :meth:`get` per key (read
    window measured from before the request, owner alive after the copy). The value's
    length per key, or the exception: missing, buffers larger or smaller than the value
    (as the async client). Keys with no memcpy-able replica are read by the async client."""
    from mooncake.errors import InvalidArgumentError, error_from_code

    parts = batching.chunks(keys)
    if len(parts) > 1:  # past one call's bounds: chunk by chunk
        joined: list[int | MooncakeError] = []
        for lo, hi in parts:
            joined += fp.batch_get_parts(keys[lo:hi], ptrs[lo:hi], plens[lo:hi], caps[lo:hi])
        return joined
    s = fp.store
    stamp = [time.monotonic()]
    items: list[rpc.Item[st.GetReplicaListResponse]] = fp.master().call(
        "BatchGetReplicaList", rpc.KeysParams(keys=keys, for_read=True), stamp
    )
    t0 = stamp[0]
    if len(items) != len(keys):
        raise ProtocolError(
            f"BatchGetReplicaList answered {len(items)} results for {len(keys)} keys"
        )
    out: list[int | MooncakeError] = [0] * len(keys)
    slow: list[int] = []
    dsts: list[int] = []
    srcs: list[int] = []
    lens: list[int] = []
    owners: list[tuple[int, MappedPeer | None, float]] = []
    checks: list[tuple[int, int, st.ReplicaDescriptor, st.GetReplicaListResponse, int, int]]
    checks = []
    sums: list[bool] = []  # per copied part: checksum it (its key is verified)
    landed: list[int] = []
    pinned: dict[int, MappedPeer] = {}
    try:
        for i, item in enumerate(items):
            resp = item.value
            if item.code != 0 or resp is None:
                out[i] = error_from_code(item.code)
                continue
            try:
                check_replica_list(keys[i], resp)
            except MooncakeError as e:
                out[i] = e
                continue
            if not resp.replicas and resp.disk_clients:
                slow.append(i)
                continue
            n = s._size_of(resp)
            if n > caps[i]:
                out[i] = InvalidArgumentError(
                    f"buffers of {caps[i]} bytes are smaller than the {n}-byte value"
                )
                continue
            if n < caps[i]:  # the published client reads every buffer in full
                out[i] = TransferError(
                    f"buffers of {caps[i]} bytes are larger than the {n}-byte value"
                )
                continue
            target = None
            rep_of_target = None
            for r in s._order(resp.replicas):
                t = fp.target(r, n)
                if t is not None and _pin(t[1], pinned):
                    target, rep_of_target = t, r
                    break
            if target is None:
                slow.append(i)
                continue
            src, peer = target
            dsts += ptrs[i]
            srcs += itertools.accumulate(plens[i][:-1], initial=src)
            lens += plens[i]
            owners.append((i, peer, t0 + (resp.read_ttl_ms or resp.lease_ttl_ms) / 1000.0))
            want = s._want_crc(resp, n)
            if want != NO_CRC:
                assert rep_of_target is not None
                checks.append((i, want, rep_of_target, resp, len(sums), len(plens[i])))
            sums += [want != NO_CRC] * len(plens[i])
            out[i] = n
        if dsts:
            if checks:  # copied and checksummed in one pass
                landed = _fast.copy_crc32c_batch(dsts, srcs, lens, sums)
            else:
                _fast.memcpy_batch(dsts, srcs, lens)
    finally:
        _unpin(pinned)
    now = time.monotonic()
    for i, peer, deadline in owners:
        if peer is not None and not peer.alive():
            out[i] = PeerDiedError(f"{peer.segment}: its owner died while the read was in flight")
        elif now > deadline:
            s.lease_fences += 1
            out[i] = LeaseExpiredError("the read finished after its lease expired")
    for i, want, r, resp, pos, k in checks:  # what landed, against the writer's CRC
        if isinstance(out[i], MooncakeError):
            continue
        crc = landed[pos]
        for q in range(pos + 1, pos + k):
            crc = _fast.crc32c_combine(crc, landed[q], lens[q])
        if s.verify.check(want, crc, "dram", r.segment_name):
            continue
        fp.report_corrupt(keys[i], resp.vid, r)
        if len(s._order(resp.replicas)) > 1:
            slow.append(i)  # the loop path reads the others (the master dropped this one)
        else:
            out[i] = none_verified(keys[i])
    if slow:
        got: list[int | MooncakeError] = fp.loop.call(
            s.batch_get_parts,
            [keys[i] for i in slow],
            [list(zip(ptrs[i], plens[i], strict=True)) for i in slow],
        )
        for i, g in zip(slow, got, strict=True):
            out[i] = g
    for g in out:
        if isinstance(g, MooncakeError):
            s._note_miss(g)
    fp.hits += 1
    return out
