"""Pure-Python twins of ``_tcp.pyx``: RegionTable, ServeConn, ClientPipe (same contracts).

Used when the extension is not built or ``MOONCAKE_NO_EXTENSIONS=1``. One system call per
step of the protocol, Python objects per request: correct, only slower.
"""

from __future__ import annotations

import bisect
import errno
import struct
import threading
import time
from collections.abc import Sequence

from mooncake._fast._pure import _view

COMPILED = False

STAGE_SIZE = 65536
DONE = 0
WANT_READ = 1
WANT_WRITE = 2
YIELD = 3
CLOSE = 4
PEER_CLOSED = 5
STAGE = 6

_E_PROTO = 100000
_HDR = struct.Struct("<QQB7x")
_ST = struct.Struct("<Q")
_MAGIC = 0x4D43545600000000
_MASK = 0xFFFFFFFF00000000
_V2 = 0x80
_STEP_REQUESTS = 64
_STEP_BYTES = 16 << 20
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


class _Region:
    __slots__ = ("closing", "device", "length", "start", "users")

    def __init__(self, start: int, length: int, device: int = -1) -> None:
        self.start = start
        self.length = length
        self.device = device if device >= 0 else -1
        self.users = 0
        self.closing = False


class RegionTable:
    """Registered ranges the TCP server may serve (sorted, disjoint), with user counts."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regs: list[_Region] = []
        self._cv = threading.Condition()

    def add(self, start: int, length: int, device: int = -1) -> None:
        if length == 0:
            raise ValueError("empty range")
        with self._cv:
            i = bisect.bisect_right(self._starts, start) - 1
            if i >= 0 and self._regs[i].start + self._regs[i].length > start:
                raise ValueError("overlaps a registered range")
            if i + 1 < len(self._regs) and self._regs[i + 1].start < start + length:
                raise ValueError("overlaps a registered range")
            self._starts.insert(i + 1, start)
            self._regs.insert(i + 1, _Region(start, length, device))

    def remove(self, start: int) -> bool:
        with self._cv:
            i = bisect.bisect_left(self._starts, start)
            if i >= len(self._starts) or self._starts[i] != start:
                return False
            r = self._regs[i]
            r.closing = True
            while r.users > 0:
                self._cv.wait()
            i = self._regs.index(r)
            del self._starts[i]
            del self._regs[i]
            return True

    def close(self, start: int) -> bool:
        with self._cv:
            i = bisect.bisect_left(self._starts, start)
            if i >= len(self._starts) or self._starts[i] != start:
                return False
            r = self._regs[i]
            r.closing = True
            return r.users > 0

    def reopen(self, start: int) -> bool:
        with self._cv:
            i = bisect.bisect_left(self._starts, start)
            if i >= len(self._starts) or self._starts[i] != start:
                return False
            self._regs[i].closing = False
            return True

    def find(self, addr: int, length: int) -> bool:
        r = self.acquire(addr, length)
        if r is None:
            return False
        self.release(r)
        return True

    def __len__(self) -> int:
        return len(self._regs)

    def acquire(self, addr: int, length: int) -> _Region | None:
        if length == 0:
            return None
        with self._cv:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            r = self._regs[i]
            if r.closing or addr + length > r.start + r.length:
                return None
            r.users += 1
            return r

    def release(self, r: _Region) -> None:
        with self._cv:
            r.users -= 1
            if r.users == 0 and r.closing:
                self._cv.notify_all()


def _recv(fd: int, addr: int, n: int) -> int:
    from mooncake._fast._pure import recv_at

    return recv_at(fd, addr, n)


class ServeConn:
    """The server side of one connection (see ``_tcp.pyx``)."""

    def __init__(
        self, fd: int, table: RegionTable, drain_limit: int, scratch_size: int = 65536
    ) -> None:
        self.fd = fd
        self.table = table
        self.drain_limit = drain_limit
        self.state = "hdr"
        self.hdr = bytearray(24)
        self.got = 0
        self.held: _Region | None = None
        self.scratch = bytearray(scratch_size)
        self.out: list[memoryview] = []
        self.left = 0
        self.addr = 0
        self.v2 = False
        self.close_after = False
        self.served = 0
        self.refused = 0
        self.req_start = -1.0  # monotonic seconds the current request began; -1 idle
        self.req_mark = 0  # served + refused when it began
        self.req_size = 0  # its size, from its header

    def frame_wait(self, progress_ms: int = -1, idle_ms: int = -1, min_rate: float = 0) -> int:
        """As ``_tcp.pyx``: ms to wait now (-1 forever); 0 once the request's bound passed."""
        if self.idle:
            self.req_start = -1.0
            return idle_ms
        now = time.monotonic()
        mark = self.served + self.refused
        if self.req_start < 0 or mark != self.req_mark:
            self.req_start, self.req_mark = now, mark
        if progress_ms < 0:
            return -1
        end = self.req_start * 1000 + progress_ms
        if min_rate > 0:
            end += self.req_size * 1000.0 / min_rate
        left = int(end - now * 1000)
        if left <= 0:
            return 0
        return min(left, progress_ms)

    def _release(self) -> None:
        if self.held is not None:
            self.table.release(self.held)
            self.held = None

    _stop_fd = -1
    _stopping = False
    _evicting = False

    @property
    def idle(self) -> bool:
        return self.state == "hdr" and self.got == 0 and self.held is None and not self.close_after

    def holds_closing(self) -> bool:
        held = self.held
        return held is not None and held.closing

    def wake(self) -> None:
        import os

        if self._stop_fd >= 0:
            os.eventfd_write(self._stop_fd, 1)

    def evict(self) -> None:
        self._evicting = True
        self.wake()

    def prepare_blocking(self) -> None:
        import os

        if self._stop_fd < 0:
            self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    def serve_blocking(self, progress_ms: int = -1, idle_ms: int = -1, min_rate: float = 0) -> int:
        import os
        import select

        if self._stop_fd < 0:
            raise ValueError("call prepare_blocking() first")
        p = select.poll()
        p.register(self._stop_fd, select.POLLIN)
        while True:
            r = self.step()
            if r == YIELD:
                continue
            if r not in (WANT_READ, WANT_WRITE):
                return r
            busy = not self.idle
            wait = self.frame_wait(progress_ms, idle_ms, min_rate)
            if busy and wait == 0:
                return -errno.ETIMEDOUT
            p.register(self.fd, select.POLLIN if r == WANT_READ else select.POLLOUT)
            events = p.poll(wait)
            p.unregister(self.fd)
            if not events:
                return -errno.ETIMEDOUT if busy else CLOSE
            if any(fd == self._stop_fd for fd, _ in events):
                try:
                    os.eventfd_read(self._stop_fd)
                except BlockingIOError:
                    pass
                if self._stopping:
                    return PEER_CLOSED
                if self.holds_closing():
                    return -errno.ECONNABORTED
                if self._evicting:
                    self._evicting = False
                    if self.idle:
                        return CLOSE

    def __del__(self) -> None:
        import os

        if self._stop_fd >= 0:
            os.close(self._stop_fd)
            self._stop_fd = -1

    _staged: tuple[int, int, int, bool, int] = (0, 0, 0, False, -1)

    def staged(self) -> tuple[int, int, int, bool, int]:
        if self.state != "stage":
            raise ValueError("no request is waiting for staging")
        return self._staged

    def take_input(self, addr: int, n: int) -> int:
        if self.state != "stage":
            raise ValueError("no request is waiting for staging")
        return 0  # headers are read exactly: a payload is still all in the socket

    def staged_done(self) -> None:
        if self.state != "stage":
            raise ValueError("no request is waiting for staging")
        self._release()
        self.state = "hdr"

    def close(self) -> None:
        self._release()
        self.state = "closed"

    def _status(self, code: int) -> None:
        self.out = [memoryview(_ST.pack(_MAGIC | code))]
        self.state = "send"

    def step(self) -> int:
        import os

        nreq = 0
        nbytes = 0
        while True:
            if self.state == "closed":
                return PEER_CLOSED
            if self.state == "stage":
                return STAGE
            if nreq >= _STEP_REQUESTS or nbytes >= _STEP_BYTES:
                return YIELD
            try:
                if self.state == "hdr":
                    n = os.readv(self.fd, [memoryview(self.hdr)[self.got :]])
                    if n == 0:
                        if self.got == 0:
                            self.state = "closed"
                            return PEER_CLOSED
                        return -errno.ECONNRESET
                    self.got += n
                    if self.got < 24:
                        continue
                    self.got = 0
                    size, addr, op = _HDR.unpack(self.hdr)
                    self.req_size = size
                    self.v2 = bool(op & _V2)
                    op &= ~_V2
                    if op > 1:
                        return -_E_PROTO
                    nreq += 1
                    self.held = self.table.acquire(addr, size)
                    if self.held is None:
                        self.refused += 1
                        if not self.v2:
                            self.state = "closed"
                            return CLOSE
                        if op == 1:
                            if size > self.drain_limit:
                                self._status(1)
                                self.close_after = True
                            else:
                                self.left = size
                                self.state = "drain"
                                if size == 0:
                                    self._status(1)
                        else:
                            self._status(1)
                        continue
                    self.served += 1
                    if self.held.device >= 0:
                        self._staged = (op, addr, size, self.v2, self.held.device)
                        self.state = "stage"
                        return STAGE
                    if op == 1:
                        self.addr, self.left = addr, size
                        self.state = "payload"
                    else:
                        self.out = [memoryview(_ST.pack(_MAGIC))] if self.v2 else []
                        self.out.append(_view(addr, size))
                        self.state = "send"
                        nbytes += size
                elif self.state == "payload":
                    n = os.readv(self.fd, [_view(self.addr, self.left)])
                    if n == 0:
                        return -errno.ECONNRESET
                    self.addr += n
                    self.left -= n
                    nbytes += n
                    if self.left == 0:
                        self._release()
                        if self.v2:
                            self._status(0)
                        else:
                            self.state = "hdr"
                elif self.state == "drain":
                    k = min(self.left, len(self.scratch))
                    n = os.readv(self.fd, [memoryview(self.scratch)[:k]])
                    if n == 0:
                        return -errno.ECONNRESET
                    self.left -= n
                    if self.left == 0:
                        self._status(1)
                elif self.state == "send":
                    n = os.writev(self.fd, self.out)
                    while n > 0 and self.out:
                        if n >= len(self.out[0]):
                            n -= len(self.out[0])
                            self.out.pop(0)
                        else:
                            self.out[0] = self.out[0][n:]
                            n = 0
                    if not self.out:
                        self._release()
                        if self.close_after:
                            self.state = "closed"
                            return CLOSE
                        self.state = "hdr"
            except InterruptedError:
                continue
            except BlockingIOError:
                return WANT_WRITE if self.state == "send" else WANT_READ
            except OSError as e:
                return -(e.errno or errno.EIO)


