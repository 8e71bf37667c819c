"""Verified reads, the client's half: writers checksum, readers prove their bytes.

A writer computes the CRC32C of each value (of the concatenation of its parts for a
multi-buffer value) and sends it with ``PutEnd``; the master hands it back with the replica
list (``GetReplicaListResponse.crc``, with the version id ``vid``, the object's generation).
Every read path, after the bytes have landed in the caller's memory and before it reports
success, checksums exactly those bytes and compares. A mismatch while the read window is still
open is a corrupt replica: the read goes on to the next replica, and the bad one is reported
to the master (``ReportCorruptReplica``), which drops it; when no replica verifies the read
fails with :class:`~mooncake.errors.ChecksumMismatchError` (``-801``, published
``CHECKSUM_MISMATCH``) and the master, having dropped the last replica, has removed the object.
A mismatch after the read window closed proves nothing (the space may hold another object by
then): the read fails with ``LEASE_EXPIRED`` as it would anyway, and nothing is reported.

A version with no CRC (written by a client that predates them, or with verification off) is
read unverified and counted (``unverified``). :class:`ReadVerifier` holds the switch and the
counters (exported by :mod:`mooncake._store.metrics`).

Switch: ``open_store(verify=...)``, else ``MOONCAKE_STORE_CHECKSUM`` (the published client's
variable; ``1`` on, ``0`` off), else :data:`DEFAULT`: on where this process's CRC32C kernel
is one of :data:`FAST_KERNELS`, the kernels measured to cost within the goal (<= 5 % of batch
CPU at 1 MiB x 32 put and get, <= 1 us on a 4 KiB get p50): ``avx512`` (VPCLMULQDQ folding,
its fused copy at ``memcpy``'s speed: a verified put ~0 %, a 1 MiB x 32 ``batch_get_into``
~+3 % CPU, a 4 KiB ``get`` ~2 us faster and a ``get_into`` within ~1 us; docs/benchmarks.md,
"verified reads on by default"), but a read over TCP (another host's replica) checksums what
landed in a pass of its own after the transfer, ~+17-23 % CPU at 1 MiB x 32. None is listed
until that CRC is taken per received chunk: the default is **off** with every kernel (with
the SSE4.2 / ARMv8 CRC instruction the same-host batches cost ~+28-48 %). Off: writers send
no CRC, readers check none (and count the read unverified).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from mooncake import _fast
from mooncake._core import rpc
from mooncake._core import store_types as st
from mooncake.errors import ChecksumMismatchError

log = logging.getLogger("mooncake.store")

#: the version carries no CRC
NO_CRC = -1

ENV = "MOONCAKE_STORE_CHECKSUM"


#: the CRC32C kernels (``mooncake._fast._crc32c.KERNELS``) measured fast enough for
#: verification on by default (docs/benchmarks.md): none while the TCP read path checksums in
#: a pass of its own ("avx512" meets the goal on same-host copies only)
FAST_KERNELS: tuple[str, ...] = ()

#: verified reads when neither ``open_store(verify=...)`` nor the variable says (see above):
#: whether the CRC32C kernel chosen at import is one of :data:`FAST_KERNELS`
DEFAULT = _fast.CRC_KERNEL in FAST_KERNELS


def default_enabled() -> bool:
    """``MOONCAKE_STORE_CHECKSUM`` if set (``1``/``true``/``on`` or ``0``/``false``/``off``),
    else :data:`DEFAULT`."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("0", "false", "off", "no"):
        return False
    if v in ("1", "true", "on", "yes"):
        return True
    return DEFAULT


def crc_of(addr: int, n: int) -> int:
    """The CRC32C of ``n`` bytes at ``addr``."""
    return int(_fast.crc32c_at(addr, n))


def crc_of_parts(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC32C of the concatenation of ``(address, length)`` parts."""
    return int(_fast.crc32c_parts(parts))


def crc_of_bytes(data: bytes) -> int:
    return int(_fast.crc32c(data))


def none_verified(key: str) -> ChecksumMismatchError:
    """The error of a read none of whose replicas verified."""
    return ChecksumMismatchError(
        f"{key!r}: no replica's bytes match the CRC32C its writer recorded "
        "(each was reported and dropped)"
    )


def corrupt_report(
    client_id: str, key: str, vid: int, r: st.ReplicaDescriptor
) -> rpc.CorruptReplicaParams:
    """Log replica ``r`` of version ``vid`` of ``key`` as corrupt; the report to send."""
    log.error(
        "corrupt replica of %r (version %d) at %s+%#x: its bytes fail the CRC32C its writer "
        "recorded; dropping it",
        key,
        vid,
        r.segment_name,
        r.addr,
    )
    return rpc.CorruptReplicaParams(
        client_id=client_id, key=key, vid=vid, segment_name=r.segment_name, addr=r.addr
    )


def report_blocking(
    call: Callable[[str, Any], Any],
    verifier: ReadVerifier,
    client_id: str,
    key: str,
    vid: int,
    r: st.ReplicaDescriptor,
) -> None:
    """Report a corrupt replica through a blocking master ``call`` (the caller-thread path);
    best effort: a failed report is logged."""
    from mooncake.errors import MooncakeError

    try:
        call("ReportCorruptReplica", corrupt_report(client_id, key, vid, r))
        verifier.replicas_reported += 1
    except MooncakeError as e:
        log.warning("reporting the corrupt replica of %r failed: %s", key, e)


class ReadVerifier:
    """The switch and the counters of verified reads (one per store client)."""

    __slots__ = ("enabled", "mismatches", "replicas_reported", "unverified", "verified")

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = default_enabled() if enabled is None else enabled
        self.verified = 0
        """Reads whose bytes matched their version's CRC32C."""
        self.unverified = 0
        """Reads of versions without a CRC (or with verification off) and partial ranges."""
        self.mismatches: collections.Counter[tuple[str, str]] = collections.Counter()
        """Mismatches by (tier, holder): tier ``dram`` (holder: the segment name) or ``ssd``
        (holder: this client's id)."""
        self.replicas_reported = 0
        """Corrupt replicas reported to the master (it drops each)."""

    def expected(self, resp: st.GetReplicaListResponse) -> int:
        """The CRC a read of ``resp``'s whole value must match, or :data:`NO_CRC` (counted as
        an unverified read)."""
        if not self.enabled or resp.crc < 0:
            self.unverified += 1
            return NO_CRC
        return resp.crc

    def check(self, want: int, got: int, tier: str, holder: str) -> bool:
        """Whether ``got`` matches ``want`` (counting the result)."""
        if got == want:
            self.verified += 1
            return True
        self.mismatches[(tier, holder)] += 1
        return False

    def stats(self) -> dict[str, object]:
        """The counters: ``verified``, ``unverified``, ``mismatches`` (by ``tier/holder``),
        ``replicas_reported``, ``enabled``."""
        return {
            "enabled": self.enabled,
            "verified": self.verified,
            "unverified": self.unverified,
            "mismatches": {f"{t}/{h}": n for (t, h), n in self.mismatches.items()},
            "replicas_reported": self.replicas_reported,
        }
