"""Sans-I/O pieces of the RDMA transport: wire formats, slicing, NIC choice, rail health.

Wire formats follow the published engine's RDMA mode:

* **NIC path** ``"<segment name>@<device>"`` (``MakeNicPath``); the segment name may itself hold
  ``:``, so the device is what follows the *last* ``@``.
* **GID text**: 16 bytes as two-digit lowercase hex joined by ``:`` (``RdmaContext::gid``).
* **Connection handshake** (frame type 0): ``{"local_nic_path", "peer_nic_path", "qp_num": [..],
  "reply_msg"}``, plus ``local_lid`` / ``local_gid`` (newer engines send them; older ones make
  the receiver look them up in the sender's descriptor, which :func:`decode_connection`
  leaves to the caller by returning None). A non-empty ``reply_msg`` in a reply is a refusal.
* **Descriptor** (``protocol: "rdma"``): ``devices: [{"name", "lid", "gid"}]`` index-aligned
  with every buffer's ``rkey: [..]`` / ``lkey: [..]`` arrays, and ``priority_matrix:
  {location: [[preferred devices], [available devices]]}``.

Slicing (``submitTransferTask``): slices of ``slice_size`` (64 KiB), a tail of at most
``slice_size + fragment_limit`` merged into the last slice, never crossing a cut (an MR chunk
boundary on either side).

Everything here is pure: times are passed in (``now``), randomness through a ``random.Random``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake._core.descriptor import BufferDesc, SegmentDescriptor
from mooncake.errors import ProtocolError

DEFAULT_SLICE_SIZE = 65536  # MC_SLICE_SIZE
DEFAULT_FRAGMENT_RATIO = 4  # MC_FRAGMENT_RATIO: fragment_limit = slice_size / ratio
DEFAULT_RETRY_CNT = 9  # MC_RETRY_CNT
RAIL_ERROR_THRESHOLD = 5  # kRailErrorThreshold
RAIL_ERROR_WINDOW_S = 5.0
DEFAULT_RAIL_PAUSE_S = 30.0  # MC_RDMA_RAIL_PAUSE_SECONDS
MAX_QP_PER_EP = 64
U32 = 1 << 32

# ---- GIDs and NIC paths ---------------------------------------------------------------------


def format_gid(raw: bytes) -> str:
    """16 raw GID bytes as Mooncake writes them: ``fe:80:00:...``."""
    if len(raw) != 16:
        raise ValueError(f"a GID is 16 bytes, got {len(raw)}")
    return ":".join(f"{b:02x}" for b in raw)


def parse_gid(text: str, what: str = "gid") -> bytes:
    """Parse Mooncake's GID text (also accepts 32 bare hex digits)."""
    if not isinstance(text, str):
        raise ProtocolError(f"{what} must be a string")
    parts = text.split(":")
    try:
        if len(parts) == 16 and all(len(p) in (1, 2) for p in parts):
            return bytes(int(p, 16) for p in parts)
        if len(parts) == 1 and len(text) == 32:
            return bytes.fromhex(text)
    except ValueError:
        pass
    raise ProtocolError(f"{what} {text[:64]!r} is not 16 hex bytes separated by ':'")


def nic_path(segment: str, device: str) -> str:
    return f"{segment}@{device}"


def split_nic_path(path: str, what: str = "NIC path") -> tuple[str, str]:
    """``(segment, device)`` of ``"<segment>@<device>"``."""
    if not isinstance(path, str):
        raise ProtocolError(f"{what} must be a string")
    seg, sep, dev = path.rpartition("@")
    if not sep or not seg or not dev:
        raise ProtocolError(f"{what} {path[:128]!r} is not '<segment>@<device>'")
    return seg, dev


# ---- connection handshake -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """One side of the endpoint handshake (``HandShakeDesc``)."""

    local_nic_path: str
    peer_nic_path: str
    qp_num: tuple[int, ...]
    lid: int | None = None
    gid: bytes | None = None
    reply_msg: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "local_nic_path": self.local_nic_path,
            "peer_nic_path": self.peer_nic_path,
            "qp_num": list(self.qp_num),
            "reply_msg": self.reply_msg,
        }
        if self.lid is not None:
            out["local_lid"] = self.lid
        if self.gid is not None:
            out["local_gid"] = format_gid(self.gid)
        return out


