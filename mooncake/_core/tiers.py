"""Storage tiers, sans-I/O: the SSD object format and index, promotion admission, counters.

Nothing here touches a file or an event loop; :mod:`mooncake._store.ssd` does the I/O.

SSD object file (one file per object, little-endian)
----------------------------------------------------
::

    offset 0   header block (HEADER_FIXED + key + 4 bytes, zero-padded to a multiple of BLOCK)
               magic  8s  b"MCSSD\\x01\\r\\n"
               version u32 (1)   flags u32 (0)
               generation u64    size u64    checksum u32 (crc32 of the payload)
               key_len u32       key bytes (UTF-8)
               header_crc u32    (crc32 of every header byte before it)
    offset H   payload: ``size`` bytes, zero-padded to a multiple of BLOCK

So the file length is exactly ``H + round_up(size, BLOCK)``, every write and read is
BLOCK-aligned (what ``O_DIRECT`` needs), and a file is checkable on its own: the header names
its key and generation, and the payload checksum is in the header.

The writer commits a file by writing it under a temporary name, syncing it, renaming it to its
final name and syncing the directory; a reader verifies the header, the length and the payload
checksum, so a missing, truncated or corrupted file is detected and never yields wrong bytes.

:class:`SsdIndex` is the tier's bookkeeping: committed entries, in-flight reservations, bytes
used against the capacity, readers in flight (whose objects are not evicted), and its own
eviction policy (:mod:`mooncake._core.policies`). :class:`Admission` rules decide whether an
SSD hit is promoted back to DRAM and (``admit_dram``, ``admit_ssd``) whether an object enters
DRAM in place of a victim, or is written to the SSD on demotion: :class:`TinyLFUAdmission` and
:class:`FrequencyAdmission` count accesses in a :class:`FrequencySketch` for that.
:class:`TierCounters` are the per-tier metrics.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from mooncake._core.policies import EvictionPolicy, make_policy
from mooncake.errors import InvalidArgumentError, NoAvailableHandleError

__all__ = [
    "BLOCK",
    "MAGIC",
    "TIERS",
    "Admission",
    "AlwaysAdmit",
    "FrequencyAdmission",
    "FrequencySketch",
    "HitCountAdmission",
    "NeverAdmit",
    "Reservation",
    "SsdEntry",
    "SsdHeader",
    "SsdIndex",
    "TierCounters",
    "TinyLFUAdmission",
    "decode_header",
    "encode_header",
    "file_length",
    "file_name",
    "header_length",
    "make_admission",
    "round_up",
]

BLOCK = 4096
"""Alignment of every SSD write and read (logical block size ``O_DIRECT`` needs; 4 KiB)."""

MAGIC = b"MCSSD\x01\r\n"
_FIXED = struct.Struct("<8sIIQQII")  # magic, version, flags, generation, size, checksum, key_len
HEADER_FIXED = _FIXED.size
_CRC = struct.Struct("<I")
VERSION = 1
MAX_KEY_BYTES = 1 << 16

TIERS = ("gpu", "dram", "ssd")
"""Tier names used in counters, metrics labels and miss attribution."""


def round_up(n: int, align: int = BLOCK) -> int:
    return (n + align - 1) // align * align


def header_length(key_bytes: int) -> int:
    """Bytes of the header block of an object whose key is ``key_bytes`` long (UTF-8)."""
    return round_up(HEADER_FIXED + key_bytes + _CRC.size)


def file_length(key_bytes: int, size: int) -> int:
    """Exact length of a committed object file (also the bytes it costs against capacity)."""
    return header_length(key_bytes) + round_up(size)


def file_name(key: str) -> str:
    """Relative path of ``key``'s file: ``ab/<32 hex>.obj`` (blake2b-128 of the UTF-8 key).

    Two keys with the same name (a 128-bit collision) cannot be confused: the header names
    its key and a read checks it.
    """
    digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return f"{digest[:2]}/{digest}.obj"


@dataclass(frozen=True, slots=True)
class SsdHeader:
    key: str
    size: int
    generation: int
    checksum: int

    @property
    def header_length(self) -> int:
        return header_length(len(self.key.encode()))

    @property
    def file_length(self) -> int:
        return file_length(len(self.key.encode()), self.size)


def encode_header(header: SsdHeader) -> bytes:
    """The whole header block (zero-padded to :data:`BLOCK`)."""
    key = header.key.encode()
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"key of {len(key)} bytes is too long for the SSD tier (at most {MAX_KEY_BYTES})"
        )
    if header.size < 0 or header.generation < 0 or not 0 <= header.checksum < 1 << 32:
        raise InvalidArgumentError(f"bad SSD header fields: {header!r}")
    body = (
        _FIXED.pack(MAGIC, VERSION, 0, header.generation, header.size, header.checksum, len(key))
        + key
    )
    body += _CRC.pack(zlib.crc32(body))
    return body + bytes(header_length(len(key)) - len(body))


def decode_header(block: bytes | bytearray | memoryview) -> SsdHeader:
    """Parse a header block (at least the used part). Raises ``ValueError`` saying what is wrong."""
    mv = memoryview(block)
    if len(mv) < HEADER_FIXED + _CRC.size:
        raise ValueError(f"header truncated: {len(mv)} bytes")
    magic, version, flags, generation, size, checksum, key_len = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise ValueError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ValueError(f"unsupported format version {version}")
    if key_len > MAX_KEY_BYTES:
        raise ValueError(f"key length {key_len} out of range")
    end = HEADER_FIXED + key_len
    if len(mv) < end + _CRC.size:
        raise ValueError(f"header truncated: {len(mv)} bytes, key needs {end + _CRC.size}")
    (crc,) = _CRC.unpack_from(mv, end)
    if crc != zlib.crc32(mv[:end]):
        raise ValueError("header checksum mismatch")
    if flags != 0:
        raise ValueError(f"unknown flags {flags:#x}")
    try:
        key = bytes(mv[HEADER_FIXED:end]).decode()
    except UnicodeDecodeError:
        raise ValueError("key is not UTF-8") from None
    return SsdHeader(key, size, generation, checksum)


# -- index --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SsdEntry:
    """A committed object on the SSD tier."""

    key: str
    size: int
    generation: int
    checksum: int
    name: str
    """Relative file path (:func:`file_name`)."""

    @property
    def disk_bytes(self) -> int:
        return file_length(len(self.key.encode()), self.size)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Space set aside for a write in flight; :meth:`SsdIndex.commit` or ``abort`` ends it."""

    key: str
    size: int
    generation: int
    disk_bytes: int
    victims: tuple[SsdEntry, ...]
    """Entries evicted to make room: already gone from the index; the caller deletes files."""


