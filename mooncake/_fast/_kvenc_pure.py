"""Pure-Python twin of ``_kvenc.pyx``: the KV event batch body from pre-encoded pieces.

Contracts (identical in both twins):

* :func:`parse_seq_hash` is the u64 a decimal (ASCII digits) or ``0x``-hex object key
  encodes (upstream's ``ParseSeqHashFromObjectKey``), ``None`` for any other key or one of
  ``2**64`` or more;
* :func:`encode_events` returns ``(body, n, unparsed)``: the msgpack encodings of the event
  maps, concatenated (the caller writes the array header around them), how many events that
  is and how many of them had a key that is not a u64 hash. Per event ``(kind, key,
  medium)`` (``kind`` 0 or 1 indexes ``heads`` and ``tails``): a key starting with
  ``prefix`` is first split by ``split`` into ``(key, tenant)``; a key that is not a hash is
  left out when ``okey`` is ``None`` (and an empty key always then); otherwise the map is
  ``heads[kind] + msgpack(event_id) + ts_entry + middle + [okey + msgpack(key)] + hashes +
  tails[kind]``, where ``middle`` is ``mids[(kind, medium, tenant)]`` or, missing,
  ``middle_of(kind, medium, tenant)``; ``hashes`` is ``empty`` for a non-hash key, else
  ``seq_key + msgpack([h])`` and, when ``block_key`` is given, ``block_key +
  msgpack([h as a signed i64])``. Event ids count up from ``first_event_id``. Encodings are
  msgspec's (the smallest msgpack form of each int and string).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

COMPILED = False

_enc = msgspec.msgpack.Encoder().encode
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


def parse_seq_hash(key: str) -> int | None:
    """The u64 ``key`` encodes in decimal or ``0x`` hex, else ``None``."""
    if not key:
        return None
    if len(key) >= 2 and key[0] == "0" and key[1] in "xX":
        if len(key) == 2 or not all(c in _HEX for c in key[2:]):
            return None
        v = int(key[2:], 16)
    else:
        if not key.isascii() or not key.isdigit():
            return None
        v = int(key)
    return v if v < (1 << 64) else None


def encode_events(
    events: list[tuple[int, str, str]],
    first_event_id: int,
    ts_entry: bytes,
    heads: tuple[bytes, bytes],
    tails: tuple[bytes, bytes],
    mids: dict[tuple[int, str, str], bytes],
    middle_of: Callable[[int, str, str], bytes],
    prefix: str,
    split: Callable[[str], tuple[str, str]],
    okey: bytes | None,
    seq_key: bytes,
    block_key: bytes | None,
    empty: bytes,
) -> tuple[bytes, int, int]:
    """The batch body of ``events`` (see the module docstring)."""
    enc = _enc
    parts: list[bytes] = []
    append = parts.append
    eid = first_event_id
    unparsed = 0
    for kind, key, medium in events:
        tenant = ""
        if key[:1] == prefix:
            key, tenant = split(key)
        h = parse_seq_hash(key) if key[:1] in _DIGITS else None
        if h is None and (okey is None or not key):
            continue
        m = mids.get((kind, medium, tenant)) or middle_of(kind, medium, tenant)
        if h is None:
            unparsed += 1
            hashes = empty
        elif block_key is not None:
            signed = h - (1 << 64) if h >= (1 << 63) else h
            hashes = seq_key + enc([h]) + block_key + enc([signed])
        else:
            hashes = seq_key + enc([h])
        if okey is not None:
            append(heads[kind] + enc(eid) + ts_entry + m + okey + enc(key) + hashes + tails[kind])
        else:
            append(heads[kind] + enc(eid) + ts_entry + m + hashes + tails[kind])
        eid += 1
    return b"".join(parts), eid - first_event_id, unparsed
