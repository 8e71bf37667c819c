from collections.abc import Sequence

COMPILED: bool
STAGE_SIZE: int
DONE: int
WANT_READ: int
WANT_WRITE: int
YIELD: int
CLOSE: int
PEER_CLOSED: int

class RegionTable:
    def __init__(self) -> None: ...
    def add(self, start: int, length: int) -> None: ...
    def remove(self, start: int) -> bool: ...
    def find(self, addr: int, length: int) -> bool: ...
    def __len__(self) -> int: ...

class ServeConn:
    served: int
    refused: int
    def __init__(
        self, fd: int, table: RegionTable, drain_limit: int, scratch_size: int = 65536
    ) -> None: ...
    def step(self) -> int: ...
    def close(self) -> None: ...
    def prepare_blocking(self) -> None: ...
    def serve_blocking(self) -> int: ...
    def stop(self) -> None: ...

class ClientPipe:
    done: int
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
    ) -> None: ...
    @property
    def statuses(self) -> list[int]: ...
    def step(self) -> int: ...