class SsdIndex:
    """Bookkeeping of one SSD tier (see the module docstring). Not thread-safe: one owner.

    ``used`` counts committed files plus reservations; it never exceeds ``capacity``.
    """

    def __init__(self, capacity: int, policy: EvictionPolicy | str = "lru") -> None:
        if not isinstance(capacity, int) or capacity < BLOCK * 2:
            raise InvalidArgumentError(
                f"SSD capacity must be an int >= {BLOCK * 2} bytes, got {capacity!r}"
            )
        self.capacity = capacity
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        if len(self.policy):
            raise InvalidArgumentError("the SSD tier needs a fresh (empty) policy object")
        self.entries: dict[str, SsdEntry] = {}
        self.used = 0
        self._reserved: dict[str, Reservation] = {}
        self._readers: dict[str, int] = {}
        self._next_generation = 1

    # -- lookups ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def get(self, key: str) -> SsdEntry | None:
        return self.entries.get(key)

    # -- reads ------------------------------------------------------------------------------

    def begin_read(self, key: str) -> SsdEntry | None:
        """Start a read of ``key`` (counts a hit with the policy); ``None`` if absent.

        Until :meth:`end_read`, the object is not proposed for eviction.
        """
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.policy.on_access(key)
        self._readers[key] = self._readers.get(key, 0) + 1
        return entry

    def end_read(self, key: str) -> None:
        n = self._readers[key] - 1
        if n:
            self._readers[key] = n
        else:
            del self._readers[key]

    # -- writes -----------------------------------------------------------------------------

    def reserve(self, key: str, size: int) -> Reservation:
        """Set aside room for ``key`` (``size`` payload bytes), evicting by policy if needed.

        Raises :class:`NoAvailableHandleError` if the object cannot fit even after evicting
        every evictable object (larger than the capacity, or the rest is being read/written);
        nothing is evicted then. Raises :class:`InvalidArgumentError` if ``key`` already has a
        write in flight (the caller serialises writes per key).
        """
        if key in self._reserved:
            raise InvalidArgumentError(f"{key!r} already has an SSD write in flight")
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size of {key!r} must be an int >= 0, got {size!r}")
        need = file_length(len(key.encode()), size)
        if need > self.capacity:
            raise NoAvailableHandleError(
                f"{key!r} needs {need} bytes on SSD, more than the tier's capacity {self.capacity}"
            )
        victims: list[SsdEntry] = []
        short = self.used + need - self.capacity
        if short > 0:
            readers, reserved = self._readers, self._reserved
            keys = self.policy.victims(short, lambda k: k not in readers and k not in reserved)
            freed = sum(self.entries[str(k)].disk_bytes for k in keys)
            if freed < short:
                raise NoAvailableHandleError(
                    f"SSD tier full: {key!r} needs {need} bytes, {self.capacity - self.used} "
                    f"free and only {freed} evictable (the rest is being read or written)"
                )
            for k in keys:
                victims.append(self._forget(str(k)))
        generation = self._next_generation
        self._next_generation += 1
        res = Reservation(key, size, generation, need, tuple(victims))
        self._reserved[key] = res
        self.used += need
        return res

    def commit(self, res: Reservation, checksum: int) -> SsdEntry | None:
        """The file of ``res`` is durable under its final name. Returns the entry it replaced."""
        if self._reserved.get(res.key) is not res:
            raise InvalidArgumentError(f"no such reservation for {res.key!r}")
        del self._reserved[res.key]
        old = self.entries.get(res.key)
        if old is not None:
            self._forget(res.key)
        entry = SsdEntry(res.key, res.size, res.generation, checksum, file_name(res.key))
        self.entries[res.key] = entry
        self.policy.on_insert(res.key, entry.disk_bytes)
        return old

    def abort(self, res: Reservation) -> None:
        """The write of ``res`` failed or was cancelled: release its room."""
        if self._reserved.get(res.key) is res:
            del self._reserved[res.key]
            self.used -= res.disk_bytes

    def _forget(self, key: str) -> SsdEntry:
        entry = self.entries.pop(key)
        self.policy.on_remove(key)
        self.used -= entry.disk_bytes
        return entry

    def remove(self, key: str) -> SsdEntry | None:
        """Drop ``key`` (removed, corrupt or lost); the caller deletes the file."""
        if key not in self.entries:
            return None
        return self._forget(key)

    def next_victim(self, key: str, size: int) -> str | None:
        """The object :meth:`reserve` would evict first to make room for ``key`` (``size``
        payload bytes), or ``None`` if it fits now (or nothing is evictable). Evicts nothing."""
        short = self.used + file_length(len(key.encode()), size) - self.capacity
        if short <= 0:
            return None
        readers, reserved = self._readers, self._reserved
        keys = self.policy.victims(short, lambda k: k not in readers and k not in reserved)
        return str(keys[0]) if keys else None

    def evict(self, nbytes: int) -> list[SsdEntry]:
        """Evict by policy until ``nbytes`` are freed (or nothing evictable is left)."""
        readers, reserved = self._readers, self._reserved
        keys = self.policy.victims(nbytes, lambda k: k not in readers and k not in reserved)
        return [self._forget(str(k)) for k in keys]

    # -- recovery ---------------------------------------------------------------------------

    def recover(self, headers: Iterable[SsdHeader]) -> list[SsdHeader]:
        """Load the headers of files found at start-up (oldest generation inserted first).

        Returns the ones not loaded because they do not fit the (possibly smaller) capacity
        any more; the caller deletes those files. Must be called on an empty index.
        """
        if self.entries or self._reserved:
            raise InvalidArgumentError("recover() needs an empty index")
        ordered = sorted(headers, key=lambda h: h.generation)
        dropped: list[SsdHeader] = []
        # Newest first against the capacity: when the tier shrank, keep the most recent.
        keep: list[SsdHeader] = []
        used = 0
        seen: set[str] = set()
        for h in reversed(ordered):
            if h.key in seen or used + h.file_length > self.capacity:
                dropped.append(h)
                continue
            seen.add(h.key)
            used += h.file_length
            keep.append(h)
        for h in reversed(keep):
            entry = SsdEntry(h.key, h.size, h.generation, h.checksum, file_name(h.key))
            self.entries[h.key] = entry
            self.policy.on_insert(h.key, entry.disk_bytes)
        self.used = used
        if ordered:
            self._next_generation = max(self._next_generation, ordered[-1].generation + 1)
        return dropped