class ClientPipe:
    """One pipelined group of same-opcode requests on one connection (see ``_tcp.pyx``)."""

    def __init__(
        self,
        fd: int,
        write: bool,
        v2: bool,
        laddrs: Sequence[int],
        raddrs: Sequence[int],
        lens: Sequence[int],
        stage_addr: int = 0,
        stage_size: int = 0,
        stage_owner: object = None,
    ) -> None:
        n = len(laddrs)
        if not n == len(raddrs) == len(lens):
            raise ValueError("ClientPipe: laddrs, raddrs and lens differ in length")
        self.fd = fd
        self.write = write
        self.v2 = v2
        self.lens = list(lens)
        self.laddrs = list(laddrs)
        op = (1 if write else 0) | (_V2 if v2 else 0)
        self.out: list[memoryview] = []
        for la, ra, ln in zip(laddrs, raddrs, lens, strict=True):
            self.out.append(memoryview(_HDR.pack(ln, ra, op)))
            if write and ln:
                self.out.append(_view(la, ln))
        self._st = [-1] * n
        self.done = 0
        self.rx_phase = 0
        self.rx_got = 0
        self.stbuf = bytearray(8)
        self.last_refused = False

    @property
    def statuses(self) -> list[int]:
        return list(self._st)

    def run_blocking(self, timeout_ms: int, spin_us: int = 0) -> int:
        """Run to the end on the calling thread, waiting in ``poll`` (see ``_tcp.pyx``; the
        twin does not spin)."""
        import select
        import time

        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms >= 0 else None
        while True:
            r = self.step()
            if r not in (WANT_READ, WANT_WRITE):
                return r
            left = -1
            if deadline is not None:
                left = int((deadline - time.monotonic()) * 1000)
                if left <= 0:
                    return -errno.ETIMEDOUT
            p = select.poll()
            p.register(self.fd, select.POLLIN if r == WANT_READ else select.POLLOUT)
            p.poll(left)

    def step(self) -> int:
        import os

        n = len(self._st)
        try:
            while self.out:
                r = os.writev(self.fd, self.out[:512])
                while r > 0 and self.out:
                    if r >= len(self.out[0]):
                        r -= len(self.out[0])
                        self.out.pop(0)
                    else:
                        self.out[0] = self.out[0][r:]
                        r = 0
            if not self.v2:
                if self.write:
                    self._st = [0] * n
                    self.done = n
                    return DONE
                while self.done < n:
                    i = self.done
                    if self.rx_got < self.lens[i]:
                        r = os.readv(
                            self.fd,
                            [_view(self.laddrs[i] + self.rx_got, self.lens[i] - self.rx_got)],
                        )
                        if r == 0:
                            return -errno.ECONNRESET
                        self.rx_got += r
                        continue
                    self._st[i] = 0
                    self.done += 1
                    self.rx_got = 0
                return DONE
            while self.done < n:
                i = self.done
                if self.rx_phase == 0:
                    r = os.readv(self.fd, [memoryview(self.stbuf)[self.rx_got :]])
                    if r == 0:
                        if self.rx_got == 0 and self.last_refused:
                            return PEER_CLOSED
                        return -errno.ECONNRESET
                    self.rx_got += r
                    if self.rx_got < 8:
                        continue
                    self.rx_got = 0
                    (v,) = _ST.unpack(self.stbuf)
                    if v & _MASK != _MAGIC or v & 0xFFFFFFFF > 1:
                        return -_E_PROTO
                    v &= 0xFFFFFFFF
                    self.last_refused = v != 0
                    if v == 0 and not self.write and self.lens[i] > 0:
                        self.rx_phase = 1
                        continue
                    self._st[i] = v
                    self.done += 1
                else:
                    r = os.readv(
                        self.fd, [_view(self.laddrs[i] + self.rx_got, self.lens[i] - self.rx_got)]
                    )
                    if r == 0:
                        return -errno.ECONNRESET
                    self.rx_got += r
                    if self.rx_got == self.lens[i]:
                        self.rx_got = 0
                        self.rx_phase = 0
                        self._st[i] = 0
                        self.done += 1
            return DONE
        except InterruptedError:
            return self.step()
        except BlockingIOError:
            return WANT_WRITE if self.out else WANT_READ
        except OSError as e:
            return -(e.errno or errno.EIO)
