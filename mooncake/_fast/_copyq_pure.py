"""Pure-Python twin of ``_copyq.pyx``: a CopyQueue on Python threads and an eventfd."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence

from mooncake._fast._pure import memcpy_batch

COMPILED = False


class CopyQueue:
    """Worker threads copying scatter-gather jobs; completions via an eventfd (``fileno``)."""

    def __init__(self, workers: int = 1) -> None:
        self.closed = True
        self._efd = -1
        self._threads: list[threading.Thread] = []
        if not 1 <= workers <= 16:
            raise ValueError("workers must be in 1..16")
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[int, list[int], list[int], list[int]]] = (
            collections.deque()
        )
        self._done: list[int] = []
        self._stop = False
        self.closed = False
        self._threads += [
            threading.Thread(target=self._work, daemon=True, name="mooncake-copy")
            for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    def fileno(self) -> int:
        return self._efd

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job_id, d, s, n = self._jobs.popleft()
            memcpy_batch(d, s, n)
            with self._cv:
                self._done.append(job_id)
            os.eventfd_write(self._efd, 1)

    def submit(
        self, job_id: int, dsts: Sequence[int], srcs: Sequence[int], lens: Sequence[int]
    ) -> None:
        if self.closed:
            raise ValueError("CopyQueue is closed")
        if not len(dsts) == len(srcs) == len(lens):
            raise ValueError("submit: dsts, srcs and lens differ in length")
        with self._cv:
            self._jobs.append((job_id, list(dsts), list(srcs), list(lens)))
            self._cv.notify()

    def drain(self) -> list[int]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._cv:
            out, self._done = self._done, []
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def __del__(self) -> None:
        try:
            self.close()
        finally:
            if self._efd >= 0:
                os.close(self._efd)
                self._efd = -1