# -- promotion admission ------------------------------------------------------------------


class Admission(ABC):
    """Admission at the tier boundaries.

    ``admit(key)``: on each hit of an object served from a lower tier, count it and say
    whether to promote it now. ``admit_dram(key, victim)``: may ``key`` take DRAM room from
    ``victim`` (the object DRAM's policy would evict for it; ``None`` when there is room)?
    ``admit_ssd(key, victim)``: on demotion, may ``key`` be written to the SSD (``victim``:
    the SSD's next eviction, or ``None``)? ``record(key)`` counts an access for rules that
    keep frequencies. The defaults admit everything and count nothing (write-through).
    """

    name: str = ""

    @abstractmethod
    def admit(self, key: Hashable) -> bool:
        """Count a hit on ``key``; return True to promote it now."""

    def forget(self, key: Hashable) -> None:
        """``key`` left the lower tier (its history may be dropped)."""

    def record(self, key: Hashable) -> None:
        """Count one access of ``key`` (a no-op for rules without frequencies)."""

    def admit_dram(self, key: Hashable, victim: Hashable | None) -> bool:
        """Whether ``key`` may enter DRAM, evicting ``victim`` if it is not ``None``."""
        return True

    def admit_ssd(self, key: Hashable, victim: Hashable | None) -> bool:
        """Whether ``key`` may be written to the SSD on demotion (evicting ``victim``)."""
        return True


