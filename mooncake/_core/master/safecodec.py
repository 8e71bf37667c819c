"""An object graph to msgpack and back, without running code from the data.

What a master snapshot carries besides its columns (hot records, clients, tasks, queues,
ledgers, counters, the rng) is a graph of plain records that share references (a queued write
and its object). Pickle would carry it whole, but unpickling calls whatever the bytes name, so a
hostile snapshot could run code in every master that restores it. This codec writes the graph as
msgpack (via ``msgspec``) and rebuilds it from a closed list of types only:

* builtins: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``bytearray``, ``list``, ``tuple``,
  ``dict``, ``set``, ``frozenset``, ``OrderedDict``, ``Counter``, ``deque``, ``array.array``,
  ``random.Random`` (through its ``getstate``/``setstate``);
* classes of ``mooncake._core`` (and the ``_fast`` twins, and the leaf ``mooncake._miss``) that
  do not define ``__del__``: a record is made with ``cls.__new__(cls)`` and its attributes set
  (no ``__init__``, no ``__setstate__``), an enum by value, a ``msgspec.Struct`` through its own constructor;
* the ``_fast`` containers (``ObjectTable``, ``IntMap``) as their columns, rebuilt by the
  functions in :data:`_REBUILDERS`, which validate what they get.

Shared and cyclic references are kept: every mutable container and record is numbered on first
sight and later sights refer to the number. A malformed graph raises :class:`ValueError` (the
caller turns it into its own error); nothing in it is ever called.
"""

from __future__ import annotations

import array
import collections
import enum
import random
import sys
from collections.abc import Callable
from typing import Any, cast

import msgspec

__all__ = ["decode", "decode_tree", "encode", "encode_tree"]

_ALLOWED_PREFIXES = ("mooncake._core.", "mooncake._fast.")
#: leaf modules outside those packages whose records the state holds (``Miss``, ``MissReason``)
_ALLOWED_MODULES = frozenset({"mooncake._miss"})


def _module_allowed(name: str) -> bool:
    return name.startswith(_ALLOWED_PREFIXES) or name in _ALLOWED_MODULES


def _impls(name: str) -> tuple[type, ...]:
    """Every implementation of the ``_fast`` class ``name`` loaded (compiled, pure)."""
    out = []
    for mod in (
        "mooncake._fast._intmap",
        "mooncake._fast._intmap_pure",
        "mooncake._fast._objtable",
        "mooncake._fast._objtable_pure",
    ):
        m = sys.modules.get(mod)
        cls = getattr(m, name, None) if m is not None else None
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def _rebuild_intmap(kb: bytes, vb: bytes) -> Any:
    from mooncake import _fast

    fn: Callable[[bytes, bytes], Any] = sys.modules[_fast.IntMap.__module__]._rebuild
    return fn(kb, vb)


def _rebuild_objtable(st: dict[str, Any]) -> Any:
    from mooncake._fast import ObjectTable

    return ObjectTable.from_state(st)


#: the only functions a snapshot may have called (each validates its arguments)
_REBUILDERS: dict[str, Callable[..., Any]] = {
    "intmap": _rebuild_intmap,
    "objtable": _rebuild_objtable,
}


def _rebuilder_table() -> dict[str, Callable[..., Any]]:
    return _REBUILDERS


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _allowed(cls: type) -> bool:
    return (
        isinstance(cls, type)
        and _module_allowed(cls.__module__)
        and "__del__" not in dir(cls)
        and not issubclass(cls, BaseException)
    )


def _lookup_class(name: Any) -> type:
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"bad class name {name!r}")
    mod_name, _, qual = name.partition(":")
    mod = sys.modules.get(mod_name)  # never imports: only what this process already has
    if mod is None or not _module_allowed(mod_name):
        raise ValueError(f"class {name!r} is not one a snapshot may hold")
    obj: Any = mod
    for part in qual.split("."):
        if part.startswith("__") or not part.isidentifier():
            raise ValueError(f"class {name!r} is not one a snapshot may hold")
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or not _allowed(obj):
        raise ValueError(f"class {name!r} is not one a snapshot may hold")
    return obj


