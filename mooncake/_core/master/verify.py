"""Verified reads, the master's half: each readable version's CRC32C, and corrupt replicas.

The writer sends the CRC32C of the whole value with ``PutEnd``/``UpsertEnd``
(:class:`~mooncake._core.rpc.PutEndParams`); the master keeps it in one 64-bit slot per object
handle (``_crcs``, an ``array('Q')`` indexed by handle: **8 bytes per object**): a tag of the
version id in the high 32 bits, the CRC in the low 32. A slot answers only while its tag is the
readable version's, so what an earlier version (or an earlier object of a reused handle) left
there never answers for a new one: such a version simply has no CRC. ``GetReplicaList`` hands
the CRC out as :attr:`~mooncake._core.store_types.GetReplicaListResponse.crc` (``-1``: none,
e.g. written by a client that sent none) together with the version id ``vid``, the object's
*generation* (strictly increasing per key: every put or upsert draws a new one).

A reader whose bytes fail the CRC reports the replica (``ReportCorruptReplica``): the master
drops that replica at once (its space returns after the read windows already granted on it,
as for any dropped replica) and, when it was the version's last memory replica, removes the
object (``OBJECT_NOT_FOUND`` afterwards, attributed ``removed: corrupt``). A report for a
version that is no longer the readable one, or for a replica already gone, changes nothing.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from mooncake._core.master.base import _StateBase
from mooncake._core.master.config import _codes
from mooncake.errors import ObjectHasReplicationTaskError

#: the CRC of a version written without one
NO_CRC = -1
_TAG_MOD = 0xFFFFFFFF  # tags are 1 .. 2**32 - 1: a zeroed slot matches no version


def _tag(vid: int) -> int:
    return (vid % _TAG_MOD) + 1


class _Verify(_StateBase):
    """Per-version CRC32C records and corrupt-replica reports (part of the master state)."""

    _crcs: array[int]

    if TYPE_CHECKING:

        def put_end(self, client_id: str, key: str, now: float) -> None: ...

    def _crc_slots(self) -> array[int]:
        slots = self.__dict__.get("_crcs")
        if slots is None:  # a state restored from a snapshot taken before CRCs existed
            slots = self._crcs = array("Q")
        return slots

    def record_crc(self, h: int, vid: int, crc: int) -> None:
        """Version ``vid`` of the object of handle ``h`` has CRC32C ``crc`` (``-1``: none)."""
        slots = self._crc_slots()
        if h >= len(slots):
            slots.frombytes(bytes(8 * (h + 1 + (h >> 3) - len(slots))))
        slots[h] = (_tag(vid) << 32) | (crc & 0xFFFFFFFF) if crc >= 0 else 0

    def crc_of(self, h: int, vid: int) -> int:
        """The CRC32C recorded for version ``vid`` of handle ``h``, or ``-1``."""
        slots = self._crc_slots()
        if h < len(slots):
            v = slots[h]
            if v >> 32 == _tag(vid):
                return v & 0xFFFFFFFF
        return NO_CRC

    def put_end_crc(self, client_id: str, key: str, crc: int, now: float) -> None:
        """``PutEnd``/``UpsertEnd`` recording the value's CRC32C (``-1``: none)."""
        self.put_end(client_id, key, now)
        obj = self._objects.get(key)
        if obj is not None and obj.readable is not None:
            self.record_crc(obj.h, obj.readable.vid, crc)

    def batch_put_end_crc(
        self, client_id: str, keys: list[str], crcs: list[int], now: float
    ) -> list[int]:
        """``BatchPutEnd``/``BatchUpsertEnd``: ``crcs[i]`` for ``keys[i]`` (missing: none)."""
        it = iter(range(len(keys)))
        return _codes(
            lambda k: self.put_end_crc(
                client_id, k, crcs[i] if (i := next(it)) < len(crcs) else NO_CRC, now
            ),
            keys,
        )

    def report_corrupt_replica(
        self, client_id: str, key: str, vid: int, segment_name: str, addr: int, now: float
    ) -> int:
        """Drop the replica ``(segment_name, addr)`` of version ``vid`` of ``key``, whose bytes
        failed their CRC32C at ``client_id``; the readable replicas left (0: the object is
        gone, or was not that version any more)."""
        self.stats.corrupt_reports += 1
        obj = self._objects.get(key)
        if obj is None or obj.readable is None or obj.readable.vid != vid:
            return 0
        ver = obj.readable
        gone = [r for r in ver.replicas if r.seg.segment.name == segment_name and r.addr == addr]
        if not gone:
            return len(ver.replicas)
        if obj.task is not None:
            raise ObjectHasReplicationTaskError(
                f"object {key!r} has task {obj.task.id} in flight; its corrupt replica stays "
                "until the task ends"
            )
        self.stats.corrupt_replicas_dropped += 1
        if len(gone) < len(ver.replicas):
            ver.replicas = [r for r in ver.replicas if r not in gone]
            if obj.read_deadline > now:
                self._defer(obj.read_deadline, gone)
            else:
                self._free_replicas(gone)
            return len(ver.replicas)
        self._drop_object(obj, now)
        self.misses.record_removal(key, now=now, detail="corrupt: every replica failed its CRC32C")
        self.stats.corrupt_objects_removed += 1
        return 0