class AlwaysAdmit(Admission):
    name = "always"

    def admit(self, key: Hashable) -> bool:
        return True


class NeverAdmit(Admission):
    name = "never"

    def admit(self, key: Hashable) -> bool:
        return False


class HitCountAdmission(Admission):
    """Promote on the ``threshold``-th hit, counted in a count-min sketch (bounded memory).

    Like the published Mooncake's ``promotion_on_hit`` (CountMin, threshold 2). Counts are
    halved every ``window`` hits so history ages out. A count-min sketch only over-counts:
    collisions can promote a key early (rare with the default 4 x 4096 counters), never late.
    """

    name = "hits"

    def __init__(
        self, threshold: int = 2, *, width: int = 4096, depth: int = 4, window: int = 1 << 16
    ) -> None:
        if threshold < 1:
            raise InvalidArgumentError(f"threshold must be >= 1, got {threshold!r}")
        if width < 1 or width & (width - 1) or not 1 <= depth <= 8 or window < 1:
            raise InvalidArgumentError(
                f"bad sketch shape width={width!r} (power of two) depth={depth!r} (1..8) "
                f"window={window!r}"
            )
        self.threshold = threshold
        self.window = window
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(depth)]
        self._seen = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
        return [
            int.from_bytes(h[2 * i : 2 * i + 2], "little") & self._mask
            for i in range(len(self._rows))
        ]

    def count(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self._rows, self._slots(key), strict=True))

    def admit(self, key: Hashable) -> bool:
        slots = self._slots(key)
        for row, i in zip(self._rows, slots, strict=True):
            if row[i] < 255:
                row[i] += 1
        self._seen += 1
        if self._seen >= self.window:
            self._seen = 0
            for row in self._rows:
                row[:] = bytes(v >> 1 for v in row)
        return min(row[i] for row, i in zip(self._rows, slots, strict=True)) >= self.threshold


