"""The master's object table, pure-Python twin of ``_objtable.pyx`` (same names, contracts).

An :class:`ObjectTable` maps keys (``str``) to small integer *handles* and keeps, per handle:

* its key and a sequence number (``seq``: the order the keys were added in; never reused);
* an optional *cold row*: the whole record of an object in its common shape (one readable
  version with one memory replica, nothing else in flight), as plain numbers -- the replica's
  segment number, address and size, the version id, the lease and read-window deadlines and
  the writer's number. An object in any other shape is kept by the caller as a Python record
  (a *hot* object) and has no cold row;
* an optional place in one intrusive recency list with a size (the LRU/FIFO order of an
  eviction policy over handles).

Handles are ``0 <= h < capacity``; a removed handle is reused by a later :meth:`add` (the most
recently freed first), so a caller must forget a handle when it removes it. Methods given a
handle that is not live raise ``KeyError``; wrong types raise ``TypeError``; numbers out of
range for their column (``seg``/``writer`` in ``[0, 2**31)``, ``addr``/``size``/``vid``
``>= 0`` and ``< 2**63``, ``lru`` sizes likewise) raise ``OverflowError`` or ``ValueError``.

:meth:`state` and :meth:`from_state` move the whole table as columns (``array`` buffers in
native byte order, indexed by handle), so a snapshot restores handles, sequence numbers, cold
rows and the recency order exactly; both twins read and write the same layout.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

COMPILED = False

_COLD = ("seg", "addr", "size", "vid", "lease", "read", "writer")
_I31 = 2**31
_I63 = 2**63


def _check_row(seg: int, addr: int, size: int, vid: int, writer: int) -> None:
    for name, v, hi in (
        ("seg", seg, _I31),
        ("addr", addr, _I63),
        ("size", size, _I63),
        ("vid", vid, _I63),
        ("writer", writer, _I31),
    ):
        if type(v) is not int:
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 0 <= v < hi:
            raise OverflowError(f"{name} {v} out of range [0, {hi})")


def _check_limit(limit: int) -> None:
    if type(limit) is not int:
        raise TypeError(f"limit must be an int, got {type(limit).__name__}")


# the columns of a state and their array typecodes (None: not an array)
STATE_COLUMNS: dict[str, str | None] = {
    "n": None,
    "next_seq": None,
    "live": None,
    "key_blob": None,
    "key_len": "Q",
    "seq": "q",
    "free": "q",
    "seg": "i",
    "addr": "q",
    "size": "q",
    "vid": "q",
    "lease": "d",
    "read": "d",
    "writer": "i",
    "lru": "q",
    "lru_size": "q",
}
_PER_HANDLE = ("key_len", "seq", "seg", "addr", "size", "vid", "lease", "read", "writer")


def normalize_state(st: dict[str, Any]) -> tuple[int, int, bytes, bytes, dict[str, array[Any]]]:
    """``(n, next_seq, live, key_blob, columns)`` of a state, every column an ``array`` of its
    typecode; ``ValueError`` if a column is missing, of the wrong type or length. Both twins
    check a state's shape here; each then checks the contents (its ``from_state``)."""
    if not isinstance(st, dict):
        raise ValueError(f"an object table state is a dict, got {type(st).__name__}")
    missing = [c for c in STATE_COLUMNS if c not in st]
    if missing:
        raise ValueError(f"object table state without {', '.join(missing)}")
    n, next_seq = st["n"], st["next_seq"]
    if type(n) is not int or not 0 <= n < _I31:
        raise ValueError(f"object table state with n={n!r}")
    if type(next_seq) is not int or not 0 <= next_seq < _I63:
        raise ValueError(f"object table state with next_seq={next_seq!r}")
    if isinstance(st["live"], int) or isinstance(st["key_blob"], int):
        raise ValueError("object table state with an int for live/key_blob")
    try:
        live = st["live"] if type(st["live"]) is bytes else bytes(st["live"])
        blob = st["key_blob"] if type(st["key_blob"]) is bytes else bytes(st["key_blob"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"object table state with bad live/key_blob: {e}") from None
    if len(live) != n:
        raise ValueError("object table columns of different lengths")
    if live.translate(None, b"\x00\x01"):
        raise ValueError("object table state with live flags other than 0 and 1")
    cols: dict[str, array[Any]] = {}
    for c, tc in STATE_COLUMNS.items():
        if tc is None:
            continue
        v = st[c]
        if not (isinstance(v, array) and v.typecode == tc):
            try:
                v = array(tc, v)
            except (TypeError, OverflowError, ValueError) as e:
                raise ValueError(f"object table column {c}: {e}") from None
        cols[c] = v
    if any(len(cols[c]) != n for c in _PER_HANDLE):
        raise ValueError("object table columns of different lengths")
    if len(cols["lru"]) != len(cols["lru_size"]):
        raise ValueError("object table lru and lru_size of different lengths")
    return n, next_seq, live, blob, cols


class ObjectTable:
    """Keys to handles, with cold rows and one recency list (see the module docstring)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._keys: list[str | None] = []
        self._seq: list[int] = []
        self._free: list[int] = []
        self._next_seq = 0
        self._cold: list[tuple[int, int, int, int, float, float, int] | None] = []
        self._ncold = 0
        # recency list: handle -> size, in order (dicts keep insertion order)
        self._lru: dict[int, int] = {}
        self._lru_bytes = 0

    # -- keys and handles ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    @property
    def capacity(self) -> int:
        """One past the largest handle ever handed out."""
        return len(self._keys)

    @property
    def next_seq(self) -> int:
        """The sequence number the next :meth:`add` gets."""
        return self._next_seq

    def find(self, key: str) -> int:
        """The handle of ``key``, or ``-1``."""
        if type(key) is not str:
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        return self._index.get(key, -1)

    def lease_keys(self, keys: list[str], deadline: float) -> list[int]:
        """For each key of the list ``keys``: ``-1`` if absent, ``-2`` if cold (its lease
        raised to at least ``deadline``), else its handle (a hot object: the caller's)."""
        if type(keys) is not list:
            raise TypeError(f"keys must be a list, got {type(keys).__name__}")
        d = float(deadline)
        out: list[int] = []
        for key in keys:
            h = self.find(key)
            if h >= 0 and (row := self._cold[h]) is not None:
                if row[4] < d:
                    seg, addr, size, vid, _, read, writer = row
                    self._cold[h] = (seg, addr, size, vid, d, read, writer)
                h = -2
            out.append(h)
        return out

    def add(self, key: str) -> int:
        """A new handle for ``key`` (``ValueError`` if ``key`` is already in the table)."""
        if type(key) is not str:
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if key in self._index:
            raise ValueError(f"key {key!r} is already in the table")
        if self._free:
            h = self._free.pop()
            self._keys[h] = key
            self._seq[h] = self._next_seq
        else:
            h = len(self._keys)
            self._keys.append(key)
            self._seq.append(self._next_seq)
            self._cold.append(None)
        self._next_seq += 1
        self._index[key] = h
        return h

    def _live(self, h: int) -> str:
        if type(h) is not int:
            raise TypeError(f"handle must be an int, got {type(h).__name__}")
        if not 0 <= h < len(self._keys) or (key := self._keys[h]) is None:
            raise KeyError(h)
        return key

    def remove(self, h: int) -> None:
        """Forget handle ``h``: its key, cold row and place in the recency list."""
        key = self._live(h)
        if h in self._lru:
            self.lru_unlink(h)
        if self._cold[h] is not None:
            self._ncold -= 1
            self._cold[h] = None
        del self._index[key]
        self._keys[h] = None
        self._free.append(h)

    def key(self, h: int) -> str:
        return self._live(h)

    def seq(self, h: int) -> int:
        self._live(h)
        return self._seq[h]

    def handles(self) -> list[int]:
        """Every live handle, in ``seq`` order (the order their keys were added in)."""
        return sorted(self._index.values(), key=self._seq.__getitem__)

    def sort_by_seq(self, handles: Iterable[int]) -> list[int]:
        """``handles`` (live, distinct) in ``seq`` order."""
        hs = list(handles)
        for h in hs:
            self._live(h)
        return sorted(hs, key=self._seq.__getitem__)

    # -- cold rows -------------------------------------------------------------------------

    @property
    def cold_count(self) -> int:
        return self._ncold

    def is_cold(self, h: int) -> bool:
        self._live(h)
        return self._cold[h] is not None

    def set_cold(
        self,
        h: int,
        seg: int,
        addr: int,
        size: int,
        vid: int,
        lease: float,
        read: float,
        writer: int,
    ) -> None:
        """Give ``h`` a cold row (replacing any it has)."""
        self._live(h)
        _check_row(seg, addr, size, vid, writer)
        row = (seg, addr, size, vid, float(lease), float(read), writer)
        if self._cold[h] is None:
            self._ncold += 1
        self._cold[h] = row

    def cold_row(self, h: int) -> tuple[int, int, int, int, float, float, int]:
        """``(seg, addr, size, vid, lease, read, writer)``; ``KeyError`` if ``h`` is not cold."""
        self._live(h)
        row = self._cold[h]
        if row is None:
            raise KeyError(h)
        return row

    def clear_cold(self, h: int) -> None:
        """Drop the cold row of ``h`` (``KeyError`` if it has none)."""
        self.cold_row(h)
        self._cold[h] = None
        self._ncold -= 1

    def set_deadlines(self, h: int, lease: float, read: float) -> None:
        """Set the lease and read-window deadlines of cold ``h``."""
        seg, addr, size, vid, _, _, writer = self.cold_row(h)
        self._cold[h] = (seg, addr, size, vid, float(lease), float(read), writer)

    def extend_deadlines(self, at_least: float) -> None:
        """Raise every cold row's lease and read deadlines to at least ``at_least``."""
        t = float(at_least)
        for h, row in enumerate(self._cold):
            if row is not None:
                seg, addr, size, vid, lease, read, writer = row
                self._cold[h] = (seg, addr, size, vid, max(lease, t), max(read, t), writer)

    def cold_on_segment(self, seg: int) -> list[int]:
        """Cold handles whose replica is on segment ``seg``, in ``seq`` order."""
        if type(seg) is not int:
            raise TypeError(f"seg must be an int, got {type(seg).__name__}")
        return self.sort_by_seq(
            h for h, row in enumerate(self._cold) if row is not None and row[0] == seg
        )

    # -- the recency list ------------------------------------------------------------------

    def lru_push(self, h: int, size: int) -> None:
        """Append ``h`` (``size`` bytes) at the most recent end (``ValueError`` if listed)."""
        self._live(h)
        if type(size) is not int:
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if not 0 <= size < _I63:
            raise OverflowError(f"size {size} out of range [0, {_I63})")
        if h in self._lru:
            raise ValueError(f"handle {h} is already in the recency list")
        self._lru[h] = size
        self._lru_bytes += size

    def lru_unlink(self, h: int) -> None:
        """Take ``h`` out of the recency list (``KeyError`` if it is not in it)."""
        self._live(h)
        self._lru_bytes -= self._lru.pop(h)

    def lru_touch(self, h: int) -> None:
        """Move ``h`` to the most recent end (``KeyError`` if it is not listed)."""
        self._live(h)
        self._lru[h] = self._lru.pop(h)

    def lru_contains(self, h: int) -> bool:
        return type(h) is int and h in self._lru

    def lru_size(self, h: int) -> int:
        self._live(h)
        return self._lru[h]

    def lru_first(self) -> int:
        """The least recent handle, or ``-1``."""
        return next(iter(self._lru), -1)

    def lru_order(self, limit: int = -1) -> list[int]:
        """Listed handles, least recent first (at most ``limit`` of them when ``>= 0``)."""
        _check_limit(limit)
        if limit < 0:
            return list(self._lru)
        out: list[int] = []
        for h in self._lru:
            if len(out) >= limit:
                break
            out.append(h)
        return out

    def lru_after(self, h: int, limit: int) -> list[int]:
        """Up to ``limit`` listed handles that follow ``h``, in order (``KeyError`` if ``h``
        is not listed)."""
        _check_limit(limit)
        self._live(h)
        if h not in self._lru:
            raise KeyError(h)
        out: list[int] = []
        it = iter(self._lru)
        for x in it:
            if x == h:
                break
        for x in it:
            if len(out) >= limit:
                break
            out.append(x)
        return out

    @property
    def lru_len(self) -> int:
        return len(self._lru)

    @property
    def lru_bytes(self) -> int:
        return self._lru_bytes

    # -- whole-table moves -----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The table as columns indexed by handle (see the module docstring)."""
        n = len(self._keys)
        live = bytes(0 if k is None else 1 for k in self._keys)
        keys = [k or "" for k in self._keys]
        cold = self._cold
        z = (-1, 0, 0, 0, 0.0, 0.0, 0)
        rows = [r if r is not None else z for r in cold]
        return {
            "n": n,
            "next_seq": self._next_seq,
            "live": live,
            "key_blob": "".join(keys).encode("utf-8", "surrogatepass"),
            "key_len": array("Q", (len(k.encode("utf-8", "surrogatepass")) for k in keys)),
            "seq": array("q", self._seq),
            "free": array("q", self._free),
            "seg": array("i", (r[0] for r in rows)),
            "addr": array("q", (r[1] for r in rows)),
            "size": array("q", (r[2] for r in rows)),
            "vid": array("q", (r[3] for r in rows)),
            "lease": array("d", (r[4] for r in rows)),
            "read": array("d", (r[5] for r in rows)),
            "writer": array("i", (r[6] for r in rows)),
            "lru": array("q", self._lru),
            "lru_size": array("q", self._lru.values()),
        }

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> ObjectTable:
        """The table :meth:`state` described (``ValueError`` if the state is malformed: a
        column missing or of the wrong length, a key twice or not UTF-8, a live ``seq`` not
        below ``next_seq``, a cold row out of range, a free list that is not exactly the dead
        handles, a recency entry that is dead, listed twice or of a negative size)."""
        n, next_seq, live, blob, c = normalize_state(st)
        t = cls()
        key_len, seqs, segs = c["key_len"], c["seq"], c["seg"]
        if sum(key_len) != len(blob):
            raise ValueError("object table key_len does not add up to key_blob")
        pos = 0
        for h in range(n):
            ln = key_len[h]
            try:
                key = blob[pos : pos + ln].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise ValueError(f"object table key of handle {h} is not UTF-8") from None
            pos += ln
            s = seqs[h]
            t._seq.append(s)
            if not live[h]:
                t._keys.append(None)
                t._cold.append(None)
                continue
            if not 0 <= s < next_seq:
                raise ValueError(f"object table seq {s} of handle {h} not in [0, {next_seq})")
            t._keys.append(key)
            t._index[key] = h
            seg = segs[h]
            if seg < 0:
                t._cold.append(None)
                continue
            row = (seg, c["addr"][h], c["size"][h], c["vid"][h], c["writer"][h])
            if min(row) < 0:
                raise ValueError(f"object table cold row of handle {h} out of range: {row}")
            t._cold.append((*row[:4], c["lease"][h], c["read"][h], row[4]))
            t._ncold += 1
        if len(t._index) != live.count(1):
            raise ValueError("object table with a key twice")
        free = list(c["free"])
        if sorted(free) != [h for h in range(n) if not live[h]]:
            raise ValueError("object table free list is not the dead handles")
        t._free = free
        t._next_seq = next_seq
        for h, size in zip(c["lru"], c["lru_size"], strict=True):
            try:
                t.lru_push(h, size)
            except (KeyError, OverflowError, ValueError):
                raise ValueError(f"object table recency entry ({h}, {size}) is bad") from None
        return t

    def self_check(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests)."""
        assert len(self._index) + len(self._free) == len(self._keys)
        assert self._ncold == sum(r is not None for r in self._cold)
        assert self._lru_bytes == sum(self._lru.values())
        for key, h in self._index.items():
            assert self._keys[h] == key
        for h in self._lru:
            assert self._keys[h] is not None

    def memory_bytes(self) -> int:
        """Bytes the table's own buffers take (the compiled table's figure; 0 here: a
        Python twin's objects are not its own buffers)."""
        return 0
