"""The ``shm`` transport: peers on the same host move bytes with one memcpy.

Reach: a peer whose descriptor carries our ``shm_host`` (boot id + network and pid namespaces)
and an ``shm_socket``. A published-Mooncake peer has neither, so it keeps getting TCP.

Protocol (ours, on an abstract ``AF_UNIX``/``SOCK_SEQPACKET`` socket, one JSON object per
message): the client sends ``{"op": "list"}``; the server answers with ``{"op": "buffers",
"pid": p, "buffers": [{"addr", "length", "fd"}], "more": bool}`` pages, passing one memfd per
engine-allocated buffer with ``SCM_RIGHTS`` (``fd`` is its index in the page's fds, -1 for memory
the engine did not allocate). The client maps each memfd once (``MAP_SHARED``) and closes the fd.
On ``unregister`` the server sends ``{"op": "revoke", "addr", "seq"}`` to every client and waits
(at most ``REVOKE_ACK_S``, then drops that client) for ``{"op": "ack", "seq"}``, which a client
sends only once no copy of its own still uses the range and the mapping is gone.

Transfers: each request must lie inside one buffer of the server's *own* list (not the cached
descriptor), exactly the bound TCP's server enforces; a miss refreshes the list once, then
fails with :class:`RemoteAccessError`. Mapped buffers: ``memcpy``; a batch up to ``INLINE_MAX``
bytes is copied on the loop thread with the GIL released, bigger ones by a ``_fast.CopyQueue``
worker whose completions arrive on an eventfd (:mod:`mooncake._engine._copier`). Other buffers: ``process_vm_readv``/``writev`` on the server's pid; where the kernel refuses
(``EPERM``: ptrace policy, another user) the requests go over TCP instead and the peer stays on
TCP for those buffers, with one warning saying why.

Trust (the socket is abstract: no file permissions guard it): both ends check the other's
credentials with ``SO_PEERCRED``. The server serves only clients of its own effective uid or of
a uid listed in ``MOONCAKE_SHM_ALLOW_UIDS`` (comma-separated); others are disconnected before
they can send anything. The client trusts a listener only if it has such a uid and is the
process the descriptor names (``shm_pid``): a name taken over by another user (after the engine
exited) is never talked to; that peer's requests go over TCP instead, with one warning. With
``MOONCAKE_CLUSTER_SECRET`` set the descriptor says ``shm_auth: 1`` and every connection first
runs the challenge-response of :mod:`mooncake._core.auth` (channel ``shm``; ``auth_hello`` /
``auth_challenge`` / ``auth_prove`` / ``auth_ok`` messages, :data:`AUTH_S` in all) before the
server lists anything; a peer on the other side of a secret mismatch is reached over TCP, whose
own exchange then names the problem. Every
message is validated (types, ranges, fd indices, memfd size and seals); a malformed one drops
that connection, never the engine. Only sealed memfds (``F_SEAL_SHRINK``: they cannot be
truncated under our mapping) are mapped.

Lifetimes (the engine's pinning rule, seen from the client): an entry is looked up with no
``await`` since and pinned (``users``) for the whole time a copy may touch it: memcpy into the
mapping and process_vm copies alike. A revoke waits for the pins to drop before it unmaps and
acknowledges, so the server's ``unregister`` returns only once no copy of ours runs in its
memory. A process_vm copy on a worker thread goes in pieces of at most ``VM_CHUNK`` bytes and
stops at the next piece once its entry is revoked (the rest of its requests fail), so an
acknowledgement waits for one piece, not for a whole large copy. A mapping lives until its
revoke, the server's connection closing (the peer died or closed), ``forget_peer`` or the
engine's close, whichever comes first, and never while a copy into it runs (the last user
unmaps). Cancellation waits for a running worker-thread copy to finish: nothing touches local
memory after ``execute`` returns.

The wire (messages, the secret exchange) and the client's sessions and mapped entries are in
:mod:`mooncake._engine.transports.shm_session`; this module is the transport (server, routing,
copies).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from mooncake import _fast
from mooncake._core import auth
from mooncake._core.memory import Region
from mooncake._core.transfer import Opcode, TransferRequest, TransferResult, completed, failed
from mooncake._engine import _sockio, _unix
from mooncake._engine._copier import Copier
from mooncake._engine.transports.base import PeerInfo, Transport
from mooncake._engine.transports.shm_session import (
    AUTH_S,  # noqa: F401 (the wire's limits, also by their names here)
    FDS_PER_MSG,
    MAX_BUFFERS,  # noqa: F401
    MAX_MSG,  # noqa: F401
    _client_auth,
    _Entry,
    _int,
    _recv,
    _send,
    _seqpacket,
    _server_auth,
    _Session,
)
from mooncake.errors import (
    AuthError,
    MooncakeError,
    NotSupportedError,
    PeerDiedError,
    ProtocolError,
    RemoteAccessError,
    TransferError,
)

log = logging.getLogger("mooncake.shm")

SHM_PROTO = 1
INLINE_MAX = 4 << 20
COPY_WORKERS = 1  # one copy thread: the loop thread is the other core's worth on small hosts
REVOKE_ACK_S = 5.0
MAX_CLIENTS = 256
VM_CHUNK = 16 << 20  # process_vm bytes per call on a worker thread (a revoke waits for one)


def host_id() -> str:
    """Same value in two processes iff ``shm`` can connect them (boot, net and pid namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        pid = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{net}/{pid}"


def available() -> bool:
    return hasattr(socket, "AF_UNIX") and hasattr(os, "memfd_create") and bool(host_id())


# -- server side ---------------------------------------------------------------------------


class _Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = anyio.Lock()
        self.acks: dict[int, anyio.Event] = {}


class _Untrusted:
    """Peer state marking a listener we refused to talk to (its requests go over TCP)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.closed = False


class ShmTransport(Transport):
    name = "shm"
    priority = 20

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._host = host_id()
        self._name = f"mooncake-shm/{os.getpid()}/{secrets.token_hex(8)}"
        self._listener: socket.socket | None = None
        self._clients: set[_Client] = set()
        self._seq = 0
        self._warned_vm = False
        self._warned_trust = False
        self._copier: Copier | None = None
        self._uids = _unix.allowed_uids()
        #: the cluster secret clients must prove before anything else (None: no exchange)
        self.secret = auth.load_secret()
        self.auth_failures = 0

    async def start(self) -> None:
        if not available():
            raise NotSupportedError("shm transport needs Linux (AF_UNIX, memfd_create, /proc)")
        sock = _seqpacket()
        sock.bind("\0" + self._name)
        sock.listen(64)
        self._listener = sock
        self.engine.task_group.start_soon(self._accept_loop, sock, name="shm-accept")
        self._copier = Copier(COPY_WORKERS)
        await self.engine.task_group.start(self._copier.run, name="shm-copier")

    def descriptor_fields(self) -> dict[str, Any]:
        return {
            "shm_host": self._host,
            "shm_socket": "@" + self._name,
            "shm_pid": os.getpid(),
            "shm_proto": SHM_PROTO,
            **({"shm_auth": 1} if self.secret is not None else {}),
        }

    async def _accept_loop(self, lsock: socket.socket) -> None:
        limiter = anyio.CapacityLimiter(MAX_CLIENTS)
        async with anyio.create_task_group() as tg:
            try:
                while True:
                    await anyio.wait_readable(lsock)
                    try:
                        conn, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    conn.setblocking(False)
                    tg.start_soon(self._serve_client, conn, limiter)
            finally:
                tg.cancel_scope.cancel()
                _sockio.close(lsock)
                self._listener = None

    async def _serve_client(self, sock: socket.socket, limiter: anyio.CapacityLimiter) -> None:
        pid = -1
        client = _Client(sock)
        try:
            pid, uid, _ = _unix.peer_credentials(sock)
            if uid not in self._uids:
                # another user: not even the buffer list (MOONCAKE_SHM_ALLOW_UIDS widens this)
                log.info("shm: refusing a client of uid %d (pid %d)", uid, pid)
                return
            if self.secret is not None and not await _server_auth(sock, self.secret):
                self.auth_failures += 1
                log.warning("shm: refusing pid %d: it did not prove the cluster secret", pid)
                return
            async with limiter:
                self._clients.add(client)
                while True:
                    msg, fds = await _recv(sock)
                    for fd in fds:  # clients have nothing to pass us
                        os.close(fd)
                    op = msg.get("op")
                    if op == "list":
                        await self._send_list(client)
                    elif op == "ack":
                        ev = client.acks.pop(_int(msg.get("seq"), "ack seq"), None)
                        if ev is not None:
                            ev.set()
                    else:
                        raise ProtocolError(f"shm: unknown request {op!r:.60}")
        except (MooncakeError, OSError, anyio.ClosedResourceError) as e:
            log.debug("shm client pid %d gone: %s", pid, e)
        except Exception as e:  # a message we failed to foresee: drop the client, keep serving
            log.warning("shm client pid %d dropped on an unexpected message: %r", pid, e)
        finally:
            self._clients.discard(client)
            for ev in client.acks.values():
                ev.set()
            _sockio.close(sock)

    async def _send_list(self, client: _Client) -> None:
        # built and sent under the client's lock: a revoke sent after it is seen after it
        async with client.lock:
            regions = [
                r for r in self.engine.registry.regions() if r.remote_accessible and not r.closing
            ]
            page: list[dict[str, Any]] = []
            fds: list[int] = []
            for k, r in enumerate(regions):
                fd = r.meta.get("memfd", -1)
                page.append({"addr": r.addr, "length": r.length, "fd": len(fds) if fd >= 0 else -1})
                if fd >= 0:
                    fds.append(fd)
                last = k == len(regions) - 1
                if last or len(fds) >= FDS_PER_MSG or len(page) >= 1024:
                    msg = {"op": "buffers", "pid": os.getpid(), "buffers": page, "more": not last}
                    await _send(client.sock, msg, fds)
                    page, fds = [], []
            if not regions:
                await _send(client.sock, {"op": "buffers", "pid": os.getpid(), "buffers": []})

    async def on_unregister(self, region: Region) -> None:
        await self._revoke([region.addr])

    async def on_close(self) -> None:
        """Revoke every buffer from every client before the engine's tasks stop: a client
        copying with process_vm would otherwise learn of the close only from the connection
        ending, after ``close`` had returned."""
        await self._revoke([r.addr for r in self.engine.registry.regions() if r.remote_accessible])

    async def _revoke(self, addrs: list[int]) -> None:
        """Send a revoke per address to every client; wait (at most ``REVOKE_ACK_S`` per
        client) until each acknowledged all of them, its connection ended, or it was dropped."""
        if not self._clients or not addrs:
            return

        async def revoke(client: _Client) -> None:
            # one deadline for sending and acknowledging: a client that stops reading cannot
            # hold an unregister by filling its socket buffer either
            with anyio.move_on_after(REVOKE_ACK_S) as scope:
                events = []
                try:
                    async with client.lock:
                        for addr in addrs:
                            self._seq += 1
                            seq = self._seq
                            ev = client.acks[seq] = anyio.Event()
                            events.append(ev)
                            await _send(client.sock, {"op": "revoke", "addr": addr, "seq": seq})
                except MooncakeError:
                    return  # gone: its connection's end sets every event
                for ev in events:
                    await ev.wait()
            if scope.cancelled_caught:
                log.warning(
                    "shm client did not confirm unmapping within %s s; dropped", REVOKE_ACK_S
                )
                _sockio.close(client.sock)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for c in list(self._clients):
                    tg.start_soon(revoke, c)

    # -- client ---------------------------------------------------------------------------

    def can_reach(self, peer: PeerInfo) -> bool:
        x = peer.descriptor.extra
        return (
            bool(self._host)
            and x.get("shm_host") == self._host
            and isinstance(x.get("shm_socket"), str)
            and x.get("shm_proto") == SHM_PROTO
        )

    async def _session(self, peer: PeerInfo) -> _Session | _Untrusted:
        s = peer.state.get(self.name)
        if isinstance(s, (_Session, _Untrusted)) and not s.closed:
            return s
        name = str(peer.descriptor.extra["shm_socket"])
        sock = _seqpacket()
        try:
            sock.connect("\0" + name.removeprefix("@"))
        except BlockingIOError:
            await anyio.wait_writable(sock)
        except OSError as e:
            sock.close()
            raise PeerDiedError(f"shm: cannot connect to {peer.segment} ({e})") from None
        try:
            pid, uid, _ = _unix.peer_credentials(sock)
        except OSError as e:
            sock.close()
            raise PeerDiedError(f"shm: no credentials from {peer.segment} ({e})") from None
        want_pid = peer.descriptor.extra.get("shm_pid")
        reason = ""
        if uid not in self._uids:
            reason = f"its shm socket is held by uid {uid}"
        elif type(want_pid) is int and want_pid != pid:
            reason = f"its shm socket is held by pid {pid}, not the pid {want_pid} it published"
        wants = bool(peer.descriptor.extra.get("shm_auth"))
        if not reason and wants != (self.secret is not None):
            # one side has the cluster secret, the other not: TCP's exchange says which
            reason = (
                "it takes the cluster secret and we have none"
                if wants
                else ("it does not take the cluster secret")
            )
        if reason:
            # a name taken over by someone else (or a user we do not share memory with): say
            # nothing to it, map nothing from it
            sock.close()
            u = peer.state[self.name] = _Untrusted(reason)
            return u
        if self.secret is not None:
            try:
                await _client_auth(sock, self.secret, peer.segment)
            except BaseException:
                sock.close()
                raise
        s = _Session(sock, pid)
        peer.state[self.name] = s
        self.engine.task_group.start_soon(s.reader, name=f"shm-session {peer.segment}")
        await s.refresh()
        return s

    def forget_peer(self, peer: PeerInfo) -> None:
        s = peer.state.pop(self.name, None)
        if isinstance(s, _Session):
            s.close()

    def _tcp(self, peer: PeerInfo) -> Transport | None:
        for t in self.engine.transports:
            if t.name == "tcp" and t.can_reach(peer):
                assert isinstance(t, Transport)
                return t
        return None

    async def execute(
        self, peer: PeerInfo, requests: Sequence[TransferRequest]
    ) -> list[TransferResult]:
        results: list[TransferResult | None] = [None] * len(requests)
        try:
            s = await self._session(peer)
            if isinstance(s, _Session):
                s.check_alive()
        except (PeerDiedError, AuthError) as e:
            return [failed(e)] * len(requests)
        if isinstance(s, _Untrusted):
            if not self._warned_trust:
                self._warned_trust = True
                log.warning("shm: not using shared memory with %s: %s", peer.segment, s.reason)
            await self._over_tcp(peer, requests, list(range(len(requests))), results, s.reason)
            return [r if r is not None else failed(TransferError("not attempted")) for r in results]
        # Entries are looked up after the last await (a revoke or a new listing may replace
        # entries found before one) and pinned, below, with no await in between.
        ents = [s.find(r.remote_addr, r.length) for r in requests]
        if None in ents:  # the peer may have registered more since we listed
            try:
                await s.refresh()
            except PeerDiedError as err:
                return [failed(err)] * len(requests)
            ents = [s.find(r.remote_addr, r.length) for r in requests]
        plan: list[tuple[int, _Entry]] = []
        for i, ent in enumerate(ents):
            if ent is None:
                r = requests[i]
                results[i] = failed(
                    RemoteAccessError(
                        f"peer refused {r.opcode.name} of [{r.remote_addr:#x}, +{r.length}): "
                        "not inside one of its registered buffers"
                    )
                )
            else:
                plan.append((i, ent))
        pinned = list({id(ent): ent for _, ent in plan}.values())
        for ent in pinned:
            ent.pin()
        s.enter()
        try:
            mapped = [(i, x) for i, x in plan if x.mm is not None]
            vm = [(i, x) for i, x in plan if x.mm is None]
            if mapped:
                await self._copy(requests, mapped, results)
            if vm:
                await self._vm(peer, s, requests, vm, results)
        finally:
            for ent in pinned:
                ent.release()
            s.leave()
        rest = [i for i, _ in plan if results[i] is None]  # process_vm refused by the kernel
        if rest:
            await self._over_tcp(peer, requests, rest, results, "process_vm refused (EPERM)")
        return [r if r is not None else failed(TransferError("not attempted")) for r in results]

    async def _copy(
        self,
        requests: Sequence[TransferRequest],
        mapped: list[tuple[int, _Entry]],
        results: list[TransferResult | None],
    ) -> None:
        """memcpy to/from pinned mappings: inline when small, else on the copy worker."""
        dsts: list[int] = []
        srcs: list[int] = []
        lens: list[int] = []
        total = 0
        for i, e in mapped:
            r = requests[i]
            remote = e.base + (r.remote_addr - e.addr)
            if r.opcode is Opcode.READ:
                dsts.append(r.local_addr)
                srcs.append(remote)
            else:
                dsts.append(remote)
                srcs.append(r.local_addr)
            lens.append(r.length)
            total += r.length
        if total <= INLINE_MAX:
            _fast.memcpy_batch(dsts, srcs, lens)
        else:
            # on a worker thread, completion through an eventfd; cancellation waits for it
            assert self._copier is not None
            await self._copier.copy(dsts, srcs, lens)
        for i, _ in mapped:
            results[i] = completed(requests[i].length)

    async def _vm(
        self,
        peer: PeerInfo,
        s: _Session,
        requests: Sequence[TransferRequest],
        plan: list[tuple[int, _Entry]],
        results: list[TransferResult | None],
    ) -> None:
        """process_vm copies on pinned entries; leaves the results of EPERM-refused ones None."""
        if s.vm_denied:
            return
        for op, fn in ((Opcode.READ, _fast.vm_readv_at), (Opcode.WRITE, _fast.vm_writev_at)):
            sel = [(i, e) for i, e in plan if requests[i].opcode is op]
            if not sel:
                continue
            la = [requests[i].local_addr for i, _ in sel]
            ra = [requests[i].remote_addr for i, _ in sel]
            ln = [requests[i].length for i, _ in sel]
            if sum(ln) <= INLINE_MAX:
                rc, ndone = fn(s.pid, la, ra, ln), len(sel)
            else:
                ents = [e for _, e in sel]

                def revoked(ents: list[_Entry] = ents) -> bool:
                    return s.closed or any(e.dead for e in ents)

                rc, ndone = await anyio.to_thread.run_sync(
                    _vm_pieces, fn, s.pid, la, ra, ln, revoked
                )
            if rc == -errno.EPERM:
                s.vm_denied = True
                return
            for k, (i, _) in enumerate(sel):
                if rc >= 0 and k < ndone:
                    results[i] = completed(requests[i].length)
                elif rc >= 0 and s.closed:  # stopped: the session ended (its entries with it)
                    results[i] = failed(
                        PeerDiedError(f"{peer.segment}: its shm session ended during the copy")
                    )
                elif rc >= 0:
                    results[i] = failed(
                        RemoteAccessError(f"{peer.segment}: buffer unregistered during the copy")
                    )
                elif rc == -errno.ESRCH:
                    results[i] = failed(PeerDiedError(f"{peer.segment}: process is gone"))
                else:
                    name = errno.errorcode.get(-rc, str(-rc))
                    results[i] = failed(
                        RemoteAccessError(f"{peer.segment}: process_vm copy failed ({name})")
                    )

    async def _over_tcp(
        self,
        peer: PeerInfo,
        requests: Sequence[TransferRequest],
        idx: list[int],
        results: list[TransferResult | None],
        why: str,
    ) -> None:
        """Send ``requests[idx]`` over the TCP transport (the server bounds them itself)."""
        if why.startswith("process_vm") and not self._warned_vm:
            self._warned_vm = True
            log.warning(
                "shm: the kernel refuses process_vm_readv/writev on %s: ptrace policy "
                "(kernel.yama.ptrace_scope, another user, no CAP_SYS_PTRACE); memory it did not "
                "allocate with engine.allocate() goes over TCP",
                peer.segment,
            )
        tcp = self._tcp(peer)
        if tcp is None:
            err = NotSupportedError(f"{peer.segment}: {why}, and no TCP transport to fall back to")
            for i in idx:
                results[i] = failed(err)
            return
        out = await tcp.execute(peer, [requests[i] for i in idx])
        for i, res in zip(idx, out, strict=True):
            results[i] = res

    async def aclose(self) -> None:
        if self._listener is not None:
            _sockio.close(self._listener)
            self._listener = None
        if self._copier is not None:
            self._copier.close()
            self._copier = None


def _vm_pieces(
    fn: Callable[[int, list[int], list[int], list[int]], int],
    pid: int,
    la: list[int],
    ra: list[int],
    ln: list[int],
    revoked: Callable[[], bool],
) -> tuple[int, int]:
    """Run ``fn`` (a process_vm copy) over the ranges in calls of at most ``VM_CHUNK`` bytes,
    checking ``revoked()`` before each call (runs on a worker thread).

    Returns ``(rc, done)``: ``done`` ranges were copied whole; ``rc`` is the first negative
    errno, else 0 (``done < len(la)`` then means it stopped on a revoke).
    """
    n = len(la)
    k = 0  # current range
    off = 0  # bytes of it already copied
    while k < n:
        if revoked():
            return 0, k
        bl: list[int] = []
        br: list[int] = []
        bn: list[int] = []
        budget = VM_CHUNK
        first = k
        while k < n and budget > 0:
            take = min(ln[k] - off, budget)
            bl.append(la[k] + off)
            br.append(ra[k] + off)
            bn.append(take)
            budget -= take
            off += take
            if off == ln[k]:
                k, off = k + 1, 0
        rc = fn(pid, bl, br, bn)
        if rc < 0:
            return rc, first
    return 0, n
