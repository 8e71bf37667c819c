"""How much memory this machine can still back: allocations that cannot fit are refused up front.

Segments and buffers are pre-faulted (every page touched at allocation), so one larger than
the memory left does not fail at ``mmap``: it grinds through swap or reclaim for minutes and is
then killed by the OOM killer. :func:`check_backable` refuses such a size at once, naming it and
what is available: the smaller of ``MemAvailable`` (``/proc/meminfo``) and the room left under
this process's memory cgroup limit (v2 ``memory.max`` - ``memory.current``, or v1
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), where either is known.
``MC_MEMORY_CHECK=0`` turns the check off (an operator who knows better, e.g. hugepage pools).
"""

from __future__ import annotations

import os
from pathlib import Path

from mooncake.errors import InvalidArgumentError

CHECK_ENV = "MC_MEMORY_CHECK"
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number

__all__ = ["CHECK_ENV", "available_bytes", "check_backable"]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path, self_cgroup: Path) -> int | None:
    """Bytes left under this process's memory cgroup limit, or None if unlimited/unknown."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            base = root / rel
            limit, used = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        elif "memory" in controllers.split(","):
            base = root / "memory" / rel
            if not base.exists():
                base = root / "memory"  # the namespace's own view
            limit = _read_int(base / "memory.limit_in_bytes")
            used = _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < _NO_LIMIT and used is not None:
            return max(0, limit - used)
    return None


def available_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    self_cgroup: Path = Path("/proc/self/cgroup"),
) -> int | None:
    """Bytes this process can still back with memory now (None: nothing known)."""
    known = [
        v
        for v in (_mem_available(meminfo), _cgroup_room(cgroup_root, self_cgroup))
        if v is not None
    ]
    return min(known) if known else None


def check_backable(size: int, what: str, available: int | None = None) -> None:
    """Raise :class:`InvalidArgumentError` if ``size`` bytes (a pre-faulted ``what``) exceed
    what the machine can back now (``available``: measured when None); nothing when the
    amount is unknown or ``MC_MEMORY_CHECK=0``."""
    if os.environ.get(CHECK_ENV, "1") in ("0", "false", "False"):
        return
    if available is None:
        available = available_bytes()
    if available is not None and size > available:
        raise InvalidArgumentError(
            f"{what} of {size} bytes ({size / (1 << 30):.1f} GiB) cannot be backed: only "
            f"{available} bytes ({available / (1 << 30):.1f} GiB) of memory are available "
            f"(MemAvailable and the memory cgroup's limit; {CHECK_ENV}=0 skips this check)"
        )