def decode_connection(obj: Any) -> ConnectionInfo:
    """Validate a Connection frame payload (:class:`ProtocolError` naming what is wrong)."""
    if not isinstance(obj, dict):
        raise ProtocolError("connection handshake must be a JSON object")
    reply = obj.get("reply_msg", "")
    if not isinstance(reply, str):
        raise ProtocolError("connection handshake: 'reply_msg' must be a string")
    local = obj.get("local_nic_path", "")
    peer = obj.get("peer_nic_path", "")
    if not isinstance(local, str) or not isinstance(peer, str):
        raise ProtocolError("connection handshake: NIC paths must be strings")
    qps = obj.get("qp_num", [])
    if not isinstance(qps, list) or len(qps) > MAX_QP_PER_EP:
        raise ProtocolError(f"connection handshake: 'qp_num' must be a list of <= {MAX_QP_PER_EP}")
    for q in qps:
        if isinstance(q, bool) or not isinstance(q, int) or not 0 < q < (1 << 24):
            raise ProtocolError(f"connection handshake: QP number {q!r} outside (0, 2^24)")
    lid = obj.get("local_lid")
    if lid is not None and (
        isinstance(lid, bool) or not isinstance(lid, int) or not 0 <= lid < 65536
    ):
        raise ProtocolError(f"connection handshake: local_lid {lid!r} outside [0, 65535]")
    gid_text = obj.get("local_gid")
    gid = parse_gid(gid_text, "connection handshake local_gid") if gid_text else None
    if not reply:
        split_nic_path(local, "connection handshake local_nic_path")
        split_nic_path(peer, "connection handshake peer_nic_path")
        if not qps:
            raise ProtocolError("connection handshake: no QP numbers")
    return ConnectionInfo(local, peer, tuple(qps), lid, gid, reply)


# ---- descriptor fields ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceDesc:
    name: str
    lid: int
    gid: bytes