_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


class FrequencySketch:
    """TinyLFU's frequency estimate (Einziger et al., TOS 2017) in bounded memory.

    A doorkeeper (a bit per hashed key, ``width * 8`` bits) absorbs each key's first access;
    later ones go to a count-min sketch of ``depth`` rows of ``width`` saturating 8-bit
    counters. After ``window`` accesses (default ``8 * width``) every counter is halved and
    the doorkeeper cleared, so old popularity ages out. ``estimate(key)`` is the doorkeeper
    bit plus the sketch's minimum: never below the true count since the last reset, over it
    only on collisions. Keys are hashed with ``hash()``: stable for ints, per process for str.
    """

    __slots__ = ("_door", "_mask", "_rows", "_seen", "window")

    def __init__(self, width: int = 1 << 16, depth: int = 4, window: int | None = None) -> None:
        if not 8 <= width <= 1 << 16 or width & (width - 1) or not 1 <= depth <= 4:
            raise InvalidArgumentError(
                f"bad sketch shape width={width!r} (power of two in 8..65536) "
                f"depth={depth!r} (1..4)"
            )
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(depth)]
        self._door = bytearray(width)
        self.window = window if window is not None else 8 * width
        if self.window < 1:
            raise InvalidArgumentError(f"window must be >= 1, got {window!r}")
        self._seen = 0

    def add(self, key: Hashable) -> None:
        """Count one access of ``key``."""
        h = (hash(key) * _MIX) & _M64
        mask = self._mask
        door, bit = self._door, 1 << ((h >> 61) & 7)
        i = h & mask
        if not door[i] & bit:
            door[i] |= bit
        else:
            for row in self._rows:
                j = h & mask
                if row[j] < 255:
                    row[j] += 1
                h >>= 16
        self._seen += 1
        if self._seen >= self.window:
            self._seen = 0
            for row in self._rows:
                row[:] = bytes(v >> 1 for v in row)
            self._door[:] = bytes(len(self._door))

    def estimate(self, key: Hashable) -> int:
        """Accesses of ``key`` since the last halving (an upper bound; see the class doc)."""
        h = (hash(key) * _MIX) & _M64
        mask = self._mask
        if not self._door[h & mask] & (1 << ((h >> 61) & 7)):
            return 0
        least = 255
        for row in self._rows:
            v = row[h & mask]
            if v < least:
                least = v
            h >>= 16
        return least + 1