def _fields(obj: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name in seen or name in ("__dict__", "__weakref__"):
                continue
            seen.add(name)
            if hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    d = getattr(obj, "__dict__", None)
    if d is not None:
        out.extend(d.items())
    return out


class _Encoder:
    def __init__(self, persistent: dict[int, int] | None = None) -> None:
        self.persistent = persistent or {}
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # keeps ids stable while encoding

    def _ref(self, obj: Any) -> int | None:
        idx = self.memo.get(id(obj))
        if idx is not None:
            return idx
        self.memo[id(obj)] = len(self.memo)
        self.keep.append(obj)
        return None

    def enc(self, obj: Any) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is float or t is str or t is bytes:
            return obj
        if t is int:
            return obj if -(1 << 63) <= obj < (1 << 64) else ["I", str(obj)]
        if t is tuple:
            return ["T", [self.enc(x) for x in obj]]
        if t is frozenset:
            return ["F", [self.enc(x) for x in obj]]
        if isinstance(obj, enum.Enum):
            return ["E", _class_name(t), self.enc(obj.value)]
        pid = self.persistent.get(id(obj))
        if pid is not None:
            return ["P", pid]
        idx = self._ref(obj)
        if idx is not None:
            return ["r", idx]
        idx = self.memo[id(obj)]
        if t is list:
            return ["L", idx, [self.enc(x) for x in obj]]
        if t is dict:
            return ["D", idx, [self.enc(x) for kv in obj.items() for x in kv]]
        if t is collections.OrderedDict:
            return ["O", idx, [self.enc(x) for kv in obj.items() for x in kv]]
        if t is collections.Counter:
            return ["N", idx, [self.enc(x) for kv in obj.items() for x in kv]]
        if t is collections.deque:
            return ["Q", idx, obj.maxlen, [self.enc(x) for x in obj]]
        if t is set:
            return ["S", idx, [self.enc(x) for x in obj]]
        if t is array.array:
            return ["A", idx, obj.typecode, obj.tobytes()]
        if t is bytearray:
            return ["B", idx, bytes(obj)]
        if t is random.Random:
            return ["G", idx, self.enc(obj.getstate())]
        if not _allowed(t):
            raise TypeError(f"a snapshot cannot hold a {t.__module__}.{t.__qualname__}")
        if isinstance(obj, msgspec.Struct):
            return ["M", idx, _class_name(t), self.enc(msgspec.structs.asdict(obj))]
        if t in _impls("ObjectTable"):
            return ["C", idx, "objtable", self.enc((obj.state(),))]
        if t in _impls("IntMap"):
            k, v = obj.items_sorted()
            return ["C", idx, "intmap", self.enc((k.tobytes(), v.tobytes()))]
        if "__reduce__" in vars(t) or "__reduce_ex__" in vars(t):
            raise TypeError(f"a snapshot cannot rebuild a {t.__qualname__}")
        base = None
        items: list[Any] = []
        if isinstance(obj, dict):
            base = [self.enc(x) for kv in obj.items() for x in kv]
        elif isinstance(obj, list):
            base = [self.enc(x) for x in obj]
        for k, v in _fields(obj):
            items.append(k)
            items.append(self.enc(v))
        return ["X", idx, _class_name(t), items, base]


class _Decoder:
    def __init__(self, persistent: list[Any] | None = None) -> None:
        self.persistent = persistent or []
        self.memo: dict[int, Any] = {}

    def _put(self, idx: Any, obj: Any) -> Any:
        if type(idx) is not int or idx in self.memo or idx != len(self.memo):
            raise ValueError(f"bad reference number {idx!r}")
        self.memo[idx] = obj
        return obj

    def _pairs(self, flat: Any) -> list[tuple[Any, Any]]:
        if type(flat) is not list or len(flat) % 2:
            raise ValueError("a mapping is not a flat list of pairs")
        return [(self.dec(flat[i]), self.dec(flat[i + 1])) for i in range(0, len(flat), 2)]

    def _seq(self, items: Any) -> list[Any]:
        if type(items) is not list:
            raise ValueError("a sequence is not a list")
        return [self.dec(x) for x in items]

    def dec(self, v: Any) -> Any:
        t = type(v)
        if v is None or t is bool or t is int or t is float or t is str or t is bytes:
            return v
        if t is not list or not v or type(v[0]) is not str:
            raise ValueError(f"bad node {v!r:.60}")
        tag = v[0]
        if tag == "r" and len(v) == 2:
            try:
                return self.memo[v[1]]
            except (KeyError, TypeError):
                raise ValueError(f"reference {v[1]!r} before its object") from None
        if tag == "P" and len(v) == 2:
            if type(v[1]) is not int or not 0 <= v[1] < len(self.persistent):
                raise ValueError(f"bad outside reference {v[1]!r}")
            return self.persistent[v[1]]
        if tag == "I" and len(v) == 2 and type(v[1]) is str and len(v[1]) < 400:
            return int(v[1])
        if tag == "T" and len(v) == 2:
            return tuple(self._seq(v[1]))
        if tag == "F" and len(v) == 2:
            return frozenset(self._seq(v[1]))
        if tag == "E" and len(v) == 3:
            cls = _lookup_class(v[1])
            if not issubclass(cls, enum.Enum):
                raise ValueError(f"{v[1]!r} is not an enum")
            return cls(self.dec(v[2]))
        if tag == "L" and len(v) == 3:
            out: list[Any] = self._put(v[1], [])
            out.extend(self._seq(v[2]))
            return out
        if tag in ("D", "O", "N") and len(v) == 3:
            empty = {"D": dict, "O": collections.OrderedDict, "N": collections.Counter}[tag]
            d: dict[Any, Any] = self._put(v[1], empty())
            for key, val in self._pairs(v[2]):  # (Counter.update would count the pairs)
                d[key] = val
            return d
        if tag == "Q" and len(v) == 4:
            if v[2] is not None and type(v[2]) is not int:
                raise ValueError("bad deque maxlen")
            q: collections.deque[Any] = self._put(v[1], collections.deque(maxlen=v[2]))
            q.extend(self._seq(v[3]))
            return q
        if tag == "S" and len(v) == 3:
            s: set[Any] = self._put(v[1], set())
            s.update(self._seq(v[2]))
            return s
        if tag == "A" and len(v) == 4:
            if v[2] not in ("b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "f", "d"):
                raise ValueError(f"bad array typecode {v[2]!r}")
            if type(v[3]) is not bytes:
                raise ValueError("array data is not bytes")
            a = array.array(v[2])
            if len(v[3]) % a.itemsize:
                raise ValueError("array data is not a whole number of items")
            a.frombytes(v[3])
            return self._put(v[1], a)
        if tag == "B" and len(v) == 3:
            if type(v[2]) is not bytes:
                raise ValueError("bytearray data is not bytes")
            return self._put(v[1], bytearray(v[2]))
        if tag == "G" and len(v) == 3:
            r = self._put(v[1], random.Random())
            r.setstate(self.dec(v[2]))
            return r
        if tag == "M" and len(v) == 4:
            cls = _lookup_class(v[2])
            if not issubclass(cls, msgspec.Struct):
                raise ValueError(f"{v[2]!r} is not a struct")
            slot = len(self.memo)
            self._put(v[1], None)
            fields = self.dec(v[3])
            if type(fields) is not dict:
                raise ValueError("struct fields are not a mapping")
            obj = msgspec.convert(fields, cls)
            self.memo[slot] = obj
            return obj
        if tag == "C" and len(v) == 4:
            fn = _rebuilder_table().get(v[2]) if type(v[2]) is str else None
            if fn is None:
                raise ValueError(f"no rebuild function {v[2]!r}")
            slot = len(self.memo)
            self._put(v[1], None)
            args = self.dec(v[3])
            if type(args) is not tuple:
                raise ValueError("rebuild arguments are not a tuple")
            obj = fn(*args)
            self.memo[slot] = obj
            return obj
        if tag == "X" and len(v) == 5:
            cls = _lookup_class(v[2])
            obj = self._put(v[1], cast(Any, cls).__new__(cls))
            for k, val in self._pairs(v[3]):
                if type(k) is not str or not k.isidentifier():
                    raise ValueError(f"bad attribute name {k!r}")
                object.__setattr__(obj, k, val)
            if v[4] is not None:
                if isinstance(obj, dict):
                    for key, val in self._pairs(v[4]):
                        dict.__setitem__(obj, key, val)
                elif isinstance(obj, list):
                    list.extend(obj, self._seq(v[4]))
                else:
                    raise ValueError(f"{v[2]!r} has no items")
            return obj
        raise ValueError(f"bad node tag {tag!r}")


def encode_tree(obj: Any, persistent: dict[int, int] | None = None) -> Any:
    """``obj`` as a tree of msgpack-ready builtins (``TypeError`` for a type this codec
    cannot carry); ``persistent``: ``id(obj)`` to an index, for objects written as
    references to a list the reader supplies."""
    return _Encoder(persistent).enc(obj)


def decode_tree(tree: Any, persistent: list[Any] | None = None) -> Any:
    """The graph :func:`encode_tree` wrote; ``ValueError`` for anything else."""
    try:
        return _Decoder(persistent).dec(tree)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except (TypeError, KeyError, AttributeError, OverflowError, msgspec.ValidationError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None


def encode(obj: Any) -> bytes:
    """``obj`` as msgpack (``TypeError`` for a type this codec cannot carry)."""
    return msgspec.msgpack.encode(encode_tree(obj))


def decode(data: bytes | memoryview) -> Any:
    """The graph :func:`encode` wrote; ``ValueError`` for anything else."""
    try:
        tree = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    return decode_tree(tree)