@dataclass(frozen=True, slots=True)
class PriorityMatrix:
    """``location -> (preferred devices, available devices)`` by device index."""

    entries: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]
    ndevices: int

    def candidates(self, location: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        e = self.entries.get(location) or self.entries.get("*")
        if e is None and ":" in location:
            # "cpu:3" unknown here: any cpu entry beats nothing
            kind = location.split(":", 1)[0] + ":"
            e = next((v for k, v in sorted(self.entries.items()) if k.startswith(kind)), None)
        if e is None or not (e[0] or e[1]):
            return tuple(range(self.ndevices)), ()
        return e

    def select(
        self,
        location: str,
        retry: int,
        rng: random.Random,
        usable: Iterable[int] | None = None,
    ) -> int | None:
        """Mooncake's ``selectDevice``: retry 0 picks at random among the preferred devices
        (else the available ones); retry k > 0 rotates deterministically over preferred then
        available. Devices not in ``usable`` (paused rails, inactive NICs) are skipped; None if
        nothing is left."""
        preferred, available = self.candidates(location)
        ok = set(range(self.ndevices)) if usable is None else set(usable)
        pref = [d for d in preferred if d in ok]
        allc = pref + [d for d in available if d in ok and d not in pref]
        if not allc:
            return None
        if retry == 0:
            return rng.choice(pref or allc)
        return allc[(retry - 1) % len(allc)] if len(allc) > 1 else allc[0]

    def to_json(self, names: Sequence[str]) -> dict[str, list[list[str]]]:
        return {
            loc: [[names[i] for i in pref], [names[i] for i in avail]]
            for loc, (pref, avail) in self.entries.items()
        }

    @classmethod
    def from_json(cls, obj: Any, names: Sequence[str], what: str) -> PriorityMatrix:
        if obj is None:
            return cls({}, len(names))
        if not isinstance(obj, dict):
            raise ProtocolError(f"{what}: 'priority_matrix' must be an object")
        index = {n: i for i, n in enumerate(names)}
        entries: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for loc, val in obj.items():
            if (
                not isinstance(val, list)
                or len(val) < 2
                or not all(isinstance(x, list) for x in val[:2])
            ):
                raise ProtocolError(f"{what}: priority_matrix[{loc!r}] must be [[...], [...]]")
            lists = []
            for lst in val[:2]:
                ids = []
                for n in lst:
                    if n not in index:
                        raise ProtocolError(
                            f"{what}: priority_matrix[{loc!r}] names unknown device {n!r}"
                        )
                    ids.append(index[n])
                lists.append(tuple(ids))
            entries[str(loc)] = (lists[0], lists[1])
        return cls(entries, len(names))


@dataclass(frozen=True, slots=True)
class RdmaSegment:
    """The RDMA view of a peer's descriptor: devices, topology, rkeys per buffer."""

    devices: tuple[DeviceDesc, ...]
    matrix: PriorityMatrix

    def device_index(self, name: str) -> int | None:
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        return None

    def rkey(self, buf: BufferDesc, device: int, what: str = "buffer") -> int:
        keys = buf.extra.get("rkey")
        if not isinstance(keys, list) or len(keys) != len(self.devices):
            raise ProtocolError(
                f"{what} [{buf.addr:#x}, +{buf.length}): 'rkey' must list one key per device"
            )
        k = keys[device]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < U32:
            raise ProtocolError(f"{what} [{buf.addr:#x}, +{buf.length}): bad rkey {k!r}")
        return k


def decode_rdma_segment(desc: SegmentDescriptor) -> RdmaSegment | None:
    """The RDMA fields of ``desc`` (None if it has none; :class:`ProtocolError` if malformed)."""
    raw = desc.extra.get("devices")
    if raw is None:
        return None
    what = f"segment descriptor {desc.name!r}"
    if not isinstance(raw, list) or not raw:
        raise ProtocolError(f"{what}: 'devices' must be a non-empty list")
    devices = []
    for i, d in enumerate(raw):
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
            raise ProtocolError(f"{what}: devices[{i}] needs a 'name'")
        lid = d.get("lid", 0)
        if isinstance(lid, bool) or not isinstance(lid, int) or not 0 <= lid < 65536:
            raise ProtocolError(f"{what}: devices[{i}] lid {lid!r} outside [0, 65535]")
        gid = parse_gid(d.get("gid", "0" * 32), f"{what} devices[{i}] gid")
        devices.append(DeviceDesc(d["name"], lid, gid))
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ProtocolError(f"{what}: duplicate device names")
    matrix = PriorityMatrix.from_json(desc.extra.get("priority_matrix"), names, what)
    return RdmaSegment(tuple(devices), matrix)


# ---- slicing --------------------------------------------------------------------------------


def split_lengths(
    length: int,
    slice_size: int = DEFAULT_SLICE_SIZE,
    fragment_limit: int | None = None,
    cuts: Iterable[int] = (),
) -> list[tuple[int, int]]:
    """``(offset, length)`` slices of ``[0, length)``.

    Full slices of ``slice_size``; when what is left is at most ``slice_size + fragment_limit``
    it becomes one (last) slice; no slice crosses an offset in ``cuts`` (each cut starts a new
    piece that is sliced the same way).
    """
    if slice_size <= 0:
        raise ValueError("slice_size must be positive")
    if fragment_limit is None:
        fragment_limit = slice_size // DEFAULT_FRAGMENT_RATIO
    bounds = sorted({c for c in cuts if 0 < c < length} | {0, length})
    out: list[tuple[int, int]] = []
    for lo, hi in itertools.pairwise(bounds):
        off = lo
        while off < hi:
            left = hi - off
            n = left if left <= slice_size + fragment_limit else slice_size
            out.append((off, n))
            off += n
    return out


# ---- rail health ----------------------------------------------------------------------------


@dataclass
class RailHealth:
    """Errors per rail (local device, peer NIC path): ``threshold`` errors within ``window`` s
    pause the rail for ``pause`` s (``kRailErrorThreshold`` / ``MC_RDMA_RAIL_PAUSE_SECONDS``)."""

    threshold: int = RAIL_ERROR_THRESHOLD
    window: float = RAIL_ERROR_WINDOW_S
    pause: float = DEFAULT_RAIL_PAUSE_S
    _errors: dict[Any, list[float]] = field(default_factory=dict)
    _paused_until: dict[Any, float] = field(default_factory=dict)

    def record_error(self, rail: Any, now: float) -> bool:
        """Count one error; True if this one paused the rail."""
        errs = [t for t in self._errors.get(rail, []) if now - t < self.window]
        errs.append(now)
        if len(errs) >= self.threshold:
            self._errors.pop(rail, None)
            self._paused_until[rail] = now + self.pause
            return True
        self._errors[rail] = errs
        return False

    def record_success(self, rail: Any) -> None:
        self._errors.pop(rail, None)

    def paused(self, rail: Any, now: float) -> bool:
        until = self._paused_until.get(rail)
        if until is None:
            return False
        if now >= until:
            del self._paused_until[rail]
            return False
        return True

    def paused_rails(self, now: float) -> list[Any]:
        return [r for r in list(self._paused_until) if self.paused(r, now)]