class TinyLFUAdmission(Admission):
    """TinyLFU admission: a candidate enters a full tier only if it is more popular than the
    victim it would displace (the frequency filter of Dynamo KVBM's offload path).

    SSD (demotion): written only once seen before (``estimate >= 2``) and, when the SSD is
    full, ``estimate(key) > estimate(victim)`` (ties keep the resident: a write saved).
    DRAM (with ``dram=True``, rule ``"tinylfu-dram"``): a new block displaces DRAM's victim only
    when ``estimate(key) >= estimate(victim)`` (ties favour the newer block); by default DRAM
    admits every block (a recency window in front of the filter, as W-TinyLFU's). Promotion of
    an SSD hit: when ``estimate >= 2``. Accesses are counted by :meth:`record` (and by
    :meth:`admit`, for hits served from the lower tier).
    """

    def __init__(self, sketch: FrequencySketch | None = None, *, dram: bool = False) -> None:
        self.sketch = sketch if sketch is not None else FrequencySketch()
        self.dram = dram
        self.name = "tinylfu-dram" if dram else "tinylfu"

    def record(self, key: Hashable) -> None:
        self.sketch.add(key)

    def admit(self, key: Hashable) -> bool:
        self.sketch.add(key)
        return self.sketch.estimate(key) >= 2

    def admit_dram(self, key: Hashable, victim: Hashable | None) -> bool:
        if victim is None or not self.dram:
            return True
        est = self.sketch.estimate
        return est(key) >= est(victim)

    def admit_ssd(self, key: Hashable, victim: Hashable | None) -> bool:
        est = self.sketch.estimate
        mine = est(key)
        return mine >= 2 and (victim is None or mine > est(victim))


class FrequencyAdmission(Admission):
    """Frequency threshold: write to the SSD on demotion (and promote an SSD hit) only once a
    key has been accessed ``threshold`` times (in the sketch's window); DRAM admits all."""

    name = "freq"

    def __init__(self, threshold: int = 2, sketch: FrequencySketch | None = None) -> None:
        if threshold < 1:
            raise InvalidArgumentError(f"threshold must be >= 1, got {threshold!r}")
        self.threshold = threshold
        self.sketch = sketch if sketch is not None else FrequencySketch()

    def record(self, key: Hashable) -> None:
        self.sketch.add(key)

    def admit(self, key: Hashable) -> bool:
        self.sketch.add(key)
        return self.sketch.estimate(key) >= self.threshold

    def admit_ssd(self, key: Hashable, victim: Hashable | None) -> bool:
        return self.sketch.estimate(key) >= self.threshold


def make_admission(rule: str | Admission) -> Admission:
    """``"always"``, ``"never"``, ``"hits"`` (threshold 2) or ``"hits:N"``, ``"tinylfu"``,
    ``"tinylfu-dram"``, ``"freq"`` (threshold 2) or ``"freq:N"``; or an instance."""
    if isinstance(rule, Admission):
        return rule
    if not isinstance(rule, str):
        raise InvalidArgumentError(f"admission rule must be a str or Admission, got {rule!r}")
    name, _, arg = rule.strip().lower().partition(":")
    if name == "always" and not arg:
        return AlwaysAdmit()
    if name == "never" and not arg:
        return NeverAdmit()
    if name == "hits":
        try:
            threshold = int(arg) if arg else 2
        except ValueError:
            raise InvalidArgumentError(f"bad hit threshold in admission rule {rule!r}") from None
        return HitCountAdmission(threshold)
    if name in ("tinylfu", "tinylfu-dram") and not arg:
        return TinyLFUAdmission(dram=name == "tinylfu-dram")
    if name == "freq":
        try:
            threshold = int(arg) if arg else 2
        except ValueError:
            raise InvalidArgumentError(f"bad threshold in admission rule {rule!r}") from None
        return FrequencyAdmission(threshold)
    raise InvalidArgumentError(
        f"unknown admission rule {rule!r}: use 'always', 'never', 'hits', 'hits:N', "
        "'tinylfu', 'tinylfu-dram', 'freq' or 'freq:N'"
    )


# -- counters -----------------------------------------------------------------------------


@dataclass(slots=True)
class TierCounters:
    """Per-tier counters (metrics labels ``tier``)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    """Objects written into this tier from the tier above."""
    promotions: int = 0
    """Objects copied from this tier to the tier above."""
    errors: int = 0
    """Objects dropped because their bytes were missing or corrupt."""
    bytes_read: int = 0
    bytes_written: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        out = {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "demotions": self.demotions,
            "promotions": self.promotions,
            "errors": self.errors,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }
        out.update(self.extra)
        return out
