"""The master's objects: a compact table of cold rows, and Python records for the rest.

Most objects of a KV-cache pool sit in one shape for most of their life: one readable version
with one memory replica, nothing in flight, no pin, no group, no SSD copy. :class:`ObjectMap`
keeps such an object *cold*: a row of numbers in an :class:`~mooncake._fast.ObjectTable` (its
key in the table's arena, no Python object at all). Any other object is *hot*: an ``_Object``
record, as the state machine's rules manipulate it.

The map looks like a ``dict[str, _Object]`` to the rules: :meth:`get` and ``[key]`` hand out
the record of a key, *inflating* a cold row into a hot record first (the record then stays
hot, with a stable identity, until it is settled); ``[key] = obj`` adds a key, ``del`` removes
one. :meth:`settle` folds the hot records touched since its last call back into cold rows when
they are in the common shape; the state calls it between commands (never while a rule holds a
record), so hot or cold is a matter of representation only: the order of objects is the order
their keys were added (the table's ``seq``), whatever their representation.

Every object has an integer handle (``_Object.h``), stable for its life; the eviction policy
tracks handles, not keys.

Tenants (:mod:`mooncake._core.master.tenants`): the map notes, for each object of a named
tenant that a command touches (hands out, adds or removes), what it was charged before;
:meth:`tenant_deltas` turns those notes into the command's per-tenant changes when it settles.
Default-tenant keys are never noted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mooncake._core.master.records import _Object, _Replica, _Seg, _Version
from mooncake._core.master.tenants import PREFIX, tenant_of
from mooncake._fast import ObjectTable


def charge(obj: _Object) -> int:
    """The bytes a tenant's quota counts for ``obj``: its readable version's size plus the
    size of the version being written, if any."""
    n = obj.readable.size if obj.readable is not None else 0
    if obj.pending is not None:
        n += obj.pending.version.size
    return n


class ObjectMap:
    """Keys to objects, cold rows or hot records (see the module docstring)."""

    __slots__ = ("_dirty", "_gone", "_touched", "_writer_num", "hot", "segs", "table", "writers")

    def __init__(self, table: ObjectTable | None = None) -> None:
        self.table = table if table is not None else ObjectTable()
        self.hot: dict[int, _Object] = {}
        """Hot records by handle."""
        self.segs: dict[int, _Seg] = {}
        """Mounted segments by number (``_Seg.num``): what a cold row's segment means."""
        self.writers: list[str] = []
        """Writer client ids by number (a cold row's ``writer``); grows by distinct writers."""
        self._writer_num: dict[str, int] = {}
        self._dirty: list[int] = []
        # tenant objects touched by the command in progress: handle -> (tenant, charge
        # before, existed before); and those it removed: (tenant, charge before)
        self._touched: dict[int, tuple[str, int, bool]] = {}
        self._gone: list[tuple[str, int]] = []

    # -- the dict the rules see ------------------------------------------------------------

    def get(self, key: str, default: None = None) -> _Object | None:
        """The record of ``key`` (inflated if cold), or ``None``."""
        h = self.table.find(key)
        if h < 0:
            return None
        obj = self.hot.get(h)
        if obj is None:
            obj = self._inflate(h, key)
        else:
            self._dirty.append(h)  # the caller may change it into the common shape
        if key[:1] == PREFIX and h not in self._touched:
            self._touched[h] = (tenant_of(key), charge(obj), True)
        return obj

    def __getitem__(self, key: str) -> _Object:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return obj

    def __setitem__(self, key: str, obj: _Object) -> None:
        """Add ``key`` with the new record ``obj`` (``ValueError`` if ``key`` is present)."""
        h = self.table.add(key)
        obj.h = h
        self.hot[h] = obj
        self._dirty.append(h)
        if key[:1] == PREFIX:
            self._touched[h] = (tenant_of(key), 0, False)

    def __delitem__(self, key: str) -> None:
        h = self.table.find(key)
        if h < 0:
            raise KeyError(key)
        if key[:1] == PREFIX:
            self._note_gone(h, key)
        self.hot.pop(h, None)
        self.table.remove(h)

    def remove_handle(self, h: int) -> None:
        """``del`` by handle (``KeyError`` if ``h`` is not live)."""
        key = self.table.key(h)
        if key[:1] == PREFIX:
            self._note_gone(h, key)
        self.hot.pop(h, None)
        self.table.remove(h)

    def _note_gone(self, h: int, key: str) -> None:
        note = self._touched.pop(h, None)
        if note is None:
            obj = self.hot.get(h)
            before = charge(obj) if obj is not None else self.table.cold_row(h)[2]
            self._gone.append((tenant_of(key), before))
        elif note[2]:
            self._gone.append((note[0], note[1]))

    def tenant_deltas(self) -> list[tuple[str, int, int]]:
        """The per-tenant ``(tenant, bytes, objects)`` changes of what was touched since the
        last call (call it between commands, before :meth:`settle`); forgets the notes."""
        if not self._touched and not self._gone:
            return []
        out = [(t, -before, -1) for t, before in self._gone]
        hot = self.hot
        for h, (t, before, existed) in self._touched.items():
            obj = hot.get(h)
            after = charge(obj) if obj is not None else self.table.cold_row(h)[2]
            out.append((t, after - before, 0 if existed else 1))
        self._touched = {}
        self._gone = []
        return out

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """Every named tenant's (bytes, objects), recomputed from the objects (tests)."""
        out: dict[str, tuple[int, int]] = {}
        for obj in self.values():
            if obj.key[:1] == PREFIX:
                t = tenant_of(obj.key)
                b, n = out.get(t, (0, 0))
                out[t] = (b + charge(obj), n + 1)
        return out

    def __contains__(self, key: object) -> bool:
        return type(key) is str and self.table.find(key) >= 0

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self) -> Iterator[str]:
        """Keys in the order they were added."""
        key = self.table.key
        return (key(h) for h in self.table.handles())

    def handle(self, key: str) -> int:
        """The handle of ``key``, or ``-1`` (no inflation)."""
        return self.table.find(key)

    def by_handle(self, h: int) -> _Object:
        """The record of handle ``h`` (inflated if cold; ``KeyError`` if ``h`` is not live)."""
        obj = self.hot.get(h)
        if obj is None:
            obj = self._inflate(h, self.table.key(h))
        else:
            self._dirty.append(h)
        key = obj.key
        if key[:1] == PREFIX and h not in self._touched:
            self._touched[h] = (tenant_of(key), charge(obj), True)
        return obj

    def cold_lease(self, h: int) -> float:
        """The lease deadline of cold ``h`` (``KeyError`` if it is not cold)."""
        return self.table.cold_row(h)[4]

    def values(self) -> Iterator[_Object]:
        """Every object, in order: hot records as they are, cold rows as *copies* (read them
        only: changing a copy changes nothing; use :meth:`get` to change an object)."""
        key = self.table.key
        for h in self.table.handles():
            obj = self.hot.get(h)
            yield obj if obj is not None else self._row_object(h, key(h))

    def items(self) -> Iterator[tuple[str, _Object]]:
        """``(key, object)`` pairs in order, as :meth:`values`."""
        for obj in self.values():
            yield obj.key, obj

    def readable_keys(self) -> list[str]:
        """Keys with a readable version, in order."""
        key, hot = self.table.key, self.hot
        return [
            key(h)
            for h in self.table.handles()
            if (o := hot.get(h)) is None or o.readable is not None
        ]

    def readable_from(self, start: int) -> Iterator[tuple[int, str]]:
        """``(handle, key)`` of the keys with a readable version, from handle ``start`` on in
        handle order (a page of a listing: :mod:`mooncake._core.paging`)."""
        key, hot, table = self.table.key, self.hot, self.table
        for h in range(max(0, start), table.capacity):
            try:
                k = key(h)
            except KeyError:  # a free handle
                continue
            o = hot.get(h)
            if o is None or o.readable is not None:
                yield h, k

    # -- cold rows -------------------------------------------------------------------------

    def _row_object(self, h: int, key: str) -> _Object:
        seg, addr, size, vid, lease, read, writer = self.table.cold_row(h)
        obj = _Object(
            key,
            _Version(size, [_Replica(self.segs[seg], addr, size)], vid),
            writer=self.writers[writer],
            lease_deadline=lease,
            read_deadline=read,
        )
        obj.h = h
        return obj

    def _inflate(self, h: int, key: str) -> _Object:
        obj = self._row_object(h, key)
        self.table.clear_cold(h)
        self.hot[h] = obj
        self._dirty.append(h)
        return obj

    @staticmethod
    def coldable(obj: _Object) -> bool:
        """Whether ``obj`` is in the shape a cold row holds."""
        ver = obj.readable
        if (
            ver is None
            or obj.pending is not None
            or obj.demoting is not None
            or obj.promoting is not None
            or obj.task is not None
            or obj.hard_pinned
            or obj.soft_pin_deadline is not None
            or obj.group
            or ver.disk
            or len(ver.replicas) != 1
        ):
            return False
        r = ver.replicas[0]
        return r.length == ver.size and r.seg.mounted and r.seg.num >= 0

    def _writer(self, client_id: str) -> int:
        n = self._writer_num.get(client_id)
        if n is None:
            n = self._writer_num[client_id] = len(self.writers)
            self.writers.append(client_id)
        return n

    def settle(self) -> None:
        """Fold the records touched since the last call back into cold rows where they fit
        (call it only when no rule holds a record)."""
        dirty = self._dirty
        if not dirty:
            return
        self._dirty = []
        hot = self.hot
        for h in dirty:
            obj = hot.get(h)
            if obj is None or obj.h != h or not self.coldable(obj):
                continue
            ver = obj.readable
            assert ver is not None
            r = ver.replicas[0]
            self.table.set_cold(
                h,
                r.seg.num,
                r.addr,
                ver.size,
                ver.vid,
                obj.lease_deadline,
                obj.read_deadline,
                self._writer(obj.writer),
            )
            del hot[h]

    # -- bulk ------------------------------------------------------------------------------

    def handles_on(self, seg: _Seg) -> list[int]:
        """Handles of the objects with a replica of their readable or pending version on
        ``seg``, in order (a scan of the cold rows' segment column, and of the hot records)."""
        hs = self.table.cold_on_segment(seg.num) if seg.num >= 0 else []
        for h, obj in self.hot.items():
            for ver in (obj.readable, obj.pending.version if obj.pending else None):
                if ver is not None and any(r.seg is seg for r in ver.replicas):
                    hs.append(h)
                    break
        return self.table.sort_by_seq(hs)

    def keys_on(self, seg: _Seg) -> list[str]:
        """The keys of :meth:`handles_on`."""
        key = self.table.key
        return [key(h) for h in self.handles_on(seg)]

    def extend_deadlines(self, at_least: float) -> None:
        """Every readable object's lease and read window last at least until ``at_least``."""
        self.table.extend_deadlines(at_least)
        for obj in self.hot.values():
            if obj.readable is not None:
                obj.lease_deadline = max(obj.lease_deadline, at_least)
                obj.read_deadline = max(obj.read_deadline, at_least)

    def __canon__(self) -> Any:
        """The logical content (representation-free), for fingerprints."""
        return [(obj.key, obj) for obj in self.values()]

    def self_check(self) -> None:
        """Raise ``AssertionError`` if the two representations disagree (tests)."""
        t = self.table
        t.self_check()
        assert len(self.hot) + t.cold_count == len(t), "an object neither hot nor cold"
        for h, obj in self.hot.items():
            assert obj.h == h and t.key(h) == obj.key and not t.is_cold(h), "stray hot record"
        for obj in self.values():
            if t.is_cold(obj.h):
                seg = obj.readable.replicas[0].seg if obj.readable else None
                assert seg is not None and seg.mounted and self.segs.get(seg.num) is seg
