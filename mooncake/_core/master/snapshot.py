"""Snapshots of the master's state: :func:`snapshot` to bytes, :func:`restore` from them.

A restored state is indistinguishable from the one snapshotted: the same objects in the same
order, the same allocators (every extent and free block: nothing is ever handed out twice),
the same policy order, queues, clients, tasks, ledgers, counters and rng state, so the same
commands applied to both give the same answers and the same states.

Layout: the bulk is columns, written as raw machine arrays (``array.array`` buffers, native
byte order, so a snapshot is read on the same kind of machine that wrote it), not one pickle
per object:

* every object in table order: its key (one UTF-8 blob plus lengths) and a *simple* row (size,
  version id, lease, read window, soft pin, hard pin, writer, group, replicas as segment index,
  address, length) -- the common case: one readable version, no pending write, no tier move, no
  task, no SSD copy. Any other object is a *full* record, pickled with the rest;
* each mounted segment's allocator: its extents and free blocks as address/length arrays;
* an LRU/FIFO policy's order as row indices (other policies are pickled whole);
* everything else (clients, tasks, deferred frees, queues, ledgers, counters, rng) in one
  pickle whose references to mounted segments are indices (pickle's persistent ids), so shared
  records (a queued write and its object) stay shared.

Each mounted segment's key set is written in its own order as row indices (4 bytes a key).
The data must come from a trusted store: it is
unpickled.
"""

from __future__ import annotations

import gc
import io
import itertools
import math
import pickle
from array import array
from typing import TYPE_CHECKING, Any

from mooncake._core.allocator import OffsetAllocator
from mooncake._core.master.config import MasterConfig
from mooncake._core.master.records import KeySet, _Object, _Replica, _Seg, _Version
from mooncake._core.policies import FIFOPolicy, LRUPolicy, Pin
from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._core.master.state import MasterState

__all__ = ["restore", "snapshot"]

MAGIC = b"MCKSNAP1"
_ENCODED = frozenset({"_objects", "_segments", "_seg_list", "policy"})
"""State fields written as columns (or rebuilt); every other field goes into the pickle."""
_HARD = 1
_SOFT = 2


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, segs: dict[int, int]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self._segs = segs

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _Seg:
            return self._segs.get(id(obj))  # a mounted segment: by index (None: pickled whole)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, segs: list[_Seg]) -> None:
        super().__init__(f)
        self._segs = segs

    def persistent_load(self, pid: Any) -> Any:
        return self._segs[pid]


