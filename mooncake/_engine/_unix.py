"""Same-host plumbing shared by the engine's ``shm`` transport and the store's segment plane:
which local uids may share memory with this process, who is at the other end of a Unix socket,
and whether a peer still holds its end of a connection.

One variable names the other uids for both planes: ``MOONCAKE_SHM_ALLOW_UIDS`` (comma- or
space-separated integers). ``MC_STORE_SHM_ALLOWED_UIDS``, the store plane's earlier spelling, is
read too (the union of both). A malformed entry is an error naming it, on either plane: a typo
never silently narrows (or widens) who may map a segment.
"""

from __future__ import annotations

import os
import socket
import struct

from mooncake.errors import InvalidArgumentError

#: the variable naming the uids (besides this process's effective uid) that may share memory
ALLOW_UIDS_ENV = "MOONCAKE_SHM_ALLOW_UIDS"
#: the store plane's earlier name for the same list, still honoured
LEGACY_ALLOW_UIDS_ENV = "MC_STORE_SHM_ALLOWED_UIDS"

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def allowed_uids() -> frozenset[int]:
    """This process's effective uid plus the uids listed in :data:`ALLOW_UIDS_ENV` (and
    :data:`LEGACY_ALLOW_UIDS_ENV`). :class:`InvalidArgumentError` naming the variable and the
    entry when one is not an integer uid."""
    uids = {os.geteuid()}
    for env in (ALLOW_UIDS_ENV, LEGACY_ALLOW_UIDS_ENV):
        for part in os.environ.get(env, "").replace(",", " ").split():
            try:
                uid = int(part)
            except ValueError:
                raise InvalidArgumentError(
                    f"{env} must list uids (integers), got {part!r}"
                ) from None
            if uid < 0:
                raise InvalidArgumentError(f"{env} must list uids (>= 0), got {part!r}")
            uids.add(uid)
    return frozenset(uids)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (the
    kernel's ``SO_PEERCRED``: the effective ids at ``connect``/``listen`` time)."""
    pid, uid, gid = _CREDS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    )
    return pid, uid, gid


def peer_alive(sock: socket.socket) -> bool:
    """Whether the peer still holds its end: a non-blocking one-byte ``MSG_PEEK`` that finds
    neither end-of-file nor an error (data waiting, or nothing yet, both count as alive). Never
    blocks, consumes nothing, needs no event loop."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
