"""Snapshots of the master's state: :func:`snapshot` to bytes, :func:`restore` from them.

A restored state is indistinguishable from the one snapshotted: the same objects with the same
handles in the same order, the same allocators (every extent and free block: nothing is ever
handed out twice), the same policy order, queues, clients, tasks, ledgers, counters and rng
state, so the same commands applied to both give the same answers and the same states.

Layout: the bulk is columns, written as raw machine arrays (``array.array`` buffers, native
byte order, so a snapshot is read on the same kind of machine that wrote it), not one record
per object:

* the object table (:meth:`~mooncake._fast.ObjectTable.state`): every key, handle, sequence
  number and cold row, and the LRU/FIFO order when the policy lives in the table;
* each mounted segment's allocator: its extents and free blocks as address/length arrays;
* everything else (hot records, clients, tasks, deferred frees, queues, ledgers, counters, rng,
  a policy other than the table's) as one graph in :mod:`~mooncake._core.master.safecodec`
  form, whose references to mounted segments are indices, so shared records (a queued write
  and its object) stay shared.

Format ``MCKSNAP3``: the magic, a u32 schema version (:data:`SCHEMA`), the u32 CRC-32 and u64
length of the payload, then the payload: one msgpack map ``{"head": ..., "body": ...}``.
Nothing in a snapshot is ever called or imported: a hostile or corrupt one (bad magic, an
older format, a wrong checksum or length, a malformed graph, columns that do not agree) is
refused with :class:`~mooncake.errors.InvalidArgumentError`. Write access to where snapshots
are kept still means choosing the master's state (``docs/security.md``).

Restoring is a few bulk copies plus the hot records: no work per cold object in Python.
"""

from __future__ import annotations

import gc
import struct
import zlib
from array import array
from typing import Any, TypeVar, cast

import msgspec

from mooncake._core.allocator import OffsetAllocator
from mooncake._core.master import safecodec
from mooncake._core.master.config import MasterConfig
from mooncake._core.master.objmap import ObjectMap
from mooncake._core.master.records import _Seg
from mooncake._core.master.tablepolicy import TablePolicy, make_table_policy
from mooncake._core.store_types import Segment
from mooncake._fast import ObjectTable
from mooncake.errors import InvalidArgumentError

#: the state class (:class:`~mooncake._core.master.state.MasterState`, which calls this
#: module: typed generically so that the two do not import each other)
_S = TypeVar("_S")

__all__ = ["restore", "snapshot"]

MAGIC = b"MCKSNAP3"
_OLD_MAGICS = (b"MCKSNAP1", b"MCKSNAP2")
#: version of the payload's layout inside MCKSNAP3
SCHEMA = 1
_HEADER = struct.Struct("<IIQ")  # schema, crc32 of the payload, payload length
_ENCODED = frozenset({"_objects", "_segments", "_seg_list", "policy"})
"""State fields written as columns (or rebuilt); every other field goes into the graph."""


def snapshot(state: Any) -> bytes:
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
    # Two graphs: the columns and segments (no references), then the records that refer to
    # the segments (restored only once those exist).
    head = safecodec.encode_tree(
        {
            "segs": [(s.segment, s.client_id, s.alloc.alignment, s.num) for s in state._seg_list],
            "allocs": allocs,
            "table": objects.table.state(),
            "writers": objects.writers,
            "fields": list(vars(state)),
        }
    )
    body = safecodec.encode_tree(
        {"hot": objects.hot, "policy": policy, "rest": rest}, persistent=seg_index
    )
    payload = msgspec.msgpack.encode({"head": head, "body": body})
    return b"".join((MAGIC, _HEADER.pack(SCHEMA, zlib.crc32(payload), len(payload)), payload))


def _col(typecode: str, data: bytes) -> array[Any]:
    if type(data) is not bytes:
        raise ValueError("a column is not bytes")
    a = array(typecode)
    a.frombytes(data)
    return a


def restore(cls: type[_S], data: bytes, config: MasterConfig | None) -> _S:
    """A state equal to the one :func:`snapshot` wrote; ``config`` (validated) replaces the
    saved one when given."""
    for old in _OLD_MAGICS:
        if data.startswith(old):
            raise InvalidArgumentError(
                f"a master snapshot of an older format ({old.decode()}): restart from the "
                f"persisted objects' holders instead (this version reads {MAGIC.decode()})"
            )
    if not data.startswith(MAGIC):
        raise InvalidArgumentError("not a master snapshot (bad magic)")
    start = len(MAGIC) + _HEADER.size
    if len(data) < start:
        raise InvalidArgumentError("master snapshot cut short (no header)")
    schema, crc, length = _HEADER.unpack_from(data, len(MAGIC))
    if schema != SCHEMA:
        raise InvalidArgumentError(
            f"master snapshot schema {schema}: this version reads schema {SCHEMA}"
        )
    if len(data) - start != length:
        raise InvalidArgumentError(
            f"master snapshot of {len(data) - start} payload bytes, its header says {length}"
        )
    payload = memoryview(data)[start:]
    if zlib.crc32(payload) != crc:
        raise InvalidArgumentError("master snapshot checksum mismatch (corrupt data)")
    enabled = gc.isenabled()
    gc.disable()  # many new records, no cycles among them: collecting is pure cost
    try:
        return _restore(cls, payload, config)
    except InvalidArgumentError:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
    ) as e:
        raise InvalidArgumentError(f"malformed master snapshot: {type(e).__name__}: {e}") from None
    except msgspec.MsgspecError as e:
        raise InvalidArgumentError(f"malformed master snapshot: {e}") from None
    finally:
        if enabled:
            gc.enable()


def _restore(cls: type[_S], payload: memoryview, config: MasterConfig | None) -> _S:
    tree = msgspec.msgpack.decode(payload)
    if type(tree) is not dict or set(tree) != {"head", "body"}:
        raise ValueError("the payload is not a {head, body} map")
    head = safecodec.decode_tree(tree["head"])
    if type(head) is not dict:
        raise ValueError("the head is not a map")
    segs: list[_Seg] = []
    for (segment, client_id, alignment, num), (aaddr, alen, fstart, flen, used) in zip(
        head["segs"], head["allocs"], strict=True
    ):
        if not isinstance(segment, Segment):
            raise ValueError("a segment record is not a Segment")
        alloc = OffsetAllocator.restore(
            segment.base,
            segment.size,
            alignment,
            allocated=(_col("q", aaddr), _col("q", alen)),
            free=zip(_col("q", fstart), _col("q", flen), strict=True),
            used=used,
        )
        segs.append(_Seg(segment, client_id, alloc, num))
    body = safecodec.decode_tree(tree["body"], persistent=list(segs))
    if type(body) is not dict or type(body.get("rest")) is not dict:
        raise ValueError("the body is not a map of the state's fields")
    state: Any = cls.__new__(cls)
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
    return cast(_S, state)