def snapshot(state: MasterState) -> bytes:
    """The whole of ``state`` as bytes (see the module docstring for the layout)."""
    seg_index = {id(s): i for i, s in enumerate(state._seg_list)}
    keys = list(state._objects)
    objs = list(state._objects.values())
    kind = bytes(
        [
            0
            if (
                (v := o.readable) is not None
                and o.pending is None
                and o.demoting is None
                and o.promoting is None
                and o.task is None
                and not v.disk
                and len(v.replicas) < 256
            )
            else 1
            for o in objs
        ]
    )
    full = [o for o, k in zip(objs, kind, strict=True) if k]
    simple = [o for o, k in zip(objs, kind, strict=True) if not k] if full else objs
    vers: list[_Version] = [o.readable for o in simple]  # type: ignore[misc]
    nan = math.nan
    size = array("q", [v.size for v in vers])
    vid = array("q", [v.vid for v in vers])
    lease = array("d", [o.lease_deadline for o in simple])
    read = array("d", [o.read_deadline for o in simple])
    soft = array("d", [nan if (t := o.soft_pin_deadline) is None else t for o in simple])
    flags = bytes([_HARD if o.hard_pinned else 0 for o in simple])
    strings: dict[str, int] = {"": 0}  # writer ids and group ids, interned
    for o in simple:
        strings.setdefault(o.writer, len(strings))
        strings.setdefault(o.group, len(strings))
    writer = array("I", [strings[o.writer] for o in simple])
    group = array("I", [strings[o.group] for o in simple])
    nrep = bytes([len(v.replicas) for v in vers])
    reps = [r for v in vers for r in v.replicas]
    rseg = array("I", [seg_index[id(r.seg)] for r in reps])
    raddr = array("q", [r.addr for r in reps])
    rlen = array("q", [r.length for r in reps])
    blob = "".join(keys).encode("utf-8", "surrogatepass")
    key_len = array("Q", map(len, keys))
    allocs = []
    for seg in state._seg_list:
        a = seg.alloc
        addrs, lengths = a.extents()
        allocs.append(
            (
                addrs.tobytes(),
                lengths.tobytes(),
                array("q", a._starts).tobytes(),
                array("q", (a._free[s] for s in a._starts)).tobytes(),
                a._used,
            )
        )
    row = {k: i for i, k in enumerate(keys)}
    # each segment's key set in its own (insertion) order, as row indices
    seg_keys = [array("I", [row[k] for k in s.keys]).tobytes() for s in state._seg_list]
    policy: Any = state.policy
    order: bytes | None = None
    if type(policy) in (LRUPolicy, FIFOPolicy):
        order = array("I", [row[k] for k in policy._order]).tobytes()
        policy = (
            type(policy).__name__,
            array("q", policy._order.values()).tobytes(),
            {row[k]: int(p) for k, p in policy._pins.items()},
            policy._bytes,
        )
    rest = {k: v for k, v in vars(state).items() if k not in _ENCODED}
    f = io.BytesIO()
    f.write(MAGIC)
    # Two pickles: the columns and segments (no references), then the records that refer to
    # the segments (restored only once those exist).
    pickle.dump(
        {
            "segs": [(s.segment, s.client_id, s.alloc.alignment) for s in state._seg_list],
            "allocs": allocs,
            "strings": list(strings),
            "keys": blob,
            "key_len": key_len.tobytes(),
            "kind": kind,
            "cols": {
                "size": size.tobytes(),
                "vid": vid.tobytes(),
                "lease": lease.tobytes(),
                "read": read.tobytes(),
                "soft": soft.tobytes(),
                "flags": flags,
                "writer": writer.tobytes(),
                "group": group.tobytes(),
                "nrep": nrep,
                "rseg": rseg.tobytes(),
                "raddr": raddr.tobytes(),
                "rlen": rlen.tobytes(),
            },
            "order": order,
            "seg_keys": seg_keys,
            "fields": list(vars(state)),
        },
        f,
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    _Pickler(f, seg_index).dump({"full": full, "policy": policy, "rest": rest})
    return f.getvalue()


def _col(typecode: str, data: bytes) -> array[Any]:
    a = array(typecode)
    a.frombytes(data)
    return a


def restore(cls: type[MasterState], data: bytes, config: MasterConfig | None) -> MasterState:
    """A state equal to the one :func:`snapshot` wrote; ``config`` (validated) replaces the
    saved one when given."""
    if not data.startswith(MAGIC):
        raise InvalidArgumentError("not a master snapshot (bad magic)")
    enabled = gc.isenabled()
    gc.disable()  # millions of new records, no cycles among them: collecting is pure cost
    try:
        return _restore(cls, data, config)
    finally:
        if enabled:
            gc.enable()


def _restore(cls: type[MasterState], data: bytes, config: MasterConfig | None) -> MasterState:
    f = io.BytesIO(data)
    f.seek(len(MAGIC))
    head = pickle.load(f)
    segs: list[_Seg] = []
    for (segment, client_id, alignment), (aaddr, alen, fstart, flen, used) in zip(
        head["segs"], head["allocs"], strict=True
    ):
        alloc = OffsetAllocator.restore(
            segment.base,
            segment.size,
            alignment,
            allocated=zip(_col("q", aaddr), _col("q", alen), strict=True),
            free=zip(_col("q", fstart), _col("q", flen), strict=True),
            used=used,
        )
        segs.append(_Seg(segment, client_id, alloc))
    body = _Unpickler(f, segs).load()
    state = cls.__new__(cls)
    vars(state).update(body["rest"])
    state.config = config if config is not None else state.config
    state.config.validate()
    state._seg_list = segs
    state._segments = {s.segment.id: s for s in segs}
    strings = head["strings"]
    text = head["keys"].decode("utf-8", "surrogatepass")
    ends = list(itertools.accumulate(_col("Q", head["key_len"])))
    keys = [text[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    c = head["cols"]
    size, vid = _col("q", c["size"]), _col("q", c["vid"])
    lease, read, soft = _col("d", c["lease"]), _col("d", c["read"]), _col("d", c["soft"])
    flags, nrep = c["flags"], c["nrep"]
    writer, group = _col("I", c["writer"]), _col("I", c["group"])
    rseg, raddr, rlen = _col("I", c["rseg"]), _col("q", c["raddr"]), _col("q", c["rlen"])
    # Build the simple objects column by column (comprehensions, not one call per field).
    kinds = head["kind"]
    simple_keys = [k for k, t in zip(keys, kinds, strict=True) if not t] if body["full"] else keys
    rep_list = [_Replica(segs[s], a, n) for s, a, n in zip(rseg, raddr, rlen, strict=True)]
    ends = list(itertools.accumulate(nrep))
    groups = [rep_list[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    simple = [
        _Object(
            key,
            _Version(sz, rp, vd),
            None,
            strings[w],
            ls,
            rd,
            bool(fl & _HARD),
            None if sp != sp else sp,  # NaN: no soft pin
            None,
            None,
            None,
            strings[g],
        )
        for key, sz, rp, vd, w, ls, rd, fl, sp, g in zip(
            simple_keys, size, groups, vid, writer, lease, read, flags, soft, group, strict=True
        )
    ]
    if body["full"]:
        full, it = iter(body["full"]), iter(simple)
        objs = [next(full) if t else next(it) for t in kinds]
    else:
        objs = simple
    objects = dict(zip(keys, objs, strict=True))
    for sg, order_of_keys in zip(segs, head["seg_keys"], strict=True):
        sg.keys = KeySet((keys[i], None) for i in _col("I", order_of_keys))
    state._objects = objects
    policy = body["policy"]
    if isinstance(policy, tuple):
        name, sizes, pins, total = policy
        p = LRUPolicy() if name == "LRUPolicy" else FIFOPolicy()
        p._order.update(
            zip((keys[i] for i in _col("I", head["order"])), _col("q", sizes), strict=True)
        )
        p._pins.update((keys[i], Pin(v)) for i, v in pins.items())
        p._bytes = total
        policy = p
    state.policy = policy
    state._put_round = max(1, state.config.eviction_round_objects // 16)
    # the fields in their original order (a state's own order is part of what it is)
    fields = vars(state)
    order = {k: fields[k] for k in head["fields"] if k in fields}
    fields.clear()
    fields.update(order)
    return state
