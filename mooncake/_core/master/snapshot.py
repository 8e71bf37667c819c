"""Snapshots of the master's state: :func:`snapshot` to bytes, :func:`restore` from them.

A restored state is indistinguishable from the one snapshotted: the same objects with the same
handles in the same order, the same allocators (every extent and free block: nothing is ever
handed out twice), the same policy order, queues, clients, tasks, ledgers, counters and rng
state, so the same commands applied to both give the same answers and the same states.

Layout: the bulk is columns, written as raw machine arrays (``array.array`` buffers, native
byte order, so a snapshot is read on the same kind of machine that wrote it), not one pickle
per object:

* the object table (:meth:`~mooncake._fast.ObjectTable.state`): every key, handle, sequence
  number and cold row, and the LRU/FIFO order when the policy lives in the table;
* each mounted segment's allocator: its extents and free blocks as address/length arrays;
* everything else (hot records, clients, tasks, deferred frees, queues, ledgers, counters, rng,
  a policy other than the table's) in one pickle whose references to mounted segments are
  indices (pickle's persistent ids), so shared records (a queued write and its object) stay
  shared.

Restoring is a few bulk copies plus the hot records: no work per cold object in Python. The
data must come from a trusted store: it is unpickled.
"""

from __future__ import annotations

import gc
import io
import pickle
from array import array
from typing import TYPE_CHECKING, Any

from mooncake._core.allocator import OffsetAllocator
from mooncake._core.master.config import MasterConfig
from mooncake._core.master.objmap import ObjectMap
from mooncake._core.master.records import _Seg
from mooncake._core.master.tablepolicy import TablePolicy, make_table_policy
from mooncake._fast import ObjectTable
from mooncake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mooncake._core.master.state import MasterState

__all__ = ["restore", "snapshot"]

MAGIC = b"MCKSNAP2"
_OLD_MAGIC = b"MCKSNAP1"
_ENCODED = frozenset({"_objects", "_segments", "_seg_list", "policy"})
"""State fields written as columns (or rebuilt); every other field goes into the pickle."""


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
    objects = state._objects
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
    policy: Any = state.policy
    if isinstance(policy, TablePolicy):
        policy = ("table", policy.name, dict(policy._pins))
    rest = {k: v for k, v in vars(state).items() if k not in _ENCODED}
    f = io.BytesIO()
    f.write(MAGIC)
    # Two pickles: the columns and segments (no references), then the records that refer to
    # the segments (restored only once those exist).
    pickle.dump(
        {
            "segs": [(s.segment, s.client_id, s.alloc.alignment, s.num) for s in state._seg_list],
            "allocs": allocs,
            "table": objects.table.state(),
            "writers": objects.writers,
            "fields": list(vars(state)),
        },
        f,
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    _Pickler(f, seg_index).dump({"hot": objects.hot, "policy": policy, "rest": rest})
    return f.getvalue()


def _col(typecode: str, data: bytes) -> array[Any]:
    a = array(typecode)
    a.frombytes(data)
    return a


def restore(cls: type[MasterState], data: bytes, config: MasterConfig | None) -> MasterState:
    """A state equal to the one :func:`snapshot` wrote; ``config`` (validated) replaces the
    saved one when given."""
    if data.startswith(_OLD_MAGIC):
        raise InvalidArgumentError(
            "a master snapshot of an older format (MCKSNAP1): restart from the persisted "
            "objects' holders instead (this version reads MCKSNAP2)"
        )
    if not data.startswith(MAGIC):
        raise InvalidArgumentError("not a master snapshot (bad magic)")
    enabled = gc.isenabled()
    gc.disable()  # many new records, no cycles among them: collecting is pure cost
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
    for (segment, client_id, alignment, num), (aaddr, alen, fstart, flen, used) in zip(
        head["segs"], head["allocs"], strict=True
    ):
        alloc = OffsetAllocator.restore(
            segment.base,
            segment.size,
            alignment,
            allocated=(_col("q", aaddr), _col("q", alen)),
            free=zip(_col("q", fstart), _col("q", flen), strict=True),
            used=used,
        )
        segs.append(_Seg(segment, client_id, alloc, num))
    body = _Unpickler(f, segs).load()
    state = cls.__new__(cls)
    vars(state).update(body["rest"])
    state.config = config if config is not None else state.config
    state.config.validate()
    state._seg_list = segs
    state._segments = {s.segment.id: s for s in segs}
    objects = ObjectMap(ObjectTable.from_state(head["table"]))
    objects.hot = body["hot"]
    objects.segs = {s.num: s for s in segs}
    objects.writers = list(head["writers"])
    objects._writer_num = {w: i for i, w in enumerate(objects.writers)}
    state._objects = objects
    policy = body["policy"]
    if isinstance(policy, tuple):
        _, name, pins = policy
        policy = make_table_policy(name, objects.table)
        policy._pins.update(pins)
    state.policy = policy
    state._put_round = max(1, state.config.eviction_round_objects // 16)
    # the fields in their original order (a state's own order is part of what it is)
    fields = vars(state)
    order = {k: fields[k] for k in head["fields"] if k in fields}
    fields.clear()
    fields.update(order)
    return state
