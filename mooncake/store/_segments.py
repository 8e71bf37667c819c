"""The segments family: memory mounted at the master after ``setup``, and the memory pool.

* ``mount_segment(path, size, offset=0, protocol="tcp", location="")`` maps ``size`` bytes of
  the file at ``path`` (a shared-memory file, a DAX device...) from page-aligned ``offset`` and
  mounts them as one more segment of this client: ``{"ret": 0, "segment_ids": [id]}``, or
  ``ret`` -1 with no ids (unopenable file, range past its end, unaligned offset).
* ``allocate_and_mount_segment(size, protocol="tcp", location="")`` allocates ``size`` bytes
  rounded up to 16 MiB (the published slab size) and mounts them:
  ``{"ret", "segment_ids", "allocated_size"}``.
* ``unmount_segment(segment_ids, grace_period_seconds=0)`` /
  ``unmount_and_free_segment(...)`` unmount what the matching call mounted (objects stored
  there disappear) and release the memory after the grace period; 0, -1 for an id the matching
  call did not mount, or the master's code (the first error).
* ``unmount_local_disk_segment(grace_period_seconds=0)`` drains the SSD tier (0; 0 with a
  warning when there is none).
* ``alloc_from_mem_pool(size)``: 0 on a real client, as published (the pool is the dummy
  client's shared memory, see :mod:`mooncake.store._dummy`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Any

from mooncake._store.shm import SharedSegment
from mooncake.errors import MooncakeError, to_code
from mooncake.store._base import StoreBase

log = logging.getLogger("mooncake.store")

SLAB = 16 << 20


def _addr_of(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class SegmentMethods(StoreBase):
    """``mount_segment`` and friends; ``alloc_from_mem_pool``."""

    def _mount(self, addr: int, size: int, owner: Any, location: str, kind: str) -> str:
        sid: str = self._call(self._s.mount_memory, addr, size, owner, location)
        self._mounted_kinds[sid] = kind
        return sid

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"ret": -1, "segment_ids": []}
        if self._store is None:
            log.error("mount_segment: the client is not set up")
            return out
        if offset % mmap.PAGESIZE or size <= 0 or offset < 0:
            log.error(
                "mount_segment: offset %d must be page-aligned, size %d positive", offset, size
            )
            return out
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            log.error("mount_segment: open %s: %s", path, e)
            return out
        try:
            end = os.fstat(fd).st_size
            if offset > end or size > end - offset:
                log.error(
                    "mount_segment: [%d, +%d) exceeds the %d-byte %s", offset, size, end, path
                )
                return out
            m = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
            )
        except OSError as e:
            log.error("mount_segment: mmap %s: %s", path, e)
            return out
        finally:
            os.close(fd)
        try:
            sid = self._mount(_addr_of(m), size, m, location, "mounted")
        except Exception as e:
            log.error("mount_segment: %s", e)
            m.close()
            return out
        return {"ret": 0, "segment_ids": [sid]}

    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"ret": -1, "segment_ids": [], "allocated_size": 0}
        if self._store is None or not isinstance(size, int) or size <= 0:
            log.error("allocate_and_mount_segment: needs a set-up client and a positive size")
            return out
        aligned = -(-size // SLAB) * SLAB
        try:
            seg = SharedSegment(aligned, "mooncake-extra-segment")
        except (OSError, MooncakeError) as e:
            log.error("allocate_and_mount_segment: %s", e)
            return out
        try:
            sid = self._mount(seg.addr, seg.size, seg, location, "allocated")
        except Exception as e:
            log.error("allocate_and_mount_segment: %s", e)
            seg.close()
            return out
        return {"ret": 0, "segment_ids": [sid], "allocated_size": aligned}

    def _unmount(self, segment_ids: list[str], grace: int, kind: str) -> int:
        if self._store is None:
            return -1
        kinds = self._mounted_kinds
        first = 0
        for sid in segment_ids:
            if kinds.get(sid) != kind:
                log.error("%s: segment %r was not mounted by this call family", kind, sid)
                first = first or -1
                continue
            try:
                self._call(self._s.unmount_memory, sid, float(grace))
            except Exception as e:
                first = first or to_code(e)
                continue
            del kinds[sid]
        return first

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        return self._unmount(segment_ids, grace_period_seconds, "mounted")

    def unmount_and_free_segment(
        self, segment_ids: list[str], grace_period_seconds: int = 0
    ) -> int:
        return self._unmount(segment_ids, grace_period_seconds, "allocated")

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        store = self._store
        if store is None:
            return -1
        if store.ssd is None:
            log.warning("unmount_local_disk_segment: SSD offload is not enabled")
            return 0
        try:
            self._call(store.drain_ssd, float(grace_period_seconds))
        except Exception as e:
            log.error("unmount_local_disk_segment: %s", e)
            return -1
        return 0

    def alloc_from_mem_pool(self, size: int) -> int:
        """An address of ``size`` bytes in the dummy client's shared pool; 0 on a real client
        (as published: a real client's memory is its segments and registered buffers)."""
        dummy = self._dummy
        if dummy is None:
            return 0
        return int(dummy.alloc(size))
